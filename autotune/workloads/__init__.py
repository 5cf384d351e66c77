"""Real models and labelled data that ship inside packages (no downloads), for demos, tests and benchmarks."""
