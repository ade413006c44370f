"""The training run the web app starts: `python -m grpo_exp.train` in its own process and session, one at
a time, its log beside the runs (outputs/.app/), SIGTERM to stop it (the first checkpoints, a second aborts),
and what the Launch tab shows of it (launch_state: status line, progress, reward points, log, error)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from grpo_exp.base.run_files import ERROR_FILE, HISTORY_FILE, STATUS_FILE
from grpo_exp.apps import launch_check
from grpo_exp.apps.launch_check import LaunchRefused
from grpo_exp.apps.web.common import EXIT_BAD_INPUT
from grpo_exp.base import log

logger = log.get_logger(__name__)

LOG_LINES = 80
STOP_WAIT_S = 60  # a run stops within 30 s of SIGTERM; beyond twice that it is killed when the app quits

# What a run started from the app inherits of the app's environment: an allowlist. The app's login
# (GRPO_APP_AUTH) never, hub and wandb credentials only with --pass-credentials, nothing else unnamed here.
CHILD_ENV = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP", "TERM",
             "SHELL", "PWD", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHASHSEED", "LD_LIBRARY_PATH",
             "LD_PRELOAD", "CC", "CXX", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE",
             "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE", "HF_ENDPOINT",
             "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES",
             "OMP_NUM_THREADS", "MKL_NUM_THREADS", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
             "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "GRPO_EXP_CACHE"}
CHILD_ENV_PREFIXES = ("LC_",)
CREDENTIALS = {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "WANDB_API_KEY"}


@dataclass
class Launch:
    """One `python -m grpo_exp.train` started from the app."""

    overrides: list[str]
    run_dir: Path
    log_path: Path
    process: subprocess.Popen
    total_steps: int | None
    started: float = field(default_factory=time.time)
    ended: float | None = None  # when the app first saw it exit
    stops: int = 0  # SIGTERMs sent: the first checkpoints, a second aborts

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "grpo_exp.train", *self.overrides]


def display_command(overrides: list[str]) -> str:
    return shlex.join(["python", "-m", "grpo_exp.train", *overrides])


class Launcher:
    """The run the app started (one at a time: they would share the same cores), its log and its end."""

    def __init__(self, outputs: Path, pass_credentials: bool = False):
        self.outputs = outputs
        self.pass_credentials = pass_credentials
        self.cwd = Path.cwd()  # relative paths in overrides (stage.path=...) mean what they mean where the app started
        self.current: Launch | None = None
        self.lock = threading.Lock()

    def new_run_dir(self) -> Path:
        # Hydra's own layout (conf/hydra/default.yaml), under the app's outputs folder
        return self.outputs / "train" / "runs" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")

    def start(self, overrides: list[str]) -> Launch:
        """Start a run with these overrides once they pass the app's check (launch_check: the allowlist, then
        the composed config's validation); LaunchRefused, with nothing started or written, otherwise."""
        cfg, overrides = launch_check.check(overrides, self.outputs, self.cwd)  # paths as checked: resolved
        with self.lock:
            if self.current is not None and self.current.process.poll() is None:
                raise LaunchRefused(f"a run is still going (pid {self.current.process.pid}, {self.current.run_dir}); "
                                    f"stop it first")
            run_dir = self.new_run_dir()
            # The log lives beside the runs, not in the run directory: a run refused for bad input must leave
            # no run directory behind, and the app must not write into one Hydra is about to create.
            log_dir = self.outputs / ".app"
            log_dir.mkdir(parents=True, exist_ok=True)
            log_path = log_dir / f"{run_dir.name}.log"
            args = [*overrides, f"hydra.run.dir={run_dir}"]
            with log_path.open("wb") as out:
                # an argument list, no shell: `;` or `$(...)` in an override are characters of its value. Its own
                # session: Ctrl-C in the app's terminal must not stop the run without its checkpoint
                process = subprocess.Popen([sys.executable, "-m", "grpo_exp.train", *args], cwd=self.cwd, stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=child_env(os.environ, self.pass_credentials),
                                           start_new_session=True)
            self.current = Launch(args, run_dir, log_path, process, total_steps(cfg))
            logger.info("started pid %d: %s", process.pid, display_command(args))
            return self.current

    def stop(self) -> str:
        with self.lock:
            launch = self.current
            if launch is None or launch.process.poll() is not None:
                return "No run is going."
            launch.stops += 1
            launch.process.send_signal(signal.SIGTERM)
            logger.info("SIGTERM %d to pid %d", launch.stops, launch.process.pid)
            if launch.stops == 1:
                return (f"Stopping (SIGTERM sent to pid {launch.process.pid}): the run abandons the step in progress "
                        f"and keeps its last checkpoint (one more if a step finished since). Press Stop again to "
                        f"abort at once.")
            return f"Aborting (second SIGTERM to pid {launch.process.pid})."

    def on_exit(self, wait_s: float = STOP_WAIT_S) -> None:
        """The app is quitting: stop the run it started as Stop does (SIGTERM: it keeps its last checkpoint and
        can be resumed), and kill it if it has not ended within `wait_s`."""
        launch = self.current
        if launch is None or launch.process.poll() is not None:
            return
        logger.info("stopping the run the app started (pid %d, %s)", launch.process.pid, launch.run_dir)
        launch.process.send_signal(signal.SIGTERM)
        try:
            launch.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop within %.0f s: killed", launch.process.pid, wait_s)
            launch.process.kill()
            launch.process.wait()


def child_env(environ, pass_credentials: bool = False) -> dict[str, str]:
    """The environment of a run the app starts: the allowlisted variables of the app's own, unbuffered output;
    without --pass-credentials, huggingface_hub also leaves a stored token file unused."""
    env = {k: v for k, v in environ.items() if k in CHILD_ENV or k.startswith(CHILD_ENV_PREFIXES)}
    if pass_credentials:
        env.update({k: v for k, v in environ.items() if k in CREDENTIALS})
    else:
        env["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log_tail(path: Path, lines: int = LOG_LINES, max_bytes: int = 256_000) -> str:
    """The last lines of a log as a terminal shows them: a progress bar's carriage returns keep only its
    latest state."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    shown = []
    for line in text.split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        if parts:
            shown.append(parts[-1])
    return "\n".join(shown[-lines:])


def _history(run_dir: Path) -> list[dict]:
    from grpo_exp.base.io import read_jsonl

    rows = read_jsonl(run_dir / HISTORY_FILE, tolerant=True)
    for stage_dir in sorted(p.parent for p in run_dir.glob("*/history.jsonl")):  # curriculum stages
        rows += read_jsonl(stage_dir / HISTORY_FILE, tolerant=True)
    return rows


def _step_number(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _read_json(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def launch_state(launch: Launch | None) -> dict:
    """What the Launch tab shows about a launched run: status line, progress, reward points, log, error."""
    if launch is None:
        return {"status": "No run started from this app yet.", "progress": 0.0, "points": [], "log": "", "error": "",
                "command": "", "running": False}
    returncode = launch.process.poll()
    if returncode is not None and launch.ended is None:
        launch.ended = time.time()
    history = _history(launch.run_dir)
    steps = max((int(r.get("global_step", r.get("step", 0)) or 0) for r in history), default=0)
    points = [(int(r.get("global_step", r.get("step"))), float(r["reward"])) for r in history
              if isinstance(r.get("reward"), (int, float)) and r.get("step") is not None]
    total = launch.total_steps
    progress = min(1.0, steps / total) if total else 0.0
    elapsed = (launch.ended or time.time()) - launch.started
    where = f"`{launch.run_dir}`"
    error = ""
    if returncode is None:
        last = f", reward {points[-1][1]:.3f}" if points else ""
        stopping = " (stopping within seconds; the last checkpoint is kept)" if launch.stops else ""
        status = (f"**running**{stopping}: step {steps}/{total if total else '?'}{last}, {elapsed:.0f} s, "
                  f"pid {launch.process.pid}, in {where}")
    else:
        status_json = _read_json(launch.run_dir / STATUS_FILE)
        error_txt = launch.run_dir / ERROR_FILE
        if returncode == 0:
            status = f"**completed**: {steps} steps in {elapsed:.0f} s, in {where}"
            progress = 1.0
        elif returncode in (128 + signal.SIGTERM, -signal.SIGTERM, 128 + signal.SIGINT):
            found = [*launch.run_dir.glob("checkpoints/checkpoint-*"), *launch.run_dir.glob("*/checkpoints/checkpoint-*")]
            # the last stage's (curriculum stages are numbered 1_, 2_, ...), then the highest step
            checkpoints = sorted(found, key=lambda p: (str(p.parent.parent), _step_number(p.name)))
            saved = f"checkpoint saved: `{checkpoints[-1]}`" if checkpoints else "no checkpoint (stopped before a step ended)"
            status = (f"**stopped** by SIGTERM after step {steps} (exit {returncode}); {saved}. Continue it with "
                      f"`resume=true hydra.run.dir={launch.run_dir}`")
        elif error_txt.is_file():
            status = f"**failed** (exit {returncode}): {status_json.get('error') or 'see error.txt'}"
            error = f"{error_txt}:\n\n" + error_txt.read_text(errors="replace")
        else:
            tail = log_tail(launch.log_path, 400)
            bad = [line for line in tail.splitlines() if line.startswith("error:")]
            if returncode == EXIT_BAD_INPUT and bad:
                status = f"**refused** (bad input, exit 2; nothing was written): {bad[-1][len('error:'):].strip()}"
                error = bad[-1]
            else:
                status = f"**failed** (exit {returncode}) before writing error.txt; the log says why"
                error = "\n".join(tail.splitlines()[-30:])
    return {"status": status, "progress": progress, "points": points, "log": log_tail(launch.log_path),
            "error": error, "command": display_command(launch.overrides), "running": returncode is None}


def total_steps(cfg) -> int:
    """Optimizer steps of the whole run (each curriculum stage trains train.max_steps)."""
    stages = list(cfg.curriculum.stages or []) or [None]
    return int(cfg.train.max_steps) * len(stages)
