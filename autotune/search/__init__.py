"""The search: its space (`space`), the guided candidates (`guided`, with the knapsack in `knapsack`), running
plans as trials (`trials`), the policy with its budget and patience (`driver`), the finalists chosen
(`finalist_plans`), built and raced (`finalists`), and the verified winner (`winner`)."""
from autotune.search.driver import EXHAUSTIVE_LIMIT, run_search
from autotune.search.space import SearchSpace
from autotune.search.trials import TrialRunner
from autotune.search.winner import verified_winner

__all__ = ["EXHAUSTIVE_LIMIT", "SearchSpace", "TrialRunner", "run_search", "verified_winner"]
