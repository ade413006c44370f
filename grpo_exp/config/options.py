"""The conf/ directory and the options of its config groups (one YAML file each)."""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def groups() -> list[str]:
    """Config groups a user picks options from (hydra/ is Hydra's own)."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


def default_options(config_name: str = "train") -> dict[str, str | None]:
    """The option each group of conf/<config_name>.yaml picks by default (None for an optional group
    such as `debug` that picks nothing), read from its defaults list."""
    from omegaconf import OmegaConf

    chosen: dict[str, str | None] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{config_name}.yaml")).get("defaults", []):
        if not isinstance(entry, dict):
            continue  # the schema and _self_
        for key, value in entry.items():
            group = key.removeprefix("optional ").strip()
            if group in groups():
                chosen[group] = None if value is None else str(value)
    return chosen
