"""Weights & Biases tracking of one training stage (`logger=wandb`, the default).

Contract with grpo_exp.training: `start(cfg, run_dir, step_offset)` returns a Tracker, or None when
tracking is off or wandb could not start (training then goes on without it); `Tracker.attach`
hooks the trainer; `finish(tracker, metrics_or_None, failed)` is always called.

- Offline by default: no account and no network. Run files go under `<run dir>/wandb/`; upload
  them later with `wandb sync <run dir>/wandb/offline-run-*`. `logger.mode=online` (or the
  user's WANDB_MODE when logger.mode is left at offline) logs live.
- One wandb run per job and per curriculum stage. `train/global_step` is the x-axis of every
  chart and counts steps across stages (`step_offset`); `train/stage_step` restarts per stage.
- The run id is kept in `<run dir>/wandb_run_id.txt`, so a run resumed in the same directory
  continues the same wandb run (`resume="allow"`).
- Logged: TRL's GRPO metrics under `train/` (through HF's WandbCallback, so also `ewc_penalty`),
  the psutil figures of each log line under `resources/`, evaluation results and a sample of
  completions as Tables; the summary holds metrics.json's values.

`logger=trackio` (grpo_exp.training.trackio_tracking) keeps the same contract and reuses this
module's run identity, config, resource and table helpers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_exp.base import log
from grpo_exp.base.io import eval_sets
from grpo_exp.base.run_files import COMPLETIONS_FILE, HELD_OUT_PREFIXES
from grpo_exp.base.text import error_line

logger = log.get_logger(__name__)

RUN_ID_FILE = "wandb_run_id.txt"
STEP_METRIC = "train/global_step"
COMPLETIONS_TABLE_ROWS = 500
# Monitor row keys logged under resources/ (plus cpu_percent/core<i>).
RESOURCE_KEYS = ("rss_mb", "peak_rss_mb", "cpu_percent_mean", "step_time_s", "completion_tokens",
                 "completion_tokens_per_s", "gpu_mem_mb", "gpu_peak_mem_mb")
# HF's end-of-training figures: run summary values, not points of a chart.
_SUMMARY_ONLY = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")


def _warn(message: str) -> None:
    logger.warning(message)


def resolve_mode(logger_cfg) -> str:
    """offline unless logger.mode says otherwise, or WANDB_MODE does while logger.mode is the default."""
    mode = str(logger_cfg.mode)
    if mode != "offline":
        return mode
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    return {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline",
            "disabled": "disabled", "shared": "shared"}.get(env, "offline")


def _hydra() -> DictConfig | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get() if HydraConfig.initialized() else None
    except Exception:
        return None


def _choices(hydra_cfg) -> dict:
    if hydra_cfg is None:
        return {}
    try:
        return {str(k): (None if v is None else str(v)) for k, v in hydra_cfg.runtime.choices.items()}
    except Exception:
        return {}


def _is_multirun(hydra_cfg) -> bool:
    try:
        from hydra.types import RunMode

        return hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN
    except Exception:
        return False


def run_identity(cfg, hydra_cfg=None) -> dict:
    """name, group, job_type and tags of the wandb run, from the Hydra choices and the config.

    The stage, model, reward and thread count come from the config (a curriculum stage composes
    its own config, while the Hydra choices still describe the outer job); experiment, curriculum
    and debug choices are added as tags when set.
    """
    choices = _choices(hydra_cfg)
    model = cfg.model.name
    stage = cfg.stage.name
    reward = cfg.reward.name
    quant = cfg.quantization.method
    from grpo_exp.base import cpu

    threads = cpu.applied().get("threads", cfg.cpu.threads)  # as the run applied cpu.threads (base/cpu.apply)
    tags = [f"model:{model}", f"stage:{stage}", f"reward:{reward}", f"threads:{threads}", f"quant:{quant}"]
    if choices.get("cpu"):
        tags.append(f"cpu:{choices['cpu']}")
    for group in ("experiment", "curriculum", "debug"):
        value = choices.get(group)
        if value and value not in ("none", "null"):
            tags.append(f"{group}:{value}")
    tags += [str(t) for t in (cfg.logger.tags or [])]

    name_parts = [model, stage, reward] + ([quant] if quant != "none" else []) + [f"t{threads}"]
    multirun = _is_multirun(hydra_cfg)
    if multirun:
        name_parts.append(f"job{hydra_cfg.job.num}")
        tags.append("multirun")

    group = cfg.logger.group
    if not group and hydra_cfg is not None:
        experiment = choices.get("experiment")
        experiment = experiment if experiment not in (None, "none", "null") else None
        if multirun:
            sweep = Path(str(hydra_cfg.sweep.dir)).name
            prefix = experiment or "sweep"
            group = sweep if prefix in sweep else f"{prefix}-{sweep}"
        elif choices.get("curriculum") not in (None, "none"):
            group = f"curriculum-{Path(str(hydra_cfg.runtime.output_dir)).name}"
        else:
            group = experiment
    # wandb limits tags to 64 characters
    tags = list(dict.fromkeys(t[:64] for t in tags))
    return {"name": "-".join(str(p) for p in name_parts), "group": group, "job_type": stage, "tags": tags}


def tracker_config(cfg, hydra_cfg=None, step_offset: int = 0) -> dict:
    """The config a tracker logs with the run: the full resolved config, plus the Hydra overrides and choices of the
    job and the stage's step offset."""
    try:
        config = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that only resolves inside a Hydra job
        config = OmegaConf.to_container(cfg, resolve=False)
    config["step_offset"] = step_offset
    if hydra_cfg is not None:
        try:
            config["hydra"] = {"overrides": list(hydra_cfg.overrides.task), "choices": _choices(hydra_cfg),
                               "job_num": hydra_cfg.job.get("num"), "output_dir": str(hydra_cfg.runtime.output_dir)}
        except Exception:
            pass
    return config


@dataclass
class Tracker:
    run: Any
    run_dir: Path
    step_offset: int = 0
    mode: str = "offline"
    callbacks: list = field(default_factory=list)
    report_to = "wandb"  # the HF/TRL integration name (TrainingArguments.report_to); not a field

    def attach(self, trainer, monitor=None) -> None:
        """Swap HF's WandbCallback (added by report_to=["wandb"]) for one on the cumulative step axis
        that also logs the monitor's resource figures; it runs after the monitor, so its row is ready."""
        try:
            from transformers.integrations import WandbCallback

            callback = _make_callback(self.step_offset, monitor)
            trainer.callback_handler.remove_callback(WandbCallback)
            trainer.add_callback(callback)
            self.callbacks.append(callback)
        except Exception as err:  # HF's own WandbCallback (per-stage steps) stays in place
            _warn(f"wandb step/resource logging not attached ({error_line(err)})")


def _make_callback(step_offset: int, monitor):
    from transformers.integrations import WandbCallback
    from transformers.integrations.integration_utils import rewrite_logs

    class StageWandbCallback(WandbCallback):
        """HF's WandbCallback (config, charts of every TRL metric) with `train/global_step` offset by
        the steps of earlier stages and `resources/*` from grpo_exp.monitor in the same row."""

        def on_log(self, args, state, control, model=None, logs=None, **kwargs):
            if self._wandb is None:
                return
            if not self._initialized:
                self.setup(args, state, model)
            if not state.is_world_process_zero:
                return
            logs = dict(logs or {})
            final = "train_runtime" in logs
            for key in _SUMMARY_ONLY:
                if key in logs:
                    self._wandb.run.summary[key] = logs.pop(key)
            # held-out figures keep their own namespace (HF would file them under train/)
            own = {k: logs.pop(k) for k in list(logs) if k.startswith(HELD_OUT_PREFIXES)}
            logs = {k: v for k, v in logs.items() if not isinstance(v, str)}  # e.g. skipped_reason: history.jsonl has it
            row = {**rewrite_logs(logs), **own}
            if not final and monitor is not None and monitor.rows and monitor.rows[-1].get("step") == state.global_step:
                row.update(resource_metrics(monitor.rows[-1]))
            row["train/stage_step"] = state.global_step
            row[STEP_METRIC] = state.global_step + step_offset
            self._wandb.log(row)

    return StageWandbCallback()


def resource_metrics(row: dict) -> dict:
    out = {f"resources/{k}": row[k] for k in RESOURCE_KEYS if isinstance(row.get(k), (int, float))}
    out.update({f"resources/{k}": v for k, v in row.items() if k.startswith("cpu_percent/")})
    return out


def start(cfg, run_dir: str | Path, step_offset: int = 0) -> Tracker | None:
    """Start the wandb run of this stage; None (with a warning) when wandb cannot start."""
    mode = resolve_mode(cfg.logger)
    if mode == "disabled":
        return None
    run_dir = Path(run_dir)
    try:
        import wandb

        hydra_cfg = _hydra()
        ident = run_identity(cfg, hydra_cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if wandb.run is not None:  # left open by an earlier job of this process
            wandb.finish()
        run = wandb.init(
            project=cfg.logger.project, entity=cfg.logger.entity, dir=str(run_dir), mode=mode,
            id=run_id or None, resume="allow", config=tracker_config(cfg, hydra_cfg, step_offset),
            settings=wandb.Settings(console="off", silent=True),
            **ident,
        )
        id_file.write_text(run.id + "\n")
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
    except Exception as err:
        _warn(f"wandb did not start ({error_line(err)}); training continues without it")
        return None
    where = Path(run.dir).parent
    hint = f"; upload later with: wandb sync {where}" if mode == "offline" else ""
    logger.info("wandb %s run %s (%s) in %s%s", mode, run.id, ident["name"], where, hint)
    return Tracker(run=run, run_dir=run_dir, step_offset=step_offset, mode=mode)


def finish(tracker: Tracker | None, metrics: dict | None, failed: bool = False) -> None:
    """Summary, tables and wandb.finish; never raises (it runs on the error path too)."""
    if tracker is None:
        return
    run = tracker.run
    try:
        if metrics:
            run.summary.update(flat_scalars(metrics))
            table = eval_table(metrics.get("eval"))
            if table is not None:
                run.log({"eval/results": table})
        completions = completions_table(tracker.run_dir / COMPLETIONS_FILE, tracker.step_offset)
        if completions is not None:
            run.log({"completions": completions})
        if failed:
            run.summary["status"] = "failed"
    except Exception as err:
        _warn(f"wandb logging at the end of the run failed ({error_line(err)})")
    finally:
        try:
            run.finish(exit_code=1 if failed else 0)
        except Exception as err:
            _warn(f"wandb.finish failed ({error_line(err)})")


def flat_scalars(data: dict, prefix: str = "") -> dict:
    """Nested metrics as `a/b/c` keys; numbers, strings and booleans only (NaN and None left out)."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_scalars(value, f"{name}/"))
        elif isinstance(value, bool) or isinstance(value, str):
            out[name] = value
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = value
        elif isinstance(value, list) and value and all(isinstance(v, (str, int, float)) for v in value):
            out[name] = value
    return out


def eval_table(evaluation):
    rows = eval_rows(evaluation)
    if rows is None:
        return None
    import wandb

    return wandb.Table(columns=rows[0], data=rows[1])


def eval_rows(evaluation) -> tuple[list[str], list[list]] | None:
    """(columns, rows) of the evaluation results: one row per held-out set; None without any."""
    sets = eval_sets(evaluation)
    if not sets:
        return None
    columns = []
    for metrics in sets.values():
        for key, value in metrics.items():
            if isinstance(value, (int, float, str, bool)) and key not in columns:
                columns.append(key)
    rows = [[name] + [_cell(metrics.get(c)) for c in columns] for name, metrics in sets.items()]
    return ["set", *columns], rows


def completions_table(path: Path, step_offset: int = 0, limit: int = COMPLETIONS_TABLE_ROWS):
    rows = completions_rows(path, step_offset, limit)
    if rows is None:
        return None
    import wandb

    return wandb.Table(columns=rows[0], data=rows[1])


def completions_rows(path: Path, step_offset: int = 0,
                     limit: int = COMPLETIONS_TABLE_ROWS) -> tuple[list[str], list[list]] | None:
    """(columns, rows) of the last `limit` sampled completions in completions.jsonl; None without any."""
    from grpo_exp.base.io import read_jsonl

    try:
        rows = read_jsonl(path)[-limit:]
    except Exception:
        return None
    if not rows:
        return None
    reward_names = list(dict.fromkeys(name for r in rows for name in (r.get("rewards") or {})))
    columns = ["global_step", "step", "prompt", "completion", *[f"reward/{n}" for n in reward_names], "advantage"]
    data = [[r.get("step", 0) + step_offset, r.get("step"), str(r.get("prompt", "")), str(r.get("completion", "")),
             *[_cell((r.get("rewards") or {}).get(n)) for n in reward_names], _cell(r.get("advantage"))]
            for r in rows]
    return columns, data


def _cell(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def offline_records(run_file: str | Path):
    """The records of an offline `run-<id>.wandb` file, as wandb_internal_pb2.Record messages.

    wandb 0.31 has no Python reader for its own log format any more (a LevelDB-style log: a 7-byte
    header, then 32 KiB blocks of records with a 7-byte header each); used by the tests and handy
    to check what an offline run holds before `wandb sync`.
    """
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    block = 32768
    buf = Path(run_file).read_bytes()
    if buf[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a wandb run file")
    pos, pending = 7, b""
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", buf[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + 7 + length > len(buf):
            break  # the writer has not flushed this record yet
        data = buf[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks = [data]
        elif kind == 2:
            pending, chunks = data, []
        elif kind == 3:
            pending, chunks = pending + data, []
        else:
            chunks, pending = [pending + data], b""
        for chunk in chunks:
            record = pb.Record()
            record.ParseFromString(chunk)
            yield record


def offline_history(run_file: str | Path) -> list[dict]:
    """History rows ({key: value}) of an offline run file."""
    import json

    rows = []
    for record in offline_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows
