"""A run's signals: what each figure in history.jsonl (and the console's log lines) means, and one run's values
at its first, middle and last logged step, with its validation points, as a Markdown page.

MEANINGS is the one place a metric's meaning is written: docs/guide.md's metric table is its rendering
(`python -m grpo_exp.apps.run_signals --meanings`, a test compares the two), and the page of a run
(`python -m grpo_exp.apps.run_signals <run dir> --page docs/results/<name>.md`) carries each row's meaning beside
its values. Keys with a part that varies (a reward function, a held-out set, a CPU core) are written with a
placeholder: `rewards/<func>/mean`, `eval/<set>/accuracy`, `cpu_percent/core<i>`.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path

from grpo_exp.base.run_files import BEFORE_AFTER_FILE, HELD_OUT_PREFIXES, HISTORY_FILE

TRL_GRPO = "https://huggingface.co/docs/trl/main/en/grpo_trainer"

# metric (a history.jsonl key, or its pattern) -> what it means; TRL's own figures say so where TRL documents them
# (TRL_GRPO#logged-metrics). Grouped as the page shows them: the step, rewards, completions, the policy update,
# the sampler, grpo-exp's own levers, compute and memory, held-out figures, and the console's end-of-run line.
MEANINGS: dict[str, str] = {
    # where in the run
    "step": "optimizer steps done in this stage (the x axis of curves.png)",
    "global_step": "steps done over every stage of a curriculum (equal to step in a one-stage run)",
    "stage": "the stage this row trained on (stage.name)",
    "epoch": "passes over the training prompts so far (TRL's count; fractional)",
    "time": "when the row was logged (Unix seconds; the page shows UTC)",
    "learning_rate": "the optimizer's learning rate at this step (train.learning_rate under "
                     "train.lr_scheduler_type; linear decay to zero by default)",
    # rewards
    "reward": "mean total reward of the step's sampled completions (reward.weights applied): should rise",
    "reward_std": "spread of the total reward: the mean per-group std, or the batch's std with "
                  "train.scale_rewards=batch (TRL)",
    "rewards/<func>/mean": "mean score of one reward function, before its weight (for correctness: the share "
                           "of sampled answers that are right)",
    "rewards/<func>/std": "spread of one reward function over the step's completions",
    "frac_reward_zero_std": "share of groups whose completions all scored the same: no advantage, no gradient "
                            "from them; near 1 means nothing to learn from",
    # completions
    "completions/mean_length": "mean length of the sampled completions, in tokens",
    "completions/min_length": "shortest sampled completion, in tokens",
    "completions/max_length": "longest sampled completion, in tokens (at train.max_completion_length when any "
                              "is cut)",
    "completions/clipped_ratio": "share of completions cut at train.max_completion_length before their end",
    "completions/mean_terminated_length": "mean length of the completions that ended on their own (EOS)",
    "completions/min_terminated_length": "shortest completion that ended on its own",
    "completions/max_terminated_length": "longest completion that ended on its own",
    "num_tokens": "prompt and completion tokens processed so far (TRL's running count)",
    # the policy update
    "loss": "the GRPO loss of the step (train.loss_type); it hovers near 0 by construction and is no progress "
            "signal: read reward and accuracy instead",
    "policy_loss": "the policy-gradient part of the loss, without the KL and entropy terms (TRL)",
    "grad_norm": "norm of the gradient before clipping at train.max_grad_norm; spikes go with unstable steps",
    "kl": "mean per-token KL of the policy from the starting model (TRL's k3 estimator); logged when "
          "train.beta > 0; should grow slowly",
    "entropy": "mean per-token entropy of the policy on the sampled completions; a fast fall means the policy "
               "is collapsing onto a few answers",
    "entropy_coef": "the entropy bonus's coefficient at this step (train.entropy_coef; TRL's adaptive entropy)",
    "clip_ratio/region_mean": "share of tokens whose probability ratio was clipped (outside 1 - epsilon, "
                              "1 + epsilon_high); nonzero only off-policy",
    "clip_ratio/low_mean": "share of tokens clipped at the lower bound 1 - train.epsilon",
    "clip_ratio/low_min": "the smallest per-process share clipped at the lower bound",
    "clip_ratio/high_mean": "share of tokens clipped at the upper bound 1 + train.epsilon_high",
    "clip_ratio/high_max": "the largest per-process share clipped at the upper bound",
    "cispo_clip_ratio": "share of tokens whose importance weight the cap clipped (train.loss_type=cispo)",
    "vespo/phi_seq_mean": "mean sequence weight of the VESPO loss (train.loss_type=vespo)",
    "aux_loss": "the router's auxiliary loss of a mixture-of-experts model (TRL)",
    "step_time": "seconds of the step, generation included (TRL's own clock)",
    # the sampler against the trained policy
    "rollout/kl": "mean per-token KL of the sampler (rollout engine or vLLM) from the trained policy on the "
                  "sampled tokens (k3); near 0 when they agree",
    "rollout/logp_diff_abs": "mean absolute log-prob difference between the sampler and the trained policy "
                             "per token (float noise when they are the same weights)",
    "rollout/clipped_frac": "share of completion tokens whose importance weight the cap truncated or masked",
    "sampling/sampling_logp_difference/mean": "mean absolute log-prob difference sampler - policy (TRL's "
                                              "name)",
    "sampling/sampling_logp_difference/max": "largest absolute log-prob difference sampler - policy",
    "sampling/importance_sampling_ratio/min": "smallest importance weight pi_train / pi_sampler",
    "sampling/importance_sampling_ratio/mean": "mean importance weight pi_train / pi_sampler (1 when they agree)",
    "sampling/importance_sampling_ratio/max": "largest importance weight pi_train / pi_sampler",
    "tools/call_frequency": "tool calls per completion (TRL's tool use; not used by grpo-exp's stages)",
    "tools/failure_frequency": "share of tool calls that failed (TRL's tool use)",
    # grpo-exp's own levers
    "dynamic_sampling/draws": "extra generation rounds the step drew to replace groups with equal rewards "
                              "(train.dynamic_sampling)",
    "dynamic_sampling/dropped_groups": "groups with equal rewards dropped this step (train.dynamic_sampling)",
    "dynamic_sampling/kept_share": "share of the step's groups filled with groups whose rewards differ",
    "ewc_penalty": "the EWC term added to the loss (ewc.lambda > 0): how far the weights moved where the previous "
                   "stage's Fisher says they matter",
    "curriculum/mix/<stage>": "share of the step's prompts drawn from this stage (curriculum=adaptive)",
    "curriculum/pass_rate/<stage>": "sampled correctness on this stage's prompts, which steers the adaptive mix",
    "skipped_update": "1 on a step whose update was skipped for a NaN/inf loss or reward (on_nonfinite=skip)",
    "skipped_reason": "why the step's update was skipped (non-finite loss, reward or gradient)",
    # compute and memory (base/monitor)
    "step_time_s": "wall seconds of the optimizer step, generation included (grpo-exp's clock)",
    "cpu_s": "CPU seconds of this process in the step, all threads together",
    "cpu_s_total": "CPU seconds of this process in optimizer steps so far",
    "completion_tokens": "completion tokens generated for the step (extra dynamic-sampling rounds included)",
    "completion_tokens_per_s": "completion tokens generated per wall second of the step",
    "rss_mb": "resident memory of the process at the log line, MiB",
    "peak_rss_mb": "peak resident memory so far, MiB",
    "cpu_percent_mean": "mean use of the CPU's cores since the last row, percent",
    "cpu_percent/core<i>": "use of each core since the last row, percent (the page shows the range over cores)",
    "gpu_mem_mb": "GPU memory allocated by the process at the log line, MiB (CUDA runs)",
    "gpu_peak_mem_mb": "peak GPU memory allocated so far, MiB (CUDA runs)",
    # held-out figures, every eval.every_steps
    "eval/<set>/accuracy": "greedy accuracy on the set's validation problems (eval.every_limit of them): "
                           "the curve that says the model learned",
    "eval/<set>/format": "share of those answers in the asked format ('The answer is <number>.')",
    "eval/<set>/mean_tokens": "mean length of those greedy answers, in tokens",
    "eval/<set>/n": "validation problems scored",
    "eval/<set>/seconds": "seconds the validation pass took",
    "forgetting/<set>/kl": "KL of the policy from the previous stage's model on that stage's prompts: forgetting",
    "forgetting/<set>/kl_per_token": "the same KL per completion token",
    "forgetting/<set>/seconds": "seconds the forgetting measurement took",
    "drift/<set>/kl": "KL of the policy from the previous stage's model on this stage's own validation prompts: "
                      "how far training moved it on the task it learns",
    "drift/<set>/kl_per_token": "the same KL per completion token",
    # the console's last line of training (HF's summary), not in history.jsonl
    "train_runtime": "console only: seconds of trainer.train()",
    "train_samples_per_second": "console only: prompts trained on per second",
    "train_steps_per_second": "console only: optimizer steps per second",
    "train_loss": "console only: mean loss over the run",
    "total_flos": "console only: HF's floating-point operation estimate",
}

PLACEHOLDER = re.compile(r"<(\w+)>")
HELD_OUT = HELD_OUT_PREFIXES


def _pattern_regex(pattern: str) -> re.Pattern:
    parts = PLACEHOLDER.split(pattern)  # literal, name, literal, ...
    out = "".join(re.escape(p) if i % 2 == 0 else (r"\d+" if p == "i" else r"[^/]+") for i, p in enumerate(parts))
    return re.compile(out + "$")


_PATTERNS = [(p, _pattern_regex(p)) for p in MEANINGS if PLACEHOLDER.search(p)]


def pattern_of(key: str) -> str | None:
    """The MEANINGS entry that covers `key`: itself, or the placeholder pattern it matches; None if none does."""
    if key in MEANINGS:
        return key
    return next((p for p, regex in _PATTERNS if regex.match(key)), None)


def meaning(key: str) -> str | None:
    pattern = pattern_of(key)
    return MEANINGS[pattern] if pattern else None


def meanings_markdown() -> str:
    """MEANINGS as the Markdown table docs/guide.md holds."""
    lines = ["| metric | what it means |", "|---|---|"]
    lines += [f"| `{key}` | {text} |" for key, text in MEANINGS.items()]
    return "\n".join(lines) + "\n"


def read_history(run_dir: str | Path) -> list[dict]:
    """The run's logged rows, one per step (the last row logged for a step, as a resumed run may log it again),
    in step order."""
    from grpo_exp.base.io import read_jsonl

    path = Path(run_dir) / HISTORY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {HISTORY_FILE} in {run_dir}: give a run directory (a curriculum's stage "
                                f"directory for one of its stages)")
    rows = {r["step"]: r for r in read_jsonl(path, tolerant=True) if isinstance(r.get("step"), int)}
    if not rows:
        raise FileNotFoundError(f"{path} holds no logged step")
    return [rows[s] for s in sorted(rows)]


def _format(key: str, value) -> str:
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if key == "time":
        return datetime.fromtimestamp(value, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    if isinstance(value, int):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 10_000 else f"{value:.4g}"


def _group(keys: list[str]) -> list[tuple[str, list[str]]]:
    """(row name, keys) in first-logged order: the keys of a per-core pattern share one row; every other key,
    a reward function's included, has its own."""
    rows: dict[str, list[str]] = {}
    for key in keys:
        pattern = pattern_of(key)
        name = pattern if pattern and "<i>" in pattern else key
        rows.setdefault(name, []).append(key)
    return list(rows.items())


def _cell(rows: list[dict], index: int, keys: list[str]) -> str:
    """The value(s) of `keys` at rows[index]; where that row lacks them, the nearest row's, with its step."""
    holding = [i for i, r in enumerate(rows) if any(k in r for k in keys)]
    if not holding:
        return "-"
    nearest = min(holding, key=lambda i: (abs(i - index), i))
    values = [rows[nearest][k] for k in keys if k in rows[nearest]]
    if len(keys) > 1:  # one row of several keys (cores): their range
        numbers = [v for v in values if isinstance(v, (int, float))]
        text = (f"{_format(keys[0], min(numbers))}-{_format(keys[0], max(numbers))} ({len(numbers)} cores)"
                if numbers else "-")
    else:
        text = _format(keys[0], values[0])
    return text if nearest == index else f"{text} (step {rows[nearest]['step']})"


def training_table(rows: list[dict]) -> list[str]:
    """Markdown rows: each training figure at the first, middle and last logged step, with its meaning."""
    picks = [0, (len(rows) - 1) // 2, len(rows) - 1]
    keys = list(dict.fromkeys(k for r in rows for k in r if not k.startswith(HELD_OUT)))
    head = " | ".join(f"{label} (step {rows[i]['step']})" for label, i in zip(("first", "middle", "last"), picks))
    lines = [f"| metric | {head} | what it means |", "|---|---|---|---|---|"]
    for name, group in _group(keys):
        cells = " | ".join(_cell(rows, i, group) for i in picks)
        lines.append(f"| `{name}` | {cells} | {meaning(group[0]) or 'not documented'} |")
    return lines


def held_out_table(rows: list[dict]) -> list[str]:
    """Markdown rows: every held-out point (eval/<set>/*, forgetting/<set>/*) at its step, one row per set."""
    points = []
    columns: list[str] = []
    for row in rows:
        by_set: dict[str, dict] = {}
        for key, value in row.items():
            if key.startswith(HELD_OUT) and key.count("/") == 2:
                kind, name, figure = key.split("/")
                by_set.setdefault(name, {})[f"{kind}/<set>/{figure}"] = (key, value)
        for name, figures in by_set.items():
            columns += [c for c in figures if c not in columns]
            points.append((row["step"], name, figures))
    if not points:
        return []
    lines = ["| step | set | " + " | ".join(f"`{c}`" for c in columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for step, name, figures in points:
        cells = [_format(*figures[c]) if c in figures else "-" for c in columns]
        lines.append(f"| {step} | {name} | " + " | ".join(cells) + " |")
    lines += ["", *(f"- `{c}`: {meaning(c)}" for c in columns)]
    return lines


def undocumented(rows: list[dict]) -> list[str]:
    """The keys of the rows that MEANINGS does not cover."""
    return sorted({k for r in rows for k in r if pattern_of(k) is None})


def page_markdown(run_dir: str | Path, header: list[str]) -> str:
    """The page of one run's signals under `header` (the provenance bullets)."""
    rows = read_history(run_dir)
    name = Path(run_dir).name
    lines = ["# Signals of a run", "",
             "<!-- Written by python -m grpo_exp.apps.run_signals from the run's history.jsonl; do not edit: "
             "rerun the page's command. -->", "", *(header + [""] if header else []),
             f"What the run logged, at its first, middle and last logged step ({len(rows)} logged steps of "
             f"`{name}`). How to read these figures and what to change when a curve goes wrong: "
             f"[guide.md](../guide.md). A figure a row lacks at that step is shown at the nearest step that has "
             f"it, with that step.", "", "## Training", "", *training_table(rows), ""]
    held_out = held_out_table(rows)
    if held_out:
        lines += ["## Held-out points", "", *held_out, ""]
    return "\n".join(lines)


def header(run_dir: str | Path, command: str, machine: str | None) -> list[str]:
    """The provenance bullets every results page opens with (analysis/provenance): the run's command, this
    page's, the commit, the dates, the machine, the versions."""
    from grpo_exp.analysis import provenance

    tool = "grpo_exp.apps.run_signals"
    run_dir = Path(run_dir)
    commands = provenance.run_commands([run_dir])
    times = [r["time"] for r in read_history(run_dir) if isinstance(r.get("time"), (int, float))]
    when = (f"run logged from {provenance.stamp(datetime.fromtimestamp(min(times), timezone.utc))} to "
            f"{provenance.stamp(datetime.fromtimestamp(max(times), timezone.utc))}" if times else None)
    try:
        before_after = json.loads((run_dir / BEFORE_AFTER_FILE).read_text())
    except (OSError, ValueError):
        before_after = {}
    recorded = provenance.run_versions([{"before_after": before_after}])
    return ["- **Run made by:** " + ("; ".join(f"`{c}`" for c in commands) if commands
                                    else "not recorded (no .hydra/hydra.yaml)"),
            f"- **Page made by:** `{command}`",
            provenance.commit_line("run", provenance.run_commits([run_dir]), "no commit recorded in its files"),
            provenance.date_line(None, when),
            f"- **Machine:** {provenance.machine_line(machine, tool=tool)}",
            provenance.versions_line(tool, recorded, "run's base-model evaluation")]


def page_command(run_dir: str | Path, page: str | Path, machine: str | None) -> str:
    import shlex

    return shlex.join(["python", "-m", "grpo_exp.apps.run_signals", str(run_dir), "--page", str(page),
                       *(["--machine", machine] if machine else [])])


def write_page(run_dir: str | Path, page: str | Path, machine: str | None = None, allow_dirty: bool = False) -> Path:
    """Write the signals page of the run in `run_dir` to `page`; as for results pages (analysis/results_page), a
    run of uncommitted code is refused unless `allow_dirty` (the page then says so), and a page inside the
    repository may cite no path outside it."""
    from grpo_exp.analysis import provenance, results_page

    dirty = results_page.dirty_runs([{"row": {"dir": str(run_dir)}}])
    if dirty and not allow_dirty:
        raise results_page.PageError(f"{run_dir} ran with uncommitted changes; rerun it from a commit, or pass "
                                     f"--allow-dirty to write a page that says so")
    lines = header(run_dir, page_command(run_dir, page, machine), machine)
    if dirty:
        lines.append("- **Uncommitted code:** the run ran with uncommitted changes (its commit above carries the "
                     "diff's hash)")
    page = Path(page)
    page.parent.mkdir(parents=True, exist_ok=True)
    in_repo = page.resolve().is_relative_to(provenance.REPO.resolve())
    page.write_text(results_page.repo_relative(page_markdown(run_dir, lines), strict=in_repo))
    return page
