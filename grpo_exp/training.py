"""`train(cfg)`: one GRPO stage from a composed config to a model directory and its figures.

Plain and testable: the Hydra entrypoint (`grpo_exp.train`) only calls this (or the curriculum,
which calls it once per stage).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from grpo_exp import checkpoints, cpu, data, ewc, models, rewards
from grpo_exp.config import ewc_settings, generation_batch, resolve_precision, validate
from grpo_exp.monitor import MonitorCallback, reset_peak_rss
from grpo_exp.errors import ConfigError, TrainingHalted
from grpo_exp.runio import read_jsonl, resolve_init, save_model_dir, write_json
from grpo_exp.trainer import GracefulStop, NonFiniteError, build_trainer, completions_per_step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stage_examples(cfg, split: str, stage_cfg=None) -> list[dict]:
    stage = stage_cfg if stage_cfg is not None else cfg.stage
    return data.build_examples(
        stage.dataset, split, num_train=stage.num_train, num_test=stage.num_test, seed=cfg.train.seed,
        path=stage.path, hub_id=stage.hub_id, hub_config=stage.hub_config, test_fraction=stage.test_fraction,
    )


def train(cfg, step_offset: int = 0) -> dict:
    """Validate, load, train, save (and estimate the Fisher when EWC is on). Returns metrics.json's content.

    With `resume` set, a finished stage returns its metrics untouched and an unfinished one continues
    from its last complete checkpoint.
    """
    validate(cfg)
    models.check_available(cfg.model, cfg.paths.cache_dir)
    run_dir = Path(cfg.paths.output_dir)
    ensure_writable(run_dir)
    if cfg.resume:
        finished = finished_metrics(run_dir)
        if finished is not None:
            print(f"[grpo-exp] {run_dir} already finished stage {finished.get('stage')}; not retrained", flush=True)
            return finished
    ewc_cfg = ewc_settings(cfg)
    init = resolve_init(cfg.init_from)
    # Loaded before the model so a missing Fisher fails before anything heavy happens.
    ewc_state = ewc.EwcState.load(init[1]) if init and ewc_cfg["lambda"] > 0 else None
    resume_from = _prepare_resume(run_dir) if cfg.resume else None
    started = time.time()
    reset_peak_rss()  # this stage's peak, not the process's (sweep jobs share one process)

    threads = cpu.apply(cfg.cpu)
    seed_everything(cfg.train.seed)
    reward_funcs, reward_weights = rewards.build(list(cfg.reward.funcs), _weights(cfg))
    train_examples = stage_examples(cfg, "train")
    train_dataset = data.to_dataset(train_examples, cfg.reward.system_prompt)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed,
                                   init_from=init[0] if init else None)
    penalty = ewc.EwcPenalty(ewc_state, ewc_cfg["lambda"]) if ewc_state is not None else None

    monitor = MonitorCallback(run_dir / "history.jsonl", completions_per_step(cfg.train),
                              step_offset=step_offset, stage=cfg.stage.name,
                              completions_per_generation=generation_batch(cfg.train)[0])
    if resume_from is not None:
        monitor.continue_from(read_jsonl(run_dir / "history.jsonl"))
    tracker = _start_tracking(cfg, run_dir, step_offset)
    run_state = {"stage": cfg.stage.name, "step_offset": step_offset, "init_from": str(init[0]) if init else None,
                 "ewc_state": str(init[1] / ewc.FISHER_FILE) if ewc_state is not None else None,
                 "ewc_lambda": ewc_cfg["lambda"]}
    try:
        stage = StageRun(cfg, run_dir, tokenizer, reward_funcs, monitor, ewc_cfg, ewc_state, penalty, started)
        trainer = stage.build(model, train_dataset, reward_weights, tracker, run_state)
        metrics = stage.train_and_save(trainer, resume_from, train_examples, init, threads)
    except BaseException:
        _finish_tracking(tracker, None, failed=True)
        raise
    _finish_tracking(tracker, metrics, failed=False)
    return metrics


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
    for leftover in checkpoints.remove_staging(ckpt_dir):
        print(f"[grpo-exp] removed an incomplete checkpoint left by a crash: {leftover.name}", flush=True)
    last = checkpoints.last_checkpoint(ckpt_dir)
    if last is None:
        print(f"[grpo-exp] no complete checkpoint in {ckpt_dir}; starting this stage from the beginning", flush=True)
        for name in ("history.jsonl", "completions.jsonl"):
            checkpoints.truncate_jsonl(run_dir / name, 0)
        return None
    step = checkpoints.checkpoint_step(last)
    for name in ("history.jsonl", "completions.jsonl"):
        checkpoints.truncate_jsonl(run_dir / name, step)
    print(f"[grpo-exp] resuming from {last} (step {step})", flush=True)
    return last


class StageRun:
    """The pieces of one stage that building, training and saving share."""

    def __init__(self, cfg, run_dir: Path, tokenizer, reward_funcs, monitor, ewc_cfg, ewc_state, penalty, started):
        self.cfg, self.run_dir, self.tokenizer = cfg, run_dir, tokenizer
        self.reward_funcs, self.monitor = reward_funcs, monitor
        self.ewc_cfg, self.ewc_state, self.penalty, self.started = ewc_cfg, ewc_state, penalty, started
        self.stopper = GracefulStop()

    def build(self, model, train_dataset, reward_weights, tracker, run_state):
        report_to = ["wandb"] if tracker is not None else []
        trainer = build_trainer(self.cfg, model, self.tokenizer, train_dataset, self.reward_funcs, reward_weights,
                                output_dir=self.run_dir, callbacks=[self.monitor, self.stopper],
                                extra_loss=self.penalty, report_to=report_to, run_state=run_state)
        if self.cfg.eval.every_steps:
            trainer.add_callback(self.held_out_eval(trainer.pending_logs))
        if tracker is not None:
            tracker.attach(trainer, self.monitor)  # cumulative step axis + the monitor's resource figures
        return trainer

    def held_out_eval(self, pending_logs: dict):
        """The `eval.every_steps` callback: the first eval.every_limit problems of this stage's held-out split."""
        from grpo_exp.evaluate import held_out_split
        from grpo_exp.periodic_eval import HeldOutEvalCallback

        cfg = self.cfg
        limit = min(cfg.eval.every_limit, cfg.stage.num_test) if cfg.stage.dataset != "gsm8k" else cfg.eval.every_limit
        examples = held_out_split(cfg.stage, limit, cfg.train.seed)[:limit]
        return HeldOutEvalCallback(pending_logs, cfg.stage.name, examples, cfg.eval.every_steps,
                                   system_prompt=cfg.reward.system_prompt,
                                   max_new_tokens=cfg.train.max_completion_length, batch_size=cfg.eval.batch_size)

    def train_and_save(self, trainer, resume_from: Path | None, train_examples, init, threads) -> dict:
        cfg, run_dir = self.cfg, self.run_dir
        self.stopper.install()
        try:
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        except NonFiniteError as err:
            raise TrainingHalted(str(err)) from None
        finally:
            self.stopper.uninstall()
            self.monitor.sampler.stop()

        save_model_dir(trainer.model, self.tokenizer, run_dir / "model")
        metrics = {
            "status": "interrupted" if self.stopper.signal_received else "completed",
            "model": cfg.model.name,
            "stage": cfg.stage.name,
            "reward_set": cfg.reward.name,
            "init_from": str(init[0]) if init else None,
            "resumed_from": str(resume_from) if resume_from else None,
            **self.monitor.summary([f.__name__ for f in self.reward_funcs]),
            "wall_time_s": None,
            **{f"cpu_{k}": v for k, v in threads.items()},
            "precision": resolve_precision(cfg.train.precision),
            "torch_version": torch.__version__,
            "ewc_lambda": self.ewc_cfg["lambda"],
            "skipped_batches": trainer.skipped_batches,
        }
        if self.penalty is not None:
            metrics["ewc_weighted_distance"] = self.penalty.weighted_distance(trainer.model)
        if self.stopper.signal_received:
            metrics["wall_time_s"] = time.time() - self.started
            write_json(run_dir / "metrics.json", metrics)
            print(f"[grpo-exp] stopped by signal after step {trainer.state.global_step}; checkpoint and model saved "
                  f"in {run_dir}; continue with resume=true hydra.run.dir={run_dir}", file=sys.stderr)
            raise SystemExit(128 + self.stopper.signal_received)

        if self.ewc_cfg["lambda"] > 0:
            metrics.update(consolidate_fisher(cfg, self.ewc_cfg, trainer.model, self.tokenizer, train_examples,
                                              self.ewc_state, run_dir))
        if cfg.eval.after_train:
            from grpo_exp.evaluate import evaluate_after_train

            metrics["eval"] = evaluate_after_train(cfg, trainer.model, self.tokenizer, run_dir,
                                                   init[0] if init else None)
        metrics["wall_time_s"] = time.time() - self.started
        # Written last: its "completed" status is what marks the stage as done for resume.
        write_json(run_dir / "metrics.json", metrics)
        return metrics


def _start_tracking(cfg, run_dir: Path, step_offset: int):
    if cfg.logger.name == "none":
        return None
    from grpo_exp import tracking

    return tracking.start(cfg, run_dir, step_offset=step_offset)


def _finish_tracking(tracker, metrics: dict | None, failed: bool) -> None:
    if tracker is None:
        return
    from grpo_exp import tracking

    tracking.finish(tracker, metrics, failed=failed)


def consolidate_fisher(cfg, ewc_cfg: dict, model, tokenizer, examples: list[dict], old_state, run_dir: Path) -> dict:
    """Estimate this stage's Fisher on its training prompts, fold it into the running EWC state, save it."""
    t0 = time.time()
    prompts = [data.to_messages(ex["question"], cfg.reward.system_prompt) for ex in examples]
    random.Random(cfg.train.seed).shuffle(prompts)
    fisher = ewc.estimate(
        model, tokenizer, prompts, samples=ewc_cfg["fisher_samples"],
        max_new_tokens=ewc_cfg["fisher_max_new_tokens"] or cfg.train.max_completion_length,
        temperature=cfg.train.temperature, batch_size=ewc_cfg["fisher_batch_size"], seed=cfg.train.seed,
        include_embeddings=ewc_cfg["include_embeddings"],
    )
    anchor = ewc.current_parameters(model, fisher.keys())
    base = old_state if old_state is not None else ewc.EwcState({}, {}, [], {})
    state = base.consolidate(fisher, anchor, ewc_cfg["gamma"], cfg.stage.name)
    state.save(run_dir)
    return {"fisher_time_s": time.time() - t0, **{k: v for k, v in state.stats().items() if k != "stages"},
            "ewc_stages": state.stages}


def _weights(cfg):
    return None if cfg.reward.weights is None else list(cfg.reward.weights)
