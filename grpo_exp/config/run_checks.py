"""Checks on what a command will do, read from Hydra's own node of the composed config before Hydra creates
anything: the run (or sweep) directory can be written, a sweep experiment or a search (hparams_search) is not
run as one job, and `resume` names a run that exists. Each failure is a one-line ConfigError."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from grpo_exp.base.errors import ConfigError

RUN_RECORD = Path(".hydra") / "config.yaml"  # what Hydra writes into every run directory at its start


def check_run(cfg: Any, config_name: str) -> None:
    """The checks of a single run (no -m) on a config composed with its hydra node."""
    check_not_a_sweep(cfg, config_name)
    run_dir = OmegaConf.select(cfg, "hydra.run.dir")
    if run_dir:
        check_writable("hydra.run.dir", run_dir)
    check_resume(cfg, run_dir)


def check_not_a_sweep(cfg: Any, config_name: str) -> None:
    """An experiment that sweeps (hydra.sweeper.params), or a search (hparams_search=<option>: a sweeper other than
    Hydra's basic one, which proposes each job as it goes), runs with -m; without it Hydra would quietly train one
    job of the defaults."""
    from grpo_exp.config.sweep_check import BASIC_SWEEPER

    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    sweeper = str(OmegaConf.select(cfg, "hydra.sweeper._target_") or BASIC_SWEEPER)
    search = sweeper != BASIC_SWEEPER
    if not params and not search:
        return
    choice = {group: OmegaConf.select(cfg, f"hydra.runtime.choices.{group}")
              for group in ("hparams_search", "experiment")}
    group = next((g for g, option in choice.items() if option), None)
    source = f"{group}={choice[group]}" if group else "this config"
    over = f"over {', '.join(str(k) for k in params)}" if params else "its trials proposed as it goes"
    what = f"a search ({sweeper.rsplit('.', 1)[-1]}, {over})" if search else f"a sweep ({over})"
    raise ConfigError(f"{source} is {what} and runs only with -m: python -m grpo_exp.{config_name} -m {source} ...; "
                      f"without -m it would train one default job")


def check_writable(key: str, path: str | os.PathLike) -> None:
    """`path` exists as a writable directory or can be created: its nearest existing ancestor takes a
    directory (made and removed again, so the check leaves nothing behind)."""
    target = Path(path).expanduser().absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}={path} cannot be created: {existing} is a file, not a directory; "
                          f"give {key} a directory you can write")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".grpo-exp-write-check-", dir=existing))
    except OSError as err:
        raise ConfigError(f"{key}={path} cannot be written: {existing} refuses a new directory "
                          f"({err.strerror or err}); give {key} a directory you can write") from None


def check_resume(cfg: Any, run_dir: str | None) -> None:
    """resume=true continues the run directory the command names (hydra.run.dir), resume=<dir> that one; a
    directory that holds no run would silently start a fresh one."""
    resume = cfg.get("resume")
    if resume is True:
        where, example = f"hydra.run.dir={run_dir}", "resume=true hydra.run.dir=<run dir>"
        target = run_dir
    elif isinstance(resume, str) and resume:
        where, example, target = f"resume={resume}", "resume=<run dir>", resume
    else:
        return
    if target and (Path(target) / RUN_RECORD).is_file():
        return
    task = OmegaConf.select(cfg, "task_name") or "train"
    recent = sorted(Path("outputs", task, "runs").glob("*/" + str(RUN_RECORD)))[-1:]
    hint = f" (the latest here: {recent[0].parent.parent})" if recent else ""
    raise ConfigError(f"resume={'true' if resume is True else resume}: {where} holds no run to continue (no "
                      f"{RUN_RECORD}); name the run directory to resume with {example}{hint}, or drop resume "
                      f"to start a new run")
