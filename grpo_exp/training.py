"""`train(cfg)`: one GRPO stage from a composed config to a model directory and its figures.

Plain and testable: the Hydra entrypoint (`grpo_exp.train`) only calls this (or the curriculum,
which calls it once per stage).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from grpo_exp import cpu, data, ewc, models, rewards
from grpo_exp.config import ewc_settings, resolve_precision, validate
from grpo_exp.monitor import MonitorCallback, reset_peak_rss
from grpo_exp.runio import resolve_init, save_model_dir, write_json
from grpo_exp.trainer import GracefulStop, build_trainer, completions_per_step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stage_examples(cfg, split: str, stage_cfg=None) -> list[dict]:
    stage = stage_cfg if stage_cfg is not None else cfg.stage
    return data.build_examples(
        stage.dataset, split, num_train=stage.num_train, num_test=stage.num_test, seed=cfg.train.seed,
        path=stage.path, hub_id=stage.hub_id, hub_config=stage.hub_config,
    )


def train(cfg, step_offset: int = 0) -> dict:
    """Validate, load, train, save (and estimate the Fisher when EWC is on). Returns metrics.json's content."""
    validate(cfg)
    models.check_available(cfg.model, cfg.paths.cache_dir)
    ewc_cfg = ewc_settings(cfg)
    init = resolve_init(cfg.init_from)
    # Loaded before the model so a missing Fisher fails before anything heavy happens.
    ewc_state = ewc.EwcState.load(init[1]) if init and ewc_cfg["lambda"] > 0 else None
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
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
                              step_offset=step_offset, stage=cfg.stage.name)
    tracker = _start_tracking(cfg, run_dir, step_offset)
    try:
        metrics = _train_and_save(cfg, tracker, model, tokenizer, train_dataset, train_examples, reward_funcs,
                                  reward_weights, monitor, penalty, ewc_cfg, ewc_state, init, threads, run_dir, started)
    except BaseException:
        _finish_tracking(tracker, None, failed=True)
        raise
    _finish_tracking(tracker, metrics, failed=False)
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


def _train_and_save(cfg, tracker, model, tokenizer, train_dataset, train_examples, reward_funcs, reward_weights,
                    monitor, penalty, ewc_cfg, ewc_state, init, threads, run_dir: Path, started: float) -> dict:
    report_to = ["wandb"] if tracker is not None else []
    stopper = GracefulStop().install()
    trainer = build_trainer(cfg, model, tokenizer, train_dataset, reward_funcs, reward_weights,
                            output_dir=run_dir, callbacks=[monitor, stopper], extra_loss=penalty, report_to=report_to)
    if tracker is not None:
        tracker.attach(trainer, monitor)  # cumulative step axis + the monitor's resource figures
    try:
        trainer.train()
    finally:
        stopper.uninstall()
        monitor.sampler.stop()

    save_model_dir(trainer.model, tokenizer, run_dir / "model")
    metrics = {
        "status": "interrupted" if stopper.signal_received else "completed",
        "model": cfg.model.name,
        "stage": cfg.stage.name,
        "reward_set": cfg.reward.name,
        "init_from": str(init[0]) if init else None,
        **monitor.summary([f.__name__ for f in reward_funcs]),
        "wall_time_s": None,
        **{f"cpu_{k}": v for k, v in threads.items()},
        "precision": resolve_precision(cfg.train.precision),
        "torch_version": torch.__version__,
        "ewc_lambda": ewc_cfg["lambda"],
    }
    if penalty is not None:
        metrics["ewc_weighted_distance"] = penalty.weighted_distance(trainer.model)
    if stopper.signal_received:
        metrics["wall_time_s"] = time.time() - started
        write_json(run_dir / "metrics.json", metrics)
        print(f"[grpo-exp] stopped by signal after step {trainer.state.global_step}; checkpoint and model saved "
              f"in {run_dir}", file=sys.stderr)
        raise SystemExit(128 + stopper.signal_received)

    if ewc_cfg["lambda"] > 0:
        metrics.update(consolidate_fisher(cfg, ewc_cfg, trainer.model, tokenizer, train_examples, ewc_state, run_dir))
    if cfg.eval.after_train:
        from grpo_exp.evaluate import evaluate_after_train

        metrics["eval"] = evaluate_after_train(cfg, trainer.model, tokenizer, run_dir)
    metrics["wall_time_s"] = time.time() - started
    write_json(run_dir / "metrics.json", metrics)
    return metrics


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
    return {"fisher_time_s": time.time() - t0, **{f"fisher_{k}": v for k, v in state.stats().items()
                                                 if k != "stages"}, "ewc_stages": state.stages}


def _weights(cfg):
    return None if cfg.reward.weights is None else list(cfg.reward.weights)
