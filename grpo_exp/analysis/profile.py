"""Where decoding time goes: time `generate` as GRPO samples (temperature 1, no top-k/top-p) and list
the top torch ops, plus the LM head's achieved weight bandwidth against a plain memory read.

    grpo-profile                          # default model, 8 sequences x 64 tokens, 2 threads
    grpo-profile --batch 32 --threads 1
    grpo-profile --model tiny_random --tokens 4 --out /tmp/prof

Writes profile.md and profile.json into --out (default outputs/profile_generation/<timestamp>/).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args) -> int:
    """Profile decoding as `args` (see apps/profile.py) asks; returns the exit code."""
    from grpo_exp.base import cpu
    from grpo_exp.config.compose import check_group_choices, compose
    from grpo_exp.base.errors import ConfigError

    try:
        check_group_choices([f"model={args.model}"], False)
        cfg = compose("train", [f"model={args.model}", f"cpu.threads={args.threads}"])
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
    examples = data.build_examples("basic", "test", num_train=0, num_test=args.batch, seed=0)
    prompts = [tokenizer.apply_chat_template(data.to_messages(ex["question"], cfg.reward.system_prompt),
                                             tokenize=False, add_generation_prompt=True) for ex in examples]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate() -> float:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=True,
                           temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
        return time.perf_counter() - t0

    generate()  # warm-up
    seconds = generate()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    ops = [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count,
            "ms_per_decoding_step": e.self_cpu_time_total / 1e3 / args.tokens} for e in events[: args.top]]

    head = model.get_output_embeddings().weight.detach()
    hidden = torch.randn(args.batch, head.shape[1])
    read = torch.randn(64 * 1024 * 1024)  # 256 MB, far larger than any cache

    def rate(fn, nbytes: int, reps: int = 10) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return nbytes * reps / (time.perf_counter() - t0) / 1e9

    result = {
        "model": args.model, "batch": args.batch, "tokens": args.tokens, "threads": torch.get_num_threads(),
        "generate_s": seconds, "ms_per_decoding_step": seconds / args.tokens * 1e3, "top_ops": ops,
        "lm_head_shape": list(head.shape),
        "lm_head_weight_gb_per_s": rate(lambda: torch.nn.functional.linear(hidden, head), head.numel() * 4),
        "memory_read_gb_per_s": rate(read.sum, read.numel() * 4),
    }
    lines = [f"# Generation profile: {args.model}, {args.batch} sequences x {args.tokens} tokens, "
             f"{result['threads']} threads",
             "", f"`generate`: {seconds:.2f} s, {result['ms_per_decoding_step']:.1f} ms per decoding step", "",
             "| op | share of self CPU time | calls | ms per decoding step |", "|---|---:|---:|---:|"]
    lines += [f"| {o['op']} | {o['share']:.1%} | {o['calls']} | {o['ms_per_decoding_step']:.2f} |" for o in ops]
    lines += ["", f"LM head {tuple(head.shape)} at batch {args.batch}: {result['lm_head_weight_gb_per_s']:.1f} GB/s "
              f"of weights; plain memory read: {result['memory_read_gb_per_s']:.1f} GB/s"]
    out = Path(args.out) if args.out else ROOT / "outputs" / "profile_generation" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\n[grpo-exp] profile.md and profile.json in {out}")
    return 0
