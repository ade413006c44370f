"""`python -m grpo_exp.data stage=<stage> split=<train|validation|test> [limit=N] [train.seed=S] out=<file.jsonl>`
(console script `grpo-data`): one split of a stage's problems, one JSON object a line, with `question`,
`answer`, `key` (the canonical computation), `level` and `template` (a prompts stage: its rows as the file has them,
`prompt` and the other columns), so a user can look at the data a run trains and is scored on. Other `key=value` arguments are config overrides (`stage.num_test=500`,
`stage.path=...`). Bad input is one line and exit 2, before anything is written.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from grpo_exp.base import log
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import write_jsonl

logger = log.get_logger(__name__)
EXIT_BAD_INPUT = 2
FIELDS = ("question", "answer", "key", "level", "template")
DESCRIPTION = ("Write one split of a stage's problems to a JSONL file, one object a line with question, answer, "
               "key (the canonical computation), level and template: the data a run trains and is scored on. Other "
               "key=value arguments are config overrides (stage.num_test=500, stage.path=...).")
USAGE = ("usage: python -m grpo_exp.data stage=<stage> split=<train|validation|test> [limit=N] "
         "[train.seed=S] out=<file.jsonl>")


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(this tool's own arguments, the config overrides)."""
    own, overrides = {}, []
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            raise ConfigError(f"'{arg}' is not of the form key=value; {USAGE}")
        key, value = arg.split("=", 1)
        if key in ("split", "limit", "out"):
            own[key] = value
        else:
            overrides.append(arg)
    for key in ("split", "out"):
        if key not in own:
            raise ConfigError(f"{key}= is missing; {USAGE}")
    return own, overrides


def problems(own: dict[str, str], overrides: list[str]) -> list[dict]:
    from grpo_exp.config.checks import validate
    from grpo_exp.config.compose import check_group_choices, compose
    from grpo_exp.core import data

    if own["split"] not in data.SPLITS:
        raise ConfigError(f"unknown split '{own['split']}'; valid splits: {', '.join(data.SPLITS)}")
    limit = own.get("limit")
    if limit is not None and not (limit.isdigit() and int(limit) >= 1):
        raise ConfigError(f"limit={limit} must be a positive integer")
    check_group_choices(overrides, multirun=False)  # stage=foo names the valid stages
    cfg = compose("train", overrides)
    validate(cfg)
    rows = data.stage_split(cfg.stage, own["split"], cfg.train.seed)
    return rows[: int(limit)] if limit else rows


def record(row: dict) -> dict:
    """A problem as a line of the output: a prompts stage's row as its file has it, else the FIELDS."""
    if "columns" in row:
        return {"prompt": row["prompt"], **row["columns"]}
    return {k: row.get(k, row["question"] if k == "key" else None) for k in FIELDS}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{textwrap.fill(DESCRIPTION, 100)}")
        return 0
    log.set_level("INFO")
    try:
        own, overrides = parse(argv)
        rows = problems(own, overrides)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(own["out"])
    write_jsonl(out, (record(row) for row in rows))
    distinct = len({row.get("key") or row["question"] for row in rows})
    logger.info("%d problems (%d distinct computations) written to %s", len(rows), distinct, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
