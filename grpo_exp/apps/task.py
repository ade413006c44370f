"""The one task wrapper every Hydra entrypoint runs through (in the manner of lightning-hydra-template's
`task_wrapper`):

1. compose and check the config once, before Hydra creates anything (so bad input leaves nothing behind): a
   single run's config, or every job of a sweep (config/sweep_check.py), each distinct error said once;
2. set up the CPU (OpenMP/MKL read their settings when torch loads, so before anything imports it);
3. run the task and write `status.json` (and `error.txt` with the traceback when it fails);
4. map errors to exit codes: bad input 2, a run that halted itself 3, anything else Hydra's own.

Under a launcher that runs sweep jobs side by side (`hydra/launcher=joblib|submitit_local|ray`, see
conf/hydra/launcher/), a job with cpu.threads=auto takes its share of the cores instead of all of them.

Under `torchrun --nproc_per_node=N` (or `accelerate launch`) every process runs this wrapper: each checks
the config, then the processes join one process group and take rank 0's run directory (Hydra's ${now:...}
differs per process), and only rank 0 writes Hydra's files, status.json and the run's outputs; the others
log to `<run dir>/<task>.rank<r>.log`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from grpo_exp.base import cpu, dist, log
from grpo_exp.base.errors import ConfigError, TrainingHalted
from grpo_exp.base.io import write_json
from grpo_exp.base.stop import Stopped

EXIT_BAD_INPUT = 2
EXIT_HALTED = 3
logger = log.get_logger(__name__)

# conf/hydra/launcher/<plugin's name>.yaml spell out a launcher plugin's keys under the plugin's own name,
# so Hydra 1.3 checks them against the plugin's schema of that name and says, at every composition and
# in every worker, that this matching is deprecated. The files stand on their own without it. Set on
# import, so that joblib/submitit/Ray workers (which import this module to unpickle the task) get it too.
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema")


def report_config_error(err: BaseException) -> None:
    if dist.is_main():  # N processes fail alike; one line says why
        print(f"error: {err}", file=sys.stderr)


def run_task(config_name: str, task: Callable[[Any], dict], check: Callable[[Any], None],
             objective: Callable[[dict], float | None]) -> None:
    """Run `task(cfg)` as the Hydra app `config_name` (conf/<config_name>.yaml) with the steps above.

    `check(cfg)` raises ConfigError on bad input without loading a model; `objective(result)` is the
    number a sweeper optimises (returned from the Hydra main)."""
    import hydra
    from omegaconf import DictConfig

    import grpo_exp.config.schema  # noqa: F401  (registers the structured-config schemas)
    from grpo_exp.config import sweep_check
    from grpo_exp.config.compose import CONF_DIR, check_overrides

    try:
        check_overrides(config_name, sys.argv[1:], check)
        if dist.is_distributed():
            sys.argv[1:] = distributed_overrides(config_name, sys.argv[1:])
    except ConfigError as err:
        report_config_error(err)
        raise SystemExit(EXIT_BAD_INPUT) from None

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
    def main(cfg: DictConfig) -> float | None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        started = time.time()
        log.set_level(cfg.get("log_level", "INFO"))
        try:
            if multirun:  # a single run, and each job of a basic sweep, was checked before Hydra started
                if tuple(hydra_cfg.overrides.task) not in sweep_check.checked_jobs:
                    check(cfg)  # a job of another sweeper, or one a launcher runs in another process
                share_cores(cfg, hydra_cfg)
            cpu.prepare_env(cfg.cpu)  # before anything loads torch: OpenMP reads its settings only then
            result = task(cfg)
        except (ConfigError, TrainingHalted) as err:
            record_status(hydra_cfg, "failed", started, err)
            report_config_error(err)
            if multirun:
                raise  # the sweep records this job as failed and runs the others
            sys.exit(EXIT_BAD_INPUT if isinstance(err, ConfigError) else EXIT_HALTED)
        except BaseException as err:
            interrupted = isinstance(err, (KeyboardInterrupt, SystemExit))
            # Stopped: a Ctrl-C/SIGTERM the run answered (base/stop.py), its last checkpoint in place
            status = "stopped" if isinstance(err, Stopped) else "interrupted" if interrupted else "failed"
            record_status(hydra_cfg, status, started, err)
            if multirun and not interrupted:
                logger.error("job %s failed: %s: %s (traceback in %s/error.txt); the sweep goes on",
                             hydra_cfg.job.num, type(err).__name__, err, hydra_cfg.runtime.output_dir)
            raise  # in a sweep Hydra records the job as failed, runs the others and exits non-zero at the end
        value = objective(result)
        record_status(hydra_cfg, result.get("status", "completed"), started, objective=value)
        return value

    main()


def distributed_overrides(config_name: str, args: list[str]) -> list[str]:
    """The command line of one of N data-parallel processes: rank 0's run directory for all of them, and on
    the other ranks no Hydra files (.hydra/) and a log of their own, quiet on the console."""
    if any(a in ("-m", "--multirun") for a in args):
        raise ConfigError(f"a sweep (-m) cannot run under a distributed launcher ({dist.world_size()} processes); "
                          f"launch each run with torchrun, or run the sweep's jobs through a hydra/launcher")
    dist.init()
    run_dir, job_name = dist.broadcast(_hydra_run_dir(config_name, args) if dist.is_main() else None)
    kept = [a for a in args if not a.lstrip("+").startswith("hydra.run.dir=")]
    extra = [f"hydra.run.dir={_quoted(run_dir)}"]
    if not dist.is_main():
        log_file = f"{run_dir}/{job_name}.rank{dist.rank()}.log"
        extra += ["hydra.output_subdir=null", f"hydra.job_logging.handlers.file.filename={_quoted(log_file)}",
                  "++hydra.job_logging.handlers.console.level=WARNING"]
    return [*kept, *extra]


def _hydra_run_dir(config_name: str, args: list[str]) -> tuple[str, str]:
    """The run directory Hydra would create for these overrides, resolved once (here, on rank 0), and the
    job's name (its log file is <name>.log)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf

    from grpo_exp.config.compose import CONF_DIR

    setup_globals()  # Hydra's ${now:...} resolver, which the run directory's name uses
    overrides = [a for a in args if not a.startswith("-")]
    if GlobalHydra.instance().is_initialized():
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    return str(OmegaConf.select(cfg, "hydra.run.dir")), str(OmegaConf.select(cfg, "hydra.job.name") or config_name)


def _quoted(value: str) -> str:
    """A Hydra override value that stays one string whatever the path holds (spaces, commas, '=')."""
    return "'" + value.replace("'", "\\'") + "'"


def launcher_threads(launcher, cores: int) -> int | None:
    """Threads one job may use when the Hydra launcher runs several jobs on the same cores, or None
    when it runs them one at a time (basic) or leaves the cores to a scheduler.

    joblib: n_jobs at once (joblib's convention: -1 every core, -2 all but one), cores // n_jobs each.
    submitit: cpus_per_task (submitit_local starts every job at once and does not confine them; Slurm
    confines a job to its cpus_per_task cores). Ray: the CPUs each job reserves, one by default."""
    target = str(launcher.get("_target_", ""))
    if target.endswith("JoblibLauncher"):
        n_jobs = int(launcher.get("n_jobs") or 1)
        running = n_jobs if n_jobs > 0 else cores + 1 + n_jobs
        return max(1, cores // max(1, min(running, cores)))
    if "hydra_submitit_launcher" in target:
        cpus = launcher.get("cpus_per_task")
        return min(int(cpus), cores) if cpus else None
    if target.endswith("RayLauncher"):
        remote = (launcher.get("ray") or {}).get("remote") or {}
        return min(int(remote.get("num_cpus") or 1), cores)
    return None


def share_cores(cfg, hydra_cfg) -> None:
    """cpu.threads=auto means every core; with several jobs on the same cores that oversubscribes them
    (each spins its own OpenMP threads), so a job takes the share its launcher gives it."""
    if str(cfg.cpu.threads) != "auto" or "launcher" not in hydra_cfg:
        return
    cores = cpu.resolve_threads("auto")
    threads = launcher_threads(hydra_cfg.launcher, cores)
    if threads is None or threads == cores:
        return
    cfg.cpu.threads = threads
    logger.info("cpu.threads=auto: %d of %d cores for this job (%s runs jobs side by side; set cpu.threads to "
                "choose)", threads, cores, str(hydra_cfg.launcher.get("_target_", "")).rsplit(".", 1)[-1])


def _earlier_attempts(path: Path) -> list[dict]:
    """The attempts an earlier status.json recorded (one, for a file from before `attempts`); none if unreadable."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if isinstance(old.get("attempts"), list):
        return old["attempts"]
    if isinstance(old.get("started"), (int, float)) and isinstance(old.get("duration_s"), (int, float)):
        return [{"started": old["started"], "duration_s": old["duration_s"], "status": old.get("status")}]
    return []


def record_status(hydra_cfg, status: str, started: float, err: BaseException | None = None, objective=None) -> None:
    """status.json in the job directory (and error.txt with the traceback when the job failed), so the
    report lists failed sweep jobs with their error, whatever the launcher. Rank 0 alone writes it. A job that
    ends without an error after an earlier attempt failed or was stopped moves that attempt's error.txt to
    error.earlier.txt: error.txt is always the current attempt's. A job run again (a resumed or finished one)
    keeps its earlier attempts: `attempts` lists each one's start, wall time and status, `duration_s` is their sum
    (what the job cost) and `started` the first one's start."""
    if not dist.is_main():
        return
    job_dir = Path(hydra_cfg.runtime.output_dir)
    attempts = [*_earlier_attempts(job_dir / "status.json"),
                {"started": started, "duration_s": time.time() - started, "status": status}]
    info = {"status": status, "overrides": list(hydra_cfg.overrides.task),
            "job_num": hydra_cfg.job.get("num"), "started": attempts[0]["started"],
            "duration_s": sum(a["duration_s"] for a in attempts), "objective": objective, "attempts": attempts}
    try:
        if err is not None:
            info["error_type"] = type(err).__name__
            info["error"] = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            (job_dir / "error.txt").write_text("".join(traceback.format_exception(err)))
        elif (job_dir / "error.txt").is_file():  # an earlier attempt's, which a resumed run has got past: kept aside
            (job_dir / "error.txt").replace(job_dir / "error.earlier.txt")
        write_json(job_dir / "status.json", info)
    except Exception as write_err:  # never hide the job's own outcome
        logger.warning("could not write status.json in %s: %s", job_dir, write_err)
