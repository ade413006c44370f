"""`python scripts/logprob_head_time.py [--device cuda] [--tokens N]`: the LM head's per-token log-probs and
entropies, forward and backward under bf16 autocast (or in fp32, as training runs without native bf16:
`--precision fp32`), with TRL's kernel and with the autocast head (`speed.logprob_kernel`), at the default model's
shapes (2048 tokens, hidden 576, vocabulary 49152). Prints each kernel's medians (forward, backward, both) over
timed repeats, two rounds in alternation. This is what `speed.logprob_kernel=auto` was decided on for CUDA. On a
CPU it runs under grpo-exp's memory policy (`cpu.malloc` auto, as training does: without it each fresh 50 MB block
faults its pages in) and times the head alone; grpo-bench times whole steps."""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from grpo_exp.base import cpu
from grpo_exp.kernels import logprob_head

logger = logging.getLogger("logprob_head_time")


def _now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def time_kernel(kernel: str, hidden, weight, targets, device: str, repeats: int, warmup: int,
                autocast: bool = True) -> tuple[float, float, float]:
    """Median milliseconds of the forward, the backward, and both, through `kernel`."""
    times = []
    for _ in range(warmup + repeats):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        start = _now(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logps, entropy = logprob_head.logprobs(h, w, None, targets, 0.7, True, kernel)
        middle = _now(device)
        logps.sum().backward()  # the entropy is computed for logging, as in training: no gradient
        end = _now(device)
        times.append(((middle - start) * 1e3, (end - middle) * 1e3, (end - start) * 1e3))
    kept = times[warmup:]
    return tuple(statistics.median(t[i] for t in kept) for i in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                        help="bf16: under bf16 autocast, as bf16 training runs (the default); fp32: no autocast")
    args = parser.parse_args()
    if args.tokens < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error(f"--tokens {args.tokens}, --repeats {args.repeats}, --warmup {args.warmup}: "
                     "tokens and repeats must be at least 1, warmup at least 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cpu":
        logger.info("cpu.malloc: %s", cpu.apply_malloc("auto"))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, 576, generator=gen).to(args.device)
    weight = (torch.randn(49152, 576, generator=gen) * 0.05).to(args.device)
    targets = torch.randint(0, 49152, (args.tokens,), generator=gen).to(args.device)
    for kernel in ("trl", "autocast", "trl", "autocast"):
        forward, backward, both = time_kernel(kernel, hidden, weight, targets, args.device, args.repeats, args.warmup,
                                              autocast=args.precision == "bf16")
        logger.info("%s on %s, %s, %d tokens: median %.2f ms (forward %.2f, backward %.2f) over %d (%d warm-up)",
                    kernel, args.device, args.precision, args.tokens, both, forward, backward, args.repeats,
                    args.warmup)


if __name__ == "__main__":
    main()
