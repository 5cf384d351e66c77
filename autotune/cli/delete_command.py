"""`autotune delete STUDY`: a study and everything kept with it, gone, as a study tuned for another model or data
must be before its name is used again."""
from __future__ import annotations

import click
import optuna
from optuna.trial import TrialState

from autotune.cli.base import CliError, load_study, main, open_existing_storage, storage_option
from autotune.result import counted
from autotune.storage import study as studies
from autotune.storage.claims import forget_study
from autotune.storage.rdb import shown


@main.command()
@click.argument("study_name", metavar="STUDY")
@storage_option
@click.option("--yes", is_flag=True, help="delete without asking")
def delete(study_name: str, storage: str, yes: bool) -> None:
    """Delete STUDY: its trials, best plan and signals (refused while a trial of it runs)."""
    rdb = open_existing_storage(storage)
    study = load_study(study_name, storage, rdb)
    if running := study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        raise CliError(f"study {study_name!r} has {counted(len(running), 'trial')} running: stop the tuning first "
                       "(Ctrl-C, or `autotune cancel JOB` for a service's job), then delete it")
    what = f"study {study_name!r} ({counted(len(studies.evaluated_trials(study)), 'evaluated trial')})"
    if not yes:
        click.confirm(f"delete {what} from {shown(storage)}?", abort=True)
    optuna.delete_study(study_name=study_name, storage=rdb)
    forget_study(rdb, study_name)
    click.echo(f"deleted {what}")
