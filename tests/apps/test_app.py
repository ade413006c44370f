"""The web app (`python -m grpo_exp.app`) driven in a real browser: headless Chromium (Debian's package)
through selenium and the system chromedriver; nothing is downloaded.

One app serves the module, on a free port and an outputs folder that starts empty: the Runs tab must say
so; a 1-step tiny_random run is then launched from the Launch tab with a non-default value in every
control, and the Runs, Completions and Playground tabs are checked on it. Another run is stopped with the
Stop button, and failing ones show their error; what the form does not offer (Hydra's settings, flags, paths
outside the outputs folder, shell syntax) is refused with one line and starts nothing. Each test saves a
screenshot of its tab into its tmp dir.
Without Chromium the browser tests are skipped with one line saying how to install it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

# GRPO_APP_SCREENSHOTS=docs/app: each test's screenshot is copied there too (docs/app.md shows them)
SCREENSHOTS_ENV = "GRPO_APP_SCREENSHOTS"
APP_START_S = 90
RUN_S = 180  # a 1-step tiny run, with the machine's other work beside it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_app(outputs: Path, port: int, tmp: Path, env: dict | None = None) -> subprocess.Popen:
    # TMPDIR: the app's report plots and Gradio's file cache stay in the test's tmp dir. Torch's compile cache,
    # under TMPDIR unless TORCHINDUCTOR_CACHE_DIR is set (its precompiled headers there whatever it says), is linked
    # to the one every other test's runs use: in a new TMPDIR each app's first run built them anew (about 20 s)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    tmp.mkdir(exist_ok=True)
    shared = Path(default_cache_dir())
    shared.mkdir(parents=True, exist_ok=True)
    if not (tmp / shared.name).exists():
        (tmp / shared.name).symlink_to(shared, target_is_directory=True)
    return subprocess.Popen([sys.executable, "-m", "grpo_exp.app", "--port", str(port), "--outputs", str(outputs)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), **(env or {})})


def wait_for_url(server: subprocess.Popen, url: str) -> None:
    """Read the app's output until it prints its URL (it logs a line or two before)."""
    deadline = time.time() + APP_START_S
    first = ""
    while time.time() < deadline and "grpo-exp app:" not in first:
        first = server.stdout.readline()
        if not first and server.poll() is not None:
            pytest.fail(f"the app exited with {server.returncode}")
    assert url in first, first


# ---------------------------------------------------------------- without a browser

@pytest.mark.slow
def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "grpo_exp.app", "--port", str(port), "--outputs", str(tmp_path)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: port {port} on 127.0.0.1 is already in use; choose another with --port"


def test_launch_form_overrides_name_every_control(tmp_path):
    from grpo_exp.apps.web.launch_tab import build_overrides
    from grpo_exp.apps.launch_check import LaunchRefused, check_items

    overrides = build_overrides({"model": "tiny_random", "debug": "(none)"},
                                {"train.max_steps": 3, "train.learning_rate": 3e-5, "eval.every_steps": 0},
                                False, "stage.num_train=40 ++train.max_grad_norm=0.5")
    assert overrides == ["model=tiny_random", "train.max_steps=3", "train.learning_rate=3e-05", "eval.every_steps=null",
                         "eval.after_train=false", "stage.num_train=40", "++train.max_grad_norm=0.5"]
    check_items(overrides, tmp_path, ROOT)
    with pytest.raises(LaunchRefused, match="sweeps and flags go on the command line"):
        check_items(build_overrides({}, {}, True, "-m train.seed=1,2"), tmp_path, ROOT)


@pytest.mark.slow
def test_a_refused_run_shows_its_one_line(tmp_path):
    """Bad input the app cannot see (a model folder without config.json): the entrypoint exits 2 with one
    `error:` line and writes no run directory; the Launch tab says so (the status line the browser shows).
    What the app can see is refused before any process starts."""
    from grpo_exp.apps.web.runner import Launcher, launch_state
    from grpo_exp.apps.launch_check import LaunchRefused

    launcher = Launcher(tmp_path)
    with pytest.raises(LaunchRefused, match="unknown config key 'train.max_stepz' \(did you mean 'train.max_steps'\?\); valid keys under train:"):
        launcher.start(["debug=smoke", "logger=none", "train=default", "train.max_stepz=3"])
    assert launcher.current is None and not (tmp_path / "train").exists()
    (tmp_path / "no_model").mkdir()
    launch = launcher.start(["debug=smoke", "logger=none", "model=custom", f"model.id={tmp_path / 'no_model'}"])
    launch.process.wait(120)
    state = launch_state(launch)
    assert state["status"].startswith(f"**refused** (bad input, exit 2; nothing was written): model.id="
                                      f"{tmp_path / 'no_model'} is a directory without config.json"), state
    assert not launch.run_dir.exists() and state["error"].startswith("error: model.id=")


# ---------------------------------------------------------------- the browser

def find_chromium() -> tuple[str, str] | str:
    """(browser, chromedriver) paths, or why the browser tests cannot run."""
    import importlib.util

    for module in ("gradio", "selenium"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[app]'); browser tests skipped"
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        return "Chromium or chromedriver not found (apt-get install -y chromium chromium-driver); browser tests skipped"
    return browser, driver


class Page:
    """The app in headless Chromium, with the few gestures the tests need."""

    def __init__(self, driver, url: str, debug_dir: Path):
        self.driver, self.url, self.debug_dir = driver, url, debug_dir
        self.timeouts = 0

    def el(self, elem_id: str, css: str | None = None):
        from selenium.webdriver.common.by import By

        found = self.driver.find_element(By.ID, elem_id)
        return found.find_element(By.CSS_SELECTOR, css) if css else found

    def text(self, elem_id: str) -> str:
        element = self.el(elem_id)
        # the command box (CodeMirror) renders only while on screen
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        return element.text

    def wait(self, condition, timeout: float = 30, what: str = "") -> object:
        """Poll `condition()` until it is truthy; page elements re-render, so errors count as not yet."""
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                value = condition()
                if value:
                    return value
            except Exception as err:  # stale or not yet rendered
                last = err
            time.sleep(0.25)
        self.timeouts += 1
        shot = self.debug_dir / f"timeout-{self.timeouts}.png"  # what the page showed, for whoever reads the failure
        self.driver.save_screenshot(str(shot))
        raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}; last error: {last}; "
                             f"the page: {shot}")

    def wait_text(self, elem_id: str, needle: str, timeout: float = 30) -> str:
        return self.wait(lambda: needle in self.text(elem_id) and self.text(elem_id), timeout,
                         f"'{needle}' in #{elem_id}")

    def tab(self, name: str) -> None:
        from selenium.webdriver.common.by import By

        button = self.wait(lambda: next(b for b in self.driver.find_elements(By.CSS_SELECTOR, "button[role=tab]")
                                        if b.text.strip() == name), what=f"tab {name}")
        button.click()

    def pick(self, elem_id: str, option: str) -> None:
        """Choose `option` in a Gradio dropdown as a user does: open it, click the option."""
        from selenium.webdriver.common.by import By

        box = self.el(elem_id, "input")
        box.click()
        listbox = self.wait(lambda: self.driver.find_element(By.ID, box.get_attribute("aria-controls")),
                            what=f"options of #{elem_id}")
        self.wait(lambda: next(o for o in listbox.find_elements(By.CSS_SELECTOR, "[role=option]")
                               if o.get_attribute("aria-label") == option), what=f"{option} in #{elem_id}").click()
        self.wait(lambda: self.el(elem_id, "input").get_attribute("value") == option, what=f"#{elem_id} = {option}")

    def type(self, elem_id: str, value, css: str = "input, textarea") -> None:
        from selenium.webdriver.common.keys import Keys

        box = self.el(elem_id, css)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(str(value))
        box.send_keys(Keys.TAB)  # Gradio takes the value on input/blur

    def value(self, elem_id: str, css: str = "input, textarea") -> str:
        return self.el(elem_id, css).get_attribute("value")

    def click(self, elem_id: str) -> None:
        self.el(elem_id).click()

    def shot(self, path: Path) -> Path:
        # the whole page: set the window to the document's height first
        height = self.driver.execute_script("return document.body.scrollHeight")
        self.driver.set_window_size(1400, min(max(height, 900), 4000))
        self.driver.save_screenshot(str(path))
        if os.environ.get(SCREENSHOTS_ENV):  # docs/app.md's pictures are these tests' own screenshots
            folder = Path(os.environ[SCREENSHOTS_ENV])
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, folder / path.name)
        return path


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(page, outputs, what the Runs tab said while outputs was empty) for one app and one browser."""
    found = find_chromium()
    if isinstance(found, str):
        pytest.skip(found)
    browser, chromedriver = found
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    base = tmp_path_factory.mktemp("app")
    outputs = base / "outputs"
    outputs.mkdir()
    port = free_port()
    server = start_app(outputs, port, base / "tmp")
    url = f"http://127.0.0.1:{port}/"
    wait_for_url(server, url)

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    page = Page(driver, url, base)
    try:
        driver.get(url)
        # before any run: what each tab says about an empty folder
        page.tab("Runs")
        empty = {"runs": page.wait_text("runs-header", "No runs")}
        page.shot(base / "runs_empty.png")
        page.tab("Completions")
        empty["completions"] = page.wait_text("comp-summary", "No completions")
        page.tab("Playground")
        empty["playground"] = page.wait_text("play-notice", "No trained runs")
        yield page, outputs, empty, base
    finally:
        driver.quit()
        server.terminate()  # every run it started has ended; nothing to wait for
        server.wait(30)


@pytest.mark.slow
def test_an_empty_outputs_folder_says_so(app, tmp_path):
    page, outputs, empty, base = app
    empty = {tab: " ".join(text.split()) for tab, text in empty.items()}  # a code span renders on its own line
    assert f"No runs under {outputs} yet" in empty["runs"]
    assert f"No completions under {outputs} yet" in empty["completions"]
    assert f"No trained runs under {outputs} yet" in empty["playground"]
    assert not any("Traceback" in text or "Error" in text for text in empty.values())
    shutil.copy(base / "runs_empty.png", tmp_path / "runs_empty.png")


@pytest.mark.slow
def test_the_launch_tab_refuses_what_the_form_does_not_offer(app, tmp_path):
    """Each hostile list typed into the overrides box: the command box says it is refused, Start answers with
    the one line, and nothing starts: no run directory, no callback's folder, no file from the shell."""
    from tests.apps.test_launch_check import hostile

    page, outputs, _, _ = app
    runs = outputs / "train" / "runs"
    before = sorted(runs.iterdir()) if runs.is_dir() else []
    page.tab("Launch")
    for text, item, why in hostile(tmp_path):
        page.type("launch-extra", text)
        page.wait_text("launch-command", f"# refused: '{item}': ")
        page.click("launch-start")
        notice = page.wait_text("launch-notice", f"refused: '{item}': ")
        assert notice.strip().startswith("refused: ") and why in notice and "\n" not in notice.strip(), notice
    page.shot(tmp_path / "launch_refused.png")
    page.type("launch-extra", "")
    assert not (tmp_path / "pwned").exists() and not (ROOT / "x").exists()
    assert (sorted(runs.iterdir()) if runs.is_dir() else []) == before
    assert "running" not in page.text("launch-status")


# Every control of the Launch tab set away from its default where a tiny run allows it.
CHOICES = {"debug": "smoke", "model": "tiny_random", "stage": "basic", "reward": "correctness", "quantization": "none",
           "peft": "none", "cpu": "single", "logger": "none", "train": "default", "curriculum": "none"}
NUMBERS = {"train.max_steps": 1, "train.learning_rate": 3e-05, "train.num_generations": 2,
           "train.per_device_train_batch_size": 4, "train.max_completion_length": 12, "train.temperature": 0.9,
           "train.beta": 0.01, "train.seed": 7, "ewc.lambda": 0.5, "eval.every_steps": 1}
EXTRA = "completions_every=1 stage.num_train=24"


def number_id(key: str) -> str:
    return f"launch-{key.replace('.', '-')}"


def fill_launch(page: Page, choices: dict, numbers: dict, extra: str = "", after_train: bool = False) -> None:
    page.tab("Launch")
    # debug=smoke also picks its model (tiny_random), in an answer that may land after a later pick: pick
    # until the command names every choice
    def choices_hold() -> bool:
        for group, option in choices.items():
            if f"{group}={option}" not in page.text("launch-command"):
                page.pick(f"launch-{group}", option)
        time.sleep(1.0)
        return all(f"{g}={o}" in page.text("launch-command") for g, o in choices.items())

    page.wait(choices_hold, 60, "the command to name every group")
    # Picking a group refills the numbers from the config, in answers that may land after our typing on a
    # busy machine: type until the fields keep what was typed.
    def numbers_hold() -> bool:
        for key, value in numbers.items():
            if not _same(page.value(number_id(key), "input"), value):
                page.type(number_id(key), value, "input")
        time.sleep(1.0)
        return all(_same(page.value(number_id(k), "input"), v) for k, v in numbers.items())

    page.wait(numbers_hold, 60, "the numbers to keep their typed values")
    checkbox = page.el("launch-after-train", "input[type=checkbox]")
    if checkbox.is_selected() != after_train:
        checkbox.click()
    page.type("launch-extra", extra)
    page.wait(lambda: all(f"{k}=" in page.text("launch-command") for k in numbers) and
              f"eval.after_train={'true' if after_train else 'false'}" in page.text("launch-command") and
              (not extra or extra.split()[0] in page.text("launch-command")), what="the command to name every control")


def _same(shown: str, value) -> bool:
    try:
        return float(shown) == pytest.approx(float(value))
    except (TypeError, ValueError):
        return False


def newest_run(outputs: Path) -> Path:
    """The run directory the app made last (they are named by time, to the microsecond)."""
    return max((outputs / "train" / "runs").iterdir(), key=lambda p: p.name)


@pytest.fixture(scope="module")
def launched(app):
    """A 1-step run started from the Launch tab with a chosen value in every control, once finished."""
    page, outputs, _, _ = app
    fill_launch(page, CHOICES, NUMBERS, EXTRA)
    page.click("launch-start")
    page.wait_text("launch-status", "running")
    status = page.wait(lambda: (t := page.text("launch-status")) and ("completed" in t or "failed" in t) and t,
                       RUN_S, "the launched run to end")
    assert "completed" in status, (status, page.text("launch-log"))
    runs = sorted((outputs / "train" / "runs").iterdir())
    assert len(runs) == 1
    return runs[0]


@pytest.mark.slow
def test_launch_starts_the_run_with_every_control(app, launched, tmp_path):
    page, _, _, _ = app
    page.tab("Launch")
    command = page.text("launch-command")
    overrides = yaml.safe_load((launched / ".hydra" / "overrides.yaml").read_text())
    given = dict(o.split("=", 1) for o in overrides)
    for group, option in CHOICES.items():
        assert given[group] == option, group
        assert f"{group}={option}" in command
    for key, value in NUMBERS.items():
        assert float(given[key]) == pytest.approx(value), key
    assert given["eval.after_train"] == "false"
    assert given["completions_every"] == "1" and given["stage.num_train"] == "24"
    # and the run did what they say: the resolved config and its one step
    config = yaml.safe_load((launched / ".hydra" / "config.yaml").read_text())
    assert config["model"]["name"] == "tiny_random" and config["reward"]["name"] == "correctness"
    assert config["train"]["learning_rate"] == pytest.approx(3e-05) and config["train"]["seed"] == 7
    assert json.loads((launched / "metrics.json").read_text())["steps"] == 1
    assert page.wait(lambda: float(page.value("launch-progress", "input[type=number]")) == 100, what="progress 100%")
    assert "train_runtime" in page.value("launch-log", "textarea")  # the trainer's own log lines
    page.shot(tmp_path / "launch.png")


@pytest.mark.slow
def test_runs_tab_shows_the_run(app, launched, tmp_path):
    from selenium.webdriver.common.by import By

    page, _, _, _ = app
    page.tab("Runs")
    page.wait_text("runs-header", "1 runs, 0 sweeps")
    assert launched.name in page.text("runs-overview") and "completed" in page.text("runs-overview")
    page.wait_text("runs-detail", launched.name)
    page.wait_text("runs-table", "completed")
    # the report's plots: the reward curves and the learning curve (validation accuracy) at least
    page.wait(lambda: len(page.el("runs-plots").find_elements(By.CSS_SELECTOR, "img")) >= 2, what="report plots")
    captions = page.text("runs-plots")
    assert "reward curves" in captions and "learning curve" in captions
    for plot in ("runs-reward", "runs-heldout"):  # Vega draws into a canvas or an svg
        page.wait(lambda: page.el(plot).find_elements(By.CSS_SELECTOR, "canvas, svg"), what=plot)
    page.shot(tmp_path / "runs.png")


@pytest.mark.slow
def test_completions_tab_filters_by_step_and_reward(app, launched, tmp_path):
    page, _, _, _ = app
    page.tab("Completions")
    rows = [json.loads(line) for line in (launched / "completions.jsonl").read_text().splitlines()]
    total = len(rows)
    summary = page.wait_text("comp-summary", f"{total} of {total} completions")
    assert "mean advantage" in summary
    table = page.text("comp-table")
    assert "advantage" in table and rows[0]["prompt"] in table
    page.pick("comp-step", "1")
    page.wait_text("comp-summary", f"{sum(r['step'] == 1 for r in rows)} of {total}")
    page.type("comp-min", "2")  # no reward of a correctness-only run reaches 2
    page.wait_text("comp-summary", f"0 of {total}")
    page.type("comp-min", "")
    page.wait_text("comp-summary", f"{total} of {total}")
    page.shot(tmp_path / "completions.png")


@pytest.mark.slow
def test_playground_answers_with_base_and_trained_model(app, launched, tmp_path):
    page, _, _, _ = app
    page.tab("Playground")
    page.wait(lambda: page.value("play-pick", "input") == str(launched.relative_to(launched.parents[2])),
              what="the run picked")
    page.click("play-sample")  # a held-out problem of the run's stage, with its answer
    question = page.wait(lambda: page.value("play-question", "textarea"), what="a held-out question "
                         f"(the page says: {page.text('play-notice')!r})")
    assert page.value("play-expected")
    page.click("play-ask")
    base = page.wait_text("play-base-verdict", "parsed answer", 120)
    trained = page.wait_text("play-run-verdict", "parsed answer")
    assert ("correct" in base or "wrong" in base) and ("correct" in trained or "wrong" in trained)
    assert "base model (tiny_random)" in page.text("play-base-title")
    assert launched.name in page.text("play-run-title")
    assert question
    page.shot(tmp_path / "playground.png")


@pytest.mark.slow
def test_stop_button_checkpoints_the_run(app, launched, tmp_path):
    page, outputs, _, _ = app
    fill_launch(page, {"debug": "smoke", "logger": "none"}, {"train.max_steps": 500})
    page.click("launch-start")
    page.wait(lambda: "running" in (t := page.text("launch-status")) and "step 0/" not in t,
              RUN_S, "the second run's first step")
    run_dir = newest_run(outputs)
    assert run_dir != launched and run_dir.name in page.text("launch-status")
    page.click("launch-stop")
    page.wait_text("launch-notice", "SIGTERM")
    status = page.wait_text("launch-status", "stopped", 120)
    assert "checkpoint saved" in status
    assert list((run_dir / "checkpoints").glob("checkpoint-*"))
    assert json.loads((run_dir / "status.json").read_text())["status"] == "stopped"
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] < 500
    page.shot(tmp_path / "launch_stopped.png")


@pytest.mark.slow
def test_a_failed_run_shows_its_error(app, launched, tmp_path):
    page, outputs, _, _ = app
    # a run that fails once started: a "model" directory whose weights do not load -> error.txt (under the
    # outputs folder: the app reads no model from elsewhere)
    broken = outputs / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    fill_launch(page, {"debug": "smoke", "model": "custom", "logger": "none"}, {"train.max_steps": 1},
                f"model.id={broken}")
    page.click("launch-start")
    status = page.wait(lambda: "failed" in (t := page.text("launch-status")) and t, RUN_S, "the run to fail")
    error = page.wait_text("launch-error", "Traceback")
    assert "error.txt" in error and "failed" in status
    page.shot(tmp_path / "launch_failed.png")
