"""`python scripts/rollout_mismatch.py [--copies autocast,bf16] [--rounds 3] [--out DIR]`: how far the rollout
engine's sampling log-probs are from the trained policy's, for each kind of rollout copy (`speed.rollout_dtype`),
next to how far the policy's own log-probs move with the batch they are scored in.

Each round samples 4 completions for each of 4 basic training problems (the default model, temperature 0.8, up to 64
tokens) through the engine (eager decoding step), then scores them with the policy as training does (bf16 autocast
where training runs in bf16, else fp32; grouped attention): once as one left-padded batch and once a row at a time.
Per completion token, with d = log pi_policy - log pi_sampler: mean |d| and the mean k3 estimate of KL(sampler ||
policy), exp(d) - 1 - d, the figure training logs as rollout/kl. The same two figures between the batched and the
row-by-row scoring are the noise floor: what the policy's log-probs change by between batch shapes (the scoring
forward and the training forward see different ones). This is the measurement behind the autocast copy
(`speed.rollout_dtype=autocast`) and `speed.old_logps=auto` taking its log-probs (docs/log.md, "2026-11-28 — kernel
rounding under bf16 autocast"). Writes mismatch.md and mismatch.json into --out (default
outputs/rollout_mismatch/<timestamp>)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("rollout_mismatch")


def scored(model, pad: int, rows: list[list[int]], completions: list[list[int]], temperature: float, bf16: bool,
           one_row: bool):
    """The policy's tempered log-probs of each completion, left-padded batch (or one row at a time)."""
    import torch

    groups = [[i] for i in range(len(rows))] if one_row else [list(range(len(rows)))]
    out = [None] * len(rows)
    for group in groups:
        width = max(len(rows[i]) for i in group)
        length = max(len(completions[i]) for i in group)
        ids = torch.full((len(group), width + length), pad)
        mask = torch.zeros_like(ids)
        for j, i in enumerate(group):
            prompt, completion = rows[i], completions[i]
            ids[j, width - len(prompt):width] = torch.tensor(prompt)
            ids[j, width:width + len(completion)] = torch.tensor(completion)
            mask[j, width - len(prompt):width + len(completion)] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logps = torch.log_softmax(logits[:, width - 1:-1].float() / temperature, -1)
        for j, i in enumerate(group):
            target = torch.tensor(completions[i])[:, None]
            out[i] = logps[j, :len(completions[i])].gather(1, target).squeeze(1)
    return out


def gap(a, b) -> dict:
    """mean |a - b| and mean k3 = exp(d) - 1 - d over every token, d = a - b."""
    import torch

    d = torch.cat([x - y for x, y in zip(a, b)])
    return {"mean_abs": float(d.abs().mean()), "k3": float((d.exp() - 1 - d).mean()), "tokens": d.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", default="autocast,bf16", help="speed.rollout_dtype kinds, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from grpo_exp.base import cpu
    from grpo_exp.config.compose import compose

    cfg = compose("train", [f"model={args.model}", "cpu.threads=2"])
    copies = args.copies.split(",")
    bad = [c for c in copies if c not in ("autocast", "bf16", "fp32")]
    if bad or args.rounds < 1:
        parser.error(f"--copies takes autocast, bf16, fp32 (got {bad}); --rounds must be >= 1")
    cpu.prepare_env(cfg.cpu)
    import torch

    from grpo_exp.core import data, models
    from grpo_exp.kernels import attention
    from grpo_exp.training import rollout

    cpu.apply(cfg.cpu)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    attention.use(model, "grouped")
    model.eval()
    bf16 = cpu.resolve_precision("auto") == "bf16"
    examples = data.build_examples("basic", "train", size=4, seed=3)
    prompts = [tokenizer.apply_chat_template(data.to_messages(e["question"], cfg.reward.system_prompt),
                                             tokenize=False, add_generation_prompt=True) for e in examples]
    rows = [ids for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"] for _ in range(4)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    temperature = 0.8
    result = {"policy_precision": "bf16 autocast" if bf16 else "fp32", "rounds": args.rounds, "copies": {}}
    for kind in copies:
        engine = rollout.RolloutEngine(model, dtype=torch.float32 if kind == "fp32" else torch.bfloat16,
                                       autocast=kind == "autocast", compile=False, max_new_tokens=64,
                                       temperature=temperature, eos_token_ids=[tokenizer.eos_token_id],
                                       pad_token_id=pad)
        sampler_gap, floor_gap = [], []
        for r in range(args.rounds):
            completions, logps = engine.generate(rows, torch.Generator().manual_seed(r))
            batched = scored(model, pad, rows, completions, temperature, bf16, one_row=False)
            alone = scored(model, pad, rows, completions, temperature, bf16, one_row=True)
            sampler_gap.append(gap(batched, [torch.tensor(x) for x in logps]))
            floor_gap.append(gap(batched, alone))
            logger.info("%s round %d: sampler vs policy %s; policy batched vs one row %s", kind, r,
                        sampler_gap[-1], floor_gap[-1])
        result["copies"][kind] = {"sampler_vs_policy": sampler_gap, "policy_batched_vs_one_row": floor_gap}
        del engine

    def mean(rounds, key):
        return sum(x[key] for x in rounds) / len(rounds)

    lines = [f"# Rollout copies against the policy ({args.model}, policy scored in {result['policy_precision']}, "
             f"{args.rounds} rounds of 16 completions)", "",
             "| copy | tokens | sampler vs policy: mean abs d | k3 (rollout/kl) | policy batched vs one row: "
             "mean abs d | k3 |", "|---|---:|---:|---:|---:|---:|"]
    for kind, runs in result["copies"].items():
        s, f = runs["sampler_vs_policy"], runs["policy_batched_vs_one_row"]
        lines.append(f"| {kind} | {sum(x['tokens'] for x in s)} | {mean(s, 'mean_abs'):.4f} | {mean(s, 'k3'):.2e} "
                     f"| {mean(f, 'mean_abs'):.4f} | {mean(f, 'k3'):.2e} |")
    out = Path(args.out) if args.out else ROOT / "outputs" / "rollout_mismatch" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "mismatch.json").write_text(json.dumps(result, indent=2))
    (out / "mismatch.md").write_text("\n".join(lines) + "\n")
    logger.info("\n".join(lines))
    logger.info("written to %s", out)


if __name__ == "__main__":
    main()
