"""stage=prompts end to end on the tiny random model: a JSONL file with `prompt`, `solution` and `task` columns trains
with rewards named by import path (this module's), the columns reach them, a reward's None rows and logged column
land in the run's files, and the held-out accuracy is the eval reward's verdict."""

from __future__ import annotations

import json

from grpo_exp.base.io import read_jsonl
from grpo_exp.core.data import build_examples
from grpo_exp.core.rewards import completion_text, extract_answer, parse_number
from grpo_exp.training.stage import train
from tests.conftest import compose_cfg

HERE = "tests.apps.test_prompts_run"


def solved(completions, solution, log_extra=None, log_metric=None, **kwargs):
    """1.0 where the completion's number is the solution; logs the parsed number and the share that parsed."""
    parsed = [extract_answer(completion_text(c)) for c in completions]
    if log_extra is not None:
        log_extra("parsed", parsed)
    if log_metric is not None:
        log_metric("parsed_share", sum(p is not None for p in parsed) / len(parsed))
    return [1.0 if p is not None and p == parse_number(s) else 0.0 for p, s in zip(parsed, solution)]


def max_rows(completions, task, **kwargs):
    """1.0 for every row of task "max", None for the others: its accuracy is the share of "max" rows."""
    return [1.0 if t == "max" else None for t in task]


def test_a_prompts_stage_trains_and_scores_its_held_out_rows_with_the_eval_reward(tmp_path):
    rows = []
    for i in range(160):
        a, b = 3 + i % 37, 5 + i // 37
        prompt = f"What is {a} + {b}?" if i % 2 else [{"role": "user", "content": f"Which is larger, {a} or {b}?"}]
        rows.append({"prompt": prompt, "solution": str(a + b if i % 2 else max(a, b)), "task": "sum" if i % 2 else "max"})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    cfg = compose_cfg(["debug=smoke", "logger=none", "stage=prompts", f"stage.path={path}",
                       f"reward.funcs=[{HERE}:solved,{HERE}:max_rows]", "reward.weights=null",
                       f"stage.eval_reward={HERE}:max_rows"], run_dir)
    metrics = train(cfg)
    assert metrics["status"] == "completed" and metrics["steps"] == 2

    # the columns reached the rewards: None on the rows of the other task, the logged column beside each completion
    samples = read_jsonl(run_dir / "completions.jsonl")
    assert samples and all("parsed" in row["extra"] for row in samples)
    tasks = {r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]: r["task"] for r in rows}
    for row in samples:
        assert (row["rewards"]["max_rows"] is None) == (tasks[row["prompt"]] == "sum"), row
    history = read_jsonl(run_dir / "history.jsonl")
    assert all("parsed_share" in row and "rewards/solved/mean" in row for row in history)

    # held-out accuracy: the eval reward's verdict, None counted as not solved, on the test split's rows
    test = build_examples("prompts", "test", size=0, seed=cfg.stage.split_seed, path=str(path))[:cfg.eval.limit]
    share = sum(ex["columns"]["task"] == "max" for ex in test) / len(test)
    assert 0 < share < 1
    evaluated = json.loads((run_dir / "eval.json").read_text())["sets"]["prompts"]
    assert evaluated["accuracy"] == share and evaluated["unscored"] == round(len(test) * (1 - share))
    assert evaluated["scored_by"]["reward"] == f"{HERE}:max_rows" and evaluated["scored_by"]["threshold"] == 1.0
    before_after = json.loads((run_dir / "before_after.json").read_text())
    assert before_after["sets"]["prompts"]["before"] == before_after["sets"]["prompts"]["after"] == share
    table = (run_dir / "before_after.md").read_text()
    assert f"| prompts ({len(test)}) |" in table and f"solved where {HERE}:max_rows >= 1" in table
