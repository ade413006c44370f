"""`grpo-bench --matrix`: the bench over every point of models x completion lengths x group sizes, each point
one bench as parent.run runs a single shape (grpo-exp against plain TRL fp32 and TRL's bf16 defaults, in its own
folder of the out dir), then matrix.json with every point's figures (matrix_report.py writes matrix.csv,
matrix.md, matrix.png and the results page from it).

Before anything loads (`plan`): each model's shape from its config and each point's peak-memory estimate
(memory.py) against the available memory, and the points the out dir holds already. A point with its own
bench.json, measured with the same settings and every variant ran to its end, is kept, so a stopped matrix
continues when its command runs again; one that failed runs again. On a CPU without native bf16 the trl-defaults
baseline (bf16) would be emulated, about 10x slower: it is left out, and the matrix says so once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from grpo_exp.analysis import provenance
from grpo_exp.analysis.bench import memory, parent
from grpo_exp.analysis.bench.floor import machine_info, probe_summary, step_floor
from grpo_exp.analysis.bench.matrix_report import OVER_MEMORY

DEFAULT_MODELS = ("smollm2_135m", "gemma3_270m")
DEFAULT_LENGTHS = (64, 256)
DEFAULT_GROUPS = (4, 16)
# the bench options a point takes from the matrix's command, as (Namespace key, flag)
PASSED = (("steps", "--steps"), ("warmup", "--warmup"), ("rounds", "--rounds"),
          ("prompts_per_step", "--prompts-per-step"), ("threads", "--threads"), ("seed", "--seed"),
          ("stage", "--stage"), ("lr", "--lr"), ("beta", "--beta"))
PASSED_FLAGS = (("fixed_length", "--fixed-length"), ("profile", "--profile"))
# what a measured point must have been measured with to be kept
SAME = ("model", "max_completion_length", "num_generations", "baseline", "override", "fixed_length", "profile",
        *(key for key, _ in PASSED))
MATRIX_KEYS = ("matrix", "models", "lengths", "groups", "no_memory_check", "skip_over_memory")
EMULATED_BF16 = ("this CPU has no native bf16 (grpo_exp.base.cpu.resolve_precision('auto') is {precision}): TRL's "
                 "bf16 defaults would run emulated, about 10x slower, so the trl-defaults baseline is left out of "
                 "every point")


class MatrixError(ValueError):
    """Input the matrix refuses before anything runs; the message is one line."""


@dataclass
class Point:
    model: str
    length: int
    group: int
    dir: Path
    args: argparse.Namespace
    estimate: dict = field(default_factory=dict)
    state: str = "new"  # new, measured (kept), failed (runs again), OVER_MEMORY (--skip-over-memory)

    @property
    def label(self) -> str:
        return f"{self.model} L{self.length} G{self.group}"


def point_name(model: str, length: int, group: int) -> str:
    """A point's folder: the model as a file name (a directory's last part, a hub id's owner--name)."""
    slug = Path(model).name if Path(model).expanduser().is_dir() else model.replace("/", "--")
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', slug)}-L{length}-G{group}"


def native_bf16() -> str:
    """The precision `auto` resolves to here (bf16 only with native bf16 arithmetic)."""
    from grpo_exp.base.cpu import resolve_precision

    return resolve_precision("auto")


def available_mb() -> float:
    import psutil

    return psutil.virtual_memory().available / 1024.0 ** 2


def point_args(args: argparse.Namespace, model: str, length: int, group: int, baselines: list[str],
               out: Path) -> argparse.Namespace:
    """The Namespace parent.run takes for one point: a single-shape bench with the matrix's passed options,
    whose `argv` is the grpo-bench command that measures this point alone."""
    argv = ["--model", model, "--max-completion-length", str(length), "--num-generations", str(group)]
    for baseline in baselines:
        argv += ["--baseline", baseline]
    for key, flag in PASSED:
        if getattr(args, key) is not None:
            argv += [flag, str(getattr(args, key))]
    argv += [flag for key, flag in PASSED_FLAGS if getattr(args, key)]
    for item in args.override:
        argv += ["--override", item]
    argv += ["--out", str(out)]
    values = {**vars(args), "model": model, "max_completion_length": length, "num_generations": group,
              "baseline": list(baselines), "out": str(out), "argv": argv, "page": None, "machine": None,
              **{k: None for k in MATRIX_KEYS if k != "matrix"}, "matrix": False, "no_memory_check": False,
              "skip_over_memory": False}
    return argparse.Namespace(**values)


def _measured(point: Point) -> str:
    """new, measured or failed, from the point's bench.json; a bench of other settings is refused."""
    path = point.dir / "bench.json"
    if not path.is_file():
        return "new"
    try:
        report = json.loads(path.read_text())
    except ValueError:
        return "new"  # cut short: measure it again
    recorded = report.get("settings") or {}
    differ = [k for k in SAME if recorded.get(k) != getattr(point.args, k)]
    if differ:
        key = differ[0]
        raise MatrixError(f"{path} was measured with {key}={recorded.get(key)!r}, this matrix asks "
                          f"{key}={getattr(point.args, key)!r}: give another --out, or the same options as its "
                          f"command ({report.get('command')})")
    ok = all(v.get("status") == "ok" for v in (report.get("variants") or {}).values())
    return "measured" if ok and report.get("variants") else "failed"


def plan(args: argparse.Namespace, out: Path, baselines: list[str], free_mb: float | None = None) -> list[Point]:
    """Every point, in order (model, then length, then group), with its estimate and whether it is measured
    already; raises MatrixError, before any model loads, for a model whose shape cannot be read, an out dir
    measured with other settings, or a point still to run whose estimate is over `free_mb` (default: the
    available memory), naming the largest."""
    from grpo_exp.analysis.bench.child import compose
    from grpo_exp.base.errors import ConfigError
    from grpo_exp.config.compose import check_group_choices, compose_error
    from grpo_exp.config.recipe import generation_batch
    from grpo_exp.core import models

    points = []
    for model in args.models:
        first = point_args(args, model, args.lengths[0], args.groups[0], baselines, out)
        overrides = parent.common_overrides(first) + parent.split_env(list(args.override))[0]  # grpo-exp's
        try:
            check_group_choices(overrides, multirun=False)  # --stage nope, --override model=...: named in a line
            cfg = compose(overrides, out / ".compose")
        except Exception as err:  # Hydra's errors span many lines: the first line of each cause
            raise MatrixError(compose_error("train", overrides, err)) from None
        try:
            models.check_available(cfg.model, cfg.paths.cache_dir)
            shape = memory.model_shape(cfg.model, cfg.paths.cache_dir)
        except (ConfigError, memory.ShapeError) as err:
            raise MatrixError(f"--models {model}: {err}") from None
        for length, group in itertools.product(args.lengths, args.groups):
            name = point_name(model, length, group)
            point = Point(model, length, group, out / name, point_args(args, model, length, group, baselines, out / name))
            rows = args.prompts_per_step * group
            cfg.train.per_device_train_batch_size, cfg.train.num_generations = rows, group
            gen_rows, _ = generation_batch(cfg.train, world_size=1)
            point.estimate = {**memory.estimate_mb(shape, rows, gen_rows, length, cfg.train.beta),
                              "params": shape["params"], "shape_from": shape["source"]}
            point.state = _measured(point)
            points.append(point)
    todo = [p for p in points if p.state != "measured"]
    free_mb = available_mb() if free_mb is None else free_mb
    over = sorted((p for p in todo if p.estimate["peak_mb"] > free_mb), key=lambda p: -p.estimate["peak_mb"])
    if over and args.skip_over_memory and not args.no_memory_check:
        for point in over:
            point.state = OVER_MEMORY
        return points
    if over and not args.no_memory_check:
        worst = over[0]
        raise MatrixError(
            f"point {worst.label} needs about {worst.estimate['peak_mb'] / 1024:.1f} GB by the estimate (grpo_exp/"
            f"analysis/bench/memory.py), over the {free_mb / 1024:.1f} GB this machine has available"
            + (f"; {len(over)} points are over" if len(over) > 1 else "")
            + ": leave it out (--models, --lengths, --groups, or --skip-over-memory for every such point), lower "
              "--prompts-per-step, or give --no-memory-check")
    return points


def _say(text: str) -> None:
    print(f"[bench] matrix: {text}", flush=True)


def run_matrix(args: argparse.Namespace, runner=None) -> int:
    """Run every point not measured yet (`runner`: parent.run), then write matrix.json and what
    matrix_report writes from it; returns 0 when every point ran to its end."""
    from grpo_exp.analysis.bench import matrix_report

    runner = runner or parent.run
    out = Path(args.out) if args.out else parent.ROOT / "outputs" / "bench" / "matrix"
    started = datetime.now(timezone.utc)
    precision = native_bf16()
    baselines = ["fp32", "trl-defaults"] if precision == "bf16" else ["fp32"]
    skipped = {} if precision == "bf16" else {"trl-defaults": EMULATED_BF16.format(precision=precision)}
    free_mb = available_mb()
    points = plan(args, out, baselines, free_mb)
    out.mkdir(parents=True, exist_ok=True)
    for reason in skipped.values():
        _say(reason)
    for point in points:
        if point.state not in ("measured", OVER_MEMORY) and point.estimate["peak_mb"] > free_mb:  # --no-memory-check
            _say(f"point {point.label}: estimated peak {point.estimate['peak_mb'] / 1024:.1f} GB, over the "
                 f"{free_mb / 1024:.1f} GB available; it runs (--no-memory-check)")
    kept = sum(p.state == "measured" for p in points)
    _say(f"{len(points)} points into {parent.shown(out)} ({kept} measured there already and kept; the same command "
         f"continues a stopped matrix), {free_mb / 1024:.1f} GB available")
    for i, point in enumerate(points, start=1):
        head = f"point {i}/{len(points)} {point.label}"
        if point.state == "measured":
            _say(f"{head}: measured already ({parent.shown(point.dir / 'bench.json')}), kept")
            continue
        if point.state == OVER_MEMORY:
            _say(f"{head}: left out (--skip-over-memory): estimated peak {point.estimate['peak_mb'] / 1024:.1f} GB, "
                 f"over the {free_mb / 1024:.1f} GB available")
            continue
        _say(f"{head}: start{' again (it failed before)' if point.state == 'failed' else ''} (estimated peak "
             f"{point.estimate['peak_mb'] / 1024:.1f} GB): grpo-bench {shlex.join(point.args.argv)}")
        t0 = time.time()
        try:
            runner(point.args)
        except Exception as err:  # one point's failure is that point's; the others still run
            print(f"[bench] matrix: {head} raised {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        row = point_row(point, None)
        _say(f"{head}: {'done' if row['status'] == 'ok' else 'FAILED'} in {time.time() - t0:.0f} s"
             + (f": {matrix_report.summary(row)}" if row.get("ratio") else ""))
    report = matrix_json(args, points, started, baselines, skipped, free_mb)
    (out / "matrix.json").write_text(json.dumps(report, indent=2))
    written = matrix_report.write_all(report, out)
    _say(f"wrote {', '.join(parent.shown(p) for p in written)}")
    if getattr(args, "page", None):
        page = matrix_report.write_page(report, out, args.page, args.machine)
        _say(f"results page: {page}")
    return 0 if all(p["status"] in ("ok", OVER_MEMORY) for p in report["points"]) else 1


def _load(point: Point) -> dict | None:
    try:
        return json.loads((point.dir / "bench.json").read_text())
    except (OSError, ValueError):
        return None


def point_row(point: Point, best: dict | None) -> dict:
    """One point's figures from its bench.json: each variant's s/step, tokens/s, peak RSS and x floor (against
    `best`, the matrix's best probe reading; None: the point's own), grpo-exp's tokens/s ratio and step-time
    speed-up against each baseline, each variant's peak RSS ratio to plain TRL fp32, and the point's probe."""
    row = {"point": point.dir.name, "model": point.model, "length": point.length, "group": point.group,
           "dir": str(point.dir), "status": "not run", "estimate_mb": point.estimate.get("peak_mb"),
           "estimate": point.estimate}
    if point.state == OVER_MEMORY:
        return {**row, "status": OVER_MEMORY}
    report = _load(point)
    if report is None:
        return row
    variants = report.get("variants") or {}
    ok = {n: v for n, v in variants.items() if v.get("status") == "ok"}
    limits = best or report.get("machine_limits")
    floors = {}
    for name, v in ok.items():
        if limits and v.get("model_shape"):
            floors[name] = step_floor({**v, "steps": (report.get("steps") or {}).get(name) or []}, limits)["multiple"]
    base_rss = (ok.get("baseline") or {}).get("peak_rss_mb")
    ratios_vs = report.get("ratios_vs") or {}
    probe = report.get("floor_probe") or {}
    row.update(
        status="ok" if variants and len(ok) == len(variants) else "failed",
        failed=[n for n in variants if n not in ok], command=report.get("command"), commit=report.get("commit"),
        started=report.get("started"), ended=report.get("ended"),
        s_per_step={n: _round(v.get("step_time_s_mean"), 4) for n, v in ok.items()},
        tokens_per_s={n: _round(v.get("completion_tokens_per_s"), 2) for n, v in ok.items()},
        ratio={b: (r.get("grpo-exp") or {}).get("completion_tokens_per_s") for b, r in ratios_vs.items()},
        step_speedup={b: (r.get("grpo-exp") or {}).get("speedup_step_time_mean") for b, r in ratios_vs.items()},
        x_floor=floors, x_floor_point={n: (v.get("floor") or {}).get("multiple") for n, v in ok.items()},
        peak_rss_mb={n: v.get("peak_rss_mb") for n, v in ok.items()},
        rss_ratio={n: round(v["peak_rss_mb"] / base_rss, 3) for n, v in ok.items()
                   if n != "baseline" and base_rss and v.get("peak_rss_mb")},
        probe={"best": report.get("machine_limits"), "spread": probe.get("spread"), "readings": probe.get("readings")},
        readings=probe.get("all") or [])
    return row


def _round(value, digits: int):
    return round(value, digits) if isinstance(value, float) else value


def matrix_json(args, points: list[Point], started: datetime, baselines: list[str], skipped: dict,
                free_mb: float) -> dict:
    """matrix.json: the command, provenance, the probe over every point's readings (its best is what each
    x floor is against) and one row per point (point_row)."""
    readings = [r for p in points for r in (point_row(p, None).get("readings") or [])]
    probe = probe_summary(readings) if readings else None
    best = probe["best"] if probe else None
    rows = []
    for point in points:
        row = point_row(point, best)
        row.pop("readings", None)
        rows.append(row)
    settings = {key: getattr(args, key) for key in (*(k for k, _ in PASSED), *(k for k, _ in PASSED_FLAGS),
                                                    "override", "models", "lengths", "groups",
                                                    "skip_over_memory")}
    return {"command": shlex.join(["grpo-bench", *getattr(args, "argv", sys.argv[1:])]),
            "commit": provenance.repo_commit(), "started": started.isoformat(timespec="seconds"),
            "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": provenance.versions(),
            "machine": machine_info(), "available_mb": round(free_mb, 1), "settings": settings,
            "baselines": [parent.BASELINE_NAMES[b] for b in baselines], "skipped_baselines": skipped,
            "machine_limits": best, "probe": {k: v for k, v in (probe or {}).items() if k != "best"} or None,
            "points": rows}
