"""Side-by-side evaluation of several models (base vs trained) and of fp32 vs INT8 copies, all on the
same problems, for `grpo-compare`. Evaluation itself is grpo_exp.evaluate's code path.

Differences between models are paired (the same problems), so besides the two accuracies the report
gives the discordant counts and an exact McNemar (binomial) p-value, which is far more sensitive than
comparing two overlapping Wilson intervals.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from grpo_exp.evaluation.stats import paired
from grpo_exp.evaluation.run import EvalSet, evaluate_sets, format_table, load_model, model_info, settings_summary
from grpo_exp.core.quantization import quantize_for_eval
from grpo_exp.base.io import write_json

FP32, INT8 = "none", "dynamic_int8"
_PRECISION = {FP32: "fp32", INT8: "int8"}


def _speed(results: dict) -> float | None:
    """Decoded positions per second over all sets (see evaluation.generate_completions)."""
    seconds = sum(m["generation_s"] for m in results.values())
    positions = sum(m["decode_tokens_per_s"] * m["generation_s"] for m in results.values() if m["decode_tokens_per_s"])
    return positions / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def run_comparison(cfg, models: dict[str, Path | None], sets: list[EvalSet], int8: bool) -> tuple[dict, list[dict]]:
    """Evaluate every model (label -> model dir; None = the base model of cfg.model) in fp32, and
    also as an INT8 copy when `int8`. Returns (report, samples)."""
    methods = [FP32, INT8] if int8 else [FP32]
    variants, by_variant, all_samples = {}, {}, []
    for label, model_dir in models.items():
        model, tokenizer = load_model(cfg, model_dir)
        for method in methods:
            name = f"{label} {_PRECISION[method]}"
            eval_model = quantize_for_eval(model, method)
            results, samples = evaluate_sets(eval_model, tokenizer, sets, cfg, label=name)
            variants[name] = {"model": label, "precision": _PRECISION[method],
                              **model_info(eval_model, model_dir, method), "decode_tokens_per_s": _speed(results),
                              "sets": results}
            by_variant[name] = samples
            all_samples.extend(samples)
            del eval_model
        del model
        gc.collect()

    set_names = [s.name for s in sets]
    report = {"config": {**settings_summary(cfg, sets),
                         "models": {k: str(v) if v else f"{cfg.model.name} (base)" for k, v in models.items()}},
              "variants": variants, "model_differences": [], "int8_vs_fp32": []}
    labels = list(models)
    for method in methods:
        prec = _PRECISION[method]
        for other in labels[1:]:
            first, second = f"{labels[0]} {prec}", f"{other} {prec}"
            for s in set_names:
                rows_a = [r for r in by_variant[first] if r["set"] == s]
                rows_b = [r for r in by_variant[second] if r["set"] == s]
                report["model_differences"].append({"set": s, "precision": prec, "first": first, "second": second,
                                                    **paired(rows_a, rows_b)})
    if int8:
        for label in labels:
            fp, q = variants[f"{label} fp32"], variants[f"{label} int8"]
            for s in set_names:
                rows_a = [r for r in by_variant[f"{label} fp32"] if r["set"] == s]
                rows_b = [r for r in by_variant[f"{label} int8"] if r["set"] == s]
                report["int8_vs_fp32"].append({
                    "model": label, "set": s, **paired(rows_a, rows_b),
                    "decode_tokens_per_s_fp32": fp["sets"][s]["decode_tokens_per_s"],
                    "decode_tokens_per_s_int8": q["sets"][s]["decode_tokens_per_s"],
                    "speed_ratio": _ratio(q["sets"][s]["decode_tokens_per_s"], fp["sets"][s]["decode_tokens_per_s"])})
            report["int8_vs_fp32"].append({
                "model": label, "set": "all", "decode_tokens_per_s_fp32": fp["decode_tokens_per_s"],
                "decode_tokens_per_s_int8": q["decode_tokens_per_s"],
                "speed_ratio": _ratio(q["decode_tokens_per_s"], fp["decode_tokens_per_s"]),
                "model_size_mb_fp32": fp["model_size_mb"], "model_size_mb_int8": q["model_size_mb"],
                "size_ratio": _ratio(q["model_size_mb"], fp["model_size_mb"])})
    report["markdown"] = format_markdown(report)
    return report, all_samples


def _acc(m: dict) -> str:
    return f"{m['accuracy']:.3f} [{m['accuracy_ci95_low']:.2f}, {m['accuracy_ci95_high']:.2f}]"


def _num(value, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def format_markdown(report: dict) -> str:
    cfg, variants = report["config"], report["variants"]
    names = list(variants)
    sets = cfg["sets"]
    lines = ["# Model comparison", "",
             *[f"- **{label}**: {where}" for label, where in cfg["models"].items()],
             f"- sets: {', '.join(sets)}; up to {cfg['limit']} held-out problems each (the same for every model); "
             f"{cfg['decoding']} decoding; max new tokens "
             f"{', '.join(f'{k} {v}' for k, v in cfg['max_new_tokens'].items())}; threads {cfg['threads']}", "",
             "## Accuracy (95% Wilson interval)", "",
             "| set | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for s in sets:
        lines.append(f"| {s} | " + " | ".join(_acc(variants[n]["sets"][s]) for n in names) + " |")
    lines += ["| model size MB | " + " | ".join(f"{variants[n]['model_size_mb']:.1f}" for n in names) + " |",
              "| decode tokens/s | " + " | ".join(_num(variants[n]["decode_tokens_per_s"], ".1f") for n in names)
              + " |"]
    if report["model_differences"]:
        lines += ["", "## Accuracy difference (second - first, paired on the same problems)", "",
                  "| set | first | second | difference | only first correct | only second correct | McNemar p |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for d in report["model_differences"]:
            lines.append(f"| {d['set']} | {d['first']} | {d['second']} | {d['accuracy_diff']:+.3f} | "
                         f"{d['only_first_correct']} | {d['only_second_correct']} | {d['mcnemar_p']:.3f} |")
    if report["int8_vs_fp32"]:
        lines += ["", "## INT8 vs fp32", "",
                  "| model | set | accuracy diff | decode tokens/s fp32 | decode tokens/s int8 | speed ratio int8/fp32 | "
                  "size ratio int8/fp32 |", "|---|---|---:|---:|---:|---:|---:|"]
        for d in report["int8_vs_fp32"]:
            diff = f"{d['accuracy_diff']:+.3f} (p={d['mcnemar_p']:.2f})" if "accuracy_diff" in d else ""
            lines.append(f"| {d['model']} | {d['set']} | {diff} | {_num(d['decode_tokens_per_s_fp32'], '.1f')} | "
                         f"{_num(d['decode_tokens_per_s_int8'], '.1f')} | {_num(d['speed_ratio'])} | "
                         f"{_num(d.get('size_ratio'))} |")
        lines += ["", "Speed: decoded token positions per second of generation (every row of a batch, also after "
                  "its EOS, so answers of different length do not skew it), on this machine and noisy where other "
                  "jobs share the cores. Size: parameters + buffers + packed int8 weights in memory."]
    lines += ["", "## Per variant", ""]
    for n in names:
        lines += [f"### {n}", "", format_table(variants[n]["sets"]), ""]
    return "\n".join(lines)


def write_report(out_dir: str | Path, report: dict, samples: list[dict]) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "comparison.json", report)
    (out_dir / "comparison.md").write_text(report["markdown"] + "\n")
    with (out_dir / "comparison_samples.jsonl").open("w") as fh:
        for row in samples:
            fh.write(json.dumps(row, default=str) + "\n")
    return out_dir
