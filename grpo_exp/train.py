"""Entrypoint: `python -m grpo_exp.train stage=basic` (Hydra). All logic lives in grpo_exp.training."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from grpo_exp import config as _schemas  # noqa: F401  (registers the structured-config schema)
from grpo_exp.cli import EXIT_BAD_INPUT, guarded, report_config_error
from grpo_exp.errors import ConfigError


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from grpo_exp.training import train

    try:
        metrics = train(cfg)
    except ConfigError as err:
        report_config_error(err)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the sweep records this job as failed and runs the others
        sys.exit(EXIT_BAD_INPUT)
    # Returned for sweepers that optimise an objective.
    return metrics.get("reward_mean_last")


if __name__ == "__main__":
    guarded(main, "train")
