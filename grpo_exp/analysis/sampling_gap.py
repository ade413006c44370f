"""Does training sample as well as evaluation scores? Sampled correctness during training runs against
`python -m grpo_exp.evaluate`'s pass@1 (estimated from k samples per problem) on the same model and stage.

The runs to compare are training runs from the evaluated model: one with a learning rate too small to move
the policy (1e-10) measures what the training path samples (prompt rendering, sampler, engine or TRL's
generate, precision, completion length, reward parsing) without the policy changing; one at the stage's real
learning rate shows what the updates do to it from the same prompts (same seed, so the same problems per round).

Besides the figures, two checks of the paths themselves, run here on the runs' own files:
- reward parsing: each logged completion (completions.jsonl) scored again with the parser `evaluate` uses;
- prompt rendering: the chat prompt `evaluate` renders (batched, left-padded) against the one TRL renders for
  the same problems (unpadded), token by token.

`python -m grpo_exp.apps.sampling_gap --eval <evaluate dir> --runs <run> ... --page <page.md> --machine NAME`
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from grpo_exp.base.run_files import COMPLETIONS_FILE, EVAL_FILE, SETTINGS_FILE
from grpo_exp.analysis import provenance, runs
from grpo_exp.base import log
from grpo_exp.base.text import markdown_table
from grpo_exp.evaluation.stats import wilson_interval

logger = log.get_logger(__name__)

ROUND_KEY = "rewards/correctness/mean"  # logged once per generation round


def eval_figures(eval_dir: Path) -> dict:
    """The stage's greedy accuracy, sampled pass@1 (with its bootstrap interval) and every pass@k it holds (k > 1,
    with theirs) from eval.json."""
    data = json.loads((eval_dir / EVAL_FILE).read_text())
    (stage, m), = data["sets"].items()
    if "sampled_pass_at_1" not in m:
        raise ValueError(f"{eval_dir}/eval.json has no sampled pass@1: evaluate with eval.pass_k=[1,k]")
    return {"stage": stage, "n": m["n"], "greedy": m["accuracy"], "pass1": m["sampled_pass_at_1"],
            "pass1_ci": m["sampled_pass_at_1_ci95"], "samples": m["pass_samples"] * m["n"],
            "temperature": m["pass_temperature"], "mean_tokens": m["mean_completion_tokens"],
            "split": data["config"].get("split", "?"),
            "pass_k": {int(k): (v, m.get("pass_at_k_ci95", {}).get(k)) for k, v in m.get("pass_at_k", {}).items()
                       if int(k) > 1}}


def _pass_k(ev: dict) -> str:
    """', pass@8 0.285 [0.225, 0.345]' for each k > 1 of the evaluation: how many problems a group of k holds a
    correct answer for, the share a GRPO group of that size can learn from."""
    return "".join(f", pass@{k} {v:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
                   for k, (v, ci) in sorted(ev["pass_k"].items()))


def run_figures(job: dict, per_round: int) -> dict:
    """Pooled sampled correctness of a run's generation rounds (Wilson interval over its completions), the first
    round's, and the mean completion length and clipped share."""
    rounds = [r for r in job["history"] if ROUND_KEY in r]
    if not rounds:
        raise ValueError(f"{job['row']['dir']} logged no {ROUND_KEY}: not a GRPO training run")
    correct = round(sum(r[ROUND_KEY] for r in rounds) * per_round)
    total = per_round * len(rounds)
    thirds = [rounds[i * len(rounds) // 3:(i + 1) * len(rounds) // 3] for i in range(3)]
    return {"rounds": len(rounds), "samples": total, "correctness": correct / total,
            "ci": wilson_interval(correct, total), "first": rounds[0][ROUND_KEY],
            "by_third": [sum(r[ROUND_KEY] for r in part) / len(part) if part else None for part in thirds],
            "length": _mean(rounds, "completions/mean_length"), "clipped": _mean(rounds, "completions/clipped_ratio")}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def describe(run_dir: Path) -> tuple[str, int]:
    """A run's label (what differs between the compared paths) and its completions per generation round."""
    settings = json.loads((run_dir / SETTINGS_FILE).read_text())  # flat: "train.seed", "resolved...."
    generation = settings.get("resolved.speed.generation") or settings.get("speed.generation", "?")
    precision = settings.get("resolved.train.precision") or settings.get("train.precision", "?")
    per_round = int(settings["train.per_device_train_batch_size"]) * int(settings["train.steps_per_generation"])
    return f"{generation}, {precision}, lr {settings['train.learning_rate']:g}", per_round


def rescore_completions(run_dir: Path) -> tuple[int, int]:
    """(logged completions, those whose logged correctness the evaluation's parser gives again)."""
    from grpo_exp.core import rewards

    rows = [json.loads(line) for line in (run_dir / COMPLETIONS_FILE).read_text().splitlines() if line.strip()]
    answers = _answers(run_dir, rows)
    agree = 0
    for row, truth in zip(rows, answers):
        again = rewards.correctness([row["completion"]], [truth])[0]
        agree += again == row["rewards"]["correctness"]
    return len(rows), agree


def _config(run_dir: Path):
    from grpo_exp.config.recorded import run_config

    found = run_config(run_dir)
    if found is None:
        raise ValueError(f"{run_dir} is not a training run (no .hydra/config.yaml)")
    return found[0]


def _answers(run_dir: Path, rows: list[dict]) -> list[str]:
    """Each logged completion's ground truth, looked up by its question in the run's training problems."""
    from grpo_exp.core.data import stage_split

    cfg = _config(run_dir)
    truth = {ex["question"]: str(ex["answer"]) for ex in stage_split(cfg.stage, "train", cfg.train.seed)}
    missing = [r["prompt"] for r in rows if r["prompt"] not in truth]
    if missing:
        raise ValueError(f"{len(missing)} logged prompts are not training problems of {run_dir}, e.g. {missing[0]!r}")
    return [truth[r["prompt"]] for r in rows]


def prompt_tokens_match(run_dir: Path, limit: int = 64) -> tuple[int, int]:
    """(prompts compared, prompts whose tokens agree) between evaluate's batched, left-padded rendering and
    TRL's unpadded one, for the run's first `limit` training problems."""
    from transformers import AutoTokenizer

    from grpo_exp.core import models
    from grpo_exp.core.data import stage_split, to_messages

    cfg = _config(run_dir)
    tokenizer = models.prepare_tokenizer(AutoTokenizer.from_pretrained(str(run_dir / "model")))
    prompts = [to_messages(ex["question"], cfg.reward.system_prompt)
               for ex in stage_split(cfg.stage, "train", cfg.train.seed)[:limit]]
    tokenizer.padding_side = "left"
    enc = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, return_dict=True, padding=True)
    trl = tokenizer.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    same = sum([t for t, m in zip(ids, mask) if m] == list(ref)
               for ids, mask, ref in zip(enc["input_ids"], enc["attention_mask"], trl))
    return len(prompts), same


def write_page(eval_dir: Path, run_dirs: list[Path], page: Path, machine: str | None, command: str) -> Path:
    ev = eval_figures(eval_dir)
    jobs = runs.load(run_dirs, page.parent)
    rows = [["`evaluate` (HF generate, fp32), " + ev["split"], f"{ev['samples']} ({ev['n']} problems x "
             f"{ev['samples'] // ev['n']})", f"{ev['pass1']:.3f} [{ev['pass1_ci'][0]:.3f}, {ev['pass1_ci'][1]:.3f}]",
             "", "", f"{ev['mean_tokens']:.1f} (greedy)", ""]]
    checks = []
    for run_dir, job in zip(run_dirs, jobs):
        label, per_round = describe(run_dir)
        f = run_figures(job, per_round)
        thirds = " / ".join(f"{v:.3f}" for v in f["by_third"] if v is not None)
        rows.append([f"training: {label} (`{run_dir}`)", f"{f['samples']} ({f['rounds']} rounds)",
                     f"{f['correctness']:.3f} [{f['ci'][0]:.3f}, {f['ci'][1]:.3f}]", f"{f['first']:.3f}", thirds,
                     _num(f["length"]), _num(f["clipped"])])
        logged, agree = rescore_completions(run_dir)
        checks.append(f"- `{run_dir}`: {agree} of {logged} logged completions get the same correctness from "
                      "the evaluation's parser")
    compared, same = prompt_tokens_match(run_dirs[0])
    checks.append(f"- prompt rendering: {same} of {compared} training prompts have the same tokens in `evaluate`'s "
                  "batched, left-padded rendering (padding removed) as in TRL's")
    lines = [f"# Results: {page.stem}", "",
             "<!-- Written by grpo_exp.apps.sampling_gap from the runs' files; do not edit: rerun the page's command. -->",
             "", *provenance.header(jobs + [runs.load([eval_dir], page.parent)[0]], command, machine), "",
             f"Stage `{ev['stage']}`; temperature {ev['temperature']}; greedy accuracy of the evaluated model "
             f"{ev['greedy']:.3f} on {ev['n']} {ev['split']} problems{_pass_k(ev)}.", "",
             markdown_table(["sampled by", "completions", "correct [95% CI]", "first round", "by thirds of the run",
                             "mean tokens", "clipped"], rows), "",
             "Intervals: pass@1's is a bootstrap over problems (eval.json); a run's is Wilson over its completions "
             "(rounds of the same problems' groups are not independent, so it is narrower than it should be).", "",
             "## The paths compared", "", *checks, ""]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines))
    return page


def _num(value) -> str:
    return "" if value is None else f"{value:.2f}"


def page_command(argv: list[str]) -> str:
    return shlex.join(["python", "-m", "grpo_exp.apps.sampling_gap", *argv])
