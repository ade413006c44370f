"""A stage's run directory from its opening to its metrics.json: one run at a time (an advisory lock), a resume
that trains what the run was started with (its training settings, and what each `auto` among them resolved to on
that machine and grpo-exp version, are recorded at the first start and compared on resume) from its last complete
checkpoint, and the figures metrics.json records (written last: its status marks the stage done)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from grpo_exp.base import commit, dist, log, stop
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import write_json
from grpo_exp.base.run_files import (CHECKPOINTS_DIR, COMPLETIONS_FILE, HISTORY_FILE, LOCK_FILE, METRICS_FILE,
                                     MODEL_DIR, SETTINGS_FILE)
from grpo_exp.training import checkpoints, ewc, lora

logger = log.get_logger(__name__)
REMOVED_SUFFIX = ".removed"  # checkpoints/ renamed before it is removed (drop_checkpoints)
# May differ on resume: how the run is executed, logged, evaluated or checkpointed, not what it trains.
FREE_ON_RESUME = ("cpu.", "logger.", "paths.", "eval.", "curriculum.eval_", "resume", "log_level", "task_name",
                  "completions_every", "train.save_steps", "train.save_total_limit", "train.keep_final_checkpoint",
                  "train.logging_steps",
                  "push_to_hub", "hub_model_id", "hub_private")


class RunLock:
    """An flock on <run dir>/.lock holding the owner's PID. The kernel drops it when the owner dies, so
    a lock left by a dead process is simply taken over (with a warning naming that PID)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fh = None

    def acquire(self) -> "RunLock":
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise ConfigError(f"run directory {self.path.parent} is in use by another run (PID {holder}); "
                              f"wait for it or choose another hydra.run.dir") from None
        fh.seek(0)
        previous = fh.read().strip()
        if previous and previous != str(os.getpid()):
            logger.warning("took over the lock of %s left by PID %s, which is no longer running",
                           self.path.parent, previous)
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            self._fh.seek(0)
            self._fh.truncate()
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def claim(run_dir: Path) -> RunLock | None:
    """Rank 0's lock on the run directory, held for all N processes of the run (the others would only find it
    held by their own rank 0); its failure fails every rank with the same line. None on the other ranks."""
    def take() -> RunLock:
        ensure_writable(run_dir)
        return RunLock(run_dir).acquire()  # a second run on this directory fails here, naming this one's PID

    return dist.on_main(take, share=False)


def ensure_writable(run_dir: Path) -> None:
    """Fail with one line now rather than after an hour of training."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write to the output directory {run_dir}: {err.strerror or err}; "
                          f"choose another with hydra.run.dir=<dir>") from None


def open_run_dir(cfg: Any, run_dir: Path, plan) -> tuple[dict | None, Path | None]:
    """Resume's repairs and checks, and the settings record (rank 0's to write): (metrics of a finished stage or
    None, the checkpoint to resume from or None)."""
    if cfg.resume:
        for repaired in checkpoints.repair(run_dir):  # a kill may have cut a save short
            logger.info(repaired)
        finished = finished_metrics(run_dir)
        if finished is not None:
            logger.info("%s already finished stage %s; not retrained", run_dir, finished.get("stage"))
            if not cfg.train.keep_final_checkpoint:  # one finished before checkpoints were dropped
                drop_checkpoints(run_dir)
            return finished, None
    record_or_compare(cfg, run_dir, plan)  # resume=true trains what the run was started with, or says what differs
    return None, _prepare_resume(run_dir) if cfg.resume else None


def finished_metrics(run_dir: Path) -> dict | None:
    """metrics.json of a completed stage whose model/ is in place, else None."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file() or not (Path(run_dir) / MODEL_DIR / "config.json").is_file():
        return None
    metrics = json.loads(path.read_text())
    return metrics if metrics.get("status") == "completed" else None


def drop_checkpoints(run_dir: Path) -> None:
    """A completed stage's checkpoints/ removed: nothing reads it again (metrics.json marks the stage done, model/
    holds its weights), and each checkpoint holds the weights and AdamW's two moments, three times model/'s size.
    Renamed first, so that a kill during the removal leaves no checkpoint that looks whole."""
    ckpt_dir = run_dir / CHECKPOINTS_DIR
    doomed = run_dir / (CHECKPOINTS_DIR + REMOVED_SUFFIX)
    if ckpt_dir.is_dir():
        size = sum(f.stat().st_size for f in ckpt_dir.rglob("*") if f.is_file())
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)
        ckpt_dir.rename(doomed)
        logger.info("removed %s (%.2f GB): the stage is complete and model/ holds its weights "
                    "(train.keep_final_checkpoint=true keeps it)", ckpt_dir, size / 1e9)
    shutil.rmtree(doomed, ignore_errors=True)


def _prepare_resume(run_dir: Path) -> Path | None:
    """The last complete checkpoint, with run files cut back to it; None: nothing to resume, start fresh."""
    ckpt_dir = run_dir / CHECKPOINTS_DIR
    last = checkpoints.last_checkpoint(ckpt_dir)
    step = 0 if last is None else checkpoints.checkpoint_step(last)
    for name in (HISTORY_FILE, COMPLETIONS_FILE):
        checkpoints.truncate_jsonl(run_dir / name, step)
    if last is None:
        logger.info("no complete checkpoint in %s; starting this stage from the beginning", ckpt_dir)
    else:
        logger.info("resuming from %s (step %s)", last, step)
    return last


def checkpoint_note(run_dir: Path, written: Path | None) -> str:
    """What a stop leaves to resume from, for its log line."""
    last = checkpoints.last_checkpoint(run_dir / CHECKPOINTS_DIR)
    if last is None:
        return "no checkpoint (no step had finished): a resumed run starts from the beginning"
    if written is not None:
        return f"{last.name} written (a step had finished since the last checkpoint)"
    return f"the last checkpoint is {last.name}"


def stop_in_setup(run_dir: Path) -> None:
    """A stop asked for while the stage was set up (the model loaded, the trainer built) ends it before it trains."""
    try:
        stop.check("setup")
    except stop.Stopped as err:
        logger.warning("%s, before training started; %s; continue with resume=true hydra.run.dir=%s", err,
                       checkpoint_note(run_dir, None), run_dir)
        raise


def end_stopped(run_dir: Path, trainer, metrics: dict, abandoned: stop.Stopped | None) -> None:
    """End a stopped stage: a checkpoint only if a step finished since the last one (a step abandoned half-way is
    never saved), `metrics` (status `interrupted`) in metrics.json, one line saying what to resume from; then
    Stopped is raised (exit 128 + signal, status.json `stopped`). model/ is not written: resuming needs only the
    checkpoint, and a stopped run's weights are no model to use (the web app's playground, the next stage of a
    curriculum and grpo_exp.evaluate read model/ of finished runs)."""
    step = trainer.state.global_step
    # data-parallel runs stop only at a step's end, where HF saved that step on every rank already
    written = trainer.step_end.save_on_stop() if not dist.is_distributed() else None
    if dist.is_main():
        write_metrics(run_dir, metrics)
    signum = stop.requested()
    err = abandoned or stop.Stopped(signum, f"the end of step {step}")
    where = (f"during {abandoned.where} in step {step + 1} (abandoned)" if abandoned is not None
             else f"at the end of step {step}")
    name = signal.Signals(signum).name if signum else "a signal"
    logger.warning("stopped by %s %s; %s; continue with resume=true hydra.run.dir=%s", name, where,
                   checkpoint_note(run_dir, written), run_dir)
    raise err


def stage_metrics(cfg: Any, parts, trainer, monitor, *, started: float, threads: dict, resume_from: Path | None,
                  status: str) -> dict:
    """metrics.json's figures of the stage as trained so far (`parts`: training/stage.StageParts)."""
    import torch

    init = parts.init
    policy = trainer.model
    metrics = {
        "status": status,
        "model": cfg.model.name,
        "stage": cfg.stage.name,
        "reward_set": cfg.reward.name,
        "init_from": str(init[0]) if init else None,
        "resumed_from": str(resume_from) if resume_from else None,
        **monitor.summary([f.__name__ for f in parts.reward_funcs]),
        "wall_time_s": time.time() - started,
        **{f"cpu_{k}": v for k, v in threads.items()},
        "precision": trainer.speed_plan.precision,
        "torch_version": torch.__version__,
        "git_commit": commit.AT_START,
        "ewc_lambda": cfg.ewc["lambda"],
        "ewc_from": ewc.source(init, parts.ewc_state),
        "skipped_steps": trainer.skipped_steps,
        "peft": cfg.peft.name,
        "processes": dist.world_size(),
    }
    if lora.is_peft(policy):
        metrics.update({**lora.parameter_counts(policy), "lora_r": cfg.peft.r, "lora_alpha": cfg.peft.alpha,
                        "adapter_from": str(parts.adapter_from) if parts.adapter_from else None})
    if parts.penalty is not None:
        metrics["ewc_weighted_distance"] = parts.penalty.weighted_distance(policy)
    return metrics


def write_metrics(run_dir: Path, metrics: dict) -> None:
    write_json(Path(run_dir) / METRICS_FILE, metrics)


# the record's key holding what `<key>=auto` (or any other value) resolved to, e.g. resolved.train.precision
RESOLVED = "resolved."


def resolved_choices(cfg: Any, plan=None) -> dict[str, Any]:
    """What each machine-dependent choice of the training settings resolves to in this process (this machine
    and this grpo-exp version): the precision, and each speed.* key as the speed plan (config/speed.py) resolved
    it (`plan`: the run's, else resolved here). The plan's derived fields (shared_prefix, saved_tensors, ...) go to
    speed_plan.json."""
    from grpo_exp.config.speed import plan_for

    record = (plan or plan_for(cfg)).record()
    return {"train.precision": record["speed.precision"],
            **{k: v for k, v in record.items() if k.removeprefix("speed.") in cfg.speed}}


def training_settings(cfg: Any, plan=None) -> dict[str, Any]:
    """The resolved config, flattened to dotted keys, without the keys that may change on resume, and what
    each machine-dependent choice resolved to (`resolved.<key>`)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    settings = {k: v for k, v in flat.items() if not k.startswith(FREE_ON_RESUME)}
    return {**settings, **{RESOLVED + k: v for k, v in resolved_choices(cfg, plan).items()}}


def record_or_compare(cfg: Any, run_dir: Path, plan=None) -> None:
    """First start: record the training settings. Resume: refuse changed ones, naming each key, unless
    resume_allow_changes=true."""
    path = Path(run_dir) / SETTINGS_FILE
    now = training_settings(cfg, plan)
    if not cfg.resume or not path.is_file():
        write_json(path, now)
        return
    changed = differences(json.loads(path.read_text()), now)
    if not changed:
        return
    if cfg.get("resume_allow_changes"):
        logger.warning("resuming with changed training settings (resume_allow_changes=true): %s", "; ".join(changed))
        write_json(path, now)
        return
    raise ConfigError(f"resume would train other settings than {run_dir} was started with: {'; '.join(changed)}; "
                      f"resume with the run's own settings, or add resume_allow_changes=true")


def adopt_recorded_split(cfg: Any, run_dir: Path) -> None:
    """A run recorded before `stage.split_seed` existed drew its splits with its training seed: resuming it
    with the key at its default keeps that partition (every rank reads the record, so all draw the same)."""
    path = Path(run_dir) / SETTINGS_FILE
    if not cfg.resume or not path.is_file():
        return
    then = json.loads(path.read_text())
    seed = then.get("train.seed")
    if "stage.split_seed" in then or seed is None or int(seed) == int(cfg.stage.split_seed):
        return
    if int(cfg.stage.split_seed) == _schema_default("stage.split_seed"):
        logger.info("%s was started before stage.split_seed existed: it keeps the split of its train.seed=%s",
                    run_dir, seed)
        cfg.stage.split_seed = int(seed)


def differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each training setting that differs between the record `then` and `now`, as `key (then -> now)`.

    A choice both records resolved is compared by what it resolved to: `auto` that picked bf16 at the start and
    fp32 here (another machine) is a change, and naming the value it picked (train.precision=bf16) is not. A
    record from before resolved choices were kept compares the values as given."""
    then = renamed(then)
    resolved = {k[len(RESOLVED):] for k in then if k.startswith(RESOLVED) and k in now}
    changed = [f"{k} ({then[k]!r} resolved to {then[RESOLVED + k]!r} at the start -> {now[k]!r} resolves to "
               f"{now[RESOLVED + k]!r} here; {k}={then[RESOLVED + k]} trains as it started)"
               for k in sorted(resolved) if then[RESOLVED + k] != now[RESOLVED + k]]
    plain = {k for k in set(then) | set(now) if not k.startswith(RESOLVED) and k not in resolved}
    # options added to the schema after the run started, left at (or resolving to) what the run did without
    # them, train as it did
    before = {**BEFORE_THE_OPTION, "stage.split_seed": then.get("train.seed", _NO_DEFAULT)}
    newer = {k for k in plain - set(then)
             if before.get(k, _schema_default(k)) in (now[k], now.get(RESOLVED + k, _NO_DEFAULT))}
    changed += [f"{k} ({then.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r})"
                for k in sorted(plain - newer) if then.get(k) != now.get(k)]
    return changed


_NO_DEFAULT = object()
# Options whose default changed after they were added: a run recorded before the option existed trained as
# this value does, not as today's default. speed.generation: TRL's generate until the engine became `auto`'s;
# speed.attention: the model's own sdpa before the option (grouped is auto's on a CPU); speed.logprob_kernel:
# TRL's kernel, its first default
BEFORE_THE_OPTION = {"speed.generation": "trl", "speed.attention": "sdpa", "speed.logprob_kernel": "trl"}


def renamed(record: dict[str, Any]) -> dict[str, Any]:
    """A record from before the speed node: each speed switch under its speed.* key (config/speed.MOVED); the five
    exact shortcuts, now one switch, are dropped (what they computed is the same by definition). A record from
    before an option became a train.* key (train.epsilon_high, ...) has it as train.extra.<name>: it is read as
    train.<name>, which is how the run's config must spell it now."""
    import dataclasses

    from grpo_exp.config.recipe import TrainConfig
    from grpo_exp.config.speed import MOVED

    promoted = {f.name for f in dataclasses.fields(TrainConfig)}
    out = {}
    for key, value in record.items():
        prefix = RESOLVED if key.startswith(RESOLVED) else ""
        base = key[len(prefix):]
        if base.startswith("train.extra.") and base[len("train.extra."):] in promoted:
            base = f"train.{base[len('train.extra.'):]}"
            key = prefix + base
        moved = MOVED.get(base[len("train."):]) if base.startswith("train.") else None
        if moved is None:
            out[key] = value
        elif moved != "speed.exact_shortcuts":
            out[prefix + moved] = value
    return out


def _schema_default(key: str) -> Any:
    """The schema's default of a dotted `<group>.<field>` key (config/schema.py), or a sentinel equal to nothing."""
    import dataclasses

    from grpo_exp.config.schema import GROUPS

    group, _, name = key.partition(".")
    schema = GROUPS.get(group)
    found = {f.name: f for f in dataclasses.fields(schema)} if schema else {}
    spec = found.get(name)
    if spec is None:
        return _NO_DEFAULT
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return _NO_DEFAULT
