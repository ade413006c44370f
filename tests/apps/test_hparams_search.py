"""hparams_search=recipe_optuna: Hydra's Optuna sweeper over the learning rate, beta and group size, maximising each
trial's validation accuracy after training. A two-trial search of the tiny model as a user runs it, then a third
trial that continues the study, and grpo-report's study table over the sweep directory; and the one-line refusals
(without -m, a test split, a sweep directory that changes, a search space the study does not accept, the web app).

The search needs the `search` extra (hydra-optuna-sweeper), which the dev extra installs: without it these tests
are skipped with that reason."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper",
                    reason="the Optuna sweeper plugin is not installed: pip install -e '.[search]'")

from grpo_exp.apps.launch_check import LaunchRefused, check_items  # noqa: E402
from grpo_exp.apps.train import check, objective, validation_accuracy  # noqa: E402
from grpo_exp.base.errors import ConfigError  # noqa: E402
from grpo_exp.config import search_check  # noqa: E402
from grpo_exp.config.compose import check_overrides, compose  # noqa: E402
from grpo_exp.config.recipe import generation_batch  # noqa: E402
from tests.conftest import ROOT, run_module  # noqa: E402

SEARCH = "hparams_search=recipe_optuna"
PARAMS = ["train.learning_rate", "train.beta", "train.num_generations"]
# debug=smoke trains on generation rounds of 4 completions, which 8 does not divide
SMOKE_GROUPS = "train.num_generations=choice(2,4)"


pytestmark = pytest.mark.usefixtures("fresh_hydra")


def refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        check_overrides("train", args, check)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_the_search_composes_with_the_sweepers_keys():
    cfg = compose("train", [SEARCH], with_hydra=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == search_check.OPTUNA_SWEEPER
    assert sweeper.direction == "maximize" and sweeper.n_jobs == 1 and sweeper.sampler.seed == 42
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler"
    assert list(sweeper.params) == PARAMS
    assert sweeper.params["train.learning_rate"].startswith("tag(log, interval(")
    # the study lives in the fixed sweep directory, where a rerun finds it
    assert "${now:" not in OmegaConf.to_container(cfg.hydra, resolve=False)["sweep"]["dir"]
    assert sweeper.storage == f"sqlite:///{cfg.hydra.sweep.dir}/study.db"
    assert cfg.eval.split == "validation" and cfg.eval.after_train  # ranked on validation, never on test
    # every group size it tries divides the recipe's generation round
    round_size = generation_batch(cfg.train, world_size=1)[0]
    groups = sweeper.params["train.num_generations"].removeprefix("choice(").removesuffix(")").split(",")
    assert groups and all(round_size % int(g) == 0 for g in groups), (round_size, groups)


def test_without_m_the_search_is_one_line():
    message = refusal([SEARCH, "debug=smoke"])
    assert message.startswith(f"{SEARCH} is a search (OptunaSweeper, over {', '.join(PARAMS)})"), message
    assert f"python -m grpo_exp.train -m {SEARCH}" in message


@pytest.mark.parametrize("extra, needle", [
    ("eval.split=test", "it needs eval.split=validation, not eval.split=test"),
    ("eval.after_train=false", "it needs eval.after_train=true, not eval.after_train=false"),
])
def test_the_search_ranks_on_validation_only(tmp_path, extra, needle):
    message = refusal(["-m", SEARCH, "debug=smoke", extra, f"hydra.sweep.dir={tmp_path / 'search'}"])
    assert message.startswith(f"{SEARCH} ranks its trials") and needle in message, message
    assert not (tmp_path / "search").exists()


def test_a_sweep_dir_that_changes_with_the_time_is_refused(tmp_path):
    message = refusal(["-m", SEARCH, f"hydra.sweep.dir={tmp_path}/s_${{now:%H-%M-%S}}"])
    assert "changes with the time, so a rerun would not find the study" in message, message
    assert list(tmp_path.iterdir()) == []


def test_a_search_space_the_study_refuses_is_one_line(tmp_path):
    import optuna
    from optuna.distributions import CategoricalDistribution

    sweep_dir = tmp_path / "search"
    sweep_dir.mkdir()
    study = optuna.create_study(study_name="recipe_optuna", storage=f"sqlite:///{sweep_dir}/study.db",
                                direction="maximize")
    study.add_trial(optuna.trial.create_trial(params={"train.num_generations": 4}, value=0.5, distributions={
        "train.num_generations": CategoricalDistribution((2, 4, 8))}))
    args = ["-m", SEARCH, "debug=smoke", f"hydra.sweep.dir={sweep_dir}"]
    message = refusal([*args, SMOKE_GROUPS])
    assert "train.num_generations would be searched over CategoricalDistribution(choices=(2, 4))" in message
    assert "searched it over CategoricalDistribution(choices=(2, 4, 8))" in message
    check_overrides("train", args, check)  # the study's own space passes


def test_a_missing_sweeper_plugin_is_named_with_its_extra():
    err = Exception("In 'hparams_search/recipe_optuna': Could not find 'hydra/sweeper/optuna'\n\nAvailable options "
                    "in 'hydra/sweeper':\n\tbasic")
    with pytest.raises(ConfigError, match=r"^hparams_search=recipe_optuna searches with hydra/sweeper=optuna, whose "
                                          r"plugin \(hydra-optuna-sweeper\) is not installed; .*'\.\[search\]'$"):
        search_check.check_sweeper_installed(err, ["-m", SEARCH, "debug=smoke"])


def test_the_web_app_does_not_offer_the_search(tmp_path):
    with pytest.raises(LaunchRefused, match="the group hparams_search is not offered by the app"):
        check_items([SEARCH], tmp_path / "outputs", ROOT)


def test_the_objective_is_the_validation_accuracy_after_training():
    trained = {"reward_mean_last": 0.9, "eval": {"basic": {"accuracy": 0.25, "n": 8}, "before_after": {}}}
    scored = {**trained, "validation_accuracy": validation_accuracy(trained["eval"], "basic")}
    assert objective(scored) == 0.25
    # an evaluation that failed leaves the trial without an objective (Optuna records it failed)
    failed = {**trained, "validation_accuracy": validation_accuracy({"error": "no data"}, "basic")}
    assert objective(failed) is None
    assert objective(trained) == 0.9  # a run not scored on validation: its training reward, as before


def _search(sweep_dir: Path, trials: int, *extra: str) -> subprocess.CompletedProcess:
    proc = run_module("grpo_exp.train", "-m", SEARCH, "debug=smoke", f"hydra.sweeper.n_trials={trials}", SMOKE_GROUPS,
                      *extra, f"hydra.sweep.dir={sweep_dir}", timeout=500, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_two_trials_of_the_tiny_model_then_a_third_and_the_report(tmp_path):
    sweep_dir = tmp_path / "search"
    _search(sweep_dir, 2)
    jobs = sorted(p.parent for p in sweep_dir.glob("*/status.json"))
    assert len(jobs) == 2, list(sweep_dir.iterdir())
    for job in jobs:
        status = json.loads((job / "status.json").read_text())
        assert status["status"] == "completed", status
        assert isinstance(status["objective"], float) and math.isfinite(status["objective"]), status
        # the objective is the validation accuracy after training: the test split was never scored
        before_after = json.loads((job / "before_after.json").read_text())
        assert before_after["split"] == "validation"
        evaluation = json.loads((job / "metrics.json").read_text())["eval"]
        assert status["objective"] == evaluation["basic"]["accuracy"]
        assert all(any(o.startswith(f"{p}=") for o in status["overrides"]) for p in PARAMS), status["overrides"]
    assert (sweep_dir / "study.db").is_file() and (sweep_dir / "optimization_results.yaml").is_file()

    _search(sweep_dir, 1)  # a rerun continues the study in new trial directories
    assert len(list(sweep_dir.glob("*/status.json"))) == 3

    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "grpo_exp.apps.report", str(sweep_dir), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Hyperparameter search, best trial first:" in proc.stdout
    table = pd.read_csv(out / "study.csv")
    assert list(table.columns) == ["rank", "job", "trial", "status", *PARAMS, "objective"]
    assert sorted(table["trial"]) == [0, 1, 2]  # each directory matched to its trial in study.db
    assert list(table["rank"]) == [1, 2, 3] and table["objective"].is_monotonic_decreasing
    assert "## Hyperparameter search" in (out / "report.md").read_text()
    assert "holds 3 trial(s): 3 complete" in (out / "report.md").read_text()
