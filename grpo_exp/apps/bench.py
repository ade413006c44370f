"""`grpo-bench [options]` (or `python -m grpo_exp.apps.bench`): grpo-exp's training path against plain TRL on
the same prompts and settings. The logic lives in grpo_exp.analysis.bench (parent.py runs the variants,
child.py measures one); `--child` is how the parent runs each variant in its own process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    from grpo_exp.analysis import bench
    from grpo_exp.analysis.bench.parent import BASELINES

    p = argparse.ArgumentParser(prog="grpo-bench", description=bench.__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=bench.__doc__.split("\n", 1)[1])
    p.add_argument("--model", default="smollm2_135m", help="a conf/model option (default: smollm2_135m), or a model "
                   "directory or hub id (org/name), loaded as model=custom model.id=MODEL")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps before measuring (default 1)")
    p.add_argument("--prompts-per-step", type=int, default=2, help="prompts per optimizer step (default 2)")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (default 4)")
    p.add_argument("--max-completion-length", type=int, default=64, help="max completion tokens (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch/OMP threads of every variant (default 2)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: conf/train/default.yaml's)")
    p.add_argument("--beta", type=float, default=None,
                   help="KL coefficient of every variant, baselines included (default: the stage's; basic has 0.04 "
                        "since 2026-11-27, and the docs/log.md figures before that used 0: --beta 0)")
    p.add_argument("--stage", default="basic", help="conf/stage option the prompts come from (default basic)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="Hydra override for the grpo-exp variant only (repeatable), e.g. train=fast")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME=OVR[,OVR...]",
                   help="an extra grpo-exp variant with these overrides (repeatable); env.VAR=VALUE sets an "
                        "environment variable of its process; kind=trl makes it a plain-TRL variant")
    p.add_argument("--baseline", action="append", choices=BASELINES, default=None,
                   help="plain-TRL baseline(s), repeatable: fp32 (variant 'baseline': bf16 off, TRL's gradient "
                        "checkpointing; the default) and/or trl-defaults (TRL's own defaults: bf16 on, gradient "
                        "checkpointing on); ratios are against the first")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain TRL baseline(s)")
    p.add_argument("--profile", action="store_true",
                   help="time generation, old logprobs, rewards, forward, backward, optimizer inside each step")
    p.add_argument("--fixed-length", action="store_true",
                   help="every completion runs to --max-completion-length (no EOS before it, in every variant): "
                        "the same tokens per step everywhere, so tokens/s compares speed alone")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every variant this many times, in alternating order (A B C, C B A, ...); tokens/s pools "
                        "the rounds' measured steps, and bench.md adds each round's tokens/s and ratios against the "
                        "baselines of the same round, with their median and range (default 1)")
    p.add_argument("--reward-curve-steps", type=int, default=0,
                   help="run every variant for this many steps and plot reward per step (e.g. 30)")
    p.add_argument("--out", default=None, help="output directory (default outputs/bench/<timestamp>)")
    p.add_argument("--page", default=None, metavar="docs/results/<name>.md",
                   help="after the bench, write a results page here from its bench.json (its PNGs into the folder "
                        "of the same name); grpo-report <out> --page ... writes it again")
    p.add_argument("--machine", default=None, help="the machine the bench runs on, an entry of docs/machines.md "
                                                   "(the page's header)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # bench.json records the command
    if args.machine and not args.page:
        p.error("--machine names the machine in a results page; give --page too")
    for key in ("steps", "prompts_per_step", "threads", "max_completion_length", "rounds"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.num_generations < 2 or args.reward_curve_steps < 0:
        p.error("--warmup must be >= 0, --num-generations >= 2, --reward-curve-steps >= 0")
    if "/" not in args.model and not Path(args.model).expanduser().is_dir():
        from grpo_exp.base.text import did_you_mean
        from grpo_exp.config.options import group_options

        options = group_options("model")
        if args.model not in options:  # before any variant starts (each would fail alike, after seconds)
            p.error(f"--model {args.model} is not a conf/model option{did_you_mean(args.model, options)}, a model "
                    f"directory or a hub id (org/name); options: {', '.join(options)}")
    return args



def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        from grpo_exp.analysis.bench.child import child_main

        return child_main(Path(args.child))
    from grpo_exp.analysis.bench.parent import run

    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
