"""The bench's child process, one per variant and round (`python -m grpo_exp.apps.bench --child spec.json`):
it composes the config, builds grpo-exp's trainer or a plain TRL GRPOTrainer (plain_trl_config) on the same
prepared stage, times every optimizer step and reads TRL's log line (StepRecorder; with --profile, the parts
of a step and which of them raised the peak RSS), and writes result.json with the model's shape the floor
needs (model_shape)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path


class StepRecorder:
    """A TrainerCallback timing each optimizer step and reading TRL's per-step log line; with `profile`,
    also a set of timers the child wraps around the trainer's methods, and which of those parts raised the
    process's peak RSS (VmHWM, read as each part ends: one small file read, not a sampler thread)."""

    def __init__(self, gen_batch: int, profile: bool):
        from transformers import TrainerCallback

        self.gen_batch = gen_batch
        self.profile = profile
        self.steps: list[dict] = []
        self.profile_steps: list[dict] = []
        # MB by which each part raised the peak RSS over the whole run (setup: before the first step), and the
        # part in which the run's peak was reached
        self.peak_rise_mb: dict[str, float] = {}
        self.peak_part: str | None = None
        self._hwm = 0.0
        self._current: dict[str, float] = {}
        self._t0 = 0.0
        self._faults0 = 0
        self._opt_t0 = 0.0
        rec = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                rec.note_peak("other" if rec.steps else "setup")
                rec._current = {}
                rec._faults0 = _minor_faults()
                rec._t0 = time.perf_counter()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                rec.note_peak("other")
                rec._opt_t0 = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kw):
                rec.add("optimizer", time.perf_counter() - rec._opt_t0)
                rec.note_peak("optimizer")

            def on_step_end(self, args, state, control, **kw):
                rec.note_peak("other")
                elapsed = time.perf_counter() - rec._t0
                # page_faults: pages the kernel had to map in (zero-filled) during the step, memory the allocator
                # gave back and took again (cpu.malloc); peak_rss_mb: the peak so far, how it grows over a run
                rec.steps.append({"step": state.global_step, "time_s": round(elapsed, 4),
                                  "page_faults": _minor_faults() - rec._faults0, "peak_rss_mb": _vmhwm_mb()})
                if rec.profile:
                    parts = {k: round(v, 4) for k, v in rec._current.items()}
                    parts["other"] = round(elapsed - sum(rec._current.values()), 4)
                    parts["step"] = round(elapsed, 4)
                    rec.profile_steps.append(parts)

            def on_log(self, args, state, control, logs=None, **kw):
                logs = logs or {}
                if "train_runtime" in logs or not rec.steps:
                    return
                row = rec.steps[-1]
                mean_len = logs.get("completions/mean_length")
                row["generated"] = mean_len is not None
                row["mean_length"] = mean_len
                row["tokens"] = float(mean_len) * rec.gen_batch if mean_len is not None else 0.0
                row["max_length"] = logs.get("completions/max_length")
                for key in ("reward", "loss", "grad_norm"):
                    if logs.get(key) is not None:
                        row[key] = logs[key]

        self.callback = _Callback()

    def add(self, part: str, seconds: float) -> None:
        self._current[part] = self._current.get(part, 0.0) + seconds

    def note_peak(self, part: str) -> None:
        """Charge any rise of the peak RSS since the last reading to `part` (what ran in between)."""
        if not self.profile:
            return
        hwm = _vmhwm_mb()
        if hwm > self._hwm:
            self.peak_rise_mb[part] = round(self.peak_rise_mb.get(part, 0.0) + hwm - self._hwm, 1)
            self.peak_part, self._hwm = part, hwm

    def wrap(self, obj, method: str, part) -> None:
        """Replace obj.method by a timed version; `part` is a name or a function of nothing giving one."""
        import functools

        original = getattr(obj, method)

        @functools.wraps(original)
        def timed(*a, **kw):
            self.note_peak("other")  # a rise since the last reading happened outside the timed parts
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                name = part() if callable(part) else part
                self.add(name, time.perf_counter() - t0)
                self.note_peak(name)

        setattr(obj, method, timed)

    def instrument(self, trainer) -> None:
        import torch

        self.wrap(trainer, "_generate", "generation")
        self.wrap(trainer, "_calculate_rewards", "rewards")
        # no-grad forwards are the old-policy (and reference) logprobs; grad-enabled ones are the policy forward
        self.wrap(trainer, "_get_per_token_logps_and_entropies",
                  lambda: "policy_forward" if torch.is_grad_enabled() else "old_logprobs")
        self.wrap(trainer.accelerator, "backward", "backward")
        if getattr(trainer, "extra_loss", None) is not None and hasattr(trainer, "extra_loss_term"):
            self.wrap(trainer, "extra_loss_term", "extra_loss")


def compose(overrides: list[str], output_dir: Path):
    from grpo_exp.config.compose import compose as compose_config

    return compose_config("train", [*overrides, f"paths.output_dir={output_dir}"])


def plain_trl_config(train, output_dir: Path, reward_weights: list[float], max_steps: int,
                     trl_defaults: bool = False, generation_kwargs: dict | None = None):
    """GRPOConfig as a plain user writes it: TRL's defaults, fp32 (on the GPU where there is one, else the
    CPU), the GRPO settings of the run. `trl_defaults`: TRL's own precision default too (bf16 on)."""
    import torch
    from trl import GRPOConfig

    precision = {} if trl_defaults else {"bf16": False}  # GRPOConfig defaults to bf16=True
    return GRPOConfig(
        output_dir=str(output_dir),
        **precision,
        use_cpu=not torch.cuda.is_available(),  # on a GPU machine the baseline runs on the GPU too
        # gradient checkpointing: TRL's default (on), as a plain user gets it
        per_device_train_batch_size=train.per_device_train_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        # the recipe's generation rounds (TRL supports them natively), so both variants run one algorithm
        steps_per_generation=train.steps_per_generation,
        generation_batch_size=train.generation_batch_size,
        num_generations=train.num_generations,
        max_completion_length=train.max_completion_length,
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler_type,
        warmup_steps=train.warmup_steps,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        beta=train.beta,
        epsilon=train.epsilon,
        loss_type=train.loss_type,
        scale_rewards=train.scale_rewards,
        temperature=train.temperature,
        top_p=train.top_p,
        top_k=train.top_k,
        repetition_penalty=train.repetition_penalty,
        mask_truncated_completions=train.mask_truncated_completions,
        num_iterations=train.num_iterations,
        seed=train.seed,
        max_steps=max_steps,
        reward_weights=list(reward_weights),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        generation_kwargs=generation_kwargs or None,
    )


def child_main(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    out = Path(spec["dir"])
    ours = spec["kind"] == "grpo-exp"
    env_names = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")
    cfg = compose(spec["common"] + (spec["overrides"] if ours else []), out)
    from grpo_exp.base import cpu

    if ours:
        cpu.prepare_env(cfg.cpu)  # as the entrypoint does: OpenMP settings before torch loads
    env_at_start = {k: os.environ.get(k) for k in env_names}
    import torch

    from grpo_exp.config.checks import validate
    from grpo_exp.config.recipe import generation_batch
    from grpo_exp.core import models
    from grpo_exp.training.stage import prepare

    loadavg_start = os.getloadavg()
    gen_batch, spg = generation_batch(cfg.train)
    measured = math.ceil(spec["steps"] / spg) * spg  # whole generation rounds
    total = max(spec["warmup"] + measured, spec["reward_curve_steps"])
    measured = (total - spec["warmup"]) // spg * spg
    cfg.train.max_steps = total
    cfg.train.save_steps = total + 1  # no checkpoint inside the measurement
    cfg.stage.num_train = max(64, 2 * total * spec["prompts_per_step"])
    # --fixed-length: no EOS before the token limit (generate's min_new_tokens; the engine honours it too), so
    # every variant generates and trains on the same number of tokens and tokens/s compares speed alone
    from omegaconf import OmegaConf

    generation_kwargs = {"min_new_tokens": cfg.train.max_completion_length} if spec.get("fixed_length") else {}
    if ours and generation_kwargs:
        cfg.train.extra = {**OmegaConf.to_container(cfg.train.extra), "generation_kwargs": generation_kwargs}
    validate(cfg)
    models.check_available(cfg.model, cfg.paths.cache_dir)

    if ours:
        threads = cpu.apply(cfg.cpu)
    else:
        torch.set_num_threads(spec["threads"])  # same thread count; everything else as TRL sets it
        threads = {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()}
    t0 = time.perf_counter()
    parts = prepare(cfg)  # the same seeded rewards, problems and model as a training run, for every variant
    load_s = time.perf_counter() - t0

    recorder = StepRecorder(gen_batch, spec["profile"])
    if ours:
        from grpo_exp.training.trainer import build_trainer

        trainer = build_trainer(cfg, parts, output_dir=out, callbacks=[recorder.callback])
    else:
        from trl import GRPOTrainer

        trainer = GRPOTrainer(model=parts.model, reward_funcs=parts.reward_funcs, train_dataset=parts.train_dataset,
                              processing_class=parts.tokenizer, callbacks=[recorder.callback],
                              args=plain_trl_config(cfg.train, out / "checkpoints", parts.reward_weights, total,
                                                    trl_defaults=spec.get("trl_defaults", False),
                                                    generation_kwargs=generation_kwargs))
    if spec["profile"]:
        recorder.instrument(trainer)
    a = trainer.args
    settings = {
        "bf16": bool(a.bf16), "gradient_checkpointing": bool(a.gradient_checkpointing),
        "steps_per_generation": a.steps_per_generation, "generation_batch_size": a.generation_batch_size,
        "cache_implementation": a.cache_implementation, "threads": threads["threads"],
        "precision": "bf16" if a.bf16 else "fp32",  # ours: the speed plan's precision, which set bf16
        "learning_rate": a.learning_rate, "num_generations": a.num_generations,
        "per_device_train_batch_size": a.per_device_train_batch_size,
        "max_completion_length": a.max_completion_length,
        "gradient_accumulation_steps": a.gradient_accumulation_steps,
        # what sampled the completions (speed.generation=auto resolves by machine; the engine may decline a model)
        "rollout": ("engine" if getattr(trainer, "rollout_engine", None) is not None
                    else "vllm" if a.use_vllm else "trl"),
        # the engine's copy (bfloat16, bfloat16 autocast, float32) and whether its Linear weights are packed
        "rollout_copy": getattr(getattr(trainer, "rollout_engine", None), "label", None),
        "rollout_packed": bool(getattr(getattr(trainer, "rollout_engine", None), "packed", None)),
        "fixed_length": bool(generation_kwargs),
        "shared_prefix": bool(getattr(getattr(trainer, "speed_plan", None), "shared_prefix", False)),
        "attention": getattr(parts.model.config, "_attn_implementation", None),
        # peft=lora: the adapter rank and how many parameters train (the optimizer state scales with them)
        "peft": f"lora r={cfg.peft.r}" if ours and cfg.peft.name == "lora" else "none",
        "trainable_params": sum(p.numel() for p in parts.model.parameters() if p.requires_grad),
    }
    assert a.generation_batch_size == gen_batch, (a.generation_batch_size, gen_batch)
    trainer.train()
    import shutil

    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a final checkpoint is no benchmark output
    for i, row in enumerate(recorder.steps):
        row.setdefault("tokens", 0.0)
        row["measured"] = spec["warmup"] <= i < spec["warmup"] + measured
    settings_text = (f"{settings['precision']}, grad-ckpt {'on' if settings['gradient_checkpointing'] else 'off'}, "
                     f"gen batch {gen_batch}" + (f", cache {settings['cache_implementation']}"
                                                 if settings["cache_implementation"] else "")
                     + (", shared prefix" if settings["shared_prefix"] else "")
                     + (f", {settings['attention']} attention" if settings["attention"] not in (None, "sdpa") else "")
                     + (f", {settings['peft']}" if settings["peft"] != "none" else "")
                     + (f", rollout engine ({settings['rollout_copy']} copy"
                        f"{', packed' if settings['rollout_packed'] else ''})"
                        if settings["rollout"] == "engine" else "")
                     + (", fixed length" if settings["fixed_length"] else "") + f", {settings['threads']} thr")
    result = {
        "name": spec["name"], "kind": spec["kind"], "overrides": spec["overrides"], "settings": settings,
        "settings_text": settings_text, "prompts_per_step": spec["prompts_per_step"], "model": cfg.model.name,
        "model_load_s": round(load_s, 2), "warmup_steps": spec["warmup"], "total_steps": total,
        "child_vmhwm_mb": _vmhwm_mb(), "steps": recorder.steps,
        "model_shape": model_shape(parts.model, parts.tokenizer, parts.train_dataset),
        "profile_steps": recorder.profile_steps or None,
        "peak_rss_part": recorder.peak_part, "peak_rss_rise_mb": recorder.peak_rise_mb or None,
        "torch": torch.__version__, "env": {k: os.environ.get(k) for k in env_names},
        "env_at_start": env_at_start,  # what OpenMP read when torch loaded (grpo-exp: after grpo_exp's default)
        "loadavg_end": os.getloadavg(), "loadavg_start": loadavg_start,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return 0


def matmul_parameters(model) -> tuple[int, int, bool]:
    """(all parameters, those that multiply a token, whether the LM head is tied): a tied LM head counts once, the
    input embedding is a lookup."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    total = sum(p.numel() for p in inner.parameters())
    embed = inner.get_input_embeddings().weight
    head = inner.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    return total, total - (0 if tied else embed.numel()), tied


def model_shape(model, tokenizer, dataset, prompts: int = 64) -> dict:
    """What the floor needs: the parameters that multiply (matmul_parameters) and the mean chat-templated prompt
    length of the first training prompts."""
    total, matmul, tied = matmul_parameters(model)
    rows = [dataset[i]["prompt"] for i in range(min(prompts, len(dataset)))]
    lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
               if isinstance(p, list) else len(tokenizer(p)["input_ids"]) for p in rows]
    return {"total_params": total, "matmul_params": matmul, "tied_lm_head": tied,
            "prompt_tokens_mean": statistics.mean(lengths) if lengths else 0.0}


def _vmhwm_mb() -> float:
    """The child's peak RSS so far, in MB: the kernel's high-water mark, as training's own monitor reads it."""
    from grpo_exp.base.monitor import peak_rss_mb

    return round(peak_rss_mb(), 1)


def _minor_faults() -> int:
    """The process's minor page faults so far (getrusage): each maps one page in, zero-filled when it is new."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
