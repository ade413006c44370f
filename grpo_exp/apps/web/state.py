"""The state behind the page (App): the outputs folder it browses and launches into, the run it started,
the models the Playground loaded, the folder the report's plots go to; the function behind the Launch
button and the `/launch` API, and the dropdowns' view of the outputs folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from grpo_exp.apps import launch_bounds, launch_check
from grpo_exp.apps.launch_check import LaunchRefused
from grpo_exp.apps.web.common import REFUSED, mtime
from grpo_exp.apps.web.runner import Launcher
from grpo_exp.base import log

logger = log.get_logger(__name__)


class App:
    """What the Gradio Blocks (web/page.py) work on: the outputs folder, the launched run, loaded models."""

    def __init__(self, outputs: Path, pass_credentials: bool = False):
        from grpo_exp.analysis.playground import Models

        self.outputs = outputs
        self.launcher = Launcher(outputs, pass_credentials)
        self.models = Models()
        # the report's PNGs are written here, not into the runs (browsing must not change them)
        self.report_dir = Path(tempfile.mkdtemp(prefix="grpo-app-reports-"))

    # -- starting a run

    def launch(self, overrides: str) -> str:
        """The run directory of a run started with these overrides (text, split as a shell splits words, run
        without one), or "refused: <why>" in one line with nothing started: the /launch API and the Launch button."""
        try:
            too_big = launch_bounds.request_size(overrides)
            if too_big:  # before splitting or composing: a huge box would hold the cores and the compose lock
                raise LaunchRefused(too_big)
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
        dirs = sorted(set(dirs), key=mtime, reverse=True)
        choices = [(runs.label(d, self.outputs), str(d)) for d in dirs]
        if where == "runs":
            sweeps = sorted(runs.find_sweeps(self.outputs), key=mtime, reverse=True)
            choices = [(f"sweep: {runs.label(s, self.outputs)} ({len(runs.find_runs(s))} jobs)", str(s))
                       for s in sweeps] + choices
        return choices
