"""Entrypoint: `python -m grpo_exp.train stage=basic` (Hydra). All logic lives in grpo_exp.training
(one stage) and grpo_exp.curriculum (`curriculum=progressive`: several stages in one command)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from grpo_exp import config as _schemas  # noqa: F401  (registers the structured-config schema)
from grpo_exp.cli import CONF_DIR, EXIT_BAD_INPUT, guarded, report_config_error
from grpo_exp.errors import ConfigError, TrainingHalted
from grpo_exp.runio import write_json

# Offline machines would otherwise stall on usage pings to the hub.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


EXIT_HALTED = 3


def run(cfg: DictConfig, overrides: list[str]) -> dict:
    """One stage, or the whole curriculum when cfg.curriculum.stages is set."""
    if isinstance(cfg.resume, str):  # resume=<run dir>: continue that directory, not the new Hydra one
        cfg.paths.output_dir = cfg.resume
    from grpo_exp import cpu

    cpu.prepare_env(cfg.cpu)  # before anything loads torch: OpenMP reads its settings only then
    if cfg.curriculum.stages:
        from grpo_exp.curriculum import run_curriculum

        return run_curriculum(cfg, overrides)
    from grpo_exp.training import train

    return train(cfg)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    started = time.time()
    try:
        result = run(cfg, list(hydra_cfg.overrides.task))
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
            print(f"[grpo-exp] job {hydra_cfg.job.num} failed: {type(err).__name__}: {err} "
                  f"(traceback in {hydra_cfg.runtime.output_dir}/error.txt); the sweep goes on", file=sys.stderr)
        raise  # in a sweep Hydra records the job as failed, runs the others and exits non-zero at the end
    objective = result.get("reward_mean_last", result.get("average_accuracy"))
    record_status(hydra_cfg, result.get("status", "completed"), started, objective=objective)
    # Returned for sweepers that optimise an objective.
    return objective


def record_status(hydra_cfg, status: str, started: float, err: BaseException | None = None, objective=None) -> None:
    """status.json in the job directory (and error.txt with the traceback when the job failed),
    so scripts/report.py lists failed sweep jobs with their error."""
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
        print(f"[grpo-exp] warning: could not write status.json in {job_dir}: {write_err}", file=sys.stderr)


def precheck(cfg) -> None:
    """Everything that can be checked without loading a model."""
    from grpo_exp.config import validate
    from grpo_exp.models import check_available
    from grpo_exp.runio import resolve_init

    validate(cfg)
    check_available(cfg.model, cfg.paths.cache_dir)
    init = resolve_init(cfg.init_from)
    if init and cfg.ewc["lambda"] > 0 and not (init[1] / "fisher.safetensors").is_file():
        raise ConfigError(f"init_from={cfg.init_from} has no EWC state (fisher.safetensors in {init[1]}); "
                          f"train that stage with ewc.lambda>0, or continue with ewc.lambda=0")


if __name__ == "__main__":
    guarded(main, "train", precheck)
