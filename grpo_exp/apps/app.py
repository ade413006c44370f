"""`python -m grpo_exp.app [--host H] [--port P] [--outputs DIR] [--auth USER:PASSWORD]`: a local web app
(Gradio) to launch, watch and compare runs.

Tabs:
- Launch: every config group and a few train options, from conf/ itself; starts `python -m grpo_exp.train`
  with exactly those overrides (the command is shown), streams its progress and log, and stops it with
  SIGTERM, which makes the trainer finish its step and save a checkpoint. Only what the form offers runs
  (apps/launch_check.py: an allowlist, then the composed config's validation); the same check guards the
  `/launch` API endpoint, which takes the override list as text and returns the run directory or the refusal.
- Runs: the runs and sweeps under the outputs folder: metrics table, reward and held-out accuracy curves,
  the curriculum matrix, and the report's plots (grpo_exp.analysis.report).
- Completions: a run's completions.jsonl with rewards and advantages, filtered by step and reward.
- Playground: one question answered by the run's base model and its trained model, side by side.

Whoever reaches the page can start processes as the app's user. It binds 127.0.0.1 unless --host says
otherwise, and 127.0.0.1 is shared with every user of the machine; --auth (or GRPO_APP_AUTH) sets a login,
without which another --host is refused.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from grpo_exp.apps import launch_check
from grpo_exp.apps.launch_check import LAUNCH_GROUPS, LaunchRefused, compose_train
from grpo_exp.base import log

logger = log.get_logger(__name__)

DEFAULT_PORT = 7870  # not 7860: `trackio show` takes that one
EXIT_BAD_INPUT = 2
AUTH_ENV = "GRPO_APP_AUTH"  # USER:PASSWORD, as --auth (an environment variable stays out of `ps`)
REFUSED = "refused: "  # how a refusal starts, in the Launch tab and the /launch API
NO_OPTION = "(none)"  # an optional group (debug) left out
# (key, label, int or float): train options shown as numbers, prefilled from the composed config
LAUNCH_NUMBERS = [
    ("train.max_steps", "max steps", int),
    ("train.learning_rate", "learning rate", float),
    ("train.num_generations", "completions per prompt (num_generations)", int),
    ("train.per_device_train_batch_size", "completions per step (per_device_train_batch_size)", int),
    ("train.max_completion_length", "max completion tokens", int),
    ("train.temperature", "temperature", float),
    ("train.beta", "KL coefficient (beta)", float),
    ("train.seed", "seed", int),
    ("ewc.lambda", "EWC lambda", float),
    ("eval.every_steps", "held-out accuracy every N steps (0: off)", int),
]
AFTER_TRAIN = "eval.after_train"
LOG_LINES = 80


# ---------------------------------------------------------------- the command line

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m grpo_exp.app",
                                     description="A local web app (Gradio) to launch, watch and compare grpo-exp runs.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--outputs", default="outputs", help="the folder of runs to browse, where launched runs go "
                                                             "(default: outputs)")
    parser.add_argument("--auth", default=None, metavar="USER:PASSWORD",
                        help=f"a login for the page and the API (default: ${AUTH_ENV}, else none); needed for any "
                             f"--host but 127.0.0.1 (which every user of this machine reaches)")
    return parser.parse_args(argv)


def parse_auth(text: str | None) -> tuple[str, str] | None:
    """(user, password) from USER:PASSWORD (the password may hold ':'), None for no login."""
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"--auth (or {AUTH_ENV}) must be USER:PASSWORD with both parts non-empty")
    return user, password


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def port_in_use(host: str, port: int) -> bool:
    """Whether binding (host, port) fails, checked before Gradio, whose own error spans a traceback."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        auth = parse_auth(args.auth if args.auth is not None else os.environ.get(AUTH_ENV))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if auth is None and not is_loopback(args.host):
        print(f"error: --host {args.host} lets other machines start processes as this user; set a login with "
              f"--auth USER:PASSWORD (or {AUTH_ENV}), or bind 127.0.0.1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not 0 < args.port < 65536:
        print(f"error: --port {args.port} is not a port number (1-65535)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if port_in_use(args.host, args.port):
        print(f"error: port {args.port} on {args.host} is already in use; choose another with --port", file=sys.stderr)
        return EXIT_BAD_INPUT
    outputs = Path(args.outputs).expanduser().resolve()
    if outputs.exists() and not outputs.is_dir():
        print(f"error: --outputs {outputs} is a file, not a folder", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("error: the web app needs gradio, which is not installed; run pip install -e '.[app]' "
              "(make setup does)", file=sys.stderr)
        return EXIT_BAD_INPUT
    log.set_level("INFO")
    # No network here or on many clusters: no analytics pings, and system fonts instead of Google's.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    app = App(outputs)
    demo = app.build()
    demo.queue(default_concurrency_limit=4)
    demo.launch(server_name=args.host, server_port=args.port, prevent_thread_lock=True, quiet=True, ssr_mode=False,
                show_error=True, allowed_paths=[str(outputs), str(app.report_dir)], theme=_theme(),
                footer_links=[], auth=auth)
    url = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}/"
    print(f"grpo-exp app: {url}  (outputs: {outputs}; Ctrl-C to quit)", flush=True)
    if auth is None:
        logger.info("no login (--auth): every user of this machine can reach %s and start runs", url)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        app.launcher.on_exit()
        demo.close()
        shutil.rmtree(app.report_dir, ignore_errors=True)
    return 0


def _theme():
    import gradio as gr

    system = ["ui-sans-serif", "system-ui", "sans-serif"]
    return gr.themes.Default(font=system, font_mono=["ui-monospace", "monospace"])


# ---------------------------------------------------------------- launching runs

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

    def __init__(self, outputs: Path):
        self.outputs = outputs
        self.cwd = Path.cwd()  # relative paths in overrides (stage.path=...) mean what they mean where the app started
        self.current: Launch | None = None
        self.lock = threading.Lock()

    def new_run_dir(self) -> Path:
        # Hydra's own layout (conf/hydra/default.yaml), under the app's outputs folder
        return self.outputs / "train" / "runs" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")

    def start(self, overrides: list[str]) -> Launch:
        """Start a run with these overrides once they pass the app's check (launch_check: the allowlist, then
        the composed config's validation); LaunchRefused, with nothing started or written, otherwise."""
        cfg = launch_check.check(overrides, self.outputs, self.cwd)
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
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
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
                return (f"Stopping (SIGTERM sent to pid {launch.process.pid}): the run finishes its step and saves a "
                        f"checkpoint. Press Stop again to abort at once.")
            return f"Aborting (second SIGTERM to pid {launch.process.pid})."

    def on_exit(self) -> None:
        launch = self.current
        if launch is not None and launch.process.poll() is None:
            print(f"the run goes on without the app (pid {launch.process.pid}, {launch.run_dir}); stop it with "
                  f"kill -TERM {launch.process.pid}", file=sys.stderr)


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

    rows = read_jsonl(run_dir / "history.jsonl", tolerant=True)
    for stage_dir in sorted(p.parent for p in run_dir.glob("*/history.jsonl")):  # curriculum stages
        rows += read_jsonl(stage_dir / "history.jsonl", tolerant=True)
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
        stopping = " (stopping: saving a checkpoint after this step)" if launch.stops else ""
        status = (f"**running**{stopping}: step {steps}/{total if total else '?'}{last}, {elapsed:.0f} s, "
                  f"pid {launch.process.pid}, in {where}")
    else:
        status_json = _read_json(launch.run_dir / "status.json")
        error_txt = launch.run_dir / "error.txt"
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


# ---------------------------------------------------------------- the Launch form

def group_overrides(choices: dict[str, str]) -> list[str]:
    return [f"{g}={v}" for g, v in choices.items() if v and v != NO_OPTION]


def format_value(value, kind) -> str:
    if value is None:
        return "null"
    if kind is int:
        return str(int(value))
    return repr(float(value))  # 3e-05 stays 3e-05 (Hydra reads it as a float)


def form_values(choices: dict[str, str]) -> dict[str, object]:
    """The composed config's value of every number (and eval.after_train) for these group choices."""
    from omegaconf import OmegaConf

    cfg = compose_train(group_overrides(choices))
    values: dict[str, object] = {}
    for key, _, kind in LAUNCH_NUMBERS:
        value = OmegaConf.select(cfg, key)
        if key == "eval.every_steps" and value is None:
            value = 0
        values[key] = kind(value) if value is not None else None
    values[AFTER_TRAIN] = bool(OmegaConf.select(cfg, AFTER_TRAIN))
    return values


def build_overrides(choices: dict[str, str], numbers: dict[str, object], after_train: bool, extra: str) -> list[str]:
    """Every control of the form as one override each, then the extra ones: exactly what the run gets, once
    launch_check passes them. LaunchRefused for a box that cannot be split into words (an unclosed quote)."""
    overrides = group_overrides(choices)
    kinds = {key: kind for key, _, kind in LAUNCH_NUMBERS}
    for key, value in numbers.items():
        if key == "eval.every_steps" and (value is None or int(value) == 0):
            overrides.append(f"{key}=null")  # 0 in the form: periodic held-out evaluation off
        elif value is not None:
            overrides.append(f"{key}={format_value(value, kinds[key])}")
    overrides.append(f"{AFTER_TRAIN}={'true' if after_train else 'false'}")
    return overrides + launch_check.split(extra)


def total_steps(cfg) -> int:
    """Optimizer steps of the whole run (each curriculum stage trains train.max_steps)."""
    stages = list(cfg.curriculum.stages or []) or [None]
    return int(cfg.train.max_steps) * len(stages)


# ---------------------------------------------------------------- the app

class App:
    """The Gradio Blocks and the state behind them (the outputs folder, the launched run, loaded models)."""

    def __init__(self, outputs: Path):
        from grpo_exp.analysis.playground import Models

        self.outputs = outputs
        self.launcher = Launcher(outputs)
        self.models = Models()
        # the report's PNGs are written here, not into the runs (browsing must not change them)
        self.report_dir = Path(tempfile.mkdtemp(prefix="grpo-app-reports-"))

    # -- starting a run

    def launch(self, overrides: str) -> str:
        """The run directory of a run started with these overrides (text, split as a shell splits words, run
        without one), or "refused: <why>" in one line with nothing started: the /launch API and the Launch button."""
        try:
            launch = self.launcher.start(launch_check.split(overrides))
        except LaunchRefused as err:
            line = str(err).replace("\r", "\\r").replace("\n", "\\n")  # a quoted value may hold a line break
            logger.warning("launch refused: %s", line)
            return f"{REFUSED}{line}"
        return str(launch.run_dir)

    # -- helpers reading the outputs folder

    def ours(self, path) -> str | None:
        """`path` if it lies under the outputs folder, else None: a dropdown's value comes from the browser, which
        may send any path (symlinks under the folder are the user's own, so they are not followed here)."""
        if not path:
            return None
        return str(path) if Path(os.path.abspath(path)).is_relative_to(self.outputs) else None

    def run_choices(self, where: str = "runs") -> list[tuple[str, str]]:
        """(label, path) for a dropdown, newest first: runs and sweeps ("runs"), directories with
        completions.jsonl ("completions"), or with a trained model/ ("models")."""
        from grpo_exp.analysis import runs

        if where == "completions":
            dirs = runs.completion_dirs(self.outputs)
        elif where == "models":
            dirs = [d for d in runs.find_runs(self.outputs) if (d / "model" / "config.json").is_file()]
            dirs += [p.parent.parent for d in runs.find_runs(self.outputs) for p in d.glob("*/model/config.json")]
        else:
            dirs = runs.find_runs(self.outputs)
        dirs = sorted(set(dirs), key=_mtime, reverse=True)
        choices = [(runs.label(d, self.outputs), str(d)) for d in dirs]
        if where == "runs":
            sweeps = sorted(runs.find_sweeps(self.outputs), key=_mtime, reverse=True)
            choices = [(f"sweep: {runs.label(s, self.outputs)} ({len(runs.find_runs(s))} jobs)", str(s))
                       for s in sweeps] + choices
        return choices

    def build(self):
        import gradio as gr

        with gr.Blocks(title="grpo-exp", analytics_enabled=False) as demo:
            gr.Markdown(f"## grpo-exp\nRuns in `{self.outputs}`", elem_id="header")
            with gr.Tabs():
                with gr.Tab("Launch", id="launch", elem_id="tab-launch"):
                    self._launch_tab(gr, demo)
                with gr.Tab("Runs", id="runs", elem_id="tab-runs") as runs_tab:
                    refresh_runs = self._runs_tab(gr)
                with gr.Tab("Completions", id="completions", elem_id="tab-completions") as comp_tab:
                    refresh_completions = self._completions_tab(gr)
                with gr.Tab("Playground", id="playground", elem_id="tab-playground") as play_tab:
                    refresh_models = self._playground_tab(gr)
            # each tab reads the folder again when opened: a run launched meanwhile shows up
            runs_tab.select(**refresh_runs)
            comp_tab.select(**refresh_completions)
            play_tab.select(**refresh_models)
            demo.load(**refresh_runs)
        return demo

    # -- Launch

    def _launch_tab(self, gr, demo) -> None:
        from grpo_exp.config.options import default_options, group_options

        defaults = default_options("train")
        values = form_values({g: defaults.get(g) or NO_OPTION for g in LAUNCH_GROUPS})
        gr.Markdown("Pick the config groups and train options; **Start** runs `python -m grpo_exp.train` with "
                    "exactly these overrides. Picking a group refills the numbers with the values it sets (`debug=smoke`: 2 steps). "
                    "**Stop** sends SIGTERM: the run ends its step and saves a checkpoint.")
        dropdowns = {}
        with gr.Row():
            for group in LAUNCH_GROUPS:
                options = group_options(group)
                default = defaults.get(group)
                if default is None:
                    options = [NO_OPTION, *options]
                dropdowns[group] = gr.Dropdown(options, value=default or NO_OPTION, label=group,
                                               elem_id=f"launch-{group}", min_width=140)
        numbers = {}
        with gr.Row():
            for key, label, kind in LAUNCH_NUMBERS:
                numbers[key] = gr.Number(values[key], label=f"{key} ({label})", precision=0 if kind is int else None,
                                         elem_id=f"launch-{key.replace('.', '-')}", min_width=160)
            after_train = gr.Checkbox(values[AFTER_TRAIN], label=f"{AFTER_TRAIN} (trained vs base model at the end)",
                                      elem_id="launch-after-train")
        extra = gr.Textbox(label="more overrides (key=value ..., as on the command line)", elem_id="launch-extra",
                           placeholder="e.g. stage.num_train=200 train.save_steps=10")
        preview = gr.Code(display_command([]), language="shell", label="command", elem_id="launch-command",
                          interactive=False, wrap_lines=True)
        with gr.Row():
            start = gr.Button("Start", variant="primary", elem_id="launch-start")
            stop = gr.Button("Stop (SIGTERM, checkpoints)", variant="stop", elem_id="launch-stop")
        notice = gr.Markdown(elem_id="launch-notice")
        status = gr.Markdown("No run started from this app yet.", elem_id="launch-status")
        progress = gr.Slider(0, 100, value=0, label="progress (% of steps)", interactive=False,
                             elem_id="launch-progress")
        reward_plot = gr.LinePlot(None, x="step", y="reward", title="reward per step", height=240,
                                  elem_id="launch-reward")
        error = gr.Code("", language=None, label="error (error.txt of the run)", visible=False,
                        elem_id="launch-error", interactive=False, wrap_lines=True)
        log_box = gr.Textbox("", label="log", lines=14, max_lines=14, autoscroll=True, elem_id="launch-log",
                             interactive=False)
        timer = gr.Timer(1.0)

        group_list = list(dropdowns.values())
        number_list = list(numbers.values())
        form = [*group_list, *number_list, after_train, extra]

        def read_form(args):
            choices = dict(zip(LAUNCH_GROUPS, args[:len(group_list)]))
            nums = dict(zip([k for k, _, _ in LAUNCH_NUMBERS], args[len(group_list):len(group_list) + len(number_list)]))
            return choices, nums, args[-2], args[-1]

        def show_command(*args):
            try:
                overrides = build_overrides(*read_form(args))
                launch_check.check_items(overrides, self.outputs, self.launcher.cwd)  # the quick part of the check
            except (ValueError, TypeError) as err:
                return f"# {REFUSED}{err}"
            return display_command(overrides)

        def refill(*choices):
            """Numbers as the chosen groups set them (a stage sets its completion length, debug=smoke its steps)."""
            try:
                got = form_values(dict(zip(LAUNCH_GROUPS, choices)))
            except Exception as err:
                gr.Warning(f"cannot compose these choices: {str(err).splitlines()[0]}")
                return [gr.update()] * (len(number_list) + 1)
            return [got[key] for key, _, _ in LAUNCH_NUMBERS] + [got[AFTER_TRAIN]]

        def preset_model(debug_choice, model_choice):
            """debug=smoke picks its own model (tiny_random); a model named on the command line would win."""
            if debug_choice == NO_OPTION:
                return model_choice
            try:
                return str(compose_train([f"debug={debug_choice}"]).model.name)
            except Exception:
                return model_choice

        for control in form:
            control.change(show_command, form, preview, show_progress="hidden")
        for dropdown in group_list:
            dropdown.input(refill, group_list, [*number_list, after_train], show_progress="hidden")
        dropdowns["debug"].input(preset_model, [dropdowns["debug"], dropdowns["model"]], dropdowns["model"],
                                 show_progress="hidden").then(refill, group_list, [*number_list, after_train],
                                                              show_progress="hidden")

        def do_start(*args):
            try:
                overrides = build_overrides(*read_form(args))
            except (ValueError, TypeError) as err:  # an unclosed quote in the box, a number field emptied
                return verbatim(f"{REFUSED}{err}"), gr.update()
            answer = self.launch(shlex.join(overrides))  # the /launch API's own function and check
            if answer.startswith(REFUSED):
                return verbatim(answer), gr.update()
            return f"Started: {verbatim(answer)}", display_command([*overrides, f"hydra.run.dir={answer}"])

        def launch(overrides: str) -> str:
            """Start `python -m grpo_exp.train` with these overrides (as typed in the Launch tab's box, e.g.
            "model=tiny_random debug=smoke"), checked as the Launch button's are; returns the run's directory,
            or one line starting "refused: " with nothing started."""
            return self.launch(overrides)

        gr.api(launch, api_name="launch")

        def do_stop():
            return self.launcher.stop()

        def tick():
            import pandas as pd

            state = launch_state(self.launcher.current)
            points = pd.DataFrame(state["points"], columns=["step", "reward"])
            return (state["status"], round(100 * state["progress"], 1), points,
                    gr.update(value=state["error"], visible=bool(state["error"])), state["log"])

        start.click(do_start, form, [notice, preview])
        stop.click(do_stop, None, notice)
        timer.tick(tick, None, [status, progress, reward_plot, error, log_box], show_progress="hidden")
        demo.load(show_command, form, preview)

    # -- Runs

    def _runs_tab(self, gr) -> dict:
        from grpo_exp.analysis import runs

        header = gr.Markdown(elem_id="runs-header")
        refresh = gr.Button("Refresh", size="sm", elem_id="runs-refresh")
        overview = gr.Dataframe(label="all runs", interactive=False, elem_id="runs-overview", max_height=300)
        with gr.Column(visible=False) as area:  # shown once there is a run to show
            pick = gr.Dropdown([], label="run or sweep", elem_id="runs-pick", allow_custom_value=False)
            detail = gr.Markdown(elem_id="runs-detail")
            table = gr.Dataframe(label="metrics (the report's table)", interactive=False, elem_id="runs-table",
                                 max_height=300)
            with gr.Row():
                reward = gr.LinePlot(None, x="step", y="value", color="series", title="reward", height=260,
                                     elem_id="runs-reward")
                heldout = gr.LinePlot(None, x="step", y="value", color="series", title="held-out accuracy (greedy)",
                                      height=260, elem_id="runs-heldout")
            forgetting = gr.LinePlot(None, x="step", y="value", color="series", visible=False, height=240,
                                     title="forgetting: KL from the previous stage's policy", elem_id="runs-forgetting")
            matrix = gr.Dataframe(label="curriculum matrix R[after][evaluated]", visible=False, interactive=False,
                                  elem_id="runs-matrix")
            plots = gr.Gallery(label="report plots (grpo-report)", columns=2, height=640, elem_id="runs-plots",
                               interactive=False, object_fit="contain")

        def list_runs():
            choices = self.run_choices("runs")
            if not choices:
                return (f"**{runs.empty_message(self.outputs)}**", gr.update(value=None, visible=False),
                        gr.update(visible=False), gr.update(choices=[], value=None))
            frame = rounded(runs.overview(self.outputs))
            n_sweeps = sum(label.startswith("sweep:") for label, _ in choices)
            return (f"{len(frame)} runs, {n_sweeps} sweeps under `{self.outputs}`",
                    gr.update(value=frame, visible=True), gr.update(visible=True),
                    gr.update(choices=choices, value=choices[0][1]))

        def show(path):
            path = self.ours(path)
            empty = ("", None, None, None, gr.update(visible=False), gr.update(visible=False), [])
            if not path:
                return empty
            target = Path(path)
            dirs = runs.find_runs(target)
            if not dirs:
                return (f"No runs in `{target}` (yet).",) + empty[1:]
            jobs = runs.load(dirs, target if runs.is_sweep(target) else target.parent)
            rows = [j["row"] for j in jobs]
            failed = [r for r in rows if r.get("status") not in ("completed", None)]
            text = f"`{target}`: {len(rows)} run(s), " + ", ".join(
                f"{s} {sum(r.get('status') == s for r in rows)}" for s in sorted({str(r.get('status')) for r in rows}))
            for row in failed:
                if row.get("error"):
                    text += f"\n\n- **{row['job']}** {row['status']}: {row['error']}"
            heldout_points = runs.curves(jobs, "eval/*/accuracy")
            forgetting_points = runs.curves(jobs, "forgetting/*/kl")
            matrices = [m for j in jobs if (m := runs.curriculum_table(j)) is not None]
            return (text, rounded(runs.metrics_table(jobs)), runs.curves(jobs, "reward"), heldout_points,
                    gr.update(value=forgetting_points, visible=not forgetting_points.empty),
                    gr.update(value=matrices[0] if matrices else None, visible=bool(matrices)),
                    self.report_plots(target))

        outputs = [detail, table, reward, heldout, forgetting, matrix, plots]
        listed = [header, overview, area, pick]
        refresh.click(list_runs, None, listed).then(show, pick, outputs)
        pick.change(show, pick, outputs)
        return {"fn": list_runs, "inputs": None, "outputs": listed}

    def report_plots(self, target: Path) -> list[tuple[str, str]]:
        """The report's PNGs for a run or sweep (grpo_exp.analysis.report.write_report), into the app's own folder."""
        from grpo_exp.analysis.report import write_report

        out = self.report_dir / "".join(c if c.isalnum() else "_" for c in str(target.resolve()))[-120:]
        try:
            write_report([target], out)
        except (SystemExit, Exception) as err:  # write_report exits when it finds no runs
            logger.warning("no report for %s: %s", target, err)
            return []
        return [(str(p), p.stem.replace("_", " ")) for p in sorted(out.glob("*.png"))]

    # -- Completions

    def _completions_tab(self, gr) -> dict:
        from grpo_exp.analysis import runs

        gr.Markdown("A run's `completions.jsonl` (every `completions_every` steps): each completion with its reward "
                    "(the weighted sum trained on), each reward function, and its advantage.")
        with gr.Row():
            pick = gr.Dropdown([], label="run", elem_id="comp-pick", scale=3)
            step = gr.Dropdown(["all"], value="all", label="step", elem_id="comp-step")
            # text, not numbers: an empty box means no bound (a Number box would show 0)
            low = gr.Textbox(label="reward at least", placeholder="any", elem_id="comp-min")
            high = gr.Textbox(label="reward at most", placeholder="any", elem_id="comp-max")
        summary = gr.Markdown(elem_id="comp-summary")
        table = gr.Dataframe(interactive=False, wrap=True, elem_id="comp-table", max_height=600)

        def list_dirs():
            choices = self.run_choices("completions")
            if not choices:
                return (gr.update(choices=[], value=None),
                        f"**No completions under `{self.outputs}` yet** (a run writes completions.jsonl as it trains).")
            return gr.update(choices=choices, value=choices[0][1]), gr.update()

        def steps_of(path):
            path = self.ours(path)
            if not path:
                return gr.update(choices=["all"], value="all")
            df = runs.read_completions(path)
            return gr.update(choices=["all", *[str(s) for s in sorted(df["step"].dropna().unique())]], value="all")

        def show(path, step_choice, min_reward, max_reward):
            path = self.ours(path)
            if not path:
                return f"**No completions under `{self.outputs}` yet** (a run writes completions.jsonl as it trains).", None
            try:
                bounds = [float(b) if str(b or "").strip() else None for b in (min_reward, max_reward)]
            except ValueError:
                return f"**Not a number:** reward bounds are numbers like 0.5 or -1 (empty: no bound).", None
            df = runs.read_completions(path)
            chosen = None if step_choice in (None, "all") else int(step_choice)
            shown = runs.filter_completions(df, chosen, *bounds)
            if df.empty:
                return f"`{path}` has no completions yet.", None
            text = (f"{len(shown)} of {len(df)} completions (steps {int(df['step'].min())}-{int(df['step'].max())}) "
                    f"in `{runs.label(Path(path), self.outputs)}`")
            if not shown.empty:
                text += f"; shown: mean reward {shown['reward'].mean():.3f}, mean advantage {shown['advantage'].mean():.3f}"
            # the figures first: a completion can be long enough to push them off screen
            first = ["step", "reward", "advantage", *[c for c in shown.columns if c.startswith("reward:")]]
            return text, rounded(shown[first + [c for c in shown.columns if c not in first]])

        inputs = [pick, step, low, high]
        pick.change(steps_of, pick, step).then(show, inputs, [summary, table])
        for control in (step, low, high):
            control.change(show, inputs, [summary, table])
        return {"fn": list_dirs, "inputs": None, "outputs": [pick, summary]}

    # -- Playground

    def _playground_tab(self, gr) -> dict:
        from grpo_exp.analysis import playground

        gr.Markdown("One question, answered by the run's base model (its `model` option) and by its trained "
                    "`model/`, with the run's system prompt. The answer is parsed as the correctness reward parses it.")
        with gr.Row():
            pick = gr.Dropdown([], label="trained run", elem_id="play-pick", scale=3)
            sample = gr.Button("a held-out problem of its stage", elem_id="play-sample")
        with gr.Row():
            question = gr.Textbox(label="question", lines=2, elem_id="play-question", scale=3)
            expected = gr.Textbox(label="expected answer (optional)", elem_id="play-expected")
        with gr.Row():
            decoding = gr.Radio(["greedy", "sampled"], value="greedy", label="decoding", elem_id="play-decoding")
            temperature = gr.Number(0.8, label="temperature (sampled)", elem_id="play-temperature")
            seed = gr.Number(0, label="seed (sampled)", precision=0, elem_id="play-seed")
            max_tokens = gr.Number(0, label="max new tokens (0: the run's)", precision=0, elem_id="play-max-tokens")
        ask = gr.Button("Answer with both", variant="primary", elem_id="play-ask")
        notice = gr.Markdown(elem_id="play-notice")
        with gr.Row():
            with gr.Column():
                base_title = gr.Markdown("### base model", elem_id="play-base-title")
                base_text = gr.Textbox(label="answer", lines=6, interactive=False, elem_id="play-base-answer")
                base_verdict = gr.Markdown(elem_id="play-base-verdict")
            with gr.Column():
                run_title = gr.Markdown("### trained run", elem_id="play-run-title")
                run_text = gr.Textbox(label="answer", lines=6, interactive=False, elem_id="play-run-answer")
                run_verdict = gr.Markdown(elem_id="play-run-verdict")
        counter = {"n": 0}

        def list_models():
            choices = self.run_choices("models")
            if not choices:
                return (gr.update(choices=[], value=None),
                        f"**No trained runs under `{self.outputs}` yet** (a run writes model/ when it ends).")
            return gr.update(choices=choices, value=choices[0][1]), ""

        def held_out(path):
            path = self.ours(path)
            if not path:
                return gr.update(), gr.update(), "Pick a trained run first."
            try:
                q, a = playground.held_out_problem(playground.run_settings(path), counter["n"])
            except Exception as err:
                return gr.update(), gr.update(), f"No held-out problem: {str(err).splitlines()[0]}"
            counter["n"] += 1
            return q, a, ""

        def verdict(answer: playground.Answer) -> str:
            parsed = "none found" if answer.predicted is None else f"{answer.predicted:g}"
            mark = {True: "correct", False: "wrong", None: "no expected answer given"}[answer.correct]
            return f"parsed answer: **{parsed}** ({mark}); {answer.tokens} tokens, {answer.seconds:.1f} s"

        def answer_both(path, q, exp, dec, temp, sd, max_new):
            path = self.ours(path)
            blank = [gr.update()] * 6
            if not path:
                return ["**Pick a trained run** (one with model/)."] + blank
            if not (q or "").strip():
                return ["**Write a question** (or take a held-out problem)."] + blank
            try:
                base, trained = playground.side_by_side(self.models, path, q.strip(), expected=exp or None,
                                                        do_sample=dec == "sampled", temperature=float(temp or 0.8),
                                                        seed=int(sd or 0), max_new_tokens=int(max_new or 0) or None)
            except Exception as err:
                logger.exception("playground failed")
                return [f"**Could not answer:** {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"] + blank
            return ["", f"### {base.model}", base.text, verdict(base), f"### {trained.model}", trained.text,
                    verdict(trained)]

        sample.click(held_out, pick, [question, expected, notice])
        ask.click(answer_both, [pick, question, expected, decoding, temperature, seed, max_tokens],
                  [notice, base_title, base_text, base_verdict, run_title, run_text, run_verdict])
        return {"fn": list_models, "inputs": None, "outputs": [pick, notice]}


def verbatim(text: str) -> str:
    """`text` as Markdown shows it letter for letter (a code span): a refusal quotes overrides such as
    `+hydra.callbacks.x._target_=...`, whose underscores Markdown would read as emphasis."""
    return f"`` {text} ``"


def rounded(df):
    """Floats to 4 significant digits for reading (5.710170178500448 -> 5.71); the files keep every digit."""
    def short(value):
        return float(f"{value:.4g}") if isinstance(value, float) else value

    return df.apply(lambda col: col.map(short)) if len(df) else df


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


if __name__ == "__main__":
    raise SystemExit(main())
