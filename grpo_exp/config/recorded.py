"""The config a training run recorded (Hydra's `.hydra/config.yaml`), found from its run directory or its
model/: what evaluation, EWC and the config checks read to score or continue a run on its own terms, and the
split seed it cut its stage with."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def run_config(path: str | Path | None) -> tuple[DictConfig, Path] | None:
    """(config, its file) a training run was started with (.hydra/config.yaml), for a run dir or its model/."""
    if not path:
        return None
    path = Path(path)
    for saved in (path / ".hydra" / "config.yaml", path.parent / ".hydra" / "config.yaml"):
        if saved.is_file():
            return OmegaConf.load(saved), saved
    return None


def split_seed(stage, seed: int) -> int:
    """The seed that cuts a stage's splits: its `stage.split_seed`, or, for a run recorded before that key
    existed, the training seed it drew them with."""
    recorded = stage.get("split_seed") if hasattr(stage, "get") else None
    return int(seed if recorded is None else recorded)
