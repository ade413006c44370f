"""The adaptive curriculum (curriculum=adaptive, grpo_exp/training/curriculum/mix.py): the weights favour the stages whose
pass rate sits in the band, each round's draw reads the pass rates of the round before the last, the logged mix
sums to 1, the state round-trips through a checkpoint and a resumed sampler draws what an uninterrupted one draws,
bad settings fail in one line; and short tiny-model runs (a resume, the whole curriculum) complete and log it."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_exp.base.errors import ConfigError
from grpo_exp.config.checks import validate
from grpo_exp.training import checkpoints
from grpo_exp.training.curriculum.mix import STATE_KEY, AdaptiveSampler, StageMix, StageMixing, lag_rounds
from tests.conftest import compose_cfg

STAGES = ["basic", "intermediate", "advanced"]
FAST = ["debug=smoke", "logger=none", "train.max_completion_length=8", "train.save_steps=100",
        "eval.every_steps=null", "train.lr_scheduler_type=constant"]


def _mix(**kw) -> StageMix:
    return StageMix(STAGES, kw.pop("band", (0.2, 0.8)), kw.pop("decay", 0.8), kw.pop("below", 0.2),
                    kw.pop("above", 0.1), **kw)


# ------------------------------------------------------------------------------------------ the weights


def test_the_in_band_stage_weighs_most_the_floor_below_and_mastered_little():
    mix = _mix()
    weights = mix.weights([0.95, 0.5, 0.05])  # mastered, in the band, out of reach
    assert weights.sum() == pytest.approx(1.0)
    assert weights.tolist() == pytest.approx([0.1 / 1.3, 1 / 1.3, 0.2 / 1.3])
    assert mix.weights([None, None, None]).tolist() == pytest.approx([1 / 3] * 3)  # unseen: as in the band
    assert mix.weights([0.2, 0.8, 0.81]).tolist() == pytest.approx([1 / 2.1, 1 / 2.1, 0.1 / 2.1])  # edges inside
    assert _mix(below=0, above=0).weights([0.9, 0.95, 0.01]).tolist() == pytest.approx([1 / 3] * 3)  # all 0
    assert mix.weights([0.5, 0.5, 0.5], available=[True, False, True]).tolist() == pytest.approx([0.5, 0, 0.5])


def test_draws_move_towards_the_stage_in_the_band():
    mix, pools = _mix(), [list(range(0, 50)), list(range(50, 100)), list(range(100, 150))]
    mix.update(0, [95, 1, 50], [100, 100, 100])  # basic mastered, intermediate out of reach, advanced in the band
    drawn = Counter()
    for r in range(2, 402):  # lag 1: round r reads the rates after round r - 2, here round 0's
        for index in mix.draw(r, 8, pools, seed=0):
            drawn[index // 50] += 1
    share = {s: drawn[s] / sum(drawn.values()) for s in range(3)}
    assert share[2] == pytest.approx(1 / 1.3, abs=0.03)
    assert share[1] == pytest.approx(0.2 / 1.3, abs=0.03) and share[0] == pytest.approx(0.1 / 1.3, abs=0.03)
    # before any round was scored every stage is drawn alike
    first = Counter(i // 50 for r in range(2) for i in _mix().draw(r, 600, pools, seed=0))
    assert all(abs(first[s] / 1200 - 1 / 3) < 0.05 for s in range(3))


def test_the_pass_rates_are_an_ema_and_a_round_counts_once():
    mix = _mix(decay=0.5)
    assert mix.update(0, [2, 0, 0], [4, 0, 0])
    assert mix.pass_rate == [0.5, None, None]  # a stage not yet generated stays unknown
    assert mix.update(1, [4, 1, 0], [4, 4, 0])
    assert mix.pass_rate == [0.75, 0.25, None]
    assert not mix.update(1, [0, 0, 0], [4, 4, 4])  # generated again after a resume: the first one stands
    assert mix.pass_rate == [0.75, 0.25, None] and mix.snapshots[0] == [0.5, None, None]


def test_a_round_is_drawn_from_the_rates_before_the_last_round():
    mix = _mix(lag=1)
    mix.update(0, [0, 0, 0], [4, 4, 4])  # every stage below the band after round 0
    mix.update(1, [2, 2, 2], [4, 4, 4])
    assert mix.rates_for(1) == [None] * 3 and mix.rates_for(2) == [0, 0, 0]
    assert mix.rates_for(3) == mix.snapshots[1]
    assert lag_rounds(1, 1) == 1 and lag_rounds(1, 2) == 1 and lag_rounds(4, 2) == 2 and lag_rounds(4, 1) == 4


# ------------------------------------------------------------------------------ the sampler and its state


def _pass(index: int, round_index: int) -> int:
    """A synthetic reward: a completion of prompt `index` passes by the prompt's stage and the round, so the pass
    rates move and the draws follow them."""
    stage = index // 50
    return int((index * 7 + round_index * 3) % 10 < (9, 4, 1)[stage])


def _sampler(mix: StageMix, seed: int = 3) -> AdaptiveSampler:
    from trl.trainer.utils import RepeatSampler

    stages = [STAGES[i // 50] for i in range(150)]
    repeat = RepeatSampler(stages, mini_repeat_count=2, batch_size=4, repeat_count=2, seed=seed)
    return AdaptiveSampler.wrap(repeat, mix, stages)


def _train(sampler: AdaptiveSampler, rounds: int, skip: int = 0) -> list[list[int]]:
    """The data loader's and trainer's order: a round's first batch is fetched while the round before it is still
    to be generated (one batch ahead), and after a round is generated its passes are folded in. `skip`: rounds
    a resumed run's loader draws and drops (HF skips the trained batches)."""
    per_round = sampler.batch_size * sampler.mini_repeat_count * sampler.repeat_count
    order = iter(sampler)
    rounds_drawn = [[next(order) for _ in range(per_round)] for _ in range(skip + 1)][skip:]  # + the prefetch
    for r in range(skip, skip + rounds):
        if r + 1 < skip + rounds:
            rounds_drawn.append([next(order) for _ in range(per_round)])  # the next round, fetched ahead
        chunk = rounds_drawn[r - skip][::sampler.mini_repeat_count][:sampler.batch_size]
        passed, scored = [0.0] * 3, [0.0] * 3
        for index in chunk:
            for _ in range(sampler.mini_repeat_count):
                passed[index // 50] += _pass(index, r)
                scored[index // 50] += 1
        sampler.mix.update(r, passed, scored)
    return rounds_drawn


def test_a_resumed_sampler_draws_what_an_uninterrupted_one_draws(tmp_path):
    whole = _train(_sampler(_mix()), rounds=12)
    assert len({tuple(r) for r in whole}) > 6  # the rounds differ
    assert len({i // 50 for r in whole for i in r}) == 3

    first = _sampler(_mix())
    _train(first, rounds=5)
    # the checkpoint's run state, written and read back as a resume reads it
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    checkpoints.write_state(ckpt, {"stage": "basic", STATE_KEY: first.mix.state_dict(), "global_step": 5})
    owner = StageMixing(None, STAGES, _mix())
    owner.restore(ckpt, checkpoints.STATE_FILE)
    assert owner.stage_mix.pass_rate == first.mix.pass_rate and owner.stage_mix.snapshots == first.mix.snapshots
    resumed = _train(_sampler(owner.stage_mix), rounds=7, skip=5)
    assert resumed == whole[5:]
    # without the saved state the same rounds are drawn otherwise: the state is what carries them
    assert _train(_sampler(_mix()), rounds=7, skip=5) != whole[5:]


def test_the_sampler_keeps_trls_layout_and_a_state_of_another_mix_is_refused():
    sampler = _sampler(_mix())
    indices = list(sampler)
    assert len(indices) == len(sampler) == (150 // 4) * 4 * 2 * 2
    first = indices[:16]  # one round: 4 prompts, each twice, the round twice
    assert first[:8] == first[8:] and first[0] == first[1] and first[2] == first[3]
    sampler.set_epoch(1)
    assert list(sampler)[:16] != first  # epoch 1's round 0 is round 37 of the run
    other = StageMix(["basic", "advanced"], (0.2, 0.8), 0.8, 0.2, 0.1)
    with pytest.raises(ValueError, match="mixes"):
        other.load_state_dict(_mix().state_dict())


# ------------------------------------------------------------------------------ the logged mix


class _Fake:
    """A stand-in for TRL's trainer, one process, the reward table given, with its StageMixing composed as
    GrpoExpTrainer composes it: the round's rewards observed, the adaptive mix counting around the round."""

    def __init__(self, table: torch.Tensor, stage_mix: StageMix | None):
        self._table = table
        self.model = SimpleNamespace(training=True)
        self.accelerator = SimpleNamespace(device="cpu", gather=lambda t: t)
        self._metrics = {"train": defaultdict(list)}
        self.extra = defaultdict(list)
        self.reward_func_names = ["correctness", "answer_format"]
        self.args = SimpleNamespace(gradient_accumulation_steps=1, steps_per_generation=1)
        self.num_iterations, self._step, self.state = 1, 0, SimpleNamespace(global_step=0)
        self.stage_mixing = StageMixing(self, STAGES, stage_mix)

    def _log_completion_extra(self, column, values):
        self.extra[column].extend(values)

    def _trl_round(self, inputs):
        self.stage_mixing.observe(inputs, self._table)  # TRL's _calculate_rewards, as GrpoExpTrainer's hands it on
        return {"generated": len(inputs)}

    def _generate_and_score_completions(self, inputs):
        if self.stage_mixing.stage_mix is None:
            return self._trl_round(inputs)
        return self.stage_mixing.count_round(self._trl_round, inputs)


def test_the_logged_mix_sums_to_one_and_the_pass_rates_follow_the_rewards():
    inputs = [{"stage": s} for s in ["basic"] * 4 + ["advanced"] * 2 + ["intermediate"] * 2]
    table = torch.tensor([[1, 0], [1, 0], [1, 1], [0, 0], [0, 0], [float("nan"), 0], [1, 0], [0, 0]],
                         dtype=torch.float32)
    trainer = _Fake(table, _mix(decay=0.5))
    assert trainer._generate_and_score_completions(inputs) == {"generated": 8}
    mix = {s: trainer._metrics["train"][f"curriculum/mix/{s}"] for s in STAGES}
    assert mix == {"basic": [0.5], "intermediate": [0.25], "advanced": [0.25]}
    assert sum(v[0] for v in mix.values()) == pytest.approx(1.0)
    # passes of the correctness column; an unscorable completion counts for nothing
    assert trainer.stage_mixing.stage_mix.pass_rate == [0.75, 0.5, 0.0]
    assert {s: trainer._metrics["train"][f"curriculum/pass_rate/{s}"] for s in STAGES} == {
        "basic": [0.75], "intermediate": [0.5], "advanced": [0.0]}
    assert trainer.extra["stage"] == [x["stage"] for x in inputs]
    assert trainer.stage_mixing.state()[STATE_KEY]["snapshots"] == {"0": [0.75, 0.5, 0.0]}
    # replay: the mix alone, no pass rates
    replay = _Fake(table, None)
    replay._generate_and_score_completions(inputs)
    assert sum(replay._metrics["train"][f"curriculum/mix/{s}"][0] for s in STAGES) == pytest.approx(1.0)
    assert not any(k.startswith("curriculum/pass_rate") for k in replay._metrics["train"])


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("overrides,needle", [
    (["curriculum=progressive", "curriculum.replay=1.0"], "curriculum.replay=1.0 must be in [0, 1)"),
    (["curriculum=progressive", "curriculum.replay=-0.2"], "curriculum.replay=-0.2 must be in [0, 1)"),
    (["curriculum=adaptive", "curriculum.band=[0.5,1.5]"], "curriculum.band=[0.5, 1.5] lies outside [0, 1]"),
    (["curriculum=adaptive", "curriculum.band=[-0.1,0.5]"], "curriculum.band=[-0.1, 0.5] lies outside [0, 1]"),
    (["curriculum=adaptive", "curriculum.band=[0.7,0.3]"], "curriculum.band=[0.7, 0.3] is empty"),
    (["curriculum=adaptive", "curriculum.band=[0.4,0.4]"], "curriculum.band=[0.4, 0.4] is empty"),
    (["curriculum=progressive", "curriculum.stages=[basic]", "curriculum.replay=0.2"],
     "curriculum.stages=['basic'] has a single stage"),
    (["curriculum.replay=0.2"], "curriculum.replay=0.2 needs earlier stages"),
    (["curriculum=adaptive", "reward=cookbook"], "curriculum.mode=adaptive reads each stage's pass rate"),
    (["curriculum=adaptive", "curriculum.replay=0.2"], "curriculum.mode=adaptive mixes every stage already"),
])
def test_bad_curriculum_settings_are_one_line(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(overrides, tmp_path))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_the_adaptive_option_composes_with_the_progressive_stages(tmp_path):
    cfg = compose_cfg(["curriculum=adaptive"], tmp_path)
    validate(cfg)
    assert cfg.curriculum.mode == "adaptive" and list(cfg.curriculum.band) == [0.2, 0.8]
    assert list(cfg.curriculum.stages) == list(compose_cfg(["curriculum=progressive"], tmp_path).curriculum.stages)


# ------------------------------------------------------------------------------ real training


@pytest.fixture
def stage_passes(monkeypatch):
    """`correctness` replaced by a reward that passes by the problem's stage (basic always, intermediate one
    answer in two, advanced never): the tiny random model never answers right, and the draws must have pass rates
    to follow. Records each round's questions."""
    from grpo_exp.core import rewards

    seen = []

    def correctness(completions, answer, **kwargs):
        seen.append(list(kwargs["question"]))
        rates = {"basic": 1.0, "intermediate": 0.5, "advanced": 0.0}
        return [float(int(float(a)) % 2 == 0) if rates[s] == 0.5 else rates[s]
                for a, s in zip(answer, kwargs["stage"])]

    monkeypatch.setitem(rewards.REGISTRY, "correctness", correctness)
    return seen


def _adaptive_cfg(tmp_path, *extra):
    return compose_cfg([*FAST, "curriculum=adaptive", "curriculum.stages=[basic,intermediate,advanced]",
                        "eval.after_train=false", "train.save_total_limit=null", "train.keep_final_checkpoint=true",
                        *extra], tmp_path)


@pytest.mark.slow
def test_a_resumed_adaptive_run_draws_the_prompts_an_uninterrupted_one_draws(tmp_path, stage_passes, caplog):
    from grpo_exp.training.stage import train

    caplog.set_level("WARNING", logger="grpo_exp")

    pools = {s: compose_cfg([*FAST, f"stage={s}"], tmp_path / "pools").stage for s in STAGES}
    steps = ["train.max_steps=4", "train.save_steps=2"]
    train(_adaptive_cfg(tmp_path / "whole", *steps), pools=pools)
    whole = list(stage_passes)
    history = [json.loads(line) for line in (tmp_path / "whole" / "history.jsonl").read_text().splitlines()]
    steps_logged = [r for r in history if "loss" in r]
    assert len(steps_logged) == 4
    for row in steps_logged:
        assert sum(row[f"curriculum/mix/{s}"] for s in STAGES) == pytest.approx(1.0)
    assert history[-1]["curriculum/pass_rate/basic"] > history[-1]["curriculum/pass_rate/advanced"]
    saved = json.loads((tmp_path / "whole" / "checkpoints" / "checkpoint-2" / checkpoints.STATE_FILE).read_text())
    assert sorted(saved[STATE_KEY]["snapshots"]) == ["0", "1"]

    # the same run as if killed after its checkpoint at step 2 (a copy without what came later), then resumed
    import shutil

    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for name in ("checkpoints/checkpoint-4", "model", "metrics.json"):
        path = tmp_path / "cut" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    stage_passes.clear()
    metrics = train(_adaptive_cfg(tmp_path / "cut", *steps, "resume=true"), pools=pools)
    assert metrics["resumed_from"].endswith("checkpoint-2")
    assert stage_passes == whole[2:]  # rounds 2 and 3, drawn alike
    assert "drawn before round" not in caplog.text  # every draw found the pass rates the lag promises


@pytest.mark.slow
def test_the_adaptive_curriculum_trains_once_and_scores_every_stage(tmp_path):
    from grpo_exp.training.curriculum.adaptive import run_adaptive

    overrides = [*FAST, "train.max_steps=1", "curriculum=adaptive", "curriculum.stages=[basic,intermediate]",
                 "curriculum.eval_limit=3", "curriculum.eval_batch_size=3"]
    result = run_adaptive(compose_cfg(overrides, tmp_path), overrides)
    run = tmp_path / "adaptive"
    assert json.loads((run / "metrics.json").read_text())["steps"] == 2  # the two stages' steps
    saved = json.loads((tmp_path / "curriculum.json").read_text())
    assert saved["mode"] == "adaptive" and saved["row_labels"] == ["adaptive"]
    assert len(saved["matrix"]) == 1 and len(saved["matrix"][0]) == 2 and len(saved["base"]) == 2
    assert saved["average_accuracy"] == pytest.approx(np.mean(saved["matrix"][0]))
    assert [g["stage"] for g in saved["stage_gains"]] == ["basic", "intermediate"]
    assert sum(saved["mix"].values()) == pytest.approx(1.0)
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 2
    for row in rows:  # each step's mix, and the pass rate of every stage generated so far (the tiny model: 0)
        assert row["curriculum/mix/basic"] + row["curriculum/mix/intermediate"] == pytest.approx(1.0)
        assert [row[k] for k in row if k.startswith("curriculum/pass_rate/")] in ([0.0], [0.0, 0.0])
    assert "| adaptive |" in result["table"]


def test_the_report_reads_the_adaptive_row(tmp_path):
    """curriculum.json's one row is labelled `adaptive`, not after the first stage, and each stage's reference is
    the base model (no stage trains after another)."""
    from grpo_exp.analysis import ewc_summary, plots, runs

    curriculum = {"stages": ["basic", "intermediate"], "mode": "adaptive", "row_labels": ["adaptive"],
                  "matrix": [[0.6, 0.3]], "base": [0.4, 0.1], "eval_limit": 10, "average_accuracy": 0.45,
                  "bwt": None}
    table = runs.curriculum_table({"curriculum": curriculum})
    assert table.iloc[:, 0].tolist() == ["base", "after adaptive"]
    sets = ewc_summary.job_sets({"curriculum": curriculum}, None)
    assert {name: (v["start"], v["final"]) for name, v in sets.items()} == {"basic": (0.4, 0.6),
                                                                             "intermediate": (0.1, 0.3)}
    assert ewc_summary.job_row(sets)["basic_gain"] == pytest.approx(0.2)
    assert plots.plot_curriculum(curriculum, "adaptive", tmp_path / "m.png").is_file()


def test_the_comparison_experiment_gives_both_curricula_the_same_budget_and_problems(tmp_path):
    from omegaconf import OmegaConf

    from grpo_exp.training.curriculum.adaptive import adaptive_config, stage_configs
    from tests.conftest import CONF_DIR

    params = OmegaConf.load(CONF_DIR / "experiment" / "adaptive_vs_progressive.yaml").hydra.sweeper.params
    assert params["curriculum"] == "progressive,adaptive"
    jobs = {c: compose_cfg(["experiment=adaptive_vs_progressive", f"curriculum={c}"], tmp_path)
            for c in ("progressive", "adaptive")}
    for cfg in jobs.values():
        validate(cfg)
    assert list(jobs["adaptive"].curriculum.stages) == list(jobs["progressive"].curriculum.stages)
    assert jobs["adaptive"].curriculum.eval_limit == jobs["progressive"].curriculum.eval_limit == 200
    # what each job trains: progressive's stages, and the adaptive run composed as run_adaptive composes it
    user = ["experiment=adaptive_vs_progressive", "curriculum=adaptive"]
    stage_cfgs = stage_configs(jobs["adaptive"], user, list(jobs["adaptive"].curriculum.stages), tmp_path / "adaptive")
    run = adaptive_config(jobs["adaptive"], stage_cfgs)
    validate(run)
    assert run.train.max_steps == sum(c.train.max_steps for c in stage_cfgs) == 90
    assert run.train.max_completion_length == max(c.train.max_completion_length for c in stage_cfgs) == 64
    assert run.curriculum.mode == "adaptive" and run.stage.name == "basic"
    assert run.train.seed == stage_cfgs[0].train.seed
    # one recipe: every progressive stage and the adaptive run at the same length, KL and constant rate
    for cfg in [*stage_cfgs, run]:
        assert (cfg.train.max_completion_length, cfg.train.lr_scheduler_type) == (64, "constant")
        assert (cfg.train.beta, cfg.train.learning_rate) == (run.train.beta, run.train.learning_rate)
