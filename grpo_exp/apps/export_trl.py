"""`grpo-export-trl <run> --out <file.yaml>` (or `python -m grpo_exp.export_trl`): the GRPOConfig a training run
trained with, as a YAML file that `trl grpo --config <file.yaml>` reads back with the same values (an SFT run's
SFTConfig, for `trl sft`), with the model and dataset keys TRL's script expects and comments on what TRL cannot
express. The logic lives in
grpo_exp.training.trl_export."""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="grpo-export-trl", description=(
        "Write the GRPOConfig a training run trained with as a YAML file that `trl grpo --config <file>` reads "
        "back with the same values, with the model and dataset keys TRL's script expects and comments on what "
        "TRL cannot express."))
    parser.add_argument("run", help="a training run's directory (outputs/train/runs/<run>), or its model/")
    parser.add_argument("--out", required=True, help="the YAML file to write (e.g. grpo.yaml)")
    parser.add_argument("--output-dir", help="GRPOConfig.output_dir for TRL's run (default: <run name>-trl)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from grpo_exp.base.errors import ConfigError

    try:
        from grpo_exp.training.trl_export import load_run

        load_run(args.run)  # a folder that is not a run fails here, before torch and TRL load
        from grpo_exp.training.trl_export import write

        export = write(args.run, args.out, args.output_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    trainer, command = ("SFTConfig", "sft") if export.method == "sft" else ("GRPOConfig", "grpo")
    print(f"{args.out}: {trainer} of {export.run_dir} ({len(export.grpo)} keys); train it with "
          f"trl {command} --config {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
