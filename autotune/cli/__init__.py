"""`autotune` command line: the study commands (`study_commands`), `bench` (`bench_command`), `delete`
(`delete_command`) and the service's (`service_commands`), on one group with one error path (`base`)."""
# Imported for the commands they add to `main`.
from autotune.cli import bench_command, delete_command, service_commands, study_commands  # noqa: F401
from autotune.cli.base import main

__all__ = ["main"]
