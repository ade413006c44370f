"""`grpo-profile [--path engine|generate] [--model M] [--batch B] [--tokens T] [--threads N] [--repeats R]` (or
`python -m grpo_exp.apps.profile`): where decoding time goes. The logic lives in grpo_exp.analysis.profile."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo-profile", description="Where decoding time goes: generate as GRPO samples "
                                "it, the top torch ops, and the LM head's weight-read bandwidth.")
    p.add_argument("--path", default="generate", choices=["generate", "engine"],
                   help="what decodes: transformers' generate (TRL's path; the default) or grpo-exp's rollout "
                        "engine (speed.generation=engine: native-dtype copy, static cache, compiled step where a "
                        "compiler is)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="--path generate: fp32, or under bf16 autocast as TRL runs it with bf16 training; auto "
                        "(the default) picks as train.precision=auto does (bf16 where the CPU has it natively). "
                        "The engine always decodes in the machine's native dtype")
    p.add_argument("--prepack", default="auto", choices=["auto", "true", "false"],
                   help="--path engine: the copy's Linear products through grpo-exp's op (speed.exact_shortcuts; "
                        "auto: a bf16 copy where the CPU computes bf16 natively, an fp32 copy where torch's kernels "
                        "are AVX2's; false: the plain Linear layers)")
    p.add_argument("--attention-decode", default="cache_axis", choices=["cache_axis", "last_axis"],
                   help="--path engine: how the copy's grouped attention lays out a decoding step's scores "
                        "(speed.attention_decode; default cache_axis)")
    p.add_argument("--model", default="smollm2_135m", help="a conf/model option (default: smollm2_135m), or a model "
                   "directory or hub id (org/name), loaded as model=custom model.id=MODEL")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per sequence, forced (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--top", type=int, default=12, help="ops listed (default 12)")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds after the warm-up; the median is reported "
                                                          "(default 1)")
    p.add_argument("--out", default=None, help="output directory")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.batch, args.tokens, args.threads, args.top, args.repeats) < 1:
        p.error("--batch, --tokens, --threads, --top and --repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from grpo_exp.analysis.profile import run

    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
