"""`python -m grpo_exp.apps.sources [train|evaluate] <overrides>`: every value of the config the command composes
with where it came from (a conf/ file, the schema's default, or the command line); grpo_exp/config/sources.py.

Bad input (an unknown option or key) is one line on stderr and exit 2, as for the training command."""

from __future__ import annotations

import sys

from grpo_exp.base.errors import ConfigError

DESCRIPTION = ("Print every value of the config that grpo_exp.train (or grpo_exp.evaluate) composes from these "
               "overrides, with where it came from: the conf/ file that set it last, the schema's default, or the "
               "command line.")
USAGE = "usage: python -m grpo_exp.apps.sources [train|evaluate] [key=value ...] (the command's own overrides)"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{DESCRIPTION}")
        return
    config_name = args.pop(0) if args and args[0] in ("train", "evaluate") else "train"
    from grpo_exp.config.compose import check_overrides
    from grpo_exp.config.sources import format_sources, value_sources

    try:
        check_overrides(config_name, args)  # one line for an unknown option, key or value
        rows = value_sources(config_name, [a for a in args if not a.startswith("hydra")])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_sources(rows))


if __name__ == "__main__":
    main()
