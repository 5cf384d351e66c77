"""A self-contained HTML report of a study (`html_report`): rows of trials (rows.py), charts (charts.py), the page
(page.py)."""
from autotune.report.page import html_report
from autotune.report.rows import trial_rows

__all__ = ["html_report", "trial_rows"]
