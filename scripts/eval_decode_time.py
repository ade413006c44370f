"""`python scripts/eval_decode_time.py [--rounds 2] [--threads 2] [--limit 200] [--stage basic] [--batch 32]`: greedy
evaluation through HF `generate` against the engine path (`eval.decode=generate|engine`, evaluation/fast_decode.py)
on the default run's evaluation: the default model, the first `--limit` test problems of the stage, at the stage's
completion length and eval.batch_size.

The two paths run interleaved (generate, engine, generate, engine, ...) in one process, each through
`evaluation.generate.evaluate` as every command calls it. The engine's first round includes building its decoder
and compiling its decoding step (once per model and process; inductor's on-disk cache shortens it in later
processes): that round's compile seconds are printed apart, and the warm rounds are what later evaluations of the
model cost. Each round's completions are compared with generate's first round. Prints one line per round and a
summary; writes eval_decode_time.json into --out (default outputs/eval_decode_time/<timestamp>)."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("eval_decode_time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each path")
    parser.add_argument("--threads", default="2", help="cpu.threads (auto: the machine's cores)")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--stage", default="basic")
    parser.add_argument("--batch", type=int, default=32, help="eval.batch_size")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rounds < 1 or args.limit < 1 or args.batch < 1:
        parser.error("--rounds, --limit and --batch must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from grpo_exp.base import cpu
    from grpo_exp.config.compose import compose

    cfg = compose("train", [f"model={args.model}", f"stage={args.stage}", f"cpu.threads={args.threads}"])
    cpu.prepare_env(cfg.cpu)
    import torch

    from grpo_exp.core import models
    from grpo_exp.core.data import stage_split
    from grpo_exp.evaluation import fast_decode
    from grpo_exp.evaluation.generate import evaluate

    cpu.apply(cfg.cpu)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    examples = stage_split(cfg.stage, "test", cfg.train.seed)[:args.limit]
    max_new = int(cfg.train.max_completion_length)
    logger.info("%s, %d %s test problems, %d new tokens, batch %d, %d threads", args.model, len(examples),
                args.stage, max_new, args.batch, torch.get_num_threads())
    rounds, reference = [], None
    for r in range(args.rounds):
        for decode in ("generate", "engine"):
            t0 = time.perf_counter()
            metrics, rows = evaluate(model, tokenizer, examples, system_prompt=cfg.reward.system_prompt,
                                     max_new_tokens=max_new, batch_size=args.batch, decode=decode, desc=decode)
            wall = time.perf_counter() - t0
            completions = [row["completion"] for row in rows]
            reference = reference or completions
            decoder = fast_decode._DECODERS.get(model) if decode == "engine" else None
            compile_s = decoder.timings.pop("compile_s", 0.0) if decoder is not None else 0.0
            row = {"round": r + 1, "decode": decode, "wall_s": round(wall, 2),
                   "generation_s": round(metrics["generation_s"], 2), "compile_s": round(compile_s, 2),
                   "accuracy": metrics["accuracy"], "decoded_by": metrics["decoded_by"],
                   "differ_from_generate": sum(a != b for a, b in zip(reference, completions))}
            rounds.append(row)
            logger.info("round %d %-8s %7.1f s wall (%.1f s compiling), accuracy %.3f, %d completions differ from "
                        "generate's", r + 1, decode, wall, compile_s, metrics["accuracy"], row["differ_from_generate"])
    generate = [x["wall_s"] for x in rounds if x["decode"] == "generate"]
    engine = [x["wall_s"] - x["compile_s"] for x in rounds if x["decode"] == "engine"]
    first = next(x for x in rounds if x["decode"] == "engine")
    summary = {"generate_mean_s": statistics.mean(generate), "engine_mean_s_without_compile": statistics.mean(engine),
               "engine_compile_s": first["compile_s"], "engine_first_round_s": first["wall_s"]}
    summary["speedup_without_compile"] = summary["generate_mean_s"] / summary["engine_mean_s_without_compile"]
    summary["speedup_first_round"] = generate[0] / first["wall_s"]
    logger.info("generate %.1f s, engine %.1f s (without its one compile of %.1f s): %.2fx; the engine's first "
                "round, compile included, against generate's: %.2fx", summary["generate_mean_s"],
                summary["engine_mean_s_without_compile"], summary["engine_compile_s"],
                summary["speedup_without_compile"], summary["speedup_first_round"])
    out = Path(args.out or ROOT / "outputs" / "eval_decode_time" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_decode_time.json").write_text(json.dumps({"args": vars(args), "threads": torch.get_num_threads(),
                                                           "rounds": rounds, "summary": summary}, indent=2))
    logger.info("wrote %s", out / "eval_decode_time.json")


if __name__ == "__main__":
    main()
