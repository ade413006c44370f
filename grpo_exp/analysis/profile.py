"""Where decoding time goes: time a decoding round as GRPO samples (temperature 1, no top-k/top-p, every
sequence forced to --tokens) through transformers' `generate` (TRL's path) or grpo-exp's rollout engine, and
list the top torch ops (for the engine's compiled step, inductor's kernels by name), plus the LM head's achieved
weight bandwidth against a plain memory read.

    grpo-profile                          # generate: default model, 8 sequences x 64 tokens, 2 threads
    grpo-profile --path engine --batch 16 --repeats 5
    grpo-profile --path engine --batch 16 --prepack false   # the copy's Linear weights left plain
    grpo-profile --batch 32 --threads 1
    grpo-profile --model tiny_random --tokens 4 --out /tmp/prof

Writes profile.md and profile.json into --out (default outputs/profile_generation/<timestamp>/).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args) -> int:
    """Profile decoding as `args` (see apps/profile.py) asks; returns the exit code."""
    from grpo_exp.base import cpu
    from grpo_exp.config.compose import check_group_choices, compose, model_overrides
    from grpo_exp.base.errors import ConfigError

    try:
        check_group_choices(model_overrides(args.model), False)
        cfg = compose("train", [*model_overrides(args.model), f"cpu.threads={args.threads}"])
        cpu.prepare_env(cfg.cpu)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpo_exp.core import data
    from grpo_exp.core import models

    cpu.apply(cfg.cpu)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    model.eval()
    examples = data.build_examples("basic", "train", size=args.batch, seed=0)
    prompts = [tokenizer.apply_chat_template(data.to_messages(ex["question"], cfg.reward.system_prompt),
                                             tokenize=False, add_generation_prompt=True) for ex in examples]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    if args.path == "engine":
        try:
            decode, head, label = _engine_round(args, cfg, model, tokenizer, prompts, pad)
            precision = str(head.dtype).replace("torch.", "")  # the copy's dtype
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    else:
        tokenizer.padding_side = "left"
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        # as training runs TRL's generate: under bf16 autocast when it trains in bf16 (the fp32 weights recast
        # on every op of every token), else in fp32
        precision = cpu.resolve_precision(args.precision)

        def decode() -> float:
            torch.manual_seed(0)
            t0 = time.perf_counter()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                model.generate(**enc, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=True,
                               temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
            return time.perf_counter() - t0
        head = model.get_output_embeddings().weight.detach()
        label = "`generate` under bf16 autocast" if precision == "bf16" else "`generate` in fp32"

    decode()  # warm-up (and, for the engine, compilation)
    rounds = [decode() for _ in range(args.repeats)]
    seconds = statistics.median(rounds)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    ops = [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count,
            "ms_per_decoding_step": e.self_cpu_time_total / 1e3 / args.tokens} for e in events[: args.top]]

    hidden = torch.randn(args.batch, head.shape[1], dtype=head.dtype)
    read = torch.randn(64 * 1024 * 1024)  # 256 MB, far larger than any cache

    def rate(fn, nbytes: int, reps: int = 10) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return nbytes * reps / (time.perf_counter() - t0) / 1e9

    result = {
        "path": args.path, "decoding": label,
        "precision": precision,
        "model": args.model, "batch": args.batch, "tokens": args.tokens,
        "threads": torch.get_num_threads(), "generate_s": seconds, "rounds_s": rounds,
        "ms_per_decoding_step": seconds / args.tokens * 1e3, "top_ops": ops,
        "lm_head_shape": list(head.shape), "lm_head_dtype": str(head.dtype).replace("torch.", ""),
        "lm_head_weight_gb_per_s": rate(lambda: torch.nn.functional.linear(hidden, head),
                                        head.numel() * head.element_size()),
        "memory_read_gb_per_s": rate(read.sum, read.numel() * 4),
    }
    lines = [f"# Generation profile: {args.model}, {args.batch} sequences x {args.tokens} tokens, "
             f"{result['threads']} threads",
             "", f"{label}: {seconds:.2f} s (median of {len(rounds)}), {result['ms_per_decoding_step']:.1f} ms per "
                 "decoding step", "",
             "| op | share of self CPU time | calls | ms per decoding step |", "|---|---:|---:|---:|"]
    lines += [f"| {_short(o['op'])} | {o['share']:.1%} | {o['calls']} | {o['ms_per_decoding_step']:.2f} |" for o in ops]
    lines += ["", f"LM head {tuple(head.shape)} ({result['lm_head_dtype']}) at batch {args.batch}: "
              f"{result['lm_head_weight_gb_per_s']:.1f} GB/s of weights; plain memory read: "
              f"{result['memory_read_gb_per_s']:.1f} GB/s"]
    out = Path(args.out) if args.out else ROOT / "outputs" / "profile_generation" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\n[grpo-exp] profile.md and profile.json in {out}")
    return 0


def engine_plan(cfg, prepack: str):
    """The speed plan training would make for the engine on this machine (config/speed.resolve: compile and packing
    resolved as a run resolves them), with `--prepack` true or false naming the packing itself."""
    from omegaconf import OmegaConf

    from grpo_exp.config import speed

    node = OmegaConf.merge(cfg.speed, {"generation": "engine", "rollout_dtype": "auto"})
    plan = speed.resolve(node, cfg.train, device="cpu")
    if prepack == "auto":
        return plan
    import dataclasses

    return dataclasses.replace(plan, rollout_prepack=prepack == "true")


def _engine_round(args, cfg, model, tokenizer, prompts, pad):
    """A decoding round through the rollout engine as training builds it (the machine's native dtype, compiled
    where a C++ compiler is): (the timed round, the copy's LM head weight, a label)."""
    import torch

    from grpo_exp.training import rollout

    why = rollout.model_unsupported_reason(model)
    if why:
        raise ValueError(f"--path engine cannot decode {args.model}: {why}; use --path generate")
    if rollout.compiler_missing() is None:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # the compiled step's kernels listed by name
    plan = engine_plan(cfg, args.prepack)
    engine = rollout.RolloutEngine(model, dtype=plan.weight_dtype(), compile=plan.rollout_compile,
                                   max_new_tokens=args.tokens, temperature=1.0, top_k=0, top_p=1.0,
                                   eos_token_ids=[tokenizer.eos_token_id], pad_token_id=pad,
                                   min_new_tokens=args.tokens, prepack=plan.rollout_prepack,
                                   attention_decode=args.attention_decode)
    prompt_ids = tokenizer(prompts)["input_ids"]

    def decode() -> float:
        t0 = time.perf_counter()
        engine.generate(prompt_ids, torch.Generator().manual_seed(0))
        return time.perf_counter() - t0

    label = (f"the rollout engine ({engine.label} copy, decoding step {'compiled' if engine.compiled else 'eager'}, "
             f"Linear weights {'packed' if engine.packed else 'plain'}, attention_decode={args.attention_decode})")
    return decode, engine.head.weight.detach(), label


def _short(op: str, width: int = 90) -> str:
    """Inductor names a fused kernel after every op in it; the table keeps the start."""
    return op if len(op) <= width else op[: width - 3] + "..."
