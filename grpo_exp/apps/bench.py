"""`grpo-bench [options]` (or `python -m grpo_exp.apps.bench`): grpo-exp's training path against plain TRL on
the same prompts and settings. The logic lives in grpo_exp.analysis.bench (parent.py runs the variants,
child.py measures one, matrix.py runs `--matrix`'s points); `--child` is how the parent runs each variant in its
own process. Every bad option is one line on stderr and exit code 2, before anything runs."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# the single-shape options --matrix sets per point itself, with their defaults outside it
SHAPE_DEFAULTS = {"model": "smollm2_135m", "max_completion_length": 64, "num_generations": 4}
# a hub id as the hub spells one: owner/name
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit code 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def model_problem(model: str) -> str | None:
    """Why `model` cannot be benchmarked, in a line, or None: it must be a conf/model option, a model directory
    or a hub id (owner/name; whether the hub has it is checked when it loads)."""
    if Path(model).expanduser().is_dir() or HUB_ID.match(model):
        return None
    from grpo_exp.base.text import did_you_mean
    from grpo_exp.config.options import group_options

    options = group_options("model")
    if model in options:
        return None
    return (f"{model} is not a conf/model option{did_you_mean(model, options)}, a model directory or a hub id "
            f"(owner/name); options: {', '.join(options)}")


def _int_list(least: int, why: str = ""):
    """An argparse type: comma-separated integers, each >= `least`, duplicates dropped."""

    def parse(text: str) -> list[int]:
        values = []
        for item in text.split(","):
            item = item.strip()
            try:
                value = int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not an integer") from None
            if value < least:
                raise argparse.ArgumentTypeError(f"{value} in {text!r} is under {least}{why}")
            values.append(value)
        return list(dict.fromkeys(values))

    return parse


def _model_list(text: str) -> list[str]:
    models = [m.strip() for m in text.split(",")]
    if not all(models):
        raise argparse.ArgumentTypeError(f"an empty model name in {text!r}")
    return list(dict.fromkeys(models))


def parse_args(argv=None) -> argparse.Namespace:
    from grpo_exp.analysis import bench
    from grpo_exp.analysis.bench.parent import BASELINES

    p = OneLineParser(prog="grpo-bench", description=bench.__doc__.split("\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=bench.__doc__.split("\n", 1)[1])
    p.add_argument("--model", default=None, help="a conf/model option (default: smollm2_135m), or a model "
                   "directory or hub id (org/name), loaded as model=custom model.id=MODEL")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps before measuring (default 1)")
    p.add_argument("--prompts-per-step", type=int, default=2, help="prompts per optimizer step (default 2)")
    p.add_argument("--num-generations", type=int, default=None, help="completions per prompt (default 4)")
    p.add_argument("--max-completion-length", type=int, default=None, help="max completion tokens (default 64)")
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
    p.add_argument("--matrix", action="store_true",
                   help="the bench over every point of --models x --lengths x --groups, each point one bench of "
                        "grpo-exp against plain TRL fp32 and TRL's bf16 defaults (left out, with a line, on a CPU "
                        "without native bf16), at the stage's beta; points already measured in --out (default "
                        "outputs/bench/matrix) are kept, so rerunning a stopped matrix continues it; writes "
                        "matrix.json, matrix.csv, matrix.md and matrix.png (docs/performance.md, \"The scale matrix\")")
    p.add_argument("--models", type=_model_list, default=None, metavar="M1,M2",
                   help="--matrix: the models, each as --model takes it (default smollm2_135m,gemma3_270m)")
    p.add_argument("--lengths", type=_int_list(1), default=None, metavar="L1,L2",
                   help="--matrix: the max completion lengths (default 64,256)")
    p.add_argument("--groups", type=_int_list(2, ": GRPO needs 2 or more completions per prompt"),
                   default=None, metavar="G1,G2", help="--matrix: the group sizes, completions per prompt (default 4,16)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="--matrix: run every point, even one whose estimated peak memory is over the available memory")
    p.add_argument("--skip-over-memory", action="store_true",
                   help="--matrix: leave out every point whose estimated peak memory is over the available memory "
                        "(listed as left out, with its estimate, in matrix.json and on the page) instead of refusing")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # bench.json records the command
    if args.matrix:
        _check_matrix(p, args)
    elif args.models or args.lengths or args.groups or args.no_memory_check or args.skip_over_memory:
        p.error("--models, --lengths, --groups, --no-memory-check and --skip-over-memory belong to --matrix; give "
                "--matrix too, or "
                "--model, --max-completion-length and --num-generations for one shape")
    else:
        for key, default in SHAPE_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
    if args.machine and not args.page:
        p.error("--machine names the machine in a results page; give --page too")
    for key in ("steps", "prompts_per_step", "threads", "rounds", *(() if args.matrix else ("max_completion_length",))):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or (not args.matrix and args.num_generations < 2) or args.reward_curve_steps < 0:
        p.error("--warmup must be >= 0, --num-generations >= 2, --reward-curve-steps >= 0")
    problem = None if args.matrix else model_problem(args.model)
    if problem:  # before any variant starts (each would fail alike, after seconds)
        p.error(f"--model {problem}")
    return args


def _check_matrix(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--matrix's options: it sets each point's model, length, group and baselines itself; each model must be one
    --model takes. The memory check and the points measured already come later (matrix.plan), still before any
    model loads."""
    from grpo_exp.analysis.bench.matrix import DEFAULT_GROUPS, DEFAULT_LENGTHS, DEFAULT_MODELS

    single = {"--model": args.model, "--max-completion-length": args.max_completion_length,
              "--num-generations": args.num_generations, "--baseline": args.baseline,
              "--no-baseline": args.no_baseline, "--candidate": args.candidate,
              "--reward-curve-steps": args.reward_curve_steps, "--child": args.child}
    given = [flag for flag, value in single.items() if value]
    if given:
        p.error(f"--matrix sets each point's model, length, group and baselines itself; leave out {', '.join(given)} "
                f"(--models, --lengths and --groups give the points)")
    args.models = args.models or list(DEFAULT_MODELS)
    args.lengths = args.lengths or list(DEFAULT_LENGTHS)
    args.groups = args.groups or list(DEFAULT_GROUPS)
    for model in args.models:
        problem = model_problem(model)
        if problem:
            p.error(f"--models: {problem}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        from grpo_exp.analysis.bench.child import child_main

        return child_main(Path(args.child))
    if args.matrix:
        from grpo_exp.analysis.bench.matrix import MatrixError, run_matrix

        try:
            return run_matrix(args)
        except MatrixError as err:  # a point too large, a model without a config, an out dir of other settings
            print(f"grpo-bench: error: {err}", file=sys.stderr)
            return 2
    from grpo_exp.analysis.bench.parent import run

    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
