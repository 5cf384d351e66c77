"""`autotune` command line: the study commands (`study_commands`), `bench` (`bench_command`) and the service's
(`service_commands`), on one group with one error path (`base`)."""
from autotune.cli import bench_command, service_commands, study_commands  # noqa: F401  (they add their commands)
from autotune.cli.base import main

__all__ = ["main"]
