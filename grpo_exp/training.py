"""`train(cfg)`: one GRPO run from a composed config to a model directory and its figures.

Plain and testable: the Hydra entrypoint (`grpo_exp.train`) only calls this.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from grpo_exp import cpu, data, models, rewards
from grpo_exp.config import validate
from grpo_exp.monitor import MonitorCallback
from grpo_exp.runio import save_model_dir, write_json
from grpo_exp.trainer import GracefulStop, build_trainer, completions_per_step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_train_dataset(cfg):
    examples = data.build_examples(
        cfg.stage.dataset, "train", num_train=cfg.stage.num_train, num_test=cfg.stage.num_test,
        seed=cfg.train.seed, path=cfg.stage.path, hub_id=cfg.stage.hub_id, hub_config=cfg.stage.hub_config,
    )
    return data.to_dataset(examples, cfg.reward.system_prompt)


def train(cfg) -> dict:
    """Validate, load, train, save. Returns the metrics also written to `metrics.json`."""
    validate(cfg)
    models.check_available(cfg.model, cfg.paths.cache_dir)
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    threads = cpu.apply(cfg.cpu)
    seed_everything(cfg.train.seed)
    reward_funcs, reward_weights = rewards.build(list(cfg.reward.funcs), _weights(cfg))
    train_dataset = build_train_dataset(cfg)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed)

    monitor = MonitorCallback(run_dir / "history.jsonl", completions_per_step(cfg.train), stage=cfg.stage.name)
    stopper = GracefulStop().install()
    trainer = build_trainer(cfg, model, tokenizer, train_dataset, reward_funcs, reward_weights,
                            output_dir=run_dir, callbacks=[monitor, stopper])
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
        **monitor.summary([f.__name__ for f in reward_funcs]),
        "wall_time_s": time.time() - started,
        "train_runtime_s": trainer.state.log_history[-1].get("train_runtime") if trainer.state.log_history else None,
        **{f"cpu_{k}": v for k, v in threads.items()},
        "precision": cfg.train.precision,
        "torch_version": torch.__version__,
    }
    write_json(run_dir / "metrics.json", metrics)
    if stopper.signal_received:
        print(f"[grpo-exp] stopped by signal after step {trainer.state.global_step}; checkpoint and model saved "
              f"in {run_dir}", file=sys.stderr)
        raise SystemExit(128 + stopper.signal_received)
    return metrics


def _weights(cfg):
    return None if cfg.reward.weights is None else list(cfg.reward.weights)


def resolved_config(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
