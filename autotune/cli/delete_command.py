"""`autotune delete STUDY`: a study and everything kept with it, gone, as a study tuned for another model or data
must be before its name is used again."""
from __future__ import annotations

import click
import optuna
from optuna.trial import TrialState

from autotune.cli.base import CliError, load_study, main, open_existing_storage, storage_option
from autotune.config import TuningConfig
from autotune.result import counted
from autotune.search.trials import fail_stale_trials
from autotune.storage import study as studies
from autotune.storage.claims import forget_study
from autotune.storage.rdb import open_storage, shown


@main.command()
@click.argument("study_name", metavar="STUDY")
@storage_option
@click.option("--yes", is_flag=True, help="delete without asking")
def delete(study_name: str, storage: str, yes: bool) -> None:
    """Delete STUDY: its trials, best plan and signals (refused while a trial of it runs)."""
    rdb = open_existing_storage(storage)
    study = load_study(study_name, storage, rdb)
    what = f"study {study_name!r} ({counted(len(studies.evaluated_trials(study)), 'evaluated trial')})"
    if not yes and not click.confirm(f"delete {what} from {shown(storage)}?"):
        click.echo(f"kept study {study_name!r}: nothing deleted")
        return
    settings = studies.get_attr(study, "settings") or {}
    grace, beat = (settings.get(key, TuningConfig.model_fields[key].default)     # as recorded by its runs
                   for key in ("grace_period", "heartbeat_interval"))
    if study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # Those of a killed run stay running until a run fails them: failed here too, beating as that run did.
        fail_stale_trials(load_study(study_name, storage, open_storage(storage, beat, grace)), grace)
    if running := study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        raise CliError(f"study {study_name!r} has {counted(len(running), 'trial')} running: stop the tuning first "
                       "(Ctrl-C, or `autotune cancel JOB` for a service's job), then delete it; a trial whose "
                       f"process was killed counts as running until it has been silent for {grace} s (grace_period)")
    optuna.delete_study(study_name=study_name, storage=rdb)
    forget_study(rdb, study_name)
    click.echo(f"deleted {what}")
