"""Model cards and push_to_hub: the card in a run's model/ (and adapter/) carries the hub's metadata, the
before/after table and the settings; the push uploads model/ and adapter/ through huggingface_hub (HfApi
replaced here: no network); push_to_hub without a repo id, or with the hub unreachable, fails in one line
before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants
from omegaconf import OmegaConf

from grpo_exp.base.errors import ConfigError
from grpo_exp.config.checks import validate
from grpo_exp.training import hub
from grpo_exp.training.model_card import write_cards
from tests.conftest import assert_fails_fast_with_one_line, compose_cfg

BEFORE_AFTER = """Greedy accuracy on the test split (held out, reported once):

| set (n) | base accuracy [95% CI] | trained accuracy [95% CI] |
|---|---|---|
| basic (8) | 0.125 [0.022, 0.471] | 0.500 [0.215, 0.785] |"""
PLAN = {"speed.precision": "fp32", "speed.device": "cpu", "speed.generation": "engine", "speed.attention": "grouped"}


def fake_run(tmp_path: Path, adapter: bool = False) -> Path:
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    if adapter:
        (run / "adapter").mkdir()
    (run / "before_after.md").write_text(BEFORE_AFTER + "\n")
    (run / "speed_plan.json").write_text(json.dumps(PLAN))
    return run


def test_card_has_the_hub_metadata_the_table_and_the_settings(tmp_path):
    run = fake_run(tmp_path)
    cfg = compose_cfg(["model=qwen2_5_0_5b_instruct", "stage=intermediate", "hub_model_id=me/qwen-grpo",
                       "train.learning_rate=3e-5"], run)
    assert write_cards(run, cfg, steps=90) == [run / "model" / "README.md"]
    card = ModelCard.load(run / "model" / "README.md")  # the hub's own parser reads the front matter
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert card.data.library_name == "transformers"
    assert set(card.data.tags) == {"grpo", "trl", "grpo-exp", "intermediate"}
    assert card.data.model_name == "me/qwen-grpo" and card.data.datasets is None  # generated problems
    text = card.text
    assert BEFORE_AFTER.splitlines()[-1] in text  # the before/after table itself
    assert "| `train.learning_rate` | 3e-05 |" in text and "| `train.max_steps` | 90 |" in text
    assert "| `speed.generation` | engine |" in text  # speed_plan.json
    assert "90 steps" in text and 'from_pretrained("me/qwen-grpo")' in text
    assert "| `reward` | math: correctness x 1, answer_format x 0.05 |" in text


def test_card_names_packaged_bases_hub_datasets_and_the_adapter(tmp_path):
    run = fake_run(tmp_path, adapter=True)
    (run / "before_after.md").unlink()
    cfg = compose_cfg(["stage=gsm8k", "peft=lora", "eval.after_train=false"], run)  # smollm2_135m, packaged
    written = write_cards(run, cfg, steps=3, status="interrupted")
    assert written == [run / "model" / "README.md", run / "adapter" / "README.md"]
    model_card, adapter_card = (ModelCard.load(p) for p in written)
    assert model_card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_card.data.datasets == ["openai/gsm8k"] and "gsm8k" in model_card.data.tags
    assert "Not evaluated after training" in model_card.text and "interrupted before the planned" in model_card.text
    assert adapter_card.data.library_name == "peft" and {"lora", "peft"} <= set(adapter_card.data.tags)
    assert "PeftModel.from_pretrained" in adapter_card.text and "| `peft` | lora r=16" in adapter_card.text
    # a random test model has no hub base
    tiny = compose_cfg(["debug=smoke"], run)
    write_cards(run, tiny)
    assert ModelCard.load(run / "model" / "README.md").data.base_model is None


def test_card_from_the_recorded_config_alone(tmp_path):
    run = fake_run(tmp_path)
    cfg = compose_cfg(["debug=smoke", "stage=two_step"], run)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "metrics.json").write_text(json.dumps({"git_commit": "abc1234", "status": "completed"}))
    write_cards(run)
    card = ModelCard.load(run / "model" / "README.md")
    assert "two_step" in card.data.tags and "- grpo-exp: abc1234" in card.text  # the commit that trained it
    with pytest.raises(ConfigError, match="not a training run"):
        write_cards(tmp_path / "elsewhere")


class FakeHfApi:
    """HfApi's create_repo and upload_folder, recorded instead of sent."""

    calls: list = []
    fail: Exception | None = None

    def create_repo(self, repo_id, **kwargs):
        FakeHfApi.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        if FakeHfApi.fail:
            raise FakeHfApi.fail
        FakeHfApi.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        files = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
        FakeHfApi.calls[-1][2]["files"] = files
        return type("CommitInfo", (), {"oid": f"commit-{len(FakeHfApi.calls)}"})()


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeHfApi.calls, FakeHfApi.fail = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_push_uploads_model_and_adapter(tmp_path, fake_hub):
    run = fake_run(tmp_path, adapter=True)
    cfg = compose_cfg(["debug=smoke", "push_to_hub=true", "hub_model_id=me/tiny", "hub_private=true"], run)
    write_cards(run, cfg)
    result = hub.push(cfg, run)
    assert result == {"repo_id": "me/tiny", "url": "https://huggingface.co/me/tiny",
                      "commits": {"model": "commit-2", "adapter": "commit-3"}}
    (_, repo, created), (_, _, model), (_, _, adapter) = fake_hub.calls
    assert repo == "me/tiny" and created == {"exist_ok": True, "private": True}
    assert model["folder_path"] == str(run / "model") and model["path_in_repo"] is None
    assert adapter["folder_path"] == str(run / "adapter") and adapter["path_in_repo"] == "adapter"
    assert "README.md" in model["files"] and "README.md" in adapter["files"]


def test_a_failed_push_is_recorded_and_keeps_the_run(tmp_path, fake_hub, caplog):
    run = fake_run(tmp_path)
    cfg = compose_cfg(["debug=smoke", "push_to_hub=true", "hub_model_id=me/tiny"], run)
    fake_hub.fail = ConnectionError("network went away")
    result = hub.push(cfg, run)
    assert result == {"repo_id": "me/tiny", "error": "ConnectionError: network went away"}
    assert f"retry with: hf upload me/tiny {run / 'model'} ." in caplog.text


def test_a_smoke_run_writes_its_card_and_pushes(tmp_path, fake_hub, monkeypatch):
    from grpo_exp.training.stage import train

    run = tmp_path / "run"
    cfg = compose_cfg(["debug=smoke", "logger=none", "eval.limit=4", "eval.every_steps=null",
                       "push_to_hub=true", "hub_model_id=me/smoke"], run)
    metrics = train(cfg)
    card = ModelCard.load(run / "model" / "README.md")
    assert {"grpo", "trl", "grpo-exp", "basic"} <= set(card.data.tags) and card.data.library_name == "transformers"
    assert (run / "before_after.md").read_text().strip().splitlines()[-1] in card.text
    assert "| `speed.generation` |" in card.text and "2 steps" in card.text
    assert metrics["hub"]["repo_id"] == "me/smoke" and set(metrics["hub"]["commits"]) == {"model"}
    assert json.loads((run / "metrics.json").read_text())["hub"] == metrics["hub"]
    uploaded = [c for c in fake_hub.calls if c[0] == "upload_folder"]
    assert len(uploaded) == 1 and {"README.md", "config.json", "model.safetensors"} <= set(uploaded[0][2]["files"])


class Session:
    """huggingface_hub's HTTP session, answering the pre-check's request as `Session.answer` says."""

    answer = 200
    asked = 0  # requests made

    def get(self, url, headers, timeout):
        Session.asked += 1
        assert url == f"{constants.ENDPOINT}/api/whoami-v2" and timeout == hub.CHECK_TIMEOUT_S
        assert headers == {"authorization": "Bearer hf_test"}
        if isinstance(Session.answer, Exception):
            raise Session.answer
        return type("Response", (), {"status_code": Session.answer})()


@pytest.fixture
def online(monkeypatch):
    """The hub as seen from a machine with network and a token (no request leaves this one)."""
    import huggingface_hub
    import huggingface_hub.utils

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    Session.answer = 200
    monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: Session())


def test_precheck_passes_where_the_hub_answers(tmp_path, online):
    Session.asked = 0
    hub.check(compose_cfg(["debug=smoke", "push_to_hub=true", "hub_model_id=me/tiny"], tmp_path))  # raises if not
    assert Session.asked == 1  # the token was shown to the hub once
    hub.check(compose_cfg(["debug=smoke"], tmp_path))
    assert Session.asked == 1  # no push: nothing asked of the hub


@pytest.mark.parametrize("case,needle", [
    ("offline", "needs the hub, but HF_HUB_OFFLINE is set"),
    ("no_token", "needs a Hugging Face token with write access"),
    ("unreachable", "did not answer: ConnectError: no route to host"),
    ("refused", "the hub refused the token (401)"),
    ("server_error", "/api/whoami-v2 answered HTTP 503"),
])
def test_precheck_fails_in_one_line(tmp_path, online, monkeypatch, case, needle):
    import huggingface_hub

    if case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if case == "no_token":
        monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    Session.answer = {"unreachable": type("ConnectError", (Exception,), {})("no route to host"), "refused": 401,
                      "server_error": 503}.get(case, 200)
    cfg = compose_cfg(["debug=smoke", "push_to_hub=true", "hub_model_id=me/tiny"], tmp_path)
    with pytest.raises(ConfigError) as info:
        hub.check(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("push_to_hub=true (hub_model_id=me/tiny)")


@pytest.mark.parametrize("overrides,needle", [
    (["push_to_hub=true"], "push_to_hub=true needs hub_model_id=<org/name>"),
    (["hub_model_id=a/b/c"], "hub_model_id='a/b/c' is not a hub repo id"),
    (["push_to_hub=true", "hub_model_id=bad id"], "hub_model_id='bad id' is not a hub repo id"),
])
def test_bad_hub_settings_are_one_line(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(["debug=smoke", *overrides], tmp_path))
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("args,needle", [
    (["push_to_hub=true"], "push_to_hub=true needs hub_model_id"),
    (["push_to_hub=true", "hub_model_id=me/tiny"], "needs the hub, but HF_HUB_OFFLINE is set"),
])
def test_entrypoint_refuses_before_training(tmp_path, args, needle):
    assert_fails_fast_with_one_line(tmp_path / "run", ["debug=smoke", *args], needle)


def test_a_curriculum_pushes_its_last_stage_only(tmp_path):
    from grpo_exp.training.curriculum.overrides import stage_overrides

    user = ["push_to_hub=true", "hub_model_id=me/c", "curriculum=progressive"]
    first = stage_overrides(user, "basic", tmp_path / "1_basic", None)
    last = stage_overrides(user, "advanced", tmp_path / "3_advanced", str(tmp_path / "2"), push=True)
    assert "push_to_hub=false" in first and "push_to_hub=true" not in first
    assert "push_to_hub=true" in last and "hub_model_id=me/c" in last


def test_the_card_of_a_replay_stage_says_which_prompts_it_trained_on(tmp_path):
    run = fake_run(tmp_path)
    cfg = compose_cfg(["debug=smoke", "stage=intermediate", "curriculum.replay=0.2", "curriculum.replay_from=[basic]"],
                      run)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    write_cards(run)
    text = (run / "model" / "README.md").read_text()
    assert ("Its training prompts: the intermediate stage's training set with 20% of its prompts replayed from the "
            "earlier stages' training sets (basic; curriculum.replay=0.2)") in text
    plain = fake_run(tmp_path / "plain")
    cfg = compose_cfg(["debug=smoke"], plain)
    (plain / ".hydra").mkdir()
    OmegaConf.save(cfg, plain / ".hydra" / "config.yaml")
    write_cards(plain)
    assert "Its training prompts" not in (plain / "model" / "README.md").read_text()
