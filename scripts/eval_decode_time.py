"""`python scripts/eval_decode_time.py [--rounds 2] [--threads 2] [--limit 200] [--stage basic] [--batch 32]
[--engine-cache-mb 1536] [--init-from RUN] [--profile]`: greedy evaluation through HF `generate` against the engine
path (`eval.decode=generate|engine`, evaluation/fast_decode.py) on the default run's evaluation: the default model,
the first `--limit` test problems of the stage, at the stage's completion length, `generate` in batches of
eval.batch_size and the engine in batches of as many rows as eval.engine_cache_mb holds (their defaults).

The two paths run interleaved (generate, engine, generate, engine, ...) in one process, each through
`evaluation.generate.evaluate` as every command calls it. The engine's first round includes building its decoder
and compiling its decoding step (once per model and process; inductor's on-disk cache shortens it in later
processes): that round's compile seconds are printed apart, and the warm rounds are what later evaluations of the
model cost. Each round's completions are compared with generate's first round. Prints one line per round and a
summary; writes eval_decode_time.json into --out (default outputs/eval_decode_time/<timestamp>).

The engine's rounds are also set against the machine's floor, as grpo-bench sets a training step against it: the
GEMM peak (fp32: the path decodes fp32 weights) and memory bandwidth measured before and after the rounds (best
reading), and the work the decoder counted (prompt tokens prefilled, decoding steps and the rows each step held).
Floor = the products of the weights that multiply a token (grpo-bench's count) at the GEMM peak (the body on every
prompt token and every row of every decoding step, the LM head on each decoded row and each prompt's last), or one
read of those weights per decoding step at the memory bandwidth, whichever is longer; attention and the rest are left
out, so it is a lower bound. Each engine round prints its prefill and decoding seconds and its wall time as x floor."""

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
    parser.add_argument("--batch", type=int, default=None, help="eval.batch_size, generate's (default: its default)")
    parser.add_argument("--engine-cache-mb", type=float, default=None, help="eval.engine_cache_mb, the engine "
                        "path's KV cache per batch (default: its default)")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--init-from", default=None, help="a run directory (or its model/) whose weights to score "
                        "instead of the base model's, e.g. a trained run's, whose answers are shorter")
    parser.add_argument("--profile", action="store_true", help="one more engine round under torch.profiler: its "
                        "ops by self CPU time, printed and written as profile.txt")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rounds < 1 or args.limit < 1 or (args.batch or 1) < 1 or (args.engine_cache_mb or 1) <= 0:
        parser.error("--rounds, --limit and --batch must be >= 1, --engine-cache-mb > 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from grpo_exp.base import cpu
    from grpo_exp.config.compose import compose

    cfg = compose("train", [f"model={args.model}", f"stage={args.stage}", f"cpu.threads={args.threads}"])
    args.batch = args.batch or int(cfg.eval.batch_size)
    args.engine_cache_mb = args.engine_cache_mb or float(cfg.eval.engine_cache_mb)
    cpu.prepare_env(cfg.cpu)
    import torch

    from grpo_exp.core import models
    from grpo_exp.core.data import stage_split
    from grpo_exp.evaluation import fast_decode
    from grpo_exp.evaluation.generate import evaluate

    cpu.apply(cfg.cpu)
    from grpo_exp.evaluation.run import resolve_checkpoint

    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0, init_from=resolve_checkpoint(args.init_from))
    examples = stage_split(cfg.stage, "test", cfg.train.seed)[:args.limit]
    max_new = int(cfg.train.max_completion_length)
    logger.info("%s, %d %s test problems, %d new tokens, batch %d (generate), a %g MiB KV cache (engine), %d threads",
                args.model, len(examples), args.stage, max_new, args.batch, args.engine_cache_mb,
                torch.get_num_threads())
    from grpo_exp.analysis.bench.floor import machine_limits, probe_summary

    probes = [machine_limits(torch.get_num_threads())]
    rounds, reference = [], None
    for r in range(args.rounds):
        for decode in ("generate", "engine"):
            t0 = time.perf_counter()
            metrics, rows = evaluate(model, tokenizer, examples, system_prompt=cfg.reward.system_prompt,
                                     max_new_tokens=max_new, batch_size=args.batch, decode=decode, desc=decode,
                                     engine_cache_mb=args.engine_cache_mb)
            wall = time.perf_counter() - t0
            completions = [row["completion"] for row in rows]
            reference = reference or completions
            decoder = fast_decode._DECODERS.get(model) if decode == "engine" else None
            compile_s = decoder.timings.pop("compile_s", 0.0) if decoder is not None else 0.0
            work = {k: decoder.timings.get(k) for k in WORK} if decoder is not None else {}
            row = {"round": r + 1, "decode": decode, "wall_s": round(wall, 2),
                   "generation_s": round(metrics["generation_s"], 2), "compile_s": round(compile_s, 2),
                   "accuracy": metrics["accuracy"], "decoded_by": metrics["decoded_by"],
                   "peak_rss_mb": metrics["peak_rss_mb"],
                   "differ_from_generate": sum(a != b for a, b in zip(reference, completions)), **work}
            rounds.append(row)
            logger.info("round %d %-8s %7.1f s wall (%.1f s compiling), accuracy %.3f, %d completions differ from "
                        "generate's", r + 1, decode, wall, compile_s, metrics["accuracy"], row["differ_from_generate"])
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile as profiler

        with profiler(activities=[ProfilerActivity.CPU]) as prof:
            evaluate(model, tokenizer, examples, system_prompt=cfg.reward.system_prompt, max_new_tokens=max_new,
                     batch_size=args.batch, decode="engine", desc="profiled", engine_cache_mb=args.engine_cache_mb)
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        logger.info("the engine's round under torch.profiler, by self CPU time:\n%s", profile)
    probes.append(machine_limits(torch.get_num_threads()))
    machine = probe_summary(probes)
    linear = linear_parameters(model)
    for row in rounds:
        if row["decode"] == "engine":
            row.update(floor(row, linear, len(examples), machine["best"]))
            logger.info("round %d engine: prefill %.1f s (%d tokens), decoding %.1f s (%d steps, %d row-steps), "
                        "floor %.1f s (compute %.1f, memory %.1f): %.1fx the floor without compiling", row["round"],
                        row["prefill_s"], row["prefill_tokens"], row["decode_s"] - row["compile_s"],
                        row["decode_steps"], row["row_steps"], row["floor_s"], row["floor_compute_s"],
                        row["floor_memory_s"], row["x_floor"])
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
                                                           "machine": machine, "linear_parameters": linear,
                                                           "rounds": rounds, "summary": summary}, indent=2))
    if profile is not None:
        (out / "profile.txt").write_text(profile + "\n")
    logger.info("wrote %s", out / "eval_decode_time.json")


WORK = ("prefill_s", "decode_s", "prefill_tokens", "decode_steps", "row_steps")  # GreedyDecoder's counts of a call


def linear_parameters(model) -> dict:
    """The weights the decoder multiplies a token by (`all`: grpo-bench's count, the LM head's included) and the LM
    head's alone (`head`: the prefill applies it to each prompt's last position only)."""
    from grpo_exp.analysis.bench.child import matmul_parameters

    return {"all": matmul_parameters(model)[1], "head": model.get_output_embeddings().weight.numel()}


def floor(row: dict, linear: dict, prompts: int, best: dict) -> dict:
    """An engine round's least time at the machine's best probe (fp32 weights): its products at the GEMM peak (the
    body on every prefilled token and decoded row, the head on each decoded row and each prompt's last position),
    or one read of the weights per decoding step, whichever is longer."""
    body = linear["all"] - linear["head"]
    flops = 2 * (body * (row["prefill_tokens"] + row["row_steps"]) + linear["head"] * (row["row_steps"] + prompts))
    compute = flops / (best["gemm_gflops"]["fp32"] * 1e9)
    memory = row["decode_steps"] * linear["all"] * 4 / (best["read_gb_s"] * 1e9)
    least = max(compute, memory)
    return {"floor_compute_s": round(compute, 2), "floor_memory_s": round(memory, 2), "floor_s": round(least, 2),
            "x_floor": round((row["wall_s"] - row["compile_s"]) / least, 2)}


if __name__ == "__main__":
    main()
