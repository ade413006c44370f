"""Hydra composition: the conf/ directory, its group options, `compose()` inside or outside a running
Hydra app, and the pre-check that turns composition errors into one-line ConfigErrors before any model
loads (Hydra's own reports span several lines; users asked for one line naming the bad value and the
valid choices)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf, open_dict

from grpo_exp.base.errors import ConfigError
from grpo_exp.base.text import did_you_mean, error_line

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


# the groups conf/train.yaml lists as optional, which `<group>=null` leaves out
OPTIONAL_GROUPS = ("experiment", "ablation", "method", "hparams_search", "debug")


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
            if choice in ("null", "") and group in OPTIONAL_GROUPS:
                continue
            options = group_options(group)
            if choice not in options:
                raise ConfigError(f"unknown {group} option '{choice}'{did_you_mean(choice, options)}; "
                                  f"valid choices: {', '.join(options)}")


LAUNCHER_GROUP = "hydra/launcher"
LAUNCHER_EXTRA = "launchers"


def launcher_options() -> list[str]:
    """hydra/launcher choices: Hydra's `basic` and conf/hydra/launcher/*.yaml. An allowlist: the plugins
    register more configs of their own (ray_aws starts machines on AWS), which grpo-exp does not offer."""
    return sorted({p.stem for p in (CONF_DIR / LAUNCHER_GROUP).glob("*.yaml")} | {"basic"})


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
        raise ConfigError(f"unknown {LAUNCHER_GROUP} option '{choice}'{did_you_mean(choice, options)}; "
                          f"valid choices: {', '.join(options)}")
    target = _launcher_target(choice)
    if not target:
        return  # Hydra's basic launcher
    module = target.rsplit(".", 1)[0]
    try:
        importlib.import_module(module)
    except ImportError as err:
        # hydra_plugins.hydra_joblib_launcher.* is distributed as hydra-joblib-launcher
        parts = module.split(".")
        plugin = parts[1].replace("_", "-") if len(parts) > 1 and parts[0] == "hydra_plugins" else module
        raise ConfigError(f"{LAUNCHER_GROUP}={choice} needs the {plugin} plugin, which is not installed "
                          f"({error_line(err)}); install it with: pip install -e '.[{LAUNCHER_EXTRA}]'") from None


def compose(config_name: str, overrides: list[str] | None = None, with_hydra: bool = False):
    """The config `python -m grpo_exp.<entrypoint> <overrides>` would get (config_name: train or evaluate),
    composed with Hydra's API, inside a running Hydra app or outside one; `with_hydra` keeps Hydra's own node
    (run directory, sweeper, the groups' choices)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import grpo_exp.config.schema  # noqa: F401  (registers the schema)

    overrides = list(overrides or [])
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)
    if with_hydra:
        from hydra.core.utils import setup_globals

        setup_globals()  # Hydra's ${now:...} resolver, which the run directory's name uses
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)


def _valid_keys(config_name: str, key: str) -> list[str]:
    """The keys beside `key` (under its parent), full names."""
    parent = key.rsplit(".", 1)[0] if "." in key else None
    try:
        cfg = compose(config_name)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = sorted(str(k) for k in node.keys()) if node is not None and hasattr(node, "keys") else []
    except Exception:
        keys = []
    return [f"{parent}.{k}" if parent else k for k in keys]


def compose_error(config_name: str, overrides: list[str], err: Exception) -> str:
    """One line for a failed composition: the unknown key with the nearest valid one and the valid ones beside
    it, or Hydra's chain of causes, first lines only."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = err.__cause__ or err
    # the longest key the error names: `train=default train.max_stepz=3` is about train.max_stepz
    named = [a for a in overrides if a.split("=", 1)[0].lstrip("+~") in str(err)]
    bad = max(named, key=lambda a: len(a.split("=", 1)[0]), default=None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and bad:
        key = bad.split("=", 1)[0].lstrip("+~")
        check_moved([key])
        valid = _valid_keys(config_name, key)
        parent = key.rsplit(".", 1)[0] if "." in key else None
        listed = [k.rsplit(".", 1)[-1] for k in valid]
        where = f" under {parent}" if parent else ""
        return (f"unknown config key '{key}'{did_you_mean(key, valid)}"
                + (f"; valid keys{where}: {', '.join(listed)}" if listed else ""))
    return error_line(err, chain=True)


# Hydra's flags that show a config or its sources instead of running; Hydra takes one of them or -m, not both
SHOW_FLAGS = ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--resolve", "-p", "--package")


def check_overrides(config_name: str, args: list[str], validate: Callable | None = None) -> None:
    """Compose once with the user's overrides so type, key and value errors surface as one line, then check
    what the command will do (config/run_checks.py); a sweep (-m) has every job checked (config/sweep_check.py).

    `validate(cfg)` runs the semantic checks on the composed config, still before any model loads
    and before Hydra creates a run directory.
    """
    multirun = any(a in ("-m", "--multirun") for a in args)
    flags = [a.split("=", 1)[0] for a in args if a.startswith("-")]
    if multirun and any(f in SHOW_FLAGS for f in flags):
        shown = next(f for f in flags if f in SHOW_FLAGS)
        raise ConfigError(f"-m and {shown} cannot be combined (Hydra shows the config of one run at a time); drop -m "
                          f"and give one job's values to see its config")
    check_moved(args)
    check_group_choices(args, multirun)
    check_launcher(args)
    if any(f not in ("-m", "--multirun") for f in flags):
        return  # Hydra's own flags (--cfg, --info, ...) compose and print the config themselves
    overrides = [a for a in args if not a.startswith("-")]
    if multirun:
        check_sweep(config_name, overrides, validate)
        return
    try:
        cfg = compose(config_name, overrides, with_hydra=True)
    except Exception as err:
        raise ConfigError(compose_error(config_name, overrides, err)) from None
    from grpo_exp.config.run_checks import check_run

    check_run(cfg, config_name)
    with open_dict(cfg):
        del cfg["hydra"]  # the checks below read the run's own config, as the task will
    if "cpu" in cfg:
        from grpo_exp.base import cpu

        # OpenMP reads its settings once, when torch loads, and the checks below may load torch
        cpu.prepare_env(cfg.cpu)
    if validate is not None:
        validate(cfg)


def _job_config(config_name: str, job: list[str], hydra_overrides: list[str]):
    """(a sweep job's config as the job will read it, the same with Hydra's own node, as the command line's hydra.*
    overrides set it), so a value that names the sweep's directory or a group's choice (${hydra:sweep.dir},
    ${hydra:runtime.choices.method}) resolves as in the job."""
    full = compose(config_name, [*job, *hydra_overrides], with_hydra=True)
    cfg = full.copy()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, full


@contextmanager
def _hydra_config(full):
    """The job's config with Hydra's node installed for ${hydra:...} while the job's config is checked, then what
    was there put back (this process's own run, when Hydra starts it, sets its own)."""
    from hydra.core.hydra_config import HydraConfig

    holder = HydraConfig.instance()
    before = holder.cfg
    holder.cfg = full  # not set_config's copy of the hydra node alone: its values may name the job's (task_name)
    try:
        yield
    finally:
        holder.cfg = before


def check_sweep(config_name: str, overrides: list[str], validate: Callable | None) -> None:
    """Compose and check every job of the sweep `overrides` describe (config/sweep_check.py); raise one
    ConfigError that holds each distinct problem once, with the jobs it concerns."""
    from grpo_exp.config import sweep_check
    from grpo_exp.config.run_checks import check_writable

    try:
        jobs, sweep_dir = sweep_check.sweep_jobs(config_name, overrides)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(compose_error(config_name, overrides, err)) from None
    check_writable("hydra.sweep.dir", sweep_dir)
    if jobs is None:
        return  # another sweeper (a search) makes its jobs as it goes; each is checked when it starts
    problems: dict[str, list[int]] = {}
    hydra_overrides = [o for o in overrides if o.lstrip("+~").startswith("hydra.")]
    for num, job in enumerate(jobs):
        try:
            cfg, hydra_node = _job_config(config_name, job, hydra_overrides)
            if validate is not None:
                with _hydra_config(hydra_node):
                    validate(cfg)
        except ConfigError as err:
            problems.setdefault(str(err), []).append(num)
        except Exception as err:
            problems.setdefault(compose_error(config_name, job, err), []).append(num)
    if problems:
        raise ConfigError(sweep_check.sweep_error(problems, len(jobs)))
    sweep_check.checked_jobs.update(tuple(job) for job in jobs)
