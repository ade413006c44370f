"""The machine's floor: its GEMM peak (fp32, bf16) and memory read bandwidth, measured by the parent in a few
seconds before, between and after the variants (the best reading is the machine's; their spread says whether it
moved), and from them the least time one optimizer step of a variant could take (see the package docstring for the
formula), with the variant's mean step as a multiple of it; and the machine's one-line description bench.json
keeps."""

from __future__ import annotations

import os
import statistics
import time


def machine_limits(threads: int, size: int = 1536, reps: int = 3) -> dict:
    """The machine's GEMM peak (fp32, bf16) and memory read bandwidth with `threads` threads, in a few seconds:
    the best of a few square products and of a few sums over 256 MB (larger than any cache)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    try:
        peaks = {}
        from grpo_exp.base.cpu import resolve_precision

        # emulated bf16 (AVX2) runs near 1 GFLOP/s: a full-size product would take seconds per probe, repeated before,
        # between and after the variants; a small one says as well that bf16 is not the machine's peak
        bf16_size = size if resolve_precision("auto") == "bf16" else min(size, 256)
        for name, dtype, n in (("fp32", torch.float32, size), ("bf16", torch.bfloat16, bf16_size)):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            best = _best_time(lambda: torch.mm(a, b), reps)
            peaks[name] = 2 * n ** 3 / best / 1e9
        data = torch.ones(64 * 1024 * 1024)
        read = data.numel() * 4 / _best_time(data.sum, reps) / 1e9
    finally:
        torch.set_num_threads(saved)
    return {"gemm_gflops": {k: round(v, 1) for k, v in peaks.items()}, "read_gb_s": round(read, 2),
            "threads": threads, "seconds": round(time.perf_counter() - t_start, 2)}


# the spread of the probe's GEMM readings, (best - worst) / best, past which a bench says the machine's throughput
# moved while it ran (another load, a throttled or shared host), so its ratios are not one machine's
MOVED_SPREAD = 0.25


def probe_summary(readings: list[dict]) -> dict:
    """The floor probe's readings (before, between and after the variants) as one: the best of each figure (the
    machine's own limit; a reading below it is the machine busy elsewhere), each figure's range, and whether the
    GEMM peak moved by more than MOVED_SPREAD over the bench."""
    peaks = {dtype: [r["gemm_gflops"][dtype] for r in readings] for dtype in ("fp32", "bf16")}
    reads = [r["read_gb_s"] for r in readings]
    spread = {dtype: round((max(v) - min(v)) / max(v), 3) if max(v) > 0 else 0.0 for dtype, v in peaks.items()}
    best = {"gemm_gflops": {dtype: max(v) for dtype, v in peaks.items()}, "read_gb_s": max(reads),
            "threads": readings[0]["threads"], "seconds": round(sum(r["seconds"] for r in readings), 2)}
    return {"best": best, "readings": len(readings),
            "range": {**{f"gemm_gflops_{d}": [min(v), max(v)] for d, v in peaks.items()},
                      "read_gb_s": [min(reads), max(reads)]},
            "spread": spread, "moved": max(spread.values()) > MOVED_SPREAD}


def moved_line(summary: dict) -> str | None:
    """One line for a bench whose machine moved, else None."""
    if not summary.get("moved"):
        return None
    worst = max(summary["spread"], key=summary["spread"].get)
    low, high = summary["range"][f"gemm_gflops_{worst}"]
    return (f"the machine's throughput moved during the bench: its {worst} GEMM peak read {low:.0f}-{high:.0f} GFLOP/s "
            f"over {summary['readings']} probes ({summary['spread'][worst]:.0%} apart); x floor is against the best "
            f"reading, and the ratios may mix a busy and a quiet machine: run it again with --rounds 2 or more")


def _best_time(fn, reps: int) -> float:
    fn()  # warm-up (first-touch, oneDNN primitive creation)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def step_floor(res: dict, limits: dict) -> dict:
    """The machine's floor for one optimizer step of this variant (see the package docstring) and the variant's
    mean step time as a multiple of it."""
    model = res["model_shape"]
    n = model["matmul_params"]
    peaks = limits["gemm_gflops"]
    dtype = "bf16" if peaks["bf16"] > peaks["fp32"] else "fp32"
    peak = peaks[dtype] * 1e9
    weight_bytes = n * (2 if dtype == "bf16" else 4)
    bandwidth = limits["read_gb_s"] * 1e9
    steps = [s for s in res["steps"] if s["measured"]]
    spg = res["settings"]["steps_per_generation"] or 1
    rows = res["settings"]["generation_batch_size"]
    groups = res["settings"]["num_generations"]
    per_step = res["settings"]["per_device_train_batch_size"] * res["settings"]["gradient_accumulation_steps"]
    completion_tokens = res["completion_tokens"] / len(steps) if steps else 0.0  # a round's, spread over its steps
    prompt_tokens = model["prompt_tokens_mean"]
    train_flops = 6 * n * (completion_tokens + prompt_tokens * per_step / groups)
    decode_steps = [s["max_length"] for s in steps if s.get("max_length") is not None]
    decode = statistics.mean(decode_steps) if decode_steps else res["settings"]["max_completion_length"]
    per_decode_step = max(weight_bytes / bandwidth, 2 * n * rows / peak)
    generation_s = (2 * n * prompt_tokens * rows / groups / peak + decode * per_decode_step) / spg
    floor = train_flops / peak + generation_s
    step = res.get("step_time_s_mean")
    return {"floor_s": round(floor, 4), "train_s": round(train_flops / peak, 4), "generation_s": round(generation_s, 4),
            "decode_bound": "memory" if weight_bytes / bandwidth >= 2 * n * rows / peak else "compute",
            "dtype": dtype, "matmul_params": n, "decode_steps": round(decode, 1),
            "completion_tokens_per_step": round(completion_tokens, 1), "prompt_tokens_mean": round(prompt_tokens, 1),
            "multiple": round(step / floor, 2) if step and floor else None}


def machine_info() -> str:
    import platform

    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    f = set(line.split(":", 1)[1].split())
                    flags = ",".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in f)
                    break
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus ({flags})"
