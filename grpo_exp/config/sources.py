"""Where each value of a composed config came from: the yaml file of conf/ that set it last (Hydra merges the
defaults list in order, so a stage file's train.* beats conf/train/default.yaml), the schema's default
(config/schema.py) where no file sets it, or the command line. Hydra's own `--info defaults` lists the files in
merge order but not which key each one set."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from grpo_exp.config.options import CONF_DIR

SCHEMA = "schema default (grpo_exp/config/schema.py)"
COMMAND_LINE = "command line"


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _file_of(config_path: str) -> str:
    """conf/<config_path>.yaml when conf/ holds it, else the ConfigStore's node of that name (the schema)."""
    path = CONF_DIR / f"{config_path}.yaml"
    return str(path.relative_to(CONF_DIR.parent)) if path.is_file() else SCHEMA


def value_sources(config_name: str, overrides: list[str] | None = None) -> list[tuple[str, Any, str]]:
    """(dotted key, value, where it came from) for every leaf of the config `python -m grpo_exp.<config_name>
    <overrides>` composes, Hydra's own node left out; values as written (interpolations unresolved)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl  # the loader Hydra's --info defaults uses
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    import grpo_exp.config.schema  # noqa: F401  (registers the structured-config schemas)
    from grpo_exp.config.compose import compose

    overrides = list(overrides or [])
    cfg = compose(config_name, overrides)
    values = _leaves(OmegaConf.to_container(cfg, resolve=False))
    sources = dict.fromkeys(values, SCHEMA)
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
    defaults = loader.compute_defaults_list(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN)
    for default in defaults.defaults:
        if default.config_path is None or default.package == "hydra" or str(default.package).startswith("hydra."):
            continue
        loaded = loader._load_single_config(default=default, repo=loader.repository)  # placed at its package
        node = OmegaConf.to_container(loaded.config, resolve=False)
        node.pop("hydra", None)
        where = _file_of(default.config_path)
        for key in _leaves(node):
            if key in sources and where != SCHEMA:
                sources[key] = where
    for arg in overrides:
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        for leaf in sources:
            if value and (leaf == key or leaf.startswith(key + ".")) and key not in _groups():
                sources[leaf] = f"{COMMAND_LINE} ({arg})"
    return [(key, values[key], sources[key]) for key in values]


def _groups() -> set[str]:
    from grpo_exp.config.options import groups

    return set(groups())


def format_sources(rows: list[tuple[str, Any, str]], value_width: int = 60) -> str:
    """One line per key: `key = value    <- source`, aligned; a long value is cut at `value_width` characters."""
    def shown(key: str, value: Any) -> str:
        text = repr(value)
        return f"{key} = {text if len(text) <= value_width else text[:value_width - 3] + '...'}"

    width = max((len(shown(k, v)) for k, v, _ in rows), default=0)
    return "\n".join(f"{shown(k, v):<{width}}  <- {s}" for k, v, s in rows)
