"""One GRPO stage: `prepare(cfg)` assembles its parts (rewards, problems, model, EWC state) in the one
place that training, the curriculum and the benchmark all use, and `train(cfg)` takes a composed config
to a model directory and its figures.

Plain and testable: the entrypoint (apps/train) only calls `train` (or the curriculum, which calls it
once per stage).

Data-parallel (`torchrun --nproc_per_node=N`): every process runs `train`, TRL splits each generation
batch across them and DDP averages the gradients. Rank 0 holds the run directory's lock and alone writes
run files, checkpoints' shared parts, model/, evaluations and tracking (base/dist.on_main); the Fisher is
estimated by all of them, each on its share of the samples (training/ewc.estimate).
"""

from __future__ import annotations

import json
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from grpo_exp.base import commit, cpu, dist, log, stop
from grpo_exp.base.cpu import resolve_precision
from grpo_exp.base.errors import ConfigError, TrainingHalted
from grpo_exp.base.io import read_jsonl, resolve_init, save_model_dir, write_json
from grpo_exp.base.monitor import MonitorCallback, reset_peak_rss
from grpo_exp.config.recorded import run_config
from grpo_exp.config.recipe import generation_batch
from grpo_exp.config.speed import resolve as resolve_speed
from grpo_exp.core import data, models, rewards
from grpo_exp.training import checkpoints, ewc, lora
from grpo_exp.training.guards import GracefulStop, NonFiniteError
from grpo_exp.training.model_card import write_cards
from grpo_exp.training.curriculum.replay import mixed_examples
from grpo_exp.training.run_dir import RunLock, adopt_recorded_split, record_or_compare
from grpo_exp.training.trainer import build_trainer, completions_per_step

SPEED_PLAN_FILE = "speed_plan.json"

logger = log.get_logger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stage_examples(cfg, split: str) -> list[dict]:
    """One split of the run's stage: its bands from stage.split_seed, its training problems from train.seed."""
    from grpo_exp.evaluation.run import stage_split

    return stage_split(cfg.stage, split, cfg.train.seed)


def check_init_from(cfg) -> None:
    """The part of the entrypoint's pre-check that needs this module: init_from and the EWC state and adapter
    it carries. The config's own checks and the model's availability need no torch and run before this
    module is imported (apps/train.check)."""
    init = resolve_init(cfg.init_from)
    check_ewc_init(cfg, init)
    lora.check_init(cfg, init)


def check_ewc_init(cfg, init: tuple[Path, Path] | None) -> None:
    """ewc.lambda>0 from an init_from without an EWC state: its Fisher is estimated at the start instead
    (starting_fisher), which needs the stage that run trained (its .hydra config)."""
    if init and cfg.ewc["lambda"] > 0 and not (init[1] / ewc.FISHER_FILE).is_file():
        if run_config(init[1]) is None:
            raise ConfigError(f"init_from={cfg.init_from} has no EWC state ({ewc.FISHER_FILE} in {init[1]}) and no "
                              f"recorded run config (.hydra/config.yaml) to estimate it from; give a run directory, "
                              f"train that stage with ewc.lambda>0, or continue with ewc.lambda=0")
        if lora.enabled(cfg):
            raise ConfigError(f"init_from={cfg.init_from} has no EWC state ({ewc.FISHER_FILE}); with peft=lora the "
                              f"Fisher covers the adapter, so train that stage with ewc.lambda>0 and peft=lora")


@dataclass
class StageParts:
    """What a GRPO stage is made of, before a trainer is built around it."""

    model: Any
    tokenizer: Any
    train_examples: list[dict]
    train_dataset: Any
    reward_funcs: list[Callable]
    reward_weights: list[float]
    init: tuple[Path, Path] | None  # (model dir, EWC state dir) of init_from
    ewc_state: Any  # the EWC state carried in from init_from (ewc.lambda > 0), else None
    penalty: Any  # the EWC loss term built on it, else None
    adapter_from: Path | None = None  # peft=lora: init_from's adapter/ this stage continues, else None


def prepare(cfg, pools: dict[str, Any] | None = None) -> StageParts:
    """Seeded rewards, training problems and model (from init_from when set) with the EWC state it
    carries; the EWC state is loaded before the model so a missing Fisher fails before anything heavy.

    A curriculum's replay or adaptive run trains on several stages' problems (training/replay.py), each tagged with
    its stage; `pools` (stage name -> stage node) are the stages as the curriculum composed them. The EWC Fisher is
    estimated on the stage's own problems under replay (the earlier stages' Fishers are in the carried state), on
    all of them in an adaptive run.

    peft=lora wraps the model in an adapter: a fresh one, or init_from's when that run trained one (it is
    then continued on the base model it was trained on; see training/lora.py)."""
    init = resolve_init(cfg.init_from)
    lam = cfg.ewc["lambda"]
    adapter_from = lora.check_init(cfg, init)
    check_ewc_init(cfg, init)
    carried = init is not None and lam > 0 and (init[1] / ewc.FISHER_FILE).is_file()
    ewc_state = ewc.EwcState.load(init[1]) if carried else None
    seed_everything(cfg.train.seed)
    reward_funcs, reward_weights = rewards.build(list(cfg.reward.funcs), _weights(cfg))
    train_examples = stage_examples(cfg, "train")
    mixed = mixed_examples(cfg, train_examples, pools)
    if mixed is None:
        train_dataset = data.to_dataset(train_examples, cfg.reward.system_prompt)
    else:
        train_dataset = data.to_dataset(mixed, cfg.reward.system_prompt, stage_column=True)
        if cfg.curriculum.mode == "adaptive":
            train_examples = mixed
    if adapter_from is not None:  # on the base model it was trained on, not on init_from's merged model/
        model, tokenizer = lora.load_base(cfg, adapter_from)
    else:
        model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed,
                                       init_from=init[0] if init else None)
    if init is not None and lam > 0 and ewc_state is None:
        ewc_state = starting_fisher(cfg, model, tokenizer, init[1])
    if lora.enabled(cfg):
        model = lora.wrap(model, cfg.peft, adapter_from)
    penalty = ewc.EwcPenalty(ewc_state, lam) if ewc_state is not None else None
    return StageParts(model, tokenizer, train_examples, train_dataset, reward_funcs, reward_weights, init,
                      ewc_state, penalty, adapter_from)


def train(cfg, step_offset: int = 0, pools: dict[str, Any] | None = None) -> dict:
    """Load, train, save (and estimate the Fisher when EWC is on). Returns metrics.json's content.

    The config is checked by the entrypoint (or the curriculum) that composed it. With `resume` set,
    a finished stage returns its metrics untouched and an unfinished one continues from its last
    complete checkpoint. `pools`: the curriculum's stage nodes a mixed training set draws from (prepare).
    """
    models.check_available(cfg.model, cfg.paths.cache_dir)
    run_dir = Path(cfg.paths.output_dir)

    def claim() -> RunLock:
        ensure_writable(run_dir)
        return RunLock(run_dir).acquire()  # a second run on this directory fails here, naming this one's PID

    # Rank 0 holds the lock for all N processes of the run (the others would only find it held by their own
    # rank 0); its failure to get it fails every rank with the same line.
    lock = dist.on_main(claim, share=False)
    try:
        # from here a first Ctrl-C/SIGTERM stops the stage within seconds, a second one exits at once
        # (base/stop.py); data-parallel ranks stop together at the end of a step
        with stop.handling(abandon=not dist.is_distributed()):
            return _train_locked(cfg, run_dir, step_offset, pools)
    finally:
        if dist.is_main():
            lock.release()


def _train_locked(cfg, run_dir: Path, step_offset: int, pools: dict[str, Any] | None) -> dict:
    plan = resolve_speed(cfg.speed, cfg.train)  # once: the settings record and the trainer read the same plan
    adopt_recorded_split(cfg, run_dir)
    finished, resume_from = dist.on_main(lambda: _open_run_dir(cfg, run_dir, plan))  # the files are rank 0's to change
    if finished is not None:
        return finished
    started = time.time()
    reset_peak_rss()  # this stage's peak, not the process's (sweep jobs share one process)

    threads = cpu.apply(cfg.cpu)
    parts = prepare(cfg, pools)
    _stop_in_setup(run_dir)
    # TRL gathers its logged figures over the processes, so the step's completions are all N processes' ones
    monitor = MonitorCallback(run_dir / "history.jsonl", completions_per_step(cfg.train) * dist.world_size(),
                              step_offset=step_offset, stage=cfg.stage.name,
                              completions_per_generation=generation_batch(cfg.train)[0])
    if resume_from is not None and dist.is_main():
        monitor.continue_from(read_jsonl(run_dir / "history.jsonl"))
    tracker = _start_tracking(cfg, run_dir, step_offset) if dist.is_main() else None
    init = parts.init
    run_state = {"stage": cfg.stage.name, "step_offset": step_offset, "init_from": str(init[0]) if init else None,
                 "ewc_state": _ewc_source(init, parts.ewc_state),
                 "ewc_lambda": cfg.ewc["lambda"], "peft": cfg.peft.name,
                 "adapter_from": str(parts.adapter_from) if parts.adapter_from else None}
    try:
        stage = StageRun(cfg, run_dir, parts, monitor, started, plan)
        trainer = stage.build(tracker, run_state)
        _stop_in_setup(run_dir)
        metrics = stage.train_and_save(trainer, resume_from, threads)
    except BaseException:
        _finish_tracking(tracker, None, failed=True)
        raise
    _finish_tracking(tracker, metrics, failed=False)
    return metrics


def _stop_in_setup(run_dir: Path) -> None:
    """A stop asked for while the stage was set up (the model loaded, the trainer built) ends it before it trains."""
    try:
        stop.check("setup")
    except stop.Stopped as err:
        logger.warning("%s, before training started; %s; continue with resume=true hydra.run.dir=%s", err,
                       _checkpoint_note(run_dir, None), run_dir)
        raise


def _checkpoint_note(run_dir: Path, written: Path | None) -> str:
    """What a stop leaves to resume from, for its log line."""
    last = checkpoints.last_checkpoint(run_dir / "checkpoints")
    if last is None:
        return "no checkpoint (no step had finished): a resumed run starts from the beginning"
    if written is not None:
        return f"{last.name} written (a step had finished since the last checkpoint)"
    return f"the last checkpoint is {last.name}"


def _ewc_source(init, state) -> str | None:
    """Where the carried EWC state came from (metrics.json, checkpoints' run state)."""
    if state is None:
        return None
    saved = init[1] / ewc.FISHER_FILE
    return str(saved) if saved.is_file() else f"estimated at the start from {init[0]} (starting_fisher)"


def _open_run_dir(cfg, run_dir: Path, plan) -> tuple[dict | None, Path | None]:
    """Resume's repairs and checks, and the settings record: (metrics of a finished stage or None, the
    checkpoint to resume from or None)."""
    if cfg.resume:
        for repaired in checkpoints.repair(run_dir):  # a kill may have cut a save short
            logger.info(repaired)
        finished = finished_metrics(run_dir)
        if finished is not None:
            logger.info("%s already finished stage %s; not retrained", run_dir, finished.get("stage"))
            return finished, None
    record_or_compare(cfg, run_dir, plan)  # resume=true trains what the run was started with, or says what differs
    return None, _prepare_resume(run_dir) if cfg.resume else None


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


def finished_metrics(run_dir: Path) -> dict | None:
    """metrics.json of a completed stage whose model/ is in place, else None."""
    path = run_dir / "metrics.json"
    if not path.is_file() or not (run_dir / "model" / "config.json").is_file():
        return None
    metrics = json.loads(path.read_text())
    return metrics if metrics.get("status") == "completed" else None


def _prepare_resume(run_dir: Path) -> Path | None:
    """The last complete checkpoint, with run files cut back to it; None: nothing to resume, start fresh."""
    ckpt_dir = run_dir / "checkpoints"
    last = checkpoints.last_checkpoint(ckpt_dir)
    if last is None:
        logger.info("no complete checkpoint in %s; starting this stage from the beginning", ckpt_dir)
        for name in ("history.jsonl", "completions.jsonl"):
            checkpoints.truncate_jsonl(run_dir / name, 0)
        return None
    step = checkpoints.checkpoint_step(last)
    for name in ("history.jsonl", "completions.jsonl"):
        checkpoints.truncate_jsonl(run_dir / name, step)
    logger.info("resuming from %s (step %s)", last, step)
    return last


class StageRun:
    """The pieces of one stage that building, training and saving share."""

    def __init__(self, cfg, run_dir: Path, parts: StageParts, monitor, started: float, plan):
        self.cfg, self.run_dir, self.parts, self.monitor, self.started = cfg, run_dir, parts, monitor, started
        self.plan = plan  # the resolved speed plan (config/speed.py)
        self.stopper = GracefulStop()  # a stop request at a step's end (the signals are base/stop.py's)

    def build(self, tracker, run_state):
        report_to = [tracker.report_to] if tracker is not None else []  # "wandb" or "trackio"
        # history.jsonl and the evaluations during training are rank 0's: TRL's logged figures are already
        # gathered over the processes, and the others wait for rank 0 at the next step's collectives
        main = dist.is_main()
        trainer = build_trainer(self.cfg, self.parts, output_dir=self.run_dir,
                                callbacks=[self.monitor, self.stopper] if main else [self.stopper],
                                report_to=report_to, run_state=run_state, plan=self.plan)
        if main:  # what this run computes with: the resolved speed plan, less what the model forced off
            write_json(self.run_dir / SPEED_PLAN_FILE, trainer.speed_plan.record())
        if self.cfg.eval.every_steps and main:
            trainer.add_callback(self.held_out_eval(trainer.pending_logs))
        if self.cfg.eval.forgetting_sets and main:
            trainer.add_callback(self.forgetting_eval(trainer.pending_logs))
        if tracker is not None:
            tracker.attach(trainer, self.monitor)  # cumulative step axis + the monitor's resource figures
        return trainer

    def held_out_eval(self, pending_logs: dict):
        """The `eval.every_steps` callback: the first eval.every_limit problems of this stage's validation split
        (a curve to choose settings by, so never the test split)."""
        from grpo_exp.evaluation.run import validation_subset
        from grpo_exp.training.periodic_eval import HeldOutEvalCallback

        cfg = self.cfg
        examples = validation_subset(cfg, cfg.stage)
        return HeldOutEvalCallback(pending_logs, cfg.stage.name, examples, cfg.eval.every_steps,
                                   system_prompt=cfg.reward.system_prompt,
                                   max_new_tokens=cfg.train.max_completion_length, batch_size=cfg.eval.batch_size)

    def forgetting_eval(self, pending_logs: dict):
        """The `eval.forgetting_sets` callback, its reference sampled from init_from's model/ on disk (the
        previous stage's policy, also when this stage resumes from a checkpoint)."""
        from grpo_exp.evaluation.run import set_settings, validation_subset
        from grpo_exp.training.forgetting import ForgettingCallback, sample_reference

        cfg = self.cfg
        t0 = time.time()
        previous, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed, init_from=self.parts.init[0])
        sets = []
        for name in dict.fromkeys(cfg.eval.forgetting_sets):
            stage, max_new_tokens = set_settings(cfg, name)
            examples = validation_subset(cfg, stage, name)
            reference = sample_reference(previous, tokenizer, [ex["question"] for ex in examples],
                                         system_prompt=cfg.reward.system_prompt, max_new_tokens=max_new_tokens,
                                         seed=cfg.train.seed, batch_size=cfg.eval.batch_size)
            sets.append((name, examples, max_new_tokens, reference))
        del previous
        logger.info("forgetting reference for %s sampled from %s in %.1f s", ", ".join(s[0] for s in sets),
                    self.parts.init[0], time.time() - t0)
        return ForgettingCallback(pending_logs, sets, cfg.eval.every_steps, system_prompt=cfg.reward.system_prompt,
                                  batch_size=cfg.eval.batch_size)

    def train_and_save(self, trainer, resume_from: Path | None, threads) -> dict:
        """Train (or take a checkpoint that already holds every step), then save model/, evaluate and write
        metrics.json. A stop while training ends in `stopped` (it raises Stopped); one after it, during the
        saving of model/ or the evaluation, raises Stopped with the final checkpoint kept, from which
        resume=true saves and evaluates again."""
        cfg, run_dir, parts = self.cfg, self.run_dir, self.parts
        abandoned = None
        try:
            self._train(trainer, resume_from)
        except NonFiniteError as err:
            raise TrainingHalted(str(err)) from None
        except stop.Stopped as err:  # the step in progress was abandoned
            abandoned = err
        finally:
            self.monitor.sampler.stop()
        if abandoned is not None or stop.requested() is not None:
            self.stopped(trainer, resume_from, threads, abandoned)
        try:
            return self._save_and_evaluate(trainer, resume_from, threads)
        except stop.Stopped as err:
            logger.warning("%s after training (step %s); %s; resume=true hydra.run.dir=%s saves and evaluates "
                           "from it", err, trainer.state.global_step, _checkpoint_note(run_dir, None), run_dir)
            raise

    def _train(self, trainer, resume_from: Path | None) -> None:
        cfg = self.cfg
        if resume_from is not None and checkpoints.checkpoint_step(resume_from) >= cfg.train.max_steps:
            # killed after its last step: HF's loop would run one step more than max_steps, so only
            # the checkpoint's weights and state are taken
            from transformers import TrainerState

            trainer._load_from_checkpoint(str(resume_from))
            trainer.state = TrainerState.load_from_json(str(resume_from / "trainer_state.json"))
            return
        if resume_from is not None:  # the adaptive curriculum's pass rates, as the checkpoint left them
            trainer.restore_mix(resume_from, checkpoints.STATE_FILE)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)

    def stopped(self, trainer, resume_from: Path | None, threads, abandoned: stop.Stopped | None) -> None:
        """End a stopped stage: a checkpoint only if a step finished since the last one (a step abandoned
        half-way is never saved), metrics.json saying `interrupted`, one line saying what to resume from; then
        Stopped is raised (exit 128 + signal, status.json `stopped`). model/ is not written: resuming needs only
        the checkpoint, and a stopped run's weights are no model to use (the web app's playground, the next
        stage of a curriculum and grpo_exp.evaluate read model/ of finished runs)."""
        run_dir, main = self.run_dir, dist.is_main()
        step = trainer.state.global_step
        # data-parallel runs stop only at a step's end, where HF saved that step on every rank already
        written = trainer.step_end.save_on_stop() if not dist.is_distributed() else None
        metrics = self._metrics(trainer, resume_from, threads, status="interrupted")
        if main:
            write_json(run_dir / "metrics.json", metrics)
        signum = stop.requested()
        err = abandoned or stop.Stopped(signum, f"the end of step {step}")
        where = (f"during {abandoned.where} in step {step + 1} (abandoned)" if abandoned is not None
                 else f"at the end of step {step}")
        logger.warning("stopped by %s %s; %s; continue with resume=true hydra.run.dir=%s", signal_name(signum),
                       where, _checkpoint_note(run_dir, written), run_dir)
        raise err

    def _metrics(self, trainer, resume_from: Path | None, threads, status: str) -> dict:
        """metrics.json's figures of the stage as trained so far."""
        cfg, parts = self.cfg, self.parts
        init = parts.init
        policy = trainer.model
        metrics = {
            "status": status,
            "model": cfg.model.name,
            "stage": cfg.stage.name,
            "reward_set": cfg.reward.name,
            "init_from": str(init[0]) if init else None,
            "resumed_from": str(resume_from) if resume_from else None,
            **self.monitor.summary([f.__name__ for f in parts.reward_funcs]),
            "wall_time_s": time.time() - self.started,
            **{f"cpu_{k}": v for k, v in threads.items()},
            "precision": resolve_precision(cfg.train.precision),
            "torch_version": torch.__version__,
            "git_commit": commit.AT_START,
            "ewc_lambda": cfg.ewc["lambda"],
            "ewc_from": _ewc_source(init, parts.ewc_state),
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

    def _save_and_evaluate(self, trainer, resume_from: Path | None, threads) -> dict:
        """A trained stage's model/ (or adapter/ and the merged model/), EWC state, evaluation, cards, hub push and
        metrics.json, written last."""
        cfg, run_dir, parts = self.cfg, self.run_dir, self.parts
        init = parts.init
        policy = trainer.model
        adapter = lora.is_peft(policy)
        main = dist.is_main()  # every process holds the same weights; rank 0 writes them
        if adapter and main:  # model/ (merged) is written once the adapter is no longer needed, below
            lora.save_adapter(policy, parts.tokenizer, run_dir / lora.ADAPTER_DIR, cfg)
        elif main:
            save_model_dir(policy, parts.tokenizer, run_dir / "model")
        metrics = self._metrics(trainer, resume_from, threads, status="completed")
        if cfg.ewc["lambda"] > 0:  # with an adapter: over the adapter's parameters, the only ones that train
            metrics.update(consolidate_fisher(cfg, policy, parts.tokenizer, parts.train_examples,
                                              parts.ewc_state, run_dir)[1])
        if not main:  # the evaluations and metrics.json are rank 0's; this process is done
            logger.info("rank %d of %d done: peak RSS %.1f MB", dist.rank(), dist.world_size(),
                        metrics["peak_rss_mb"])  # in <run dir>/<task>.rank<r>.log
            return metrics
        if adapter:
            policy = lora.merge_and_save(policy, parts.tokenizer, run_dir / "model")
        if cfg.eval.after_train:
            from grpo_exp.evaluation.run import evaluate_after_train

            # the merged model: what model/ holds, and generation without the adapter's extra matmuls
            metrics["eval"] = evaluate_after_train(cfg, policy, parts.tokenizer, run_dir,
                                                   init[0] if init else None)
        # model/README.md (and adapter/'s): the hub's metadata, the before/after table, the settings
        write_cards(run_dir, cfg, steps=trainer.state.global_step)
        if cfg.get("push_to_hub"):
            from grpo_exp.training import hub

            metrics["hub"] = hub.push(cfg, run_dir)
        metrics["wall_time_s"] = time.time() - self.started
        # Written last: its "completed" status is what marks the stage as done for resume.
        write_json(run_dir / "metrics.json", metrics)
        return metrics


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a signal"


def _tracking(name: str):
    """The tracking module of a logger option: start/finish and a Tracker, for wandb or trackio."""
    if name == "trackio":
        from grpo_exp.training import trackio_tracking

        return trackio_tracking
    from grpo_exp.training import tracking

    return tracking


def _start_tracking(cfg, run_dir: Path, step_offset: int):
    if cfg.logger.name == "none":
        return None
    return _tracking(cfg.logger.name).start(cfg, run_dir, step_offset=step_offset)


def _finish_tracking(tracker, metrics: dict | None, failed: bool) -> None:
    if tracker is None:
        return
    _tracking(tracker.report_to).finish(tracker, metrics, failed=failed)


def consolidate_fisher(cfg, model, tokenizer, examples: list[dict], old_state, run_dir: Path) -> tuple[Any, dict]:
    """Estimate this stage's Fisher on its training prompts, fold it into the running EWC state, save it;
    returns (the state, its figures for metrics.json)."""
    t0 = time.time()
    prompts = [data.to_messages(ex["question"], cfg.reward.system_prompt) for ex in examples]
    random.Random(cfg.train.seed).shuffle(prompts)
    # every process estimates on its share of the samples, and all of them get the whole estimate
    fisher = ewc.estimate(
        model, tokenizer, prompts, samples=cfg.ewc["fisher_samples"],
        max_new_tokens=cfg.ewc["fisher_max_new_tokens"] or cfg.train.max_completion_length,
        temperature=cfg.train.temperature, batch_size=cfg.ewc["fisher_batch_size"], seed=cfg.train.seed,
        include_embeddings=cfg.ewc["include_embeddings"], shard=(dist.rank(), dist.world_size()),
    )
    anchor = ewc.current_parameters(model, fisher.keys())
    base = old_state if old_state is not None else ewc.EwcState({}, {}, [], {})
    state = base.consolidate(fisher, anchor, cfg.ewc["gamma"], cfg.stage.name)
    if dist.is_main():
        state.save(run_dir)
    return state, {"fisher_time_s": time.time() - t0, **{k: v for k, v in state.stats().items() if k != "stages"},
                   "ewc_stages": state.stages}


def starting_fisher(cfg, model, tokenizer, init_dir: Path):
    """The EWC state of an init_from run trained without EWC: its Fisher, estimated now on the model it
    saved and the prompts of the stage it trained, with that run's data seed, sampling temperature,
    completion length and system prompt (its .hydra/config.yaml). So any earlier run can be protected,
    and one basic run can start an EWC sweep. Saved in this run's directory, never in init_from's."""
    from omegaconf import OmegaConf

    recorded = run_config(init_dir)[0]
    earlier = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    earlier.stage = OmegaConf.to_container(recorded.stage, resolve=True)
    for key in ("seed", "temperature", "max_completion_length"):
        earlier.train[key] = recorded.train[key]
    earlier.reward.system_prompt = recorded.reward.system_prompt
    state, figures = consolidate_fisher(earlier, model, tokenizer, stage_examples(earlier, "train"), None,
                                        Path(cfg.paths.output_dir))
    logger.info("init_from=%s has no EWC state: estimated its Fisher on %s prompts in %.1f s (mean %.3g)",
                init_dir, earlier.stage.name, figures["fisher_time_s"], figures["fisher_mean"])
    return state


def _weights(cfg):
    return None if cfg.reward.weights is None else list(cfg.reward.weights)
