"""Hydra composition: the conf/ directory, its group options, `compose()` inside or outside a running
Hydra app, and the pre-check that turns composition errors into one-line ConfigErrors before any model
loads (Hydra's own reports span several lines; users asked for one line naming the bad value and the
valid choices)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from grpo_exp.base.errors import ConfigError
from grpo_exp.base.text import error_line

from grpo_exp.config.speed import check_moved
from grpo_exp.config.options import CONF_DIR, group_options, groups as _groups


def _split_override(arg: str) -> tuple[str, str] | None:
    if "=" not in arg or arg.startswith(("-", "~")):
        return None
    key, value = arg.split("=", 1)
    return key.lstrip("+"), value


def model_overrides(model: str) -> list[str]:
    """A tool's `--model`: a conf/model option, or any model directory or hub id (org/name), which
    conf/model/custom.yaml loads, so a model of one's own is timed without a config file of its own."""
    if "/" in model or Path(model).expanduser().is_dir():
        return ["model=custom", f"model.id={model}"]
    return [f"model={model}"]


def check_group_choices(args: list[str], multirun: bool) -> None:
    """`model=foo`: name the valid options instead of Hydra's multi-line 'Could not find'."""
    groups = _groups()
    for arg in args:
        parsed = _split_override(arg)
        if parsed is None or parsed[0] not in groups:
            continue
        group, value = parsed
        values = value.split(",") if multirun else [value]
        for choice in values:
            choice = choice.strip()
            if choice in ("null", "") and group in ("experiment", "debug"):
                continue
            if choice not in group_options(group):
                raise ConfigError(f"unknown {group} option '{choice}'; valid choices: {', '.join(group_options(group))}")


LAUNCHER_GROUP = "hydra/launcher"
LAUNCHER_EXTRA = "launchers"


def launcher_options() -> list[str]:
    """hydra/launcher choices: Hydra's `basic`, conf/hydra/launcher/*.yaml and installed plugins' own."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports the installed hydra_plugins packages, which register their configs
    stored = {name.rsplit(".", 1)[0] for name in ConfigStore.instance().list(LAUNCHER_GROUP)}
    files = {p.stem for p in (CONF_DIR / LAUNCHER_GROUP).glob("*.yaml")}
    return sorted(stored | files | {"basic"})


def _launcher_target(choice: str) -> str | None:
    """The launcher class conf/hydra/launcher/<choice>.yaml names; None for Hydra's and plugins' own configs."""
    path = CONF_DIR / LAUNCHER_GROUP / f"{choice}.yaml"
    if not path.is_file():
        return None
    return OmegaConf.load(path).get("_target_") or None


def check_launcher(args: list[str]) -> None:
    """`hydra/launcher=<name>`: one line for an unknown launcher (Hydra's own error lists the options over
    several lines) or for one whose plugin is not installed (Hydra would fail only once the sweep starts)."""
    import importlib

    choice = None
    for arg in args:
        parsed = _split_override(arg)
        if parsed and parsed[0] == LAUNCHER_GROUP:
            choice = parsed[1].strip()
    if choice is None:
        return
    options = launcher_options()
    if "," in choice:
        raise ConfigError(f"{LAUNCHER_GROUP}={choice}: a sweep runs on one launcher; choose one of: {', '.join(options)}")
    if choice not in options:
        raise ConfigError(f"unknown {LAUNCHER_GROUP} option '{choice}'; valid choices: {', '.join(options)}")
    target = _launcher_target(choice)
    if not target:
        return  # Hydra's basic launcher, or a plugin's own config (so its plugin is installed)
    module = target.rsplit(".", 1)[0]
    try:
        importlib.import_module(module)
    except ImportError as err:
        # hydra_plugins.hydra_joblib_launcher.* is distributed as hydra-joblib-launcher
        parts = module.split(".")
        plugin = parts[1].replace("_", "-") if len(parts) > 1 and parts[0] == "hydra_plugins" else module
        raise ConfigError(f"{LAUNCHER_GROUP}={choice} needs the {plugin} plugin, which is not installed "
                          f"({error_line(err)}); install it with: pip install -e '.[{LAUNCHER_EXTRA}]'") from None


def compose(config_name: str, overrides: list[str] | None = None):
    """The config `python -m grpo_exp.<entrypoint> <overrides>` would get (config_name: train or evaluate),
    composed with Hydra's API, inside a running Hydra app or outside one."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import grpo_exp.config.schema  # noqa: F401  (registers the schema)

    overrides = list(overrides or [])
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name=config_name, overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


def _valid_keys(config_name: str, key: str) -> str:
    parent = key.rsplit(".", 1)[0] if "." in key else None
    try:
        cfg = compose(config_name)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = sorted(str(k) for k in node.keys()) if node is not None and hasattr(node, "keys") else []
    except Exception:
        keys = []
    where = f" under {parent}" if parent else ""
    return f"; valid keys{where}: {', '.join(keys)}" if keys else ""


def compose_error(config_name: str, overrides: list[str], err: Exception) -> str:
    """One line for a failed composition: the unknown key with the valid ones beside it, or Hydra's chain of
    causes, first lines only."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = err.__cause__ or err
    # the longest key the error names: `train=default train.max_stepz=3` is about train.max_stepz
    named = [a for a in overrides if a.split("=", 1)[0].lstrip("+~") in str(err)]
    bad = max(named, key=lambda a: len(a.split("=", 1)[0]), default=None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and bad:
        key = bad.split("=", 1)[0].lstrip("+~")
        check_moved([key])
        return f"unknown config key '{key}'{_valid_keys(config_name, key)}"
    return error_line(err, chain=True)


def check_overrides(config_name: str, args: list[str], validate: Callable | None = None) -> None:
    """Compose once with the user's overrides so type, key and value errors surface as one line.

    `validate(cfg)` runs the semantic checks on the composed config, still before any model loads
    and before Hydra creates a run directory.
    """
    multirun = any(a in ("-m", "--multirun") for a in args)
    check_moved(args)
    check_group_choices(args, multirun)
    check_launcher(args)
    if multirun or any(a.startswith("-") for a in args):
        return  # sweeps and Hydra flags are composed per job by Hydra itself
    overrides = [a for a in args if not a.lstrip("+~").startswith("hydra")]
    try:
        cfg = compose(config_name, overrides)
    except Exception as err:
        raise ConfigError(compose_error(config_name, overrides, err)) from None
    if "cpu" in cfg:
        from grpo_exp.base import cpu

        # OpenMP reads its settings once, when torch loads, and the checks below may load torch
        cpu.prepare_env(cfg.cpu)
    if validate is not None:
        validate(cfg)
