"""The config a training run recorded (Hydra's `.hydra/config.yaml`), found from its run directory or its
model/: what evaluation, EWC and the config checks read to score or continue a run on its own terms, and the
split seed it cut its stage with."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo_exp.core.data.splits import split_seed  # noqa: F401  (the config checks read it here; defined with the splits)


def run_config(path: str | Path | None) -> tuple[DictConfig, Path] | None:
    """(config, its file) a training run was started with (.hydra/config.yaml), for a run dir or its model/."""
    if not path:
        return None
    path = Path(path)
    for saved in (path / ".hydra" / "config.yaml", path.parent / ".hydra" / "config.yaml"):
        if saved.is_file():
            return OmegaConf.load(saved), saved
    return None
