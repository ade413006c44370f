"""The web app as an attacker meets it: through the real `/launch` endpoint of a running app with a login (gradio_client),
escaped interpolations in every path key, uploads and online logging, every bound of launch_bounds.py, an override
box too big to read: each is refused in one line, nothing is created outside the outputs folder, and no value of the
app's environment appears in any answer or in the app's log. A run it starts gets none of the app's secrets, reads a
path as it was checked even when a symlink is swapped after the check, and is stopped when the app quits, which
removes its temporary folder."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from grpo_exp.apps import launch_bounds
from tests.apps.test_app import free_port, start_app, wait_for_url

gradio_client = pytest.importorskip("gradio_client", reason="the app extra (pip install -e '.[app]') brings gradio_client")

LOGIN = ("alice", "s3cret-login-0x41")
SECRETS = {"GRPO_APP_AUTH": ":".join(LOGIN), "GRPO_TEST_SECRET": "secret-value-0x42", "HF_TOKEN": "hf_secret_0x43",
           "WANDB_API_KEY": "wandb-secret-0x44"}
RUN_S = 300


class Server:
    """A running app (its own process), its log read on as it runs."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.outputs = tmp / "outputs"
        self.outputs.mkdir(parents=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.process = start_app(self.outputs, self.port, tmp / "tmp", env=SECRETS)
        wait_for_url(self.process, self.url)
        self.said: list[str] = []
        threading.Thread(target=lambda: self.said.extend(iter(self.process.stdout.readline, "")), daemon=True).start()
        self.client = gradio_client.Client(self.url, auth=LOGIN, verbose=False)

    def launch(self, text: str) -> str:
        return self.client.predict(text, api_name="/launch")

    def started_pid(self, after: int = 0, seconds: float = 60) -> int:
        """The pid of the run the app started, from its log lines from `after` on."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            found = [int(m.group(1)) for line in self.said[after:] if (m := re.search(r"started pid (\d+)", line))]
            if found:
                return found[-1]
            time.sleep(0.3)
        raise AssertionError(f"no 'started pid' line: {self.said}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    made = Server(tmp_path_factory.mktemp("security"))
    yield made
    made.close()


def _outside(server: Server) -> Path:
    return server.tmp / "outside"


def hostile(server: Server) -> list[tuple[str, str]]:
    """(override text, what its refusal says)."""
    out, outside = server.outputs, _outside(server)
    escaped_env = r"$\{oc.env\:GRPO_TEST_SECRET\}"
    escaped_key = r"$\{reward.system_prompt\}"
    interpolation = "interpolations (${...}, escaped or not) are not accepted"
    cases = []
    for key, extra in (("init_from", ""), ("stage.path", ""), ("curriculum.branch_from", "curriculum=progressive "),
                       ("model.id", "model=custom "), ("stage.hub_id", ""), ("logger.dir", "logger=trackio ")):
        cases.append((f"{extra}{key}={out}/{escaped_env}", interpolation))
        cases.append((f"{extra}reward.system_prompt=.. {key}={out}/{escaped_key}/x", interpolation))
        # the app does not offer branching at all, wherever the path lies
        not_offered = "branching takes another run's directory" if key == "curriculum.branch_from" else None
        cases.append((f"{extra}{key}={outside}/x", not_offered or "lies outside the folders the app reads and writes"))
    cases += [
        (f"reward.system_prompt='a \\${{oc.env:GRPO_TEST_SECRET}}'", interpolation),
        (r"'model.name=a\b'", "a backslash is not accepted here"),  # quoted: shlex keeps the backslash
        ("push_to_hub=true", "uploads to the hub are not offered from the app"),
        ("hub_model_id=me/model", "uploads to the hub are not offered from the app"),
        ("hub_private=false", "uploads to the hub are not offered from the app"),
        ("logger=wandb logger.mode=online", "the app logs only offline or disabled"),
        ("logger=wandb logger.entity=me", "a wandb entity matters only when logging online"),
        ("train.save_steps=1 train.save_total_limit=null", "train.save_total_limit=null is not offered by the app"),
        ("x" * (launch_bounds.MAX_OVERRIDE_BYTES + 1), f"the app takes at most {launch_bounds.MAX_OVERRIDE_BYTES}"),
        (" ".join(["train.seed=1"] * (launch_bounds.MAX_OVERRIDE_ITEMS + 1)),
         f"the app takes at most {launch_bounds.MAX_OVERRIDE_ITEMS}"),
    ]
    for bound in launch_bounds.BOUNDS:
        if bound.high == 0:  # a list bounded by its length: curriculum.stages
            value = "[" + ",".join(["basic"] * (bound.max_items + 1)) + "]"
            cases.append((f"curriculum=progressive {bound.key}={value}", f"at most {bound.max_items}"))
        elif bound.max_items:
            cases.append((f"{bound.key}=[{bound.high + 1}]", f"the app takes {bound.low}-{bound.high}"))
        else:
            cases.append((f"model=tiny_random {bound.key}={bound.high + 1}", f"{bound.low}-{bound.high}"))
    return cases


@pytest.mark.slow
def test_every_hostile_list_is_refused_in_one_line_through_launch(server):
    outside = _outside(server)
    outside.mkdir()
    refused = []
    for text, why in hostile(server):
        answer = server.launch(text)
        assert answer.startswith("refused: ") and "\n" not in answer, (text[:200], answer)
        assert why in answer, (text[:200], answer)
        assert not any(value in answer for value in SECRETS.values()), answer
        refused.append(answer)
    assert list(outside.iterdir()) == [], "a file was created outside the outputs folder"
    assert not (server.outputs / "train").exists()  # no run started, no run directory
    time.sleep(1)  # the app's log lines of the last refusals
    log = "".join(server.said)
    assert not any(value in log for value in SECRETS.values()), "an environment value reached the app's log"
    assert len(refused) == len(hostile(server))


@pytest.mark.slow
def test_the_playground_and_uploads_are_bounded(server):
    with pytest.raises(Exception, match=f"greater than maximum value {launch_bounds.PLAYGROUND_MAX_NEW_TOKENS}"):
        server.client.predict(None, "1+1?", "", "greedy", 0.8, 0, launch_bounds.PLAYGROUND_MAX_NEW_TOKENS + 1,
                              api_name="/answer_both")
    notice = server.client.predict(None, "x" * (launch_bounds.MAX_QUESTION_CHARS + 1), "", "greedy", 0.8, 0, 0,
                                   api_name="/answer_both")[0]
    assert notice.startswith("**Refused:** the question is") and "at most 4000" in notice, notice
    import httpx

    with httpx.Client() as http:
        assert http.post(server.url + "gradio_api/upload", files={"files": ("a.bin", b"x" * 100)}).status_code == 401
        http.post(server.url + "login", data={"username": LOGIN[0], "password": LOGIN[1]}).raise_for_status()
        big = http.post(server.url + "gradio_api/upload", files={"files": ("a.bin", b"x" * 2_000_000)})
        assert big.status_code == 413, big.text


@pytest.mark.slow
def test_the_launch_api_needs_the_login(server):
    with pytest.raises(Exception, match="credentials were not provided"):
        gradio_client.Client(server.url, verbose=False).predict("model=tiny_random", api_name="/launch")
    with pytest.raises(Exception, match="Could not login"):
        gradio_client.Client(server.url, auth=(LOGIN[0], "wrong"), verbose=False)
    assert not (server.outputs / "train").exists()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _gone(pid: int, seconds: float) -> bool:
    """Whether the process ends within `seconds` (ended and not yet reaped by the app counts as ended)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.5)
    return False


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and not path.exists():
        time.sleep(0.3)
    assert path.exists(), f"{path} did not appear within {seconds} s"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a process's environment from /proc")
def test_a_launched_run_gets_no_secrets_reads_what_was_checked_and_stops_with_the_app(tmp_path):
    """A run writes trackio's database through a symlink under the outputs folder; the symlink is swapped to a
    folder outside right after /launch answers: the run still writes where the check looked. Its environment holds
    none of the app's secrets. Then a second run is started and the app is sent SIGTERM: the run is stopped and
    the app's temporary folder is gone."""
    server = Server(tmp_path)
    pids = []
    try:
        real, link, outside = server.outputs / "real", server.outputs / "link", tmp_path / "outside"
        real.mkdir()
        outside.mkdir()
        link.symlink_to(real)
        run = Path(server.launch("model=tiny_random debug=smoke logger=trackio train.max_steps=1 eval.after_train=false "
                                 f"eval.every_steps=null logger.dir={link}/trackio"))
        assert run.parent == server.outputs / "train" / "runs", run
        pids.append(server.started_pid())
        link.unlink()
        link.symlink_to(outside)  # swapped after the check: the run was given the resolved path
        env = _environ(pids[0])
        assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
        assert not any(value in "".join(env.values()) for value in SECRETS.values())
        assert env.get("HF_HUB_DISABLE_IMPLICIT_TOKEN") == "1"
        assert _gone(pids[0], RUN_S), "the run did not end"
        assert json.loads((run / "status.json").read_text())["status"] == "completed"
        assert list(outside.iterdir()) == [] and list((real / "trackio").glob("*.db")), list(real.rglob("*"))

        before = len(server.said)
        second = Path(server.launch("model=tiny_random debug=smoke logger=none train.max_steps=200 "
                                    "eval.after_train=false eval.every_steps=null"))
        pids.append(server.started_pid(after=before))
        # its first step logged: the run is training, not still importing (status.json comes only at its end, and
        # waiting for it let the 200 steps finish before the app was sent SIGTERM: nothing was left to stop)
        _wait_for(second / "history.jsonl", RUN_S)
        temp = [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("grpo-app-reports-")]
        assert temp, list((tmp_path / "tmp").iterdir())
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(120) == 0
        assert _gone(pids[1], 5), "the app quit and left its run going"
        assert not any(p.exists() for p in temp), "the app's temporary folder is left behind"
        assert json.loads((second / "status.json").read_text())["status"] == "stopped"
        assert len((second / "history.jsonl").read_text().splitlines()) < 200  # stopped, not finished
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.close()


def test_docs_app_lists_every_bound():
    from tests.conftest import ROOT

    page = (ROOT / "docs" / "app.md").read_text()
    missing = [row for row in launch_bounds.markdown_rows() if row not in page]
    assert not missing, f"docs/app.md's Bounds table lacks: {missing}"
    assert (f"at most {launch_bounds.MAX_OVERRIDE_BYTES} bytes and {launch_bounds.MAX_OVERRIDE_ITEMS} overrides" in page
            and f"at most {launch_bounds.MAX_QUESTION_CHARS} characters with at most "
                f"{launch_bounds.PLAYGROUND_MAX_NEW_TOKENS} new tokens" in page
            and "at most 1 MB" in page and launch_bounds.MAX_FILE_SIZE == "1mb")
