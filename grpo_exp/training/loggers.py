"""The `logger` option's tracker for one stage: wandb (training/tracking.py) or trackio
(training/trackio_tracking.py) started on rank 0 at the stage's start and finished at its end, or none."""

from __future__ import annotations

from pathlib import Path

from grpo_exp.base import dist


def _module(name: str):
    """The tracking module of a logger option: start/finish and a Tracker."""
    if name == "trackio":
        from grpo_exp.training import trackio_tracking

        return trackio_tracking
    from grpo_exp.training import tracking

    return tracking


def start(cfg, run_dir: Path, step_offset: int):
    """The stage's tracker (rank 0's; TRL's logged figures are already gathered over the processes), or None."""
    if cfg.logger.name == "none" or not dist.is_main():
        return None
    return _module(cfg.logger.name).start(cfg, run_dir, step_offset=step_offset)


def finish(tracker, metrics: dict | None, failed: bool) -> None:
    if tracker is not None:
        _module(tracker.report_to).finish(tracker, metrics, failed=failed)
