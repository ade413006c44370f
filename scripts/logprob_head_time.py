"""`python scripts/logprob_head_time.py [--device cuda]`: the LM head's per-token log-probs, forward and backward
under bf16 autocast, with TRL's kernel and with the autocast head (`train.logprob_kernel`), at the default model's
shapes (2048 tokens, hidden 576, vocabulary 49152). Prints each kernel's median over timed repeats, two rounds in
alternation. This is what `train.logprob_kernel=auto` was decided on for CUDA; on a CPU use grpo-bench, which
times whole steps."""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from grpo_exp.core import logprob_head

logger = logging.getLogger("logprob_head_time")


def time_kernel(kernel: str, hidden, weight, targets, device: str, repeats: int, warmup: int) -> float:
    """Median milliseconds of one forward and backward through `kernel`."""
    times = []
    for _ in range(warmup + repeats):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            logps, entropy = logprob_head.logprobs(h, w, None, targets, 0.7, True, kernel)
        logps.sum().backward()  # the entropy is computed for logging, as in training: no gradient
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, 576, generator=gen).to(args.device)
    weight = (torch.randn(49152, 576, generator=gen) * 0.05).to(args.device)
    targets = torch.randint(0, 49152, (args.tokens,), generator=gen).to(args.device)
    for kernel in ("trl", "autocast", "trl", "autocast"):
        ms = time_kernel(kernel, hidden, weight, targets, args.device, args.repeats, args.warmup)
        logger.info("%s on %s: median %.2f ms over %d (%d warm-up)", kernel, args.device, ms, args.repeats, args.warmup)


if __name__ == "__main__":
    main()
