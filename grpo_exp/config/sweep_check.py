"""The jobs of a sweep (-m) as Hydra's basic sweeper will make them, so the pre-check (config/compose.py) checks
every job's config before Hydra starts the sweep: a bad job fails the whole command in one line per distinct
error, exit 2, with nothing written and no job started (Hydra alone would start the sweep, fail job after job
and end in a traceback).

A search (hparams_search=<option>: another sweeper, Optuna's) proposes its jobs as it goes, so each is checked when
it starts; what the search itself needs is checked before it starts (config/search_check.py)."""

from __future__ import annotations

from omegaconf import OmegaConf

from grpo_exp.base.errors import ConfigError

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"

# The jobs this process checked (their override lists), so a job the basic launcher then runs here is not
# checked a second time; a launcher that runs jobs in other processes checks each there.
checked_jobs: set[tuple[str, ...]] = set()


def sweep_jobs(config_name: str, overrides: list[str]) -> tuple[list[list[str]] | None, str]:
    """(each job's task overrides, the sweep directory), as Hydra's basic sweeper will make them from the
    experiment's hydra.sweeper.params and the command line; (None, dir) under another sweeper, or where the
    config asks for each job to be checked in the job itself (sweep_check=in_job)."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.utils import setup_globals
    from hydra.types import RunMode

    from grpo_exp.config import search_check
    import grpo_exp.config.schema  # noqa: F401  (registers the structured-config schemas)
    from grpo_exp.config.options import CONF_DIR

    setup_globals()  # ${now:...}, which the sweep directory's name uses
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        try:
            master = loader.load_configuration(config_name=config_name, overrides=overrides,
                                               run_mode=RunMode.MULTIRUN, from_shell=True)
        except Exception as err:
            search_check.check_sweeper_installed(err, overrides)
            raise
        sweep_dir = str(OmegaConf.select(master, "hydra.sweep.dir"))
        if OmegaConf.select(master, "hydra.sweeper._target_") != BASIC_SWEEPER:
            search_check.prepare_search(master)
            return None, sweep_dir
        if OmegaConf.select(master, "sweep_check") == "in_job":
            return None, sweep_dir  # each job checks its own config where it runs
        params = OmegaConf.select(master, "hydra.sweeper.params") or {}
        arguments = [f"{key}={value}" for key, value in params.items()] + list(master.hydra.overrides.task)
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]], sweep_dir


def sweep_error(problems: dict[str, list[int]], total: int) -> str:
    """Each distinct problem on its own line, with the jobs (Hydra's job numbers) it concerns."""
    lines = []
    for message, nums in problems.items():
        which = f"all {total} jobs" if len(nums) == total else (
            f"job{'s' if len(nums) > 1 else ''} {', '.join(map(str, nums))} of {total}")
        lines.append(f"{message} ({which})")
    lines[-1] += "; no job of the sweep was started"
    return "\nerror: ".join(lines)
