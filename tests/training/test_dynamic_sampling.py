"""Dynamic sampling (train.dynamic_sampling, grpo_exp/training/dynamic_sampling.py): no all-equal group reaches
the loss, the number of extra rounds is bounded on a model that never gets a reward, the draws are reproducible
from the seed, two data-parallel processes fill alike, and the advantages follow TRL's formula."""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_exp.base.errors import ConfigError
from grpo_exp.base.monitor import MonitorCallback
from grpo_exp.config.checks import validate
from grpo_exp.core import rewards
from grpo_exp.training import dynamic_sampling
from grpo_exp.training.guards import RoundGuard
from grpo_exp.training.trainer import GrpoExpTrainer
from tests.conftest import compose_cfg
from tests.training.briefly import train_briefly
from tests.spread_reward_main import vowel_fraction

# debug=smoke: tiny random model, 2 prompts x 2 completions a step, one round a step
FAST = ["debug=smoke", "logger=none", "train.max_completion_length=8", "train.save_steps=100",
        "train.learning_rate=1e-3"]


def half_spread(completions, answer, **kwargs):
    """Spread on random text for problems with an even answer, 0 for the others: their groups are all equal."""
    fractions = vowel_fraction(completions)
    return [f if int(float(a)) % 2 == 0 else 0.0 for f, a in zip(fractions, answer)]


def _steps(trainer) -> list[dict]:
    return [row for row in trainer.state.log_history if "dynamic_sampling/draws" in row]


# ------------------------------------------------------------------------------------------ the pure parts


def test_all_equal_groups_are_found_and_unscorable_rows_do_not_count():
    signal = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 0.5, float("nan"), float("nan")])
    assert dynamic_sampling.all_equal(signal, 2).tolist() == [True, False, True, True]


def test_correctness_decides_where_configured_else_the_weighted_total():
    per_func = torch.tensor([[0.0, 0.3], [0.0, 0.9]])
    weights = torch.tensor([1.0, 0.5])
    assert dynamic_sampling.group_signal(per_func, ["correctness", "fmt"], weights).tolist() == [0.0, 0.0]
    assert dynamic_sampling.group_signal(per_func, ["a", "b"], weights).tolist() == pytest.approx([0.15, 0.45])


def test_draws_are_keyed_by_seed_step_and_draw_not_the_global_rng():
    torch.manual_seed(0), np.random.seed(0)
    first = dynamic_sampling.draw_prompts(100, 8, seed=42, step=3, draw=1)
    torch.manual_seed(1), np.random.seed(1)
    assert dynamic_sampling.draw_prompts(100, 8, seed=42, step=3, draw=1) == first
    assert len(set(first)) == 8  # distinct prompts where the set holds enough
    assert dynamic_sampling.draw_prompts(100, 8, seed=42, step=3, draw=2) != first
    assert dynamic_sampling.draw_prompts(100, 8, seed=42, step=4, draw=1) != first
    assert dynamic_sampling.draw_prompts(100, 8, seed=7, step=3, draw=1) != first
    assert len(dynamic_sampling.draw_prompts(3, 8, seed=42, step=0, draw=1)) == 8  # a small set cycles


def test_a_slot_takes_only_a_group_laid_out_alike_over_processes():
    # 2 processes, 4 completions each, groups of 2: groups 0 and 1 on process 0, 2 and 3 on process 1
    layout = dynamic_sampling.layouts(4, 2, 4)
    assert layout == [(0, 0), (0, 0), (1, 1), (1, 1)]
    sources = dynamic_sampling.assign([None] * 4, [False, True, False, False], layout, 0)
    assert sources == [None, (0, 1), None, None]
    # the next round keeps only process 0's groups: process 1's slots stay empty
    sources = dynamic_sampling.assign(sources, [True, True, False, False], layout, 1)
    assert sources == [(1, 0), (0, 1), None, None]
    sources = dynamic_sampling.assign(sources, [False, False, False, True], layout, 2)
    assert sources == [(1, 0), (0, 1), (2, 3), None]
    # groups that span processes (2 completions a process, groups of 4): one group, laid out alike in every round
    assert dynamic_sampling.layouts(1, 4, 2) == [(0, 0, 1, 1)]
    # 6 a process, groups of 4: three groups, each its own layout
    assert dynamic_sampling.layouts(3, 4, 6) == [(0, 0, 0, 0), (0, 0, 1, 1), (1, 1, 1, 1)]


def test_the_throughput_counts_the_extra_rounds(tmp_path):
    monitor = MonitorCallback(tmp_path / "history.jsonl", completions_per_step=4,
                              extra_rounds_key=dynamic_sampling.DRAWS_KEY)
    state = SimpleNamespace(global_step=1)
    monitor.on_step_begin(None, state, None)
    monitor.on_step_end(None, state, None)
    monitor.on_log(None, state, None, logs={"completions/mean_length": 8.0, "dynamic_sampling/draws": 2.0})
    assert monitor.rows[-1]["completion_tokens"] == 8 * 4 * 3


# ------------------------------------------------------------------- two processes, with a fake TRL round

class _Exchange:
    """accelerator.gather for threads standing in for processes."""

    def __init__(self, processes: int):
        self.barrier, self.slots = threading.Barrier(processes), [None] * processes

    def gather(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = tensor.reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor[None]
        self.barrier.wait()
        out = torch.cat(self.slots)
        self.barrier.wait()
        return out


def _fake_process(rank: int, processes: int, local: int, n: int, exchange: _Exchange, draws: int):
    """A stand-in for GrpoExpTrainer with TRL's round faked: prompt i's completions score their place in the group
    (spread), except for prompts divisible by 3, which score 0 (all equal). Prompt and completion widths change
    from round to round, as real ones do."""
    dataset = [{"prompt": f"p{i}", "index": i} for i in range(30)]
    sampling = dynamic_sampling.DynamicSampling(draws)
    trainer = SimpleNamespace(
        num_generations=n, reward_func_names=["correctness"], reward_weights=torch.tensor([1.0]),
        train_dataset=dataset, state=SimpleNamespace(global_step=5), args=SimpleNamespace(seed=42),
        _metrics={"train": defaultdict(list)}, _tokenizer=SimpleNamespace(pad_token_id=-1),
        scale_rewards="batch", multi_objective_aggregation="sum_then_normalize", rounds=0,
        accelerator=SimpleNamespace(num_processes=processes, process_index=rank,
                                    gather=lambda t: exchange.gather(rank, t)))

    def generate(inputs):
        width = 1 + trainer.rounds % 2
        trainer.rounds += 1
        index = torch.tensor([x["index"] for x in inputs])
        place = torch.tensor([(rank * local + i) % n for i in range(local)])
        local_rewards = torch.where(index % 3 == 0, 0.0, place.float())[:, None]
        sampling.observe(exchange.gather(rank, local_rewards))  # TRL's _calculate_rewards, as the trainer hands it on
        prompt = torch.cat([torch.full((local, width - 1), -1), index[:, None]], dim=1)
        completion = torch.cat([place[:, None], torch.full((local, 2 - width), -1)], dim=1)
        return {"prompt_ids": prompt, "prompt_mask": (prompt >= 0).long(), "completion_ids": completion,
                "completion_mask": (completion >= 0).long(), "advantages": torch.zeros(local),
                "num_items_in_batch": torch.tensor(0)}

    first = [dataset[i // n] for i in range(rank * local, (rank + 1) * local)]  # prompts 0, 1, ... in groups
    return trainer, lambda: sampling.fill(trainer, first, generate, RoundGuard("skip"))


@pytest.mark.parametrize("local,n", [(4, 2), (2, 4), (6, 4)], ids=["whole groups", "groups span", "mixed"])
def test_two_processes_fill_alike_and_train_no_all_equal_group(local, n):
    processes = 2
    exchange = _Exchange(processes)
    made = [_fake_process(rank, processes, local, n, exchange, draws=3) for rank in range(processes)]
    results: list = [None] * processes

    def run(rank):
        results[rank] = made[rank][1]()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    trainers = [t for t, _ in made]
    assert all(r is not None for r in results)
    # every process drew as many rounds and logged the same figures
    assert len({t.rounds for t in trainers}) == 1
    assert trainers[0]._metrics == trainers[1]._metrics
    metrics = trainers[0]._metrics["train"]
    assert metrics["dynamic_sampling/dropped_groups"][0] >= 1 and 1 <= metrics["dynamic_sampling/draws"][0] <= 3
    # the processes' rows, in order, are whole groups: one prompt each, its completions in their places
    prompt = torch.cat([r["prompt_ids"][:, -1] for r in results]).view(-1, n)
    place = torch.cat([r["completion_ids"][:, 0] for r in results]).view(-1, n)
    mask = torch.cat([r["completion_mask"].sum(1) > 0 for r in results]).view(-1, n)
    assert (prompt == prompt[:, :1]).all() and (place == torch.arange(n)).all()
    assert (mask == mask[:, :1]).all()
    # no trained group is all equal (prompts divisible by 3); the untrained ones are
    trained = mask[:, 0]
    assert trained.any() and not (prompt[trained, 0] % 3 == 0).any()
    assert metrics["dynamic_sampling/kept_share"][0] == pytest.approx(float(trained.float().mean()))
    # the advantages are those of the whole batch's trained groups, as one process would compute them
    advantages = torch.cat([r["advantages"] for r in results]).view(-1, n)
    rewards = torch.where(trained[:, None], place.float(), float("nan")).view(-1, 1)
    expected = dynamic_sampling.advantages(rewards, torch.tensor([1.0]), n, "batch", "sum_then_normalize")
    assert torch.allclose(advantages.flatten(), expected)
    assert (advantages[~trained] == 0).all()
    items = int(torch.cat([r["completion_mask"] for r in results]).sum())
    assert all(int(r["num_items_in_batch"]) == items for r in results)


# --------------------------------------------------------------------------------------- real training


@pytest.fixture
def spread_and_half_rewards(monkeypatch):
    monkeypatch.setitem(rewards.REGISTRY, "vowel_fraction", vowel_fraction)
    monkeypatch.setitem(rewards.REGISTRY, "half_spread", half_spread)


@pytest.mark.parametrize("generation", ["engine", "trl"])
def test_no_all_equal_group_reaches_the_loss(generation, tmp_path, spread_and_half_rewards):
    """half_spread scores every completion of an odd-answer problem 0: its group is all equal, and its advantage
    0. With groups of 2 a group's advantages are 0 exactly when it is all equal, so every completion that reaches
    the loss (a completion-mask token) must carry a non-zero advantage."""
    cfg = compose_cfg([*FAST, "reward.funcs=[half_spread]", "reward.weights=[1.0]", "train.dynamic_sampling=true",
                       "train.dynamic_sampling_max_draws=3", "train.max_steps=3",
                       *(["speed=trl"] if generation == "trl" else [])], tmp_path)
    trainer, seen, _, moved = train_briefly(cfg)
    assert trainer.speed_plan.generation == generation
    steps = _steps(trainer)
    assert len(steps) == 3 and sum(row["dynamic_sampling/dropped_groups"] for row in steps) >= 1
    assert all("frac_reward_zero_std" in row for row in steps)
    assert all(0 <= row["dynamic_sampling/draws"] <= 3 for row in steps)
    trained = 0
    for inputs in seen:
        rows = inputs["completion_mask"].sum(1) > 0
        assert (inputs["advantages"][rows] != 0).all(), inputs["advantages"]
        trained += int(rows.sum())
    assert trained and moved


def _never_rewarded(tmp_path, draws: int = 2):
    """tiny_random never answers right: correctness is 0 for every completion, so every group is all equal (even
    though vowel_fraction, which does not decide, has spread). Records every extra draw."""
    cfg = compose_cfg([*FAST, "reward.funcs=[correctness,vowel_fraction]", "reward.weights=[1.0,1.0]",
                       "train.dynamic_sampling=true", f"train.dynamic_sampling_max_draws={draws}",
                       "train.max_steps=2"], tmp_path)
    drawn, prompts = [], []
    draw_prompts, correctness = dynamic_sampling.draw_prompts, rewards.REGISTRY["correctness"]

    def recording_draws(*args, **kwargs):
        drawn.append((kwargs["step"], kwargs["draw"], draw_prompts(*args, **kwargs)))
        return drawn[-1][2]

    def recording_correctness(completions, answer, **kwargs):
        prompts.append([str(p) for p in kwargs["prompts"]])
        return correctness(completions, answer, **kwargs)

    recording_correctness.__name__ = "correctness"  # the name TRL logs it under, and dynamic sampling reads
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dynamic_sampling, "draw_prompts", lambda *a, **k: recording_draws(*a, **k))
        mp.setitem(rewards.REGISTRY, "correctness", recording_correctness)
        trainer, seen, _, moved = train_briefly(cfg)
    return trainer, seen, moved, drawn, prompts


def test_the_bound_holds_on_a_model_that_never_gets_a_reward(tmp_path, spread_and_half_rewards, caplog):
    with caplog.at_level("INFO", logger="grpo_exp"):
        trainer, seen, moved, drawn, prompts = _never_rewarded(tmp_path, draws=2)
    # the run says so once, in one line; the count is metrics.json's skipped_steps (trainer.skipped_steps)
    dropped = [r for r in caplog.records if "update dropped" in r.getMessage() and r.levelname == "WARNING"]
    assert len(dropped) == 1 and "dynamic sampling" in dropped[0].getMessage(), [r.getMessage() for r in dropped]
    steps = _steps(trainer)
    assert [row["dynamic_sampling/draws"] for row in steps] == [2, 2]  # max_draws extra rounds, no more
    assert [row["dynamic_sampling/kept_share"] for row in steps] == [0, 0]
    assert [row["dynamic_sampling/dropped_groups"] for row in steps] == [6, 6]  # 2 groups x 3 rounds
    assert [(step, draw) for step, draw, _ in drawn] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert len(prompts) == 6  # one scoring per round
    # the steps are skipped, and logged as such; nothing trains
    assert trainer.skipped_steps == 2
    assert all(row.get("skipped_update") == 1 and "dynamic sampling" in row["skipped_reason"] for row in steps)
    assert all(int(inputs["completion_mask"].sum()) == 0 for inputs in seen)
    assert not moved


def test_two_runs_with_the_same_seed_draw_the_same_prompts(tmp_path, spread_and_half_rewards):
    first = _never_rewarded(tmp_path / "a", draws=1)
    second = _never_rewarded(tmp_path / "b", draws=1)
    assert first[3] and first[3] == second[3]  # the drawn dataset indices
    assert first[4] == second[4]  # the prompts scored, round by round
    assert first[4][0] != first[4][1]  # an extra round scored other prompts than the first


def test_advantages_follow_trls_formula(tmp_path, spread_and_half_rewards):
    """What fill_batch computes over a spliced batch, against TRL's own advantages of a round, for each scaling and
    aggregation (one optimizer step each, dynamic sampling off)."""
    settings = [("batch", "sum_then_normalize"), ("group", "sum_then_normalize"), ("none", "sum_then_normalize"),
                ("batch", "normalize_then_sum")]
    cfg = compose_cfg([*FAST, "reward.funcs=[vowel_fraction,half_spread]", "reward.weights=[1.0,0.5]",
                       f"train.max_steps={len(settings)}"], tmp_path)
    compared, gathered = [], []
    original, calculate = GrpoExpTrainer._generate_and_score_completions, GrpoExpTrainer._calculate_rewards

    def keeping(self, *args):
        gathered.append(calculate(self, *args))
        return gathered[-1]

    def comparing(self, inputs):
        self.scale_rewards, self.multi_objective_aggregation = settings[self.state.global_step]
        output = original(self, inputs)
        ours = dynamic_sampling.advantages(gathered[-1], self.reward_weights, self.num_generations,
                                           self.scale_rewards, self.multi_objective_aggregation)
        compared.append(torch.allclose(ours, output["advantages"], atol=1e-6))
        return output

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GrpoExpTrainer, "_generate_and_score_completions", comparing)
        mp.setattr(GrpoExpTrainer, "_calculate_rewards", keeping)
        train_briefly(cfg)
    assert compared == [True] * len(settings)


def test_max_draws_below_one_is_refused_in_one_line(tmp_path):
    cfg = compose_cfg(["train.dynamic_sampling=true", "train.dynamic_sampling_max_draws=0"], tmp_path)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert "train.dynamic_sampling_max_draws=0" in message and "\n" not in message


# ------------------------------------------------------------------- the trainer's composed round, TRL faked


def test_dynamic_samplings_extra_rounds_count_towards_the_adaptive_pass_rates(monkeypatch):
    """GrpoExpTrainer's one `_generate_and_score_completions` runs the stage mix around dynamic sampling: the passes
    of every round a batch drew (the all-equal first round and the extra one) reach the pass rates, in one update.
    TRL's round and rewards are faked; everything else is the trainer's own code."""
    from trl import GRPOTrainer

    from grpo_exp.training.curriculum.mix import StageMix, StageMixing
    from grpo_exp.training.rollout.old_logps import OldLogps

    n, local = 2, 4
    dataset = [{"prompt": f"p{i}", "stage": ("basic", "advanced")[i % 2], "index": i} for i in range(8)]
    trainer = object.__new__(GrpoExpTrainer)
    trainer.__dict__.update(
        model=SimpleNamespace(training=True), num_generations=n, num_iterations=1, _step=0,
        accelerator=SimpleNamespace(device="cpu", num_processes=1, process_index=0, gather=lambda t: t),
        args=SimpleNamespace(gradient_accumulation_steps=1, steps_per_generation=1, seed=3),
        state=SimpleNamespace(global_step=0), train_dataset=dataset, _metrics={"train": defaultdict(list)},
        reward_func_names=["correctness"], reward_weights=torch.tensor([1.0]), scale_rewards="group",
        multi_objective_aggregation="sum_then_normalize", _tokenizer=SimpleNamespace(pad_token_id=-1),
        use_vllm=False, vllm_importance_sampling_correction=False)
    trainer._log_completion_extra = lambda column, values: None
    trainer.round_guard = RoundGuard("skip")
    trainer.dynamic_sampling = dynamic_sampling.DynamicSampling(2)
    mix = StageMix(["basic", "advanced"], (0.2, 0.8), 0.0, 0.1, 0.1)
    trainer.stage_mixing = StageMixing(trainer, ["basic", "advanced"], mix)
    trainer.old_logps = OldLogps(trainer, None, SimpleNamespace(scoring="round"))
    rounds = []

    def trl_round(self, inputs):
        rounds.append(inputs)
        self._calculate_rewards(inputs, None, None, None)  # the trainer's, which hands the rewards on
        ids = torch.tensor([x["index"] for x in inputs])[:, None]
        return {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "completion_ids": ids,
                "completion_mask": torch.ones_like(ids), "advantages": torch.zeros(local),
                "num_items_in_batch": torch.tensor(local)}

    def calculate(self, inputs, prompts, completions, ids):
        # the first round: every completion fails (its groups all equal); the extra one: one pass in each group
        return torch.zeros(local, 1) if not rounds[1:] else torch.tensor([1.0, 0.0, 1.0, 0.0])[:, None]

    updates = []
    update = StageMix.update
    monkeypatch.setattr(StageMix, "update", lambda self, r, passed, scored: updates.append((r, passed, scored))
                        or update(self, r, passed, scored))
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", trl_round)
    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", calculate)
    first = [dataset[i // n] for i in range(local)]  # prompts 0 and 1, twice each
    batch = trainer._generate_and_score_completions(first)
    assert len(rounds) == 2 and trainer._metrics["train"]["dynamic_sampling/draws"] == [1.0]
    assert batch["completion_mask"].sum() == local  # both groups of the extra round train
    # one update for the batch, holding both rounds' completions (8 scored) and the extra round's 2 passes
    assert len(updates) == 1 and updates[0][0] == 0
    assert sum(updates[0][2]) == 2 * local and sum(updates[0][1]) == 2
