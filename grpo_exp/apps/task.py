"""The one task wrapper every Hydra entrypoint runs through (in the manner of lightning-hydra-template's
`task_wrapper`):

1. compose and check the config once: before Hydra creates a run directory for a single run (so bad
   input leaves nothing behind), or per job inside a sweep;
2. set up the CPU (OpenMP/MKL read their settings when torch loads, so before anything imports it);
3. run the task and write `status.json` (and `error.txt` with the traceback when it fails);
4. map errors to exit codes: bad input 2, a run that halted itself 3, anything else Hydra's own.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from grpo_exp.base import cpu, log
from grpo_exp.base.errors import ConfigError, TrainingHalted
from grpo_exp.base.io import write_json

EXIT_BAD_INPUT = 2
EXIT_HALTED = 3
logger = log.get_logger(__name__)


def report_config_error(err: BaseException) -> None:
    print(f"error: {err}", file=sys.stderr)


def run_task(config_name: str, task: Callable[[Any], dict], check: Callable[[Any], None],
             objective: Callable[[dict], float | None]) -> None:
    """Run `task(cfg)` as the Hydra app `config_name` (conf/<config_name>.yaml) with the steps above.

    `check(cfg)` raises ConfigError on bad input without loading a model; `objective(result)` is the
    number a sweeper optimises (returned from the Hydra main)."""
    import hydra
    from omegaconf import DictConfig

    import grpo_exp.config.schema  # noqa: F401  (registers the structured-config schemas)
    from grpo_exp.config.compose import CONF_DIR, check_overrides

    try:
        check_overrides(config_name, sys.argv[1:], check)
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
            if multirun:  # a single run was checked before Hydra started
                check(cfg)
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
            record_status(hydra_cfg, "interrupted" if interrupted else "failed", started, err)
            if multirun and not interrupted:
                logger.error("job %s failed: %s: %s (traceback in %s/error.txt); the sweep goes on",
                             hydra_cfg.job.num, type(err).__name__, err, hydra_cfg.runtime.output_dir)
            raise  # in a sweep Hydra records the job as failed, runs the others and exits non-zero at the end
        value = objective(result)
        record_status(hydra_cfg, result.get("status", "completed"), started, objective=value)
        return value

    main()


def record_status(hydra_cfg, status: str, started: float, err: BaseException | None = None, objective=None) -> None:
    """status.json in the job directory (and error.txt with the traceback when the job failed), so the
    report lists failed sweep jobs with their error, whatever the launcher."""
    job_dir = Path(hydra_cfg.runtime.output_dir)
    info = {"status": status, "overrides": list(hydra_cfg.overrides.task),
            "job_num": hydra_cfg.job.get("num"), "started": started, "duration_s": time.time() - started,
            "objective": objective}
    try:
        if err is not None:
            info["error_type"] = type(err).__name__
            info["error"] = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            (job_dir / "error.txt").write_text("".join(traceback.format_exception(err)))
        write_json(job_dir / "status.json", info)
    except Exception as write_err:  # never hide the job's own outcome
        logger.warning("could not write status.json in %s: %s", job_dir, write_err)
