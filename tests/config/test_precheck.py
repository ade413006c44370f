"""The command line's pre-check (config/compose.check_overrides and what it calls): every bad input is one
ConfigError naming the key the user set, before any model loads and before Hydra writes anything; a sweep has
every job checked, each distinct error once; suggestions for misspelt keys and options."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_exp.apps.train import check
from grpo_exp.base.errors import ConfigError
from grpo_exp.config import sweep_check
from grpo_exp.config.compose import check_overrides
from grpo_exp.training import hub


pytestmark = pytest.mark.usefixtures("fresh_hydra")


def refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        check_overrides("train", args, check)
    return str(err.value)


def test_a_misspelt_option_or_key_gets_the_nearest_valid_one():
    assert "unknown model option 'tiny_randm' (did you mean 'tiny_random'?); valid choices:" in refusal(
        ["model=tiny_randm"])
    line = refusal(["model=tiny_random", "train.max_stepz=3"])
    assert line.startswith("unknown config key 'train.max_stepz' (did you mean 'train.max_steps'?); valid keys under "
                           "train:") and "max_steps" in line
    assert "did you mean" not in refusal(["model=tiny_random", "train.zzzzzzzz=3"])


def test_a_type_error_shows_no_omegaconf_template():
    line = refusal(["model=tiny_random", "train.max_steps=abc"])
    assert "train.max_steps=abc" in line and "could not be converted to Integer" in line
    assert "$VALUE" not in line and "\n" not in line


@pytest.mark.parametrize("args,needle", [
    (["train.lr_scheduler_type=cosin"], "train.lr_scheduler_type=cosin: cosin is not a valid SchedulerType"),
    (["+train.extra.optim=adamw_foo"], "train.extra.optim=adamw_foo: adamw_foo is not a valid OptimizerNames"),
])
def test_trls_own_value_checks_run_before_any_model_loads(tmp_path, args, needle):
    run_dir = tmp_path / "run"
    line = refusal(["model=tiny_random", "logger=none", f"hydra.run.dir={run_dir}", *args])
    assert line.startswith(needle), line
    assert not run_dir.exists()


def test_the_tiny_models_shapes_are_checked_before_transformers_sees_them():
    assert refusal(["model=tiny_random", "model.tiny_heads=3"]) == "model.tiny_heads=3 must divide model.tiny_hidden=64"
    assert refusal(["model=tiny_random", "model.tiny_kv_heads=3"]) == ("model.tiny_kv_heads=3 must divide "
                                                                       "model.tiny_heads=4")


def test_a_sweep_experiment_without_m_is_refused_naming_m():
    line = refusal(["experiment=continual"])
    assert line.startswith("experiment=continual is a sweep (over ") and " -m experiment=continual" in line


def test_an_experiment_that_needs_init_from_is_refused_without_it_and_every_job_of_its_sweep_named(tmp_path):
    sweep_dir = tmp_path / "probes"
    line = refusal(["-m", "experiment=two_step_probes", f"hydra.sweep.dir={sweep_dir}"])
    assert line.startswith("init_from is not set and this experiment needs it (requires=['init_from']): "
                           "add init_from=<value> (all 4 jobs)"), line
    assert not sweep_dir.exists()
    start = tmp_path / "start"
    (start / "model").mkdir(parents=True)
    (start / "model" / "config.json").write_text("{}\n")
    sweep_check.checked_jobs.clear()
    check_overrides("train", ["-m", "experiment=two_step_probes", f"init_from={start}", "model=tiny_random",
                              f"hydra.sweep.dir={sweep_dir}"], check)
    assert len(sweep_check.checked_jobs) == 4


def test_resume_with_nothing_to_resume_is_refused_naming_the_run_directory(tmp_path):
    empty = tmp_path / "nothing"
    line = refusal(["model=tiny_random", "resume=true", f"hydra.run.dir={empty}"])
    assert line.startswith(f"resume=true: hydra.run.dir={empty} holds no run to continue")
    assert "resume=true hydra.run.dir=<run dir>" in line and not empty.exists()
    empty.mkdir()
    assert refusal(["model=tiny_random", f"resume={empty}"]).startswith(f"resume={empty}: resume={empty} holds no run")
    (empty / ".hydra").mkdir()
    (empty / ".hydra" / "config.yaml").write_text("{}\n")  # what Hydra writes into every run directory it starts
    check_overrides("train", ["model=tiny_random", "logger=none", "resume=true", f"hydra.run.dir={empty}"], check)


def test_an_unwritable_run_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = refusal(["model=tiny_random", f"hydra.run.dir={blocker / 'run'}"])
    assert line == (f"hydra.run.dir={blocker / 'run'} cannot be created: {blocker} is a file, not a directory; "
                    f"give hydra.run.dir a directory you can write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the check left nothing behind


def test_launchers_that_cannot_run_here_are_not_offered():
    line = refusal(["-m", "hydra/launcher=ray_aws", "model=tiny_random", "train.seed=1,2"])
    assert line.startswith("unknown hydra/launcher option 'ray_aws' (did you mean 'ray'?); valid choices: basic, ")
    assert "ray_aws" not in line.split("valid choices:")[1]


def test_m_with_cfg_is_one_line():
    assert refusal(["-m", "--cfg", "job", "train.seed=1,2"]).startswith("-m and --cfg cannot be combined")


def test_a_sweep_checks_every_job_first_and_says_each_error_once(tmp_path):
    sweep_dir = tmp_path / "sweep"
    line = refusal(["-m", "model=tiny_random", "train.seed=1,2", "train.max_steps=0,3", "train.num_generations=3,4",
                    f"hydra.sweep.dir={sweep_dir}"])
    errors = line.split("\nerror: ")
    assert len(errors) == 2, errors
    assert errors[0] == "train.max_steps=0 must be a positive integer (jobs 0, 1, 4, 5 of 8)"
    assert errors[1].startswith("train.num_generations=3 does not divide")
    assert errors[1].endswith(" (jobs 2, 6 of 8); no job of the sweep was started")
    assert not sweep_dir.exists()


def test_a_sweeps_params_from_its_experiment_are_expanded_like_hydras_sweeper(tmp_path):
    jobs, sweep_dir = sweep_check.sweep_jobs("train", ["experiment=threads_batch", f"hydra.sweep.dir={tmp_path}"])
    assert sweep_dir == str(tmp_path)
    assert sorted(jobs) == sorted([f"cpu.threads={t}", f"train.per_device_train_batch_size={b}",
                                   "experiment=threads_batch"] for t in (1, 2) for b in (4, 8))


def test_a_sweep_whose_jobs_all_pass_records_them_as_checked(tmp_path):
    sweep_check.checked_jobs.clear()
    check_overrides("train", ["-m", "model=tiny_random", "logger=none", "train.seed=1,2",
                              f"hydra.sweep.dir={tmp_path / 's'}"], check)
    assert sweep_check.checked_jobs == {("model=tiny_random", "logger=none", f"train.seed={s}") for s in (1, 2)}
    assert not (tmp_path / "s").exists()


def test_gsm8k_from_an_unreachable_hub_is_one_line_saying_how_to_give_a_local_copy(monkeypatch):
    monkeypatch.setattr(hub, "hub_silent", lambda: "HF_HUB_OFFLINE is set")
    monkeypatch.setattr(hub, "_cached", lambda hub_id: False)
    line = refusal(["model=tiny_random", "stage=gsm8k"])
    assert line.startswith("stage.dataset=gsm8k reads openai/gsm8k from the hub, which cannot be reached "
                           "(HF_HUB_OFFLINE is set)")
    assert "stage.path=<dir holding train.jsonl and test.jsonl>" in line and "load_dataset('openai/gsm8k'" in line
    monkeypatch.setattr(hub, "_cached", lambda hub_id: True)  # a warm datasets cache serves the run offline
    hub.check_dataset(type("Stage", (), {"dataset": "gsm8k", "path": None, "hub_id": "openai/gsm8k",
                                          "hub_config": "main"})())


def test_a_too_small_gsm8k_split_names_the_key_that_asked_for_it(tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    row = '{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n'
    (data / "train.jsonl").write_text(row * 40)
    (data / "test.jsonl").write_text(row * 400)
    line = refusal(["model=tiny_random", "stage=gsm8k", f"stage.path={data}", "eval.every_steps=5",
                    "eval.every_limit=50"])
    assert "(eval.every_limit=50)" in line and "eval.limit" not in line, line


def test_vllm_on_a_machine_without_it_offers_only_what_runs(monkeypatch):
    from grpo_exp.config import speed

    monkeypatch.setattr(speed, "vllm_missing", lambda device: "this machine has no CUDA device")
    with pytest.raises(ConfigError) as err:
        speed.check_generation("vllm", "cpu")
    assert str(err.value).endswith("choose one of: auto, trl, engine")


def test_the_pre_check_writes_nothing(tmp_path):
    """A passing pre-check of a single run composes, checks and builds TRL's arguments: no run directory yet."""
    run_dir = tmp_path / "run"
    check_overrides("train", ["model=tiny_random", "logger=none", f"hydra.run.dir={run_dir}"], check)
    assert not run_dir.exists() and not any(Path(tmp_path).iterdir())


def test_trackio_without_its_package_is_one_line_naming_the_make_target(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    assert refusal(["model=tiny_random", "logger=trackio"]) == (
        "logger=trackio needs the trackio package, which is not installed; make train ARGS=logger=trackio installs "
        "it on first use (or: pip install -e '.[trackio]')")


def test_sweep_check_in_job_leaves_each_jobs_checks_to_the_job(tmp_path):
    """For a cluster whose jobs see files the submitting machine does not: only the sweep directory is checked."""
    sweep_check.checked_jobs.clear()
    check_overrides("train", ["-m", "model=tiny_random", "train.max_steps=0,3", "sweep_check=in_job",
                              f"hydra.sweep.dir={tmp_path / 's'}"], check)
    assert not sweep_check.checked_jobs  # each job checks itself when it runs
    assert "sweep_check='sometimes' is not valid" in refusal(["model=tiny_random", "sweep_check=sometimes"])


def test_a_sweep_job_that_names_the_sweep_directory_is_checked_as_it_will_run(tmp_path):
    """experiment=continual's jobs branch from their seed's EWC job, named through ${hydra:sweep.dir} and the method's
    choice: the pre-check resolves them as each job will (and a bad value is still one line), then leaves no Hydra
    state behind."""
    from hydra.core.hydra_config import HydraConfig

    seen = []
    sweep = ["-m", "experiment=continual", "model=tiny_random", "train.seed=3", "method=ewc,grpo",
             f"hydra.sweep.dir={tmp_path}/cl"]
    check_overrides("train", sweep, lambda cfg: seen.append(str(cfg.curriculum.branch_from)))
    assert seen == [f"{tmp_path}/cl/seed3_ewc"] * 2
    assert HydraConfig.instance().cfg is None
    line = refusal([*sweep[:-1], "curriculum.branch_from_missing=later", f"hydra.sweep.dir={tmp_path}/cl"])
    assert "curriculum.branch_from_missing" in line and "(all 2 jobs)" in line and "\n" not in line
