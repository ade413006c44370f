"""What the web app may start: an allowlist of `python -m grpo_exp.train` overrides, checked before any process
starts.

Whoever reaches the app's page can start processes as the app's user, so the app runs only what its form offers:

- `group=option` for the groups the Launch tab shows (LAUNCH_GROUPS), with an option from conf/<group>/;
- `key=value` for a key of the schema (grpo_exp/config/schema.py), `+`/`++` prefixed or not, with a literal value:
  no interpolation (`${oc.env:...}` reads the app's environment) in the value as Hydra parses it, so after its
  unescaping (`$\\{` becomes `${`), no backslash outside the free-text system prompt, no sweep. Names
  (model.name, logger.project, ...) are plain names: some become file names. Paths are confined: init_from,
  stage.path, curriculum.branch_from and a local model.id or stage.hub_id must resolve (symlinks followed) under
  the app's outputs folder or this package, logger.dir (written to) under the outputs folder. They are checked
  again on the composed, resolved config, and the child gets each path it was given as checked (resolved), so a
  symlink swapped after the check changes nothing.
- nothing that sends data off the machine: no hub upload (push_to_hub, hub_model_id, hub_private), no online
  logging (logger.mode=online, logger.entity);
- values within the app's bounds (launch_bounds.py: steps, checkpoints kept, model sizes, tokens, samples).

Everything else is refused with one line naming the bad item and what is accepted: Hydra's own settings (`hydra.*`,
`+hydra.callbacks...` would make Hydra instantiate any callable), flags (`-m`, `--config-dir`), deletions (`~key`),
`resume` and `paths.*` (they choose where a run writes), `train.extra` (passed to TRL unchecked, output_dir among
its keys) and anything not a schema key. The list that passes is then composed and validated
(grpo_exp.config.checks.validate) as the run itself would, so a bad value is refused before a process starts. The
child gets an argument list, never a shell line: `;` or `$(...)` in a value are just characters. A refusal names
the item as typed and never a value the app resolved (a symlink's target, an environment variable).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shlex
import sys
import threading
import typing
from pathlib import Path
from typing import Any

import grpo_exp
from grpo_exp.apps import launch_bounds
from grpo_exp.base.text import did_you_mean, error_line
from grpo_exp.config.options import CONF_DIR, group_options

# The config groups the Launch tab offers, in the order shown (experiment/ablation are sweeps: command line)
LAUNCH_GROUPS = ["model", "stage", "reward", "quantization", "peft", "cpu", "logger", "train", "curriculum", "debug"]
PACKAGE_DIR = Path(grpo_exp.__file__).resolve().parent

# keys read from a path: confined to the outputs folder or the package
READ_PATHS = ("init_from", "stage.path", "checkpoint", "curriculum.branch_from")
WRITE_PATHS = ("logger.dir",)  # written to: the outputs folder only
HUB_OR_PATH = ("model.id", "stage.hub_id")  # a hub id (org/name), or a local folder read like READ_PATHS
FREE_TEXT = ("reward.system_prompt",)  # any text: it only goes into the prompts
# schema keys the app does not offer, and why
NOT_OFFERED = {
    "resume": "resume continues an existing run directory, wherever it is; continue a run on the command line",
    "paths": "paths.* choose where runs and caches are written; the app puts each run under its outputs folder",
    "train.extra": "train.extra passes settings to TRL unchecked (output_dir and logging_dir among them); "
                   "set it on the command line",
    "task_name": "task_name names the entrypoint and its log file; the app runs grpo_exp.train",
    "push_to_hub": "uploads to the hub are not offered from the app (they would use this machine's hub login); "
                   "push on the command line",
    "hub_model_id": "uploads to the hub are not offered from the app; push on the command line",
    "hub_private": "uploads to the hub are not offered from the app; push on the command line",
    "logger.entity": "a wandb entity matters only when logging online, which the app does not offer; runs log "
                     "offline (wandb sync uploads them later)",
    "curriculum.stage_overrides": "a stage's own overrides reach the stage unchecked by the app; give each setting "
                                  "as its own override, or set stage_overrides on the command line",
    "curriculum.branch_from": "branching takes another run's directory, wherever it is; branch on the command line",
    "curriculum.branch_from_missing": "it only matters with curriculum.branch_from, which the app does not offer",
    "curriculum.match_accuracy_of": "matching reads another run's directory, wherever it is; match on the command "
                                    "line",
}
OFFLINE_MODES = ("offline", "disabled")  # logger.mode: what the app offers (online sends the run to a server)
NAME = re.compile(r"[A-Za-z0-9_.+-]*")
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


INTERPOLATION = ("interpolations (${...}, escaped or not) are not accepted from the app (they read its "
                 "environment and files); give the value itself")


class LaunchRefused(ValueError):
    """An override list the app will not run; the message is one line naming the item and what is accepted."""


def split(text: str) -> list[str]:
    """The override box's text as the command line would split it (quotes group, nothing is expanded)."""
    try:
        return shlex.split(text or "")
    except ValueError as err:  # an unclosed quote
        raise LaunchRefused(f"the overrides cannot be split into words ({err}): close the quote") from None


@functools.cache  # the schema is fixed once imported; the preview checks the form on every change
def schema_keys(root: type | None = None) -> dict[str, Any]:
    """Every leaf key of the schema (dotted) with its type; sections (model, train, ...) are not leaves."""
    from grpo_exp.config import schema

    keys: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        # the class's own module first: a group's schema may live beside schema.py (ewc_schema, curriculum_schema)
        hints = typing.get_type_hints(cls, {**vars(schema), **vars(sys.modules[cls.__module__])})
        for f in dataclasses.fields(cls):
            kind = hints.get(f.name, Any)
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{f.name}.")
            else:
                keys[prefix + f.name] = kind

    walk(root or schema.RunConfig, "")
    return keys


def _not_offered(key: str) -> str | None:
    for name, why in NOT_OFFERED.items():
        if key == name or key.startswith(name + "."):
            return why
    return None


def _sections() -> list[str]:
    return sorted({k.split(".", 1)[0] for k in schema_keys() if "." in k})


def allowed_keys() -> list[str]:
    return sorted(k for k in schema_keys() if _not_offered(k) is None)


def _unknown(key: str) -> str:
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    under = [k for k in allowed_keys() if parent and k.startswith(parent + ".")]
    if under:
        return (f"unknown config key '{key}'{did_you_mean(key, under)}; valid keys under {parent}: "
                f"{', '.join(k[len(parent) + 1:] for k in under)}")
    top = [k for k in allowed_keys() if "." not in k]
    return (f"unknown config key '{key}'{did_you_mean(key, allowed_keys())}; valid: {', '.join(top)}, <section>.<key> "
            f"for the sections "
            f"{', '.join(_sections())}, and the groups {', '.join(LAUNCH_GROUPS)}")


def inside(path: str | Path, roots: list[Path], cwd: Path) -> Path | None:
    """`path` resolved from cwd (symlinks followed) if it lies under one of `roots`, else None."""
    resolved = (cwd / Path(path)).resolve()
    return resolved if any(resolved.is_relative_to(root.resolve()) for root in roots) else None


def _confined(key: str, value: str, roots: list[Path], cwd: Path) -> Path:
    """The path as checked (resolved from cwd, symlinks followed); LaunchRefused if it lies outside `roots`. The
    refusal never shows the resolved path: a symlink's target is not the user's to learn."""
    where = " or ".join(str(r) for r in roots)
    if value.startswith("~"):
        raise LaunchRefused(f"'~' is not expanded here; give {key} a path under {where}")
    resolved = inside(value, roots, cwd)
    if resolved is None:
        raise LaunchRefused(f"it lies outside the folders the app reads and writes (symlinks followed); give {key} "
                            f"a path under {where}")
    if any(c in str(resolved) for c in "$\\'"):  # the run gets it as a quoted Hydra value: nothing to interpret
        raise LaunchRefused(f"the path {key} leads to holds $, a backslash or a quote, which the app does not pass on")
    return resolved


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _model_packages() -> list[str]:
    """The pip packages conf/model options load a GGUF from (a free name would be imported)."""
    from omegaconf import OmegaConf

    found = (OmegaConf.load(p).get("package") for p in sorted((CONF_DIR / "model").glob("*.yaml")))
    return sorted({str(p) for p in found if p})


def _check_value(key: str, value: Any, outputs: Path, cwd: Path) -> Path | None:
    """The rules beyond the schema's types for the keys that name files, folders, packages and names; for a path,
    the path as checked (resolved), which is what the run is given."""
    if value is None or key in FREE_TEXT:
        return None
    text = str(value)
    read_roots = [outputs, PACKAGE_DIR]
    if key in READ_PATHS:
        return _confined(key, text, read_roots, cwd)
    if key in WRITE_PATHS:
        return _confined(key, text, [outputs], cwd)
    if key in HUB_OR_PATH:
        # a local folder is read wherever it is named so (transformers and datasets look there first)
        if HUB_ID.fullmatch(text) and ".." not in text and not (cwd / text).exists():
            return None
        if not (cwd / text).exists() and not text.startswith(("/", ".", "~")):
            raise LaunchRefused(f"{key} is neither a hub id of the form org/name nor an existing folder")
        return _confined(key, text, read_roots, cwd)
    if key == "logger.mode":
        if text not in OFFLINE_MODES:
            raise LaunchRefused(f"the app logs only {' or '.join(OFFLINE_MODES)} (online would send the run to a "
                                f"server with this machine's login); wandb sync uploads an offline run later")
    elif key == "model.package":
        packages = _model_packages()
        if text not in packages:
            raise LaunchRefused(f"{text} is not a model package of conf/model; choose one of: {', '.join(packages)}")
    else:
        for item in _strings(value):
            if not NAME.fullmatch(item) or ".." in item:
                raise LaunchRefused(f"{key} takes names of letters, digits and . _ + - (some become file names), "
                                    f"not {item!r}")
    return None


def check_item(item: str, outputs: Path, cwd: Path) -> str:
    """One override against the allowlist; raises LaunchRefused naming it. Returns the override the run gets: the
    item itself, or for a path its resolved form (what was checked is what the run reads)."""
    try:
        resolved = _check_item(item, outputs, cwd)
    except LaunchRefused as err:
        raise LaunchRefused(f"'{item}': {err}") from None
    if resolved is None:
        return item
    return f"{item.split('=', 1)[0]}={_quoted(str(resolved))}"


def _quoted(value: str) -> str:
    """A checked path as one quoted Hydra value (it may hold spaces, brackets or commas; _confined refused the
    characters a quoted value would still interpret)."""
    return f"'{value}'"


def _check_item(item: str, outputs: Path, cwd: Path) -> Path | None:
    if item.startswith("-"):
        raise LaunchRefused("the app takes key=value overrides, not flags (-m, --multirun, --config-dir, ...); "
                            "sweeps and flags go on the command line (python -m grpo_exp.train -m ...)")
    if item.startswith("~"):
        raise LaunchRefused("deleting a key (~key) is not offered; set its value instead")
    if "=" not in item:
        raise LaunchRefused("not an override of the form key=value (group=option or section.key=value)")
    raw_key, raw_value = item.split("=", 1)
    key = raw_key.lstrip("+")
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        raise LaunchRefused("Hydra's own settings (hydra.*) are not offered: the app chooses each run's directory, "
                            "and hydra.callbacks would run any code")
    if "@" in key:
        raise LaunchRefused("package overrides (key@package=...) are not offered")
    if "${" in item:
        raise LaunchRefused(INTERPOLATION)
    if key in LAUNCH_GROUPS:
        if raw_key != key:
            raise LaunchRefused(f"{key} is a config group: choose its option as {key}=<option>, without '+'")
        options = group_options(key)
        if raw_value not in options:
            raise LaunchRefused(f"unknown {key} option '{raw_value}'; valid choices: {', '.join(options)}")
        return
    if (CONF_DIR / key).is_dir():
        raise LaunchRefused(f"the group {key} is not offered by the app (sweeps and the rest go on the command "
                            f"line); its groups: {', '.join(LAUNCH_GROUPS)}")
    try:
        parsed = _parser().parse_override(item)
    except Exception as err:  # Hydra's grammar: `;` or an unbalanced bracket in a value
        raise LaunchRefused(f"Hydra cannot read it ({error_line(err).split(': ', 1)[-1]}); quote a value "
                            f"with such characters as key='value'") from None
    if parsed.key_or_group != key or parsed.package:  # what was checked must be what Hydra sets
        raise LaunchRefused(f"Hydra reads its key as '{parsed.key_or_group}'; write the key alone, as key=value")
    why = _not_offered(key)
    if why:
        raise LaunchRefused(why)
    if key not in schema_keys():
        section = key in _sections()
        raise LaunchRefused(f"{key} is a section; set one of its keys ({key}.<key>=value)" if section else _unknown(key))
    if parsed.is_sweep_override():
        raise LaunchRefused("a sweep runs several runs; the app runs one (sweeps go on the command line with -m)")
    value = parsed.value()
    # Hydra unescapes \{ \} \: (and OmegaConf reads \${ back as ${): after parsing, no ${ may be left, and no
    # backslash outside free text, where it is a character of the prompt
    if any("${" in text for text in _strings(value)):
        raise LaunchRefused(INTERPOLATION)
    if "\\" in raw_value and key not in FREE_TEXT:
        raise LaunchRefused("a backslash is not accepted here (Hydra's grammar reads it as an escape); give the "
                            "value itself")
    return _check_value(key, value, outputs, cwd)


@functools.cache
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def check_items(items: list[str], outputs: Path, cwd: Path) -> list[str]:
    """Each override against the allowlist, without composing (quick enough for every keystroke); returns the
    overrides the run gets (paths resolved)."""
    too_many = launch_bounds.item_count(items)
    if too_many:
        raise LaunchRefused(too_many)
    return [check_item(item, outputs, cwd) for item in items]


def compose_train(overrides: list[str]):
    """conf/train.yaml with overrides, as `python -m grpo_exp.train` composes it (one caller at a time:
    Hydra's global state is not thread-safe)."""
    from hydra.core.global_hydra import GlobalHydra

    from grpo_exp.config.compose import compose

    with _COMPOSE_LOCK:
        GlobalHydra.instance().clear()
        return compose("train", overrides)


_COMPOSE_LOCK = threading.Lock()


def check(items: list[str], outputs: Path, cwd: Path):
    """The allowlist, then the config the run would get, composed and validated: returns (config, the overrides
    the run gets), or raises LaunchRefused with one line. Nothing is started or written."""
    from hydra.core.global_hydra import GlobalHydra

    from grpo_exp.base.errors import ConfigError
    from grpo_exp.config.checks import validate
    from grpo_exp.config.compose import compose, compose_error

    items = check_items(items, outputs, cwd)
    with _COMPOSE_LOCK:  # compose_error composes again to list the valid keys
        GlobalHydra.instance().clear()
        try:
            cfg = compose("train", items)
        except Exception as err:
            raise LaunchRefused(compose_error("train", items, err)) from None
    check_composed(cfg, outputs, cwd)  # before validating: the app's own bounds are the first thing to say
    try:
        validate(cfg)
    except ConfigError as err:
        raise LaunchRefused(str(err)) from None
    except Exception as err:  # a value left missing (model=custom without model.id), say
        raise LaunchRefused(error_line(err, chain=True)) from None
    return cfg, items


def check_composed(cfg, outputs: Path, cwd: Path) -> None:
    """What the composed, resolved config must hold whoever set it (an option's YAML, a default, an override):
    every path confined, logging offline, every value within the app's bounds."""
    from omegaconf import OmegaConf

    for key in (*READ_PATHS, *WRITE_PATHS, *HUB_OR_PATH):
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=False)
        except Exception:  # an interpolation that cannot be resolved here
            raise LaunchRefused(f"{key} cannot be resolved before the run starts; give it a plain path") from None
        if value is not None:
            try:
                _check_value(key, value, outputs, cwd)
            except LaunchRefused as err:
                raise LaunchRefused(f"{key} of the composed config: {err}") from None
    if cfg.logger.name != "none" and cfg.logger.mode not in OFFLINE_MODES:
        raise LaunchRefused(f"logger.mode={cfg.logger.mode} of the composed config: the app logs only "
                            f"{' or '.join(OFFLINE_MODES)}")
    if cfg.push_to_hub:
        raise LaunchRefused("push_to_hub=true of the composed config: uploads to the hub are not offered from the app")
    bound = launch_bounds.check(cfg)
    if bound:
        raise LaunchRefused(bound)
