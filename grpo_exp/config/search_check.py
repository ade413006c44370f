"""What a search (`hparams_search=<option>`: a sweeper other than Hydra's basic one, Optuna's) needs before its first
trial, checked by the sweep pre-check (config/sweep_check.py), each failure one ConfigError line: its sweeper plugin
installed, the validation split scored after training (the objective its trials are ranked by; the test split stays
unscored), a fixed sweep directory (the study is found there again), a search space the study already in it accepts,
and that directory made for the study's sqlite file (the sweeper opens the study before Hydra makes the directory).
Its trials' own configs are checked as each starts: the sweeper proposes them as it goes."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from grpo_exp.base.errors import ConfigError

SEARCH_EXTRA = "search"  # pyproject.toml's extra with the sweeper plugins hparams_search uses
SQLITE = "sqlite:///"
OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def check_sweeper_installed(err: Exception, overrides: list[str]) -> None:
    """A config that picks a sweeper whose plugin is not installed (hparams_search=recipe_optuna needs
    hydra-optuna-sweeper) fails to compose with Hydra's 'Could not find'; say which plugin and how to install it."""
    found = re.search(r"Could not find 'hydra/sweeper/(\w+)'", str(err))
    if not found:
        return
    name = found.group(1)
    chosen = [a for a in overrides if a.split("=", 1)[0].lstrip("+") in ("hparams_search", "experiment")]
    raise ConfigError(f"{' '.join(chosen) or 'this config'} searches with hydra/sweeper={name}, whose plugin "
                      f"(hydra-{name}-sweeper) is not installed; install it with: pip install -e '.[{SEARCH_EXTRA}]'")


def prepare_search(master) -> None:
    """The checks above on the sweep's composed config (`master`, with its hydra node), then the study's folder."""
    source = search_source(master)
    for key, wanted in (("eval.after_train", True), ("eval.split", "validation")):
        value = OmegaConf.select(master, key)
        if value != wanted:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(f"{source} ranks its trials by their accuracy on the validation split after "
                              f"training: it needs {key}={str(wanted).lower()}, not {key}={shown}")
    raw = OmegaConf.to_container(master.hydra, resolve=False)
    storage, sweep_dir = str(raw["sweeper"].get("storage") or ""), str(raw["sweep"]["dir"])
    # a study kept in a storage (not in memory) is found again only where its path stays put
    for key, value in (("hydra.sweeper.storage", storage), ("hydra.sweep.dir", sweep_dir if "hydra.sweep.dir" in storage
                                                            else "")):
        if "${now:" in value.replace(" ", ""):
            raise ConfigError(f"{source}: {key}={value} changes with the time, so a rerun would not find the study; "
                              f"give {key} a fixed directory")
    path = sqlite_path(OmegaConf.select(master, "hydra.sweeper.storage"))
    if path is None:
        return
    if path.is_file():
        check_study_space(master, path, source)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{source}: the study's folder {path.parent} (hydra.sweeper.storage) cannot be made "
                          f"({err.strerror or err}); give hydra.sweep.dir a directory you can write") from None


def sqlite_path(storage) -> Path | None:
    """The file of a sqlite storage URL (sqlite:///relative/path, sqlite:////absolute/path); None for another."""
    if not isinstance(storage, str) or not storage.startswith(SQLITE) or ":memory:" in storage:
        return None
    return Path(storage[len(SQLITE):]).expanduser()


def check_study_space(master, path: Path, source: str) -> None:
    """A rerun adds trials to the study in `path`; Optuna refuses a parameter whose kind or choices changed, but
    only once the first new trial is drawn, in a traceback that leaves that trial running in the study forever."""
    if OmegaConf.select(master, "hydra.sweeper._target_") != OPTUNA_SWEEPER:
        return
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    params = OmegaConf.select(master, "hydra.sweeper.params") or {}
    # the search space as the sweeper builds it: its params, then the command line's sweeps over them
    space, _ = create_params_from_overrides([f"{k}={v}" for k, v in params.items()] + list(master.hydra.overrides.task))
    name = OmegaConf.select(master, "hydra.sweeper.study_name")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=f"{SQLITE}{path}")
    except KeyError:
        return  # no study of that name in the file yet: the sweeper creates it
    for trial in study.trials:
        for key, before in trial.distributions.items():
            if key not in space:
                continue
            try:
                optuna.distributions.check_distribution_compatibility(before, space[key])
            except ValueError:
                raise ConfigError(f"{source}: {key} would be searched over {space[key]}, but the study {name} in "
                                  f"{path} searched it over {before}, and Optuna continues a study only over the same "
                                  f"choices; search as before, or give hydra.sweep.dir another directory for a new "
                                  f"study") from None


def search_source(master) -> str:
    """How the command chose the search: hparams_search=<option>, else the experiment, else the config."""
    for group in ("hparams_search", "experiment"):
        option = OmegaConf.select(master, f"hydra.runtime.choices.{group}")
        if option:
            return f"{group}={option}"
    return "this search"
