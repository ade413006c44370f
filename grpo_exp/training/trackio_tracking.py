"""trackio tracking of one training stage (`logger=trackio`): a local dashboard, no account, no network.

Same contract as grpo_exp.training.tracking (wandb): `start(cfg, run_dir, step_offset)` returns a
Tracker, or None when trackio is disabled or could not start (training then goes on without it);
`Tracker.attach` hooks the trainer; `finish(tracker, metrics_or_None, failed)` is always called.

- Storage: trackio's SQLite database `<dir>/<logger.project>.db`, where dir is `logger.dir`, or
  `<sweep dir>/trackio` for a Hydra multirun (all jobs are runs of one project), or
  `<curriculum run>/trackio` for the stages of a curriculum, or `<run dir>/trackio`. View it with
  `TRACKIO_DIR=<dir> trackio show --project <project>` (served on 127.0.0.1).
- Run name, group, tags and config are wandb's (`tracking.run_identity`, `tracking.tracker_config`);
  trackio has no tags or job type, so they are config keys (`tags`, `job_type`).
- The step of every row is `train/global_step`, which counts across curriculum stages
  (`step_offset`); `train/stage_step` restarts per stage. Logged: TRL's metrics under `train/`,
  the monitor's figures under `resources/`, held-out `eval/` and `forgetting/` figures, and at the
  end Tables of the evaluation results, a sample of completions and the run summary (metrics.json).
- `<run dir>/trackio_run.json` names the run, so a run resumed in the same directory continues it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from grpo_exp.base import log
from grpo_exp.base.run_files import COMPLETIONS_FILE, HELD_OUT_PREFIXES
from grpo_exp.base.text import error_line
from grpo_exp.training import tracking

logger = log.get_logger(__name__)

RUN_FILE = "trackio_run.json"
STORAGE_SUBDIR = "trackio"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def storage_dir(cfg, run_dir: str | Path, hydra_cfg=None) -> Path:
    """Where the trackio database of this stage goes (see the module docstring)."""
    if cfg.logger.get("dir"):
        return Path(str(cfg.logger.dir)).resolve()
    run_dir = Path(run_dir).resolve()
    if tracking._is_multirun(hydra_cfg):
        return Path(str(hydra_cfg.sweep.dir)).resolve() / STORAGE_SUBDIR
    # A curriculum stage trains in <run>/<i>_<stage> (grpo_exp.training.curriculum): its stages share one
    # database, as they share one wandb group
    curriculum = tracking._choices(hydra_cfg).get("curriculum")
    if curriculum not in (None, "none", "null") and re.fullmatch(rf"\d+_{re.escape(cfg.stage.name)}", run_dir.name):
        return run_dir.parent / STORAGE_SUBDIR
    return run_dir / STORAGE_SUBDIR


def use_storage(storage: Path):
    """Point trackio at `storage` and return the trackio module.

    trackio reads TRACKIO_DIR once, when it is first imported, into constants of several of its
    modules; TRL imports it with the trainer, and a sweep or a test process trains in several
    directories, so the directory is also set in each loaded trackio module. A trackio whose
    storage still points elsewhere afterwards is refused (start then warns)."""
    storage.mkdir(parents=True, exist_ok=True)
    os.environ["TRACKIO_DIR"] = str(storage)  # for a trackio imported from here on, and for subprocesses
    import trackio
    from trackio import utils
    from trackio.sqlite_storage import SQLiteStorage

    old = Path(utils.TRACKIO_DIR)
    if old != storage:
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "trackio" or name.startswith("trackio.")):
                continue
            for attr, sub in (("TRACKIO_DIR", ""), ("MEDIA_DIR", "media"), ("ARTIFACTS_DIR", "artifacts")):
                if getattr(module, attr, None) == old / sub:
                    setattr(module, attr, storage / sub)
    if SQLiteStorage.get_project_db_path("probe").parent != storage:
        raise RuntimeError(f"trackio {trackio.__version__} did not take the storage directory {storage}")
    return trackio


@contextlib.contextmanager
def _trackio_output():
    """trackio prints its progress to stdout: send it to the debug log instead (wandb runs silent)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line.strip():
                logger.debug("trackio: %s", _ANSI.sub("", line).strip())


@dataclass
class Tracker:
    run: Any
    run_dir: Path
    storage: Path
    step_offset: int = 0
    last_step: int = 0  # global step of the last row, where the end-of-run tables go
    summary: dict = field(default_factory=dict)  # HF's end-of-training figures, for the summary table
    callbacks: list = field(default_factory=list)
    log_row: Callable | None = None  # the run's own log(), without the step shift TRL's calls get
    report_to = "trackio"  # the HF/TRL integration name (TrainingArguments.report_to); not a field

    def log_step(self, row: dict, stage_step: int) -> None:
        """One row at `train/global_step` = stage step + the steps of earlier stages."""
        global_step = stage_step + self.step_offset
        row = {**row, "train/stage_step": stage_step, tracking.STEP_METRIC: global_step}
        (self.log_row or self.run.log)(row, step=global_step)
        self.last_step = max(self.last_step, global_step)

    def attach(self, trainer, monitor=None) -> None:
        """Swap HF's TrackioCallback (added by report_to=["trackio"]) for one that logs to this run on the
        cumulative step axis, with the monitor's resource figures; it runs after the monitor."""
        try:
            from transformers.integrations import TrackioCallback

            # HF's callback would start a second run in its own project and finish this one at train end,
            # so it goes even where ours cannot be added
            trainer.callback_handler.remove_callback(TrackioCallback)
            callback = _make_callback(self, monitor)
            trainer.add_callback(callback)
            self.callbacks.append(callback)
        except Exception as err:
            tracking._warn(f"trackio step logging not attached ({error_line(err)}); only the end-of-run "
                           "tables will be logged")


def _make_callback(tracker: Tracker, monitor):
    from transformers import TrainerCallback
    from transformers.integrations.integration_utils import rewrite_logs

    class StageTrackioCallback(TrainerCallback):
        """Every log line of the trainer as a trackio row: TRL's metrics under train/ (as HF's
        TrackioCallback names them), held-out figures in their own namespace, and resources/*."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero:
                return
            logs = dict(logs or {})
            final = "train_runtime" in logs
            for key in tracking._SUMMARY_ONLY:
                if key in logs:
                    tracker.summary[key] = logs.pop(key)
            own = {k: logs.pop(k) for k in list(logs) if k.startswith(HELD_OUT_PREFIXES)}
            logs = {k: v for k, v in logs.items() if not isinstance(v, str)}  # e.g. skipped_reason: history.jsonl has it
            row = {**rewrite_logs(logs), **own}
            if final:  # HF's closing line (train_runtime, ..., epoch): summary values, not a second last point
                tracker.summary.update(row)
                return
            if monitor is not None and monitor.rows and monitor.rows[-1].get("step") == state.global_step:
                row.update(tracking.resource_metrics(monitor.rows[-1]))
            if row:
                tracker.log_step(row, state.global_step)

    return StageTrackioCallback()


def _run_file_matches(path: Path, project: str, name: str, storage: Path) -> bool:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return known.get("project") == project and known.get("name") == name and known.get("dir") == str(storage)


def start(cfg, run_dir: str | Path, step_offset: int = 0) -> Tracker | None:
    """Start the trackio run of this stage; None (with a warning) when trackio cannot start."""
    if str(cfg.logger.mode) == "disabled":
        return None
    run_dir = Path(run_dir)
    try:
        hydra_cfg = tracking._hydra()
        ident = tracking.run_identity(cfg, hydra_cfg)
        storage = storage_dir(cfg, run_dir, hydra_cfg)
        trackio = use_storage(storage)
        run_dir.mkdir(parents=True, exist_ok=True)
        project = str(cfg.logger.project)
        run_file = run_dir / RUN_FILE
        # trackio resumes by run name: only where this directory's run was logged before, so that a new
        # run never continues an older one of the same name in a shared database
        resume = "allow" if _run_file_matches(run_file, project, ident["name"], storage) else "never"
        config = {**tracking.tracker_config(cfg, hydra_cfg, step_offset), "tags": ident["tags"],
                  "job_type": ident["job_type"]}
        with _trackio_output():
            # the monitor's figures are logged per step under resources/; trackio's own samplers would
            # add a thread competing with training for the cores
            run = trackio.init(project=project, name=ident["name"], group=ident["group"], config=config,
                               resume=resume, embed=False, auto_log_cpu=False, auto_log_gpu=False)
        run_file.write_text(json.dumps({"project": project, "name": run.name, "id": run.id, "dir": str(storage)}) + "\n")
    except Exception as err:
        tracking._warn(f"trackio did not start ({error_line(err)}); training continues without it")
        return None
    tracker = Tracker(run=run, run_dir=run_dir, storage=storage, step_offset=step_offset, last_step=step_offset,
                      log_row=run.log)
    if step_offset:
        # TRL's profiling timers call trackio.log(step=<stage step>): shift them onto the cumulative axis too
        own_log = run.log
        run.log = lambda metrics, step=None: own_log(metrics, step=None if step is None else step + step_offset)
    logger.info("trackio run %s (%s) in %s; dashboard: TRACKIO_DIR=%s trackio show --project %s",
                run.id, run.name, storage, storage, project)
    return tracker


def finish(tracker: Tracker | None, metrics: dict | None, failed: bool = False) -> None:
    """Evaluation, completions and summary tables, then the run's finish; never raises (it runs on
    the error path too)."""
    if tracker is None:
        return
    import trackio

    run = tracker.run
    try:
        tables = {}
        evaluation = tracking.eval_rows(metrics.get("eval")) if metrics else None
        if evaluation is not None:
            tables["eval/results"] = trackio.Table(columns=evaluation[0], data=evaluation[1])
        completions = tracking.completions_rows(tracker.run_dir / COMPLETIONS_FILE, tracker.step_offset)
        if completions is not None:
            tables["completions"] = trackio.Table(columns=completions[0], data=completions[1])
        # trackio has no run summary: metrics.json's values (and HF's closing figures) as a key/value table
        summary = {**tracker.summary, **(tracking.flat_scalars(metrics) if metrics else {})}
        if failed:
            summary["status"] = "failed"
        if summary:
            tables["summary"] = trackio.Table(columns=["key", "value"], data=[[k, v] for k, v in summary.items()])
        if tables:
            (tracker.log_row or run.log)(tables, step=tracker.last_step)
    except Exception as err:
        tracking._warn(f"trackio logging at the end of the run failed ({error_line(err)})")
    finally:
        try:
            with _trackio_output():
                run.finish()  # flushes the queued rows into the database
            if trackio.context_vars.current_run.get() is run:
                trackio.context_vars.current_run.set(None)
        except Exception as err:
            tracking._warn(f"trackio finish failed ({error_line(err)})")
