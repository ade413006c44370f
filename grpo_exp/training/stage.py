"""One GRPO stage as a pipeline: `prepare(cfg)` assembles its parts (rewards, problems, model, EWC state) in the
one place that training, the curriculum and the benchmark all use, and `train(cfg)` takes a composed, checked
config through the run directory (training/run_dir), the trainer, the saving and the evaluation to a model
directory and its figures. The problems come from core/data, the EWC state from training/ewc, the callbacks during
training from training/periodic_eval and training/forgetting.

Plain and testable: the entrypoint (apps/train) checks the config once (`check`, with the config's own rules) and
calls `train` (or the curriculum, which checks and calls it once per stage).

Data-parallel (`torchrun --nproc_per_node=N`): every process runs `train`, TRL splits each generation
batch across them and DDP averages the gradients. Rank 0 holds the run directory's lock and alone writes
run files, checkpoints' shared parts, model/, evaluations and tracking (base/dist.on_main); the Fisher is
estimated by all of them, each on its share of the samples (training/ewc.estimate).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from grpo_exp.base import cpu, dist, log, stop
from grpo_exp.base.errors import TrainingHalted
from grpo_exp.base.io import read_jsonl, resolve_init, save_model_dir, write_json
from grpo_exp.base.monitor import MonitorCallback, reset_peak_rss
from grpo_exp.base.run_files import HISTORY_FILE, MODEL_DIR, SPEED_PLAN_FILE, VALIDATION_START_FILE
from grpo_exp.config.recipe import generation_batch
from grpo_exp.config.speed import plan_for
from grpo_exp.core import data, models, rewards
from grpo_exp.training import checkpoints, dynamic_sampling, ewc, loggers, lora, pace, run_dir as run_directory
from grpo_exp.training.guards import GracefulStop, NonFiniteError
from grpo_exp.training.model_card import write_cards
from grpo_exp.training.curriculum.replay import mixed_examples
from grpo_exp.training.trainer import build_trainer, completions_per_step

logger = log.get_logger(__name__)


def check_init_from(cfg) -> None:
    """The part of the entrypoint's pre-check (apps/train.check) that reads init_from's files: the EWC state and
    adapter it carries. Once a run: a curriculum's first stage continues init_from with the same ewc and peft
    settings, and each later stage the stage before it. The config's own checks and the model's availability need
    no torch and run before this module is imported."""
    init = resolve_init(cfg.init_from)
    ewc.check_init(cfg, init)
    lora.check_init(cfg, init)


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
    """Seeded rewards, training problems and model (from init_from when set) with the EWC state it carries; the
    config is checked (check_init_from included) by whoever composed it.

    A curriculum's replay or adaptive run trains on several stages' problems (curriculum/replay.py), each tagged with
    its stage; `pools` (stage name -> stage node) are the stages as the curriculum composed them. The EWC Fisher is
    estimated on the stage's own problems under replay (the earlier stages' Fishers are in the carried state), on
    all of them in an adaptive run.

    peft=lora wraps the model in an adapter: a fresh one, or init_from's when that run trained one (it is
    then continued on the base model it was trained on; see training/lora.py)."""
    init = resolve_init(cfg.init_from)
    # check_init_from passed: with peft=lora, an adapter init_from trained is the one this stage continues
    adapter_from = lora.adapter_of(init[1]) if init and lora.enabled(cfg) else None
    ewc_state = ewc.carried_state(cfg, init)  # before the model: a broken Fisher fails before anything heavy
    seed_everything(cfg.train.seed)
    reward_funcs, reward_weights = rewards.build(list(cfg.reward.funcs), _weights(cfg))
    train_examples = data.stage_split(cfg.stage, "train", cfg.train.seed)
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
    if init is not None and cfg.ewc["lambda"] > 0 and ewc_state is None:
        ewc_state = ewc.starting_fisher(cfg, model, tokenizer, init[1])
    if lora.enabled(cfg):
        model = lora.wrap(model, cfg.peft, adapter_from)
    penalty = ewc.EwcPenalty(ewc_state, cfg.ewc["lambda"]) if ewc_state is not None else None
    return StageParts(model, tokenizer, train_examples, train_dataset, reward_funcs, reward_weights, init,
                      ewc_state, penalty, adapter_from)


def _needs_validation_start(cfg, run_dir: Path) -> bool:
    return bool(cfg.eval.every_steps) and not cfg.eval.after_train and not (run_dir / VALIDATION_START_FILE).is_file()


def _validation_start(cfg, run_dir: Path) -> None:
    from grpo_exp.evaluation.run import write_validation_start

    init = resolve_init(cfg.init_from)
    write_validation_start(cfg, run_dir, init[0] if init else None)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _weights(cfg):
    return None if cfg.reward.weights is None else list(cfg.reward.weights)


def train(cfg, step_offset: int = 0, pools: dict[str, Any] | None = None) -> dict:
    """Open the run directory, prepare, train, save, evaluate. Returns metrics.json's content.

    The config is checked by the entrypoint (or the curriculum) that composed it. With `resume` set, a finished
    stage returns its metrics untouched and an unfinished one continues from its last complete checkpoint.
    `pools`: the curriculum's stage nodes a mixed training set draws from (prepare)."""
    run_dir = Path(cfg.paths.output_dir)
    lock = run_directory.claim(run_dir)
    try:
        # from here a first Ctrl-C/SIGTERM stops the stage within seconds, a second one exits at once
        # (base/stop.py); data-parallel ranks stop together at the end of a step
        with stop.handling(abandon=not dist.is_distributed()):
            return _train_locked(cfg, run_dir, step_offset, pools)
    finally:
        if dist.is_main():
            lock.release()


def _train_locked(cfg, run_dir: Path, step_offset: int, pools: dict[str, Any] | None) -> dict:
    plan = plan_for(cfg)  # once: the settings record and the trainer read the same plan (build_trainer fits it)
    run_directory.adopt_recorded_split(cfg, run_dir)
    # the files are rank 0's to change
    finished, resume_from = dist.on_main(lambda: run_directory.open_run_dir(cfg, run_dir, plan))
    if finished is not None:
        if dist.is_main() and _needs_validation_start(cfg, run_dir):  # a run finished before the file existed
            _validation_start(cfg, run_dir)
        return finished
    started = time.time()
    # an earlier stage or job of this process (a curriculum, a sweep) gives its memory back first, and this stage's
    # peak is its own, not the process's
    cpu.release_freed_memory()
    reset_peak_rss()

    threads = cpu.apply(cfg.cpu)
    parts = prepare(cfg, pools)
    run_directory.stop_in_setup(run_dir)
    # TRL gathers its logged figures over the processes, so the step's completions are all N processes' ones
    monitor = MonitorCallback(run_dir / HISTORY_FILE, completions_per_step(cfg.train) * dist.world_size(),
                              step_offset=step_offset, stage=cfg.stage.name,
                              completions_per_generation=generation_batch(cfg.train)[0],
                              extra_rounds_key=dynamic_sampling.DRAWS_KEY)
    if resume_from is not None and dist.is_main():
        monitor.continue_from(read_jsonl(run_dir / HISTORY_FILE))
    tracker = loggers.start(cfg, run_dir, step_offset)
    init = parts.init
    run_state = {"stage": cfg.stage.name, "step_offset": step_offset, "init_from": str(init[0]) if init else None,
                 "ewc_state": ewc.source(init, parts.ewc_state),
                 "ewc_lambda": cfg.ewc["lambda"], "peft": cfg.peft.name,
                 "adapter_from": str(parts.adapter_from) if parts.adapter_from else None}
    try:
        stage = StageRun(cfg, run_dir, parts, monitor, started, plan)
        trainer = stage.build(tracker, run_state)
        run_directory.stop_in_setup(run_dir)
        metrics = stage.train_and_save(trainer, resume_from, threads)
    except BaseException:
        loggers.finish(tracker, None, failed=True)
        raise
    loggers.finish(tracker, metrics, failed=False)
    return metrics


class StageRun:
    """The pieces of one stage that building, training and saving share."""

    def __init__(self, cfg, run_dir: Path, parts: StageParts, monitor, started: float, plan):
        self.cfg, self.run_dir, self.parts, self.monitor, self.started = cfg, run_dir, parts, monitor, started
        self.plan = plan  # the resolved speed plan (config/speed.py)
        self.stopper = GracefulStop()  # a stop request at a step's end (the signals are base/stop.py's)
        self.pace_key: str | None = None  # this run's shape on this machine (training/pace.py), once built
        self.held_out = None  # the periodic validation evaluation's callback (training/periodic_eval.py), if any

    def build(self, tracker, run_state):
        report_to = [tracker.report_to] if tracker is not None else []  # "wandb" or "trackio"
        # history.jsonl and the evaluations during training are rank 0's: TRL's logged figures are already
        # gathered over the processes, and the others wait for rank 0 at the next step's collectives
        main, cfg = dist.is_main(), self.cfg
        trainer = build_trainer(cfg, self.parts, output_dir=self.run_dir,
                                callbacks=[self.monitor, self.stopper] if main else [self.stopper],
                                report_to=report_to, run_state=run_state, plan=self.plan)
        if main:  # what this run computes with: the resolved speed plan, less what the model forced off
            write_json(self.run_dir / SPEED_PLAN_FILE, trainer.speed_plan.record())
            self.pace_key = pace.shape_key(cfg, trainer.speed_plan.summary())
            logger.info("training %s on %s: %d steps, %s; %s; files in %s", cfg.model.name, cfg.stage.name,
                        cfg.train.max_steps, trainer.speed_plan.summary(),
                        pace.estimate(cfg.paths.cache_dir, self.pace_key, cfg.train.max_steps), self.run_dir)
        if cfg.eval.every_steps and main:
            from grpo_exp.training.periodic_eval import held_out_callback

            self.held_out = held_out_callback(cfg, trainer.pending_logs)
            trainer.add_callback(self.held_out)
        if cfg.eval.forgetting_sets and main:
            from grpo_exp.training.forgetting import forgetting_callback

            trainer.add_callback(forgetting_callback(cfg, trainer.pending_logs, self.parts.init[0]))
        if tracker is not None:
            tracker.attach(trainer, self.monitor)  # cumulative step axis + the monitor's resource figures
        return trainer

    def train_and_save(self, trainer, resume_from: Path | None, threads) -> dict:
        """Train (or take a checkpoint that already holds every step), then save model/, evaluate and write
        metrics.json. A stop while training ends the stage (run_dir.end_stopped raises Stopped); one after it, during the
        saving of model/ or the evaluation, raises Stopped with the final checkpoint kept, from which
        resume=true saves and evaluates again."""
        abandoned = None
        try:
            self._train(trainer, resume_from)
        except NonFiniteError as err:
            raise TrainingHalted(str(err)) from None
        except stop.Stopped as err:  # the step in progress was abandoned
            abandoned = err
        finally:
            self.monitor.sampler.stop()
        if abandoned is not None or stop.requested() is not None:  # a checkpoint, metrics.json, Stopped raised
            run_directory.end_stopped(self.run_dir, trainer, self._metrics(trainer, resume_from, threads, "interrupted"),
                                     abandoned)
        if resume_from is None and self.pace_key is not None:  # a resumed run's first steps may be another machine's
            pace.record(self.cfg.paths.cache_dir, self.pace_key, self.monitor.step_times)
        try:
            return self._save_and_evaluate(trainer, resume_from, threads)
        except stop.Stopped as err:
            logger.warning("%s after training (step %s); %s; resume=true hydra.run.dir=%s saves and evaluates "
                           "from it", err, trainer.state.global_step,
                           run_directory.checkpoint_note(self.run_dir, None), self.run_dir)
            raise

    def _train(self, trainer, resume_from: Path | None) -> None:
        # killed after its last step (HF's loop would run one step more than max_steps), or after the step at which
        # train.stop_at_accuracy ended it: only the checkpoint's weights and state are taken
        if resume_from is not None and (checkpoints.checkpoint_step(resume_from) >= self.cfg.train.max_steps
                                        or self._reached_by(checkpoints.checkpoint_step(resume_from))):
            from transformers import TrainerState

            trainer._load_from_checkpoint(str(resume_from))
            trainer.state = TrainerState.load_from_json(str(resume_from / "trainer_state.json"))
            return
        if resume_from is not None:  # the adaptive curriculum's pass rates, as the checkpoint left them
            trainer.restore_mix(resume_from, checkpoints.STATE_FILE)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)

    def _metrics(self, trainer, resume_from: Path | None, threads, status: str) -> dict:
        return run_directory.stage_metrics(self.cfg, self.parts, trainer, self.monitor, started=self.started,
                                          threads=threads, resume_from=resume_from, status=status)

    def _reached_by(self, step: int) -> bool:
        """Whether a periodic evaluation at `step` (where a resumed stage's checkpoint is) reached
        train.stop_at_accuracy: the stage ended there (history.jsonl holds the row), as the callback records it."""
        target, key = self.cfg.train.get("stop_at_accuracy"), f"eval/{self.cfg.stage.name}/accuracy"
        if target is None or self.held_out is None:
            return False
        rows = [r for r in read_jsonl(self.run_dir / HISTORY_FILE)
                if r.get("step") == step and key in r and r[key] >= target]
        if rows:
            self.held_out.reached = {"target": target, "step": step, "accuracy": rows[-1][key],
                                     "n": rows[-1].get(f"eval/{self.cfg.stage.name}/n")}
        return bool(rows)

    def _stop_record(self, trainer) -> dict:
        """Where train.stop_at_accuracy ended the stage ({"target", "step", "accuracy", "n", "reached"}), or that it
        trained every step without reaching it (the last periodic evaluation's accuracy)."""
        target = self.cfg.train.stop_at_accuracy
        reached = self.held_out.reached if self.held_out is not None else None
        if reached is not None:
            return {**reached, "reached": True}
        last = [row for row in read_jsonl(self.run_dir / HISTORY_FILE) if f"eval/{self.cfg.stage.name}/accuracy" in row]
        accuracy = last[-1][f"eval/{self.cfg.stage.name}/accuracy"] if last else None
        return {"target": target, "step": trainer.state.global_step, "accuracy": accuracy, "reached": False}

    def _save_and_evaluate(self, trainer, resume_from: Path | None, threads) -> dict:
        """A trained stage's model/ (or adapter/ and the merged model/), EWC state, evaluation, cards, hub push and
        metrics.json, written last."""
        cfg, run_dir, parts = self.cfg, self.run_dir, self.parts
        policy = trainer.model
        adapter = lora.is_peft(policy)
        main = dist.is_main()  # every process holds the same weights; rank 0 writes them
        if adapter and main:  # model/ (merged) is written once the adapter is no longer needed, below
            lora.save_adapter(policy, parts.tokenizer, run_dir / lora.ADAPTER_DIR, cfg)
        elif main:
            save_model_dir(policy, parts.tokenizer, run_dir / MODEL_DIR)
        metrics = self._metrics(trainer, resume_from, threads, status="completed")
        if cfg.train.get("stop_at_accuracy") is not None and main:
            metrics["stop_at_accuracy"] = self._stop_record(trainer)
        if cfg.ewc["lambda"] > 0:  # with an adapter: over the adapter's parameters, the only ones that train
            metrics.update(ewc.consolidate_fisher(cfg, policy, parts.tokenizer, parts.train_examples,
                                                  parts.ewc_state, run_dir)[1])
        if not main:  # the evaluations and metrics.json are rank 0's; this process is done
            logger.info("rank %d of %d done: peak RSS %.1f MB", dist.rank(), dist.world_size(),
                        metrics["peak_rss_mb"])  # in <run dir>/<task>.rank<r>.log
            return metrics
        if adapter:
            policy = lora.merge_and_save(policy, parts.tokenizer, run_dir / MODEL_DIR)
        if cfg.eval.after_train:
            from grpo_exp.evaluation.run import evaluate_after_train

            # the merged model: what model/ holds, and generation without the adapter's extra matmuls
            metrics["eval"] = evaluate_after_train(cfg, policy, parts.tokenizer, run_dir,
                                                   parts.init[0] if parts.init else None)
        elif _needs_validation_start(cfg, run_dir):
            _validation_start(cfg, run_dir)
        # model/README.md (and adapter/'s): the hub's metadata, the before/after table, the settings
        write_cards(run_dir, cfg, steps=trainer.state.global_step)
        if cfg.get("push_to_hub"):
            from grpo_exp.training import hub

            metrics["hub"] = hub.push(cfg, run_dir)
        metrics["wall_time_s"] = time.time() - self.started
        # Written last: its "completed" status is what marks the stage as done for resume.
        run_directory.write_metrics(run_dir, metrics)
        if not cfg.train.keep_final_checkpoint:
            run_directory.drop_checkpoints(run_dir)
        return metrics
