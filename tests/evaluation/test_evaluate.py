"""Evaluation: exact scoring with a scripted model, Wilson intervals, GSM8K JSONL sets, the
`python -m grpo_exp.evaluate` entrypoint (eval.json schema, one-line errors), after-train evaluation
and the comparison report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_exp.evaluation.compare import run_comparison
from grpo_exp.base.errors import ConfigError
from grpo_exp.evaluation.run import check, evaluate_after_train, load_sets, set_settings
from grpo_exp.evaluation.generate import generate_completions, evaluate, score
from grpo_exp.evaluation.stats import mcnemar_exact_p, paired, paired_difference_interval, wilson_interval
from tests.conftest import compose_cfg, run_module

# Made-up word problems in GSM8K's format ("#### n" ends the worked answer).
GSM8K_ROWS = [
    {"question": "Pia has 3 red kites and 4 blue kites. How many kites does she have?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 6 pears. How many pears are in 5 boxes?", "answer": "6 * 5 = 30\n#### 30"},
    {"question": "Otto had 1,250 coins and spent 250. How many are left?", "answer": "1250 - 250 = 1000\n#### 1,000"},
]


@pytest.fixture
def gsm8k_dir(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return d


class ScriptedLM(torch.nn.Module):
    """Answers each prompt with a fixed reply (found by the question in the decoded prompt), then EOS."""

    def __init__(self, tokenizer, replies: dict[str, str]):
        super().__init__()
        self.tokenizer, self.replies = tokenizer, replies
        self.weight = torch.nn.Parameter(torch.zeros(256))  # 1 KiB "model"

    def generate(self, input_ids, attention_mask=None, max_new_tokens=16, pad_token_id=None, **kwargs):
        tok = self.tokenizer
        rows = []
        for ids in input_ids:
            prompt = tok.decode(ids, skip_special_tokens=True)
            reply = next(r for q, r in self.replies.items() if q in prompt)
            rows.append((tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new_tokens])
        width = max(map(len, rows))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_wilson_interval_matches_hand_computed_values():
    # 3/4: p=.75, z=1.96: centre (.75 + 3.8416/8)/1.9604 = .62753, half 1.96*sqrt(.046875+.060025)/1.9604 = .32689
    assert wilson_interval(3, 4) == pytest.approx((0.30064, 0.95442), abs=1e-4)
    assert wilson_interval(2, 4) == pytest.approx((0.15004, 0.84996), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 3.8416 / 10 / (1 + 3.8416 / 10)), abs=1e-6)
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(0, 0) == (0.0, 0.0)


def test_scripted_model_scores_exactly(tiny_model):
    _, tokenizer = tiny_model
    examples = [{"question": "What is 7 + 5?", "answer": "12"}, {"question": "What is 9 - 4?", "answer": "5"},
                {"question": "What is 3 * 3?", "answer": "9"}, {"question": "What is 8 / 2?", "answer": "4"}]
    replies = {"7 + 5": "7 + 5 = 12. The answer is 12.",  # correct, formatted
               "9 - 4": "The answer is 6.",  # wrong, formatted
               "3 * 3": "3 times 3 is 9",  # correct (last number), not formatted
               "8 / 2": "I am not sure."}  # no number at all
    stub = ScriptedLM(tokenizer, replies)
    metrics, samples = evaluate(stub, tokenizer, examples, system_prompt="Solve it.", max_new_tokens=32, batch_size=3)
    assert (metrics["n"], metrics["correct"], metrics["accuracy"]) == (4, 2, 0.5)
    assert (metrics["accuracy_ci95_low"], metrics["accuracy_ci95_high"]) == pytest.approx((0.15004, 0.84996), abs=1e-4)
    assert metrics["format_compliance"] == 0.5
    lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies.values()]
    assert metrics["mean_completion_tokens"] == sum(lengths) / 4
    assert [s["correct"] for s in samples] == [True, False, True, False]
    assert [s["completion"] for s in samples] == list(replies.values())  # order kept across batches, EOS cut
    assert samples[1]["predicted"] == 6 and samples[3]["predicted"] is None
    assert metrics["model_size_mb"] == pytest.approx(1024 / 2**20, abs=0.05) and metrics["decoding"] == "greedy"
    assert "heuristic_reasoning_presence" in metrics


def test_gsm8k_jsonl_set_loads_and_scores(tmp_path, gsm8k_dir):
    cfg = compose_cfg(["model=tiny_random", "stage=gsm8k", "stage.num_test=3", "eval.sets=[basic,gsm8k]",
                       f"stage.path={gsm8k_dir}", "eval.limit=2"], tmp_path)
    check(cfg)
    basic, gsm = load_sets(cfg)
    assert (basic.name, basic.max_new_tokens, len(basic.examples), basic.held_out) == ("basic", 48, 2, 200)
    assert (gsm.name, gsm.dataset, gsm.max_new_tokens, gsm.held_out) == ("gsm8k", "gsm8k", 192, 3)
    assert len(gsm.examples) == 2 and str(gsm8k_dir) in gsm.source
    truth = {r["question"]: r["answer"].rsplit("#### ", 1)[1].replace(",", "") for r in GSM8K_ROWS}
    assert all(truth[ex["question"]] == ex["answer"] for ex in gsm.examples)
    texts = [f"So the total is {ex['answer']}. The answer is {ex['answer']}." for ex in gsm.examples]
    metrics, _ = score(gsm.examples, [texts[0], "The answer is 999."], [10, 5])
    assert (metrics["accuracy"], metrics["format_compliance"], metrics["mean_completion_tokens"]) == (0.5, 1.0, 7.5)
    # Smaller limits give a prefix of larger ones: the same problems for every model and run.
    cfg3 = compose_cfg(["eval.sets=[basic]", "eval.limit=3"], tmp_path)
    assert load_sets(cfg3)[0].examples[:2] == basic.examples


def test_curriculum_scores_the_problems_evaluate_scores(tmp_path, gsm8k_dir, monkeypatch):
    """The accuracy matrix and `python -m grpo_exp.evaluate` read the same held-out problems, also for a
    GSM8K stage whose stage.num_test is below the limit."""
    from grpo_exp.training.curriculum import record

    cfg = compose_cfg([f"stage.path={gsm8k_dir}", "stage=gsm8k", "stage.num_test=3", "eval.limit=3"], tmp_path)
    expected = load_sets(compose_cfg([f"stage.path={gsm8k_dir}", "stage=gsm8k", "stage.num_test=3",
                                      "eval.limit=3"], tmp_path, config_name="evaluate"))[0].examples
    assert len(expected) == 3
    seen = []
    monkeypatch.setattr(record.models, "load", lambda *a, **k: (None, None))
    monkeypatch.setattr(record, "evaluate", lambda model, tok, examples, **kw: (seen.append(examples) or {}, []))
    record.evaluate_dir(cfg.model, cfg.paths.cache_dir, None, [cfg], limit=3, batch_size=3, seed=cfg.train.seed)
    assert seen == [expected]


def test_other_sets_take_their_stage_settings_and_eval_overrides(tmp_path):
    cfg = compose_cfg(["stage=basic", "train.max_completion_length=20", "eval.sets=[basic,advanced]"], tmp_path)
    assert set_settings(cfg, "basic")[1] == 20  # the current stage keeps command-line overrides
    assert set_settings(cfg, "advanced")[1] == 128  # conf/stage/advanced.yaml
    cfg = compose_cfg(["eval.sets=[advanced]", "eval.max_new_tokens=7"], tmp_path)
    assert set_settings(cfg, "advanced")[1] == 7


@pytest.mark.parametrize("overrides,needle", [
    (["checkpoint=/no/such/run"], "checkpoint=/no/such/run does not exist"),
    (["eval.sets=[basic,expert]"], "unknown eval set 'expert'"),
    (["eval.limit=0"], "eval.limit=0"),
    (["eval.limit=300"], "holds 200 test problems (stage.num_test) but 300 were asked for (eval.limit=300)"),
    (["eval.split=validation", "eval.limit=300"],
     "holds 200 validation problems (stage.num_validation) but 300 were asked for (eval.limit=300)"),
    (["eval.split=train"], "eval.split='train' is not valid; choose one of: validation, test"),
    (["eval.every_steps=0"], "eval.every_steps=0 must be a positive integer"),
    (["eval.pass_k=[1,16]", "eval.num_samples=8"], "eval.pass_k has k=16, above the 8 samples per problem"),
    (["eval.maj_k=[0]"], "eval.maj_k has k=0; every k must be a positive integer"),
    (["eval.maj_k=[4,-1]"], "eval.maj_k has k=-1; every k must be a positive integer"),
    (["eval.maj_k=[16]", "eval.num_samples=8"], "eval.maj_k has k=16, above the 8 samples per problem"),
    (["eval.top_k=-1"], "eval.top_k=-1 must be >= 0"),
    (["eval.top_p=0"], "eval.top_p=0.0 must be in (0, 1]"),
])
def test_check_fails_with_one_line(tmp_path, overrides, needle):
    cfg = compose_cfg(["model=tiny_random", *overrides], tmp_path, config_name="evaluate")
    with pytest.raises(ConfigError) as info:
        check(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_evaluate_after_train_writes_eval_json(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    cfg = compose_cfg(["debug=smoke", "eval.limit=2", "eval.max_new_tokens=4", "quantization=dynamic_int8"], tmp_path)
    result = evaluate_after_train(cfg, model, tokenizer, tmp_path)
    assert list(result) == ["basic", "before_after"] and result["basic"]["n"] == 2
    comparison = json.loads((tmp_path / "before_after.json").read_text())
    assert comparison["sets"]["basic"]["n"] == 2 and 0 <= comparison["sets"]["basic"]["mcnemar_p"] <= 1
    assert comparison["sets"]["basic"]["after"] == result["basic"]["accuracy"]
    assert "| basic (2) |" in (tmp_path / "before_after.md").read_text()

    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["config"]["quantization"] == "dynamic_int8" and report["config"]["quantized_linear_layers"] == 14
    assert report["sets"]["basic"]["accuracy"] == result["basic"]["accuracy"]
    assert len((tmp_path / "eval_samples.jsonl").read_text().splitlines()) == 2
    assert all(type(m) is not torch.ao.nn.quantized.dynamic.Linear for m in model.modules())  # policy untouched


def test_paired_statistics():
    a = [{"question": str(i), "correct": c} for i, c in enumerate([1, 1, 0, 0, 1])]
    b = [{"question": str(i), "correct": c} for i, c in enumerate([1, 0, 1, 1, 1])]
    d = paired(a, b)
    assert (d["only_first_correct"], d["only_second_correct"]) == (1, 2) and d["accuracy_diff"] == pytest.approx(0.2)
    assert d["mcnemar_p"] == pytest.approx(1.0)  # 2 * P(X <= 1 | n=3) = 2 * 4/8, capped
    assert mcnemar_exact_p(0, 6) == pytest.approx(2 / 64)
    # by hand: diff 1/5, variance (1 + 2 - 1/5) / 25, half-width 1.96 * sqrt(2.8) / 5
    low, high = d["accuracy_diff_ci95"]
    assert (low, high) == (pytest.approx(0.2 - 1.96 * 2.8 ** 0.5 / 5), pytest.approx(0.2 + 1.96 * 2.8 ** 0.5 / 5))
    assert paired_difference_interval(43, 9, 200) == (pytest.approx(-0.17 - 1.96 * (52 - 34 ** 2 / 200) ** 0.5 / 200),
                                                       pytest.approx(-0.17 + 1.96 * (52 - 34 ** 2 / 200) ** 0.5 / 200))


def test_comparison_base_fp32_vs_int8(tmp_path, tiny_model):
    cfg = compose_cfg(["model=tiny_random", "eval.sets=[basic]", "eval.limit=2", "eval.max_new_tokens=3"], tmp_path)
    report, samples = run_comparison(cfg, {"base": None}, load_sets(cfg), int8=True)
    assert list(report["variants"]) == ["base fp32", "base int8"]
    overall = report["int8_vs_fp32"][-1]
    assert overall["set"] == "all" and overall["size_ratio"] < 1 and overall["speed_ratio"] > 0
    assert len(samples) == 4 and "| basic |" in report["markdown"]


def _one_line_exit_2(proc, needle):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_entrypoint_writes_eval_json(tmp_path, gsm8k_dir):
    run_dir = tmp_path / "run"
    proc = run_module("grpo_exp.evaluate", "model=tiny_random", "eval.limit=3", "eval.sets=[basic,gsm8k]",
                      f"stage.path={gsm8k_dir}", "eval.max_new_tokens=6", "eval.batch_size=4", "cpu.threads=1",
                      f"hydra.run.dir={run_dir}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "eval.json").read_text())
    assert set(report) == {"config", "sets", "table"}
    cfg = report["config"]
    assert {"model", "checkpoint", "quantization", "sets", "limit", "batch_size", "max_new_tokens", "decoding",
            "seed", "data_seed", "model_size_mb", "threads"} <= cfg.keys()
    assert (cfg["model"], cfg["checkpoint"], cfg["quantization"], cfg["sets"]) == ("tiny_random", None, "none",
                                                                                    ["basic", "gsm8k"])
    for name, n in (("basic", 3), ("gsm8k", 3)):  # the GSM8K file holds only 3 problems
        m = report["sets"][name]
        assert m["n"] == n and 0 <= m["accuracy_ci95_low"] <= m["accuracy"] <= m["accuracy_ci95_high"] <= 1
        assert {"accuracy", "format_compliance", "mean_completion_tokens", "tokens_per_s", "peak_rss_mb",
                "model_size_mb", "heuristic_reasoning_presence"} <= m.keys()
    samples = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and {"set", "question", "answer", "completion", "predicted", "correct"} <= samples[0].keys()
    assert "| basic | 3 |" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "not_a_model", "unknown_set", "bad_jsonl"])
def test_entrypoint_bad_input_exits_2_with_one_line(tmp_path, case):
    args, needle = {
        "missing": (["checkpoint=/no/such/run"], "checkpoint=/no/such/run does not exist"),
        "not_a_model": ([f"checkpoint={tmp_path}"], "holds no model"),
        "unknown_set": (["eval.sets=[basic,expert]"], "valid sets: advanced, basic, gsm8k, intermediate, multi_step, prompts, three_step, two_step"),
        "bad_jsonl": (["eval.sets=[gsm8k]", f"stage.path={tmp_path / 'bad.jsonl'}"], "bad.jsonl, line 2"),
    }[case]
    (tmp_path / "bad.jsonl").write_text(json.dumps(GSM8K_ROWS[0]) + "\n{not json\n")
    proc = run_module("grpo_exp.evaluate", "model=tiny_random", *args, f"hydra.run.dir={tmp_path / 'run'}",
                      timeout=120, env={"HF_HUB_OFFLINE": "1"})
    _one_line_exit_2(proc, needle)


def test_pass_at_k_matches_enumeration():
    """The unbiased estimator equals the share of k-subsets of the n samples that hold a correct one."""
    import itertools

    from grpo_exp.evaluation.stats import pass_at_k

    for n, c, k in [(8, 0, 1), (8, 1, 1), (8, 1, 8), (8, 3, 2), (5, 2, 3), (6, 6, 4)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        expected = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected)
    with pytest.raises(ValueError, match="pass@9 needs at least 9 samples"):
        pass_at_k(8, 1, 9)


def test_evaluate_reports_pass_at_k(tiny_model):
    _, tokenizer = tiny_model
    examples = [{"question": "What is 7 + 5?", "answer": "12"}, {"question": "What is 9 - 4?", "answer": "5"}]
    stub = ScriptedLM(tokenizer, {"7 + 5": "The answer is 12.", "9 - 4": "The answer is 6."})
    metrics, samples = evaluate(stub, tokenizer, examples, system_prompt="", max_new_tokens=16, batch_size=4,
                                pass_k=[1, 4], num_samples=4, temperature=0.7)
    # the scripted model answers the same every time: pass@k is its accuracy for every k
    assert metrics["pass_at_k"] == {"1": 0.5, "4": 0.5}
    assert (metrics["pass_samples"], metrics["pass_temperature"]) == (4, 0.7)
    assert [s["sampled_correct"] for s in samples] == [4, 0]


class CyclingLM(ScriptedLM):
    """Answers each prompt with its replies in turn: the i-th sampled completion of a problem gets reply i (mod
    their number); greedy decoding gets the first reply."""

    def __init__(self, tokenizer, replies: dict[str, list[str]]):
        super().__init__(tokenizer, {})
        self.cycles, self.seen = replies, {}

    def generate(self, input_ids, attention_mask=None, max_new_tokens=16, pad_token_id=None, **kwargs):
        tok, rows = self.tokenizer, []
        for ids in input_ids:
            prompt = tok.decode(ids, skip_special_tokens=True)
            question = next(q for q in self.cycles if q in prompt)
            i = 0
            if kwargs.get("do_sample"):
                i = self.seen[question] = self.seen.get(question, -1) + 1
            replies = self.cycles[question]
            rows.append((tok(replies[i % len(replies)], add_special_tokens=False)["input_ids"]
                         + [tok.eos_token_id])[:max_new_tokens])
        width = max(map(len, rows))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_majority_vote_breaks_ties_by_the_earliest_sample_and_ignores_unparsable_answers():
    from grpo_exp.evaluation.stats import majority_vote

    assert majority_vote([3.0, 5.0, 5.0, 3.0]) == (3.0, 2)  # tie 2-2: 3 was given first
    assert majority_vote([5.0, 3.0, 3.0, 5.0]) == (5.0, 2)
    assert majority_vote([None, None, None, 7.0]) == (7.0, 1)  # three unparsable answers do not outvote one
    assert majority_vote([None, None]) == (None, 0)
    assert majority_vote([2.0, 2.0000000001, 4.0]) == (2.0, 2)  # equal within answers_match's tolerance
    assert majority_vote([]) == (None, 0)


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    from grpo_exp.evaluation.stats import bootstrap_interval

    values = [1.0] * 30 + [0.0] * 70
    low, high = bootstrap_interval(values, seed=3)
    assert (low, high) == bootstrap_interval(values, seed=3)  # same seed, same interval
    assert bootstrap_interval(values, seed=4) != (low, high)
    assert low < 0.3 < high and 0.15 < low and high < 0.45  # about 0.3 +- 1.96 * 0.046
    assert bootstrap_interval([1.0] * 5, seed=0) == (1.0, 1.0) and bootstrap_interval([], seed=0) == (0.0, 0.0)


def test_evaluate_reports_maj_at_k_and_sampled_pass_at_1(tiny_model):
    _, tokenizer = tiny_model
    examples = [{"question": "What is 7 + 5?", "answer": "12"}, {"question": "What is 9 - 4?", "answer": "5"},
                {"question": "What is 2 * 3?", "answer": "6"}]
    stub = CyclingLM(tokenizer, {
        # right once in four: maj@2 is a 12-11 tie (12 came first: right), maj@4 goes to 11 (two votes: wrong)
        "7 + 5": ["The answer is 12.", "The answer is 11.", "The answer is 11.", "I do not know."],
        # unparsable three times out of four: the one parsed answer wins every vote
        "9 - 4": ["No idea.", "Hmm.", "The answer is 5.", "Not sure."],
        # never right
        "2 * 3": ["The answer is 5."],
    })
    metrics, samples = evaluate(stub, tokenizer, examples, system_prompt="", max_new_tokens=16, batch_size=4,
                                pass_k=[1, 4], maj_k=[1, 2, 4], num_samples=4, temperature=0.7, seed=5)
    assert metrics["sampled_pass_at_1"] == pytest.approx((1 / 4 + 1 / 4 + 0) / 3)
    assert metrics["pass_at_k"]["1"] == pytest.approx(metrics["sampled_pass_at_1"])
    assert metrics["pass_at_k"]["4"] == pytest.approx(2 / 3)
    # maj@1: the first sample alone (12 right, unparsable, 5 wrong); maj@2: 12 vs 11 tied, 12 came first;
    # maj@4: 11 outvotes 12; the lone 5 wins the second problem's votes
    assert metrics["maj_at_k"] == {"1": pytest.approx(1 / 3), "2": pytest.approx(1 / 3), "4": pytest.approx(1 / 3)}
    first, second, third = samples
    assert first["maj_at_k"]["2"] == {"answer": 12.0, "votes": 1, "correct": True}
    assert first["maj_at_k"]["4"] == {"answer": 11.0, "votes": 2, "correct": False}
    assert second["maj_at_k"]["1"] == {"answer": None, "votes": 0, "correct": False}
    assert second["maj_at_k"]["4"] == {"answer": 5.0, "votes": 1, "correct": True}
    assert third["maj_at_k"]["4"]["correct"] is False and third["sampled_correct"] == 0
    assert first["sampled_predicted"] == [12.0, 11.0, 11.0, None]
    for key in ("maj_at_k_ci95", "pass_at_k_ci95"):
        for k, (low, high) in metrics[key].items():
            assert 0.0 <= low <= metrics[key[:-5]][k] <= high <= 1.0
    assert metrics["bootstrap"] == {"resamples": 1000, "seed": 5, "over": "problems"}
    from grpo_exp.evaluation.run import format_table

    table = format_table({"basic": {**metrics, "model_size_mb": 0.0}})
    assert "maj@4 [95% CI]" in table and "pass@1 (sampled) [95% CI]" in table
    low, high = metrics["maj_at_k_ci95"]["4"]
    assert f"0.333 [{low:.3f}, {high:.3f}]" in table


def test_maj_k_alone_samples_its_largest_k_and_lands_in_eval_json(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    cfg = compose_cfg(["debug=smoke", "eval.limit=2", "eval.max_new_tokens=4", "eval.maj_k=[3]"], tmp_path)
    report = evaluate_after_train(cfg, model, tokenizer, tmp_path)
    saved = json.loads((tmp_path / "eval.json").read_text())
    figures = saved["sets"]["basic"]
    assert figures["pass_samples"] == 3 and "pass_at_k" not in figures
    assert set(figures["maj_at_k"]) == {"3"} and len(figures["maj_at_k_ci95"]["3"]) == 2
    assert saved["config"]["maj_k"] == [3] and saved["config"]["num_samples"] == 3
    assert "maj@3" in saved["table"] and report["basic"]["maj_at_k"] == figures["maj_at_k"]
    rows = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert all(len(r["sampled_predicted"]) == 3 and set(r["maj_at_k"]) == {"3"} for r in rows)


def _sampled_token_ranks(model, tokenizer, monkeypatch, **filters) -> list[int]:
    """The rank, in the model's own next-token distribution, of every token sampled at temperature 5."""
    drawn = []
    real_generate = model.generate

    def recording_generate(**kwargs):  # the real generate; only its output is kept for the check below
        out = real_generate(**kwargs)
        drawn.append((kwargs["input_ids"].shape[1], out))
        return out

    monkeypatch.setattr(model, "generate", recording_generate)
    prompts = [[{"role": "user", "content": f"What is {a} + 3?"}] for a in range(4)]
    generate_completions(model, tokenizer, prompts, max_new_tokens=12, batch_size=4, do_sample=True,
                         temperature=5.0, seed=0, **filters)
    monkeypatch.undo()
    ranks = []
    for start, out in drawn:
        with torch.no_grad():
            logits = model(out).logits[:, start - 1:-1]
        for row_logits, row in zip(logits, out[:, start:]):
            for scores, token in zip(row_logits, row):
                if token == tokenizer.eos_token_id:
                    break  # what follows is padding, not a draw
                ranks.append(int((scores > scores[token]).sum()))
    return ranks


def test_sampling_draws_from_the_whole_vocabulary_as_training_does(tiny_model, monkeypatch):
    # generate() alone filters to the 50 likeliest tokens; pass@k must sample as TRL's rollouts do (top_k=0).
    model, tokenizer = tiny_model
    assert max(_sampled_token_ranks(model, tokenizer, monkeypatch)) >= 50
    assert max(_sampled_token_ranks(model, tokenizer, monkeypatch, top_k=50)) < 50
    assert max(_sampled_token_ranks(model, tokenizer, monkeypatch, top_k=1)) == 0


def _fake_run(tmp_path, tiny_model, seed: int, split_seed: int | None = None):
    """A training run directory as training leaves it: model/ and the .hydra/config.yaml it ran with (split_seed
    None: recorded before stage.split_seed existed, when train.seed drew the split)."""
    from omegaconf import OmegaConf

    model, tokenizer = tiny_model
    run = tmp_path / "run"
    model.save_pretrained(run / "model")
    tokenizer.save_pretrained(run / "model")
    ran_with = compose_cfg(["model=tiny_random", f"train.seed={seed}"], run)
    ran_with = OmegaConf.create(OmegaConf.to_container(ran_with))
    if split_seed is None:
        del ran_with.stage["split_seed"]
    else:
        ran_with.stage.split_seed = split_seed
    (run / ".hydra").mkdir()
    OmegaConf.save(ran_with, run / ".hydra" / "config.yaml")
    return run


def test_checkpoint_is_scored_on_its_own_recorded_split(tmp_path, tiny_model):
    from grpo_exp.evaluation.run import held_out_split, settings_summary

    run = _fake_run(tmp_path, tiny_model, seed=7)
    cfg = compose_cfg(["model=tiny_random", f"checkpoint={run}", "eval.limit=20"], tmp_path / "ev",
                      config_name="evaluate")
    assert cfg.train.seed == 42  # this config's own seed would draw another split
    check(cfg)
    sets = load_sets(cfg)
    assert [e["question"] for e in sets[0].examples] == [
        e["question"] for e in held_out_split(cfg.stage, "test", 20, 7)[:20]]
    assert [e["question"] for e in sets[0].examples] != [  # the fixed partition of today's runs
        e["question"] for e in held_out_split(compose_cfg([], tmp_path / "d").stage, "test", 20, 42)[:20]]
    summary = settings_summary(cfg, sets)
    assert summary["data_seed"] == 7 and summary["data_seed_from"].endswith(".hydra/config.yaml")
    assert summary["split_seed"] == 7 and summary["precision"] == "fp32"


def test_a_run_with_a_split_seed_is_scored_on_that_partition(tmp_path, tiny_model):
    from grpo_exp.evaluation.run import held_out_split

    run = _fake_run(tmp_path, tiny_model, seed=7, split_seed=42)
    cfg = compose_cfg(["model=tiny_random", f"checkpoint={run}", "eval.limit=20"], tmp_path / "ev",
                      config_name="evaluate")
    check(cfg)
    assert cfg.train.seed == 7 and cfg.stage.split_seed == 42
    # training seed 7 on the fixed partition: the test problems every seed scores
    assert [e["question"] for e in load_sets(cfg)[0].examples] == [
        e["question"] for e in held_out_split(compose_cfg([], tmp_path / "d").stage, "test", 20, 42)[:20]]


def test_base_figures_are_cached_per_settings(tmp_path, tiny_model, monkeypatch):
    import grpo_exp.evaluation.run as ev
    from grpo_exp.evaluation import start_cache

    model, tokenizer = tiny_model
    # eval.every_steps=null: no validation level for a learning curve, so one cache entry per set of problems
    overrides = ["debug=smoke", "eval.limit=2", "eval.max_new_tokens=4", f"paths.cache_dir={tmp_path / 'cache'}",
                 "eval.every_steps=null"]
    cfg = compose_cfg(overrides, tmp_path / "a")
    # a cache of its own for the base figures, the fixture's for models (the directory its tiny model was saved
    # in): the tiny model's tokenizer would otherwise be converted from SmolLM2's GGUF again here (about 30 s)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(Path(model.name_or_path).parent, target_is_directory=True)
    first = evaluate_after_train(cfg, model, tokenizer, tmp_path / "a")
    cached = list((tmp_path / "cache" / "base_eval").glob("tiny_random-*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("the base model was loaded again"))
    second = evaluate_after_train(cfg, model, tokenizer, tmp_path / "b")
    assert second["before_after"]["basic"]["before"] == first["before_after"]["basic"]["before"]
    # other problems (another limit) are another cache entry, not a stale hit
    monkeypatch.undo()
    evaluate_after_train(compose_cfg(overrides[:1] + ["eval.limit=3"] + overrides[2:], tmp_path / "c"),
                         model, tokenizer, tmp_path / "c")
    assert len(list((tmp_path / "cache" / "base_eval").glob("tiny_random-*.json"))) == 2
    # before_after.json says where the base figures came from, and on which split
    records = [json.loads((tmp_path / d / "before_after.json").read_text()) for d in "ab"]
    assert [r["before_source"]["from"] for r in records] == ["computed now", "cache"]
    assert records[1]["before_source"]["path"] == str(cached[0]) and records[0]["split"] == "test"
    settings = records[1]["before_source"]["settings"]
    assert set(settings) == {"threads", "torch", "transformers", "trl", "model_package", "precision", "isa"}
    # another thread count, precision or library version can change the answers: another entry
    for changed in ({"threads": 99}, {"precision": "other"}, {"trl": "0.0"}, {"isa": "other"}):
        real = start_cache.evaluation_machine
        monkeypatch.setattr(start_cache, "evaluation_machine", lambda cfg, real=real, changed=changed: {**real(cfg), **changed})
        path, _ = start_cache.cache_path(cfg, ev.load_sets(cfg))
        assert path != cached[0], changed
        monkeypatch.undo()


def test_before_after_table_names_its_split(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(Path(model.name_or_path).parent, target_is_directory=True)
    cfg = compose_cfg(["debug=smoke", "eval.limit=2", "eval.max_new_tokens=4", "eval.split=validation",
                       f"paths.cache_dir={tmp_path / 'cache'}"], tmp_path / "a")
    result = evaluate_after_train(cfg, model, tokenizer, tmp_path / "a")
    record = json.loads((tmp_path / "a" / "before_after.json").read_text())
    assert record["split"] == "validation" and "validation split" in record["table"].splitlines()[0]
    validation = {e["question"] for e in ev_sets(cfg)}
    assert {r["question"] for r in map(json.loads, (tmp_path / "a" / "eval_samples.jsonl").read_text().splitlines())} <= validation
    assert result["before_after"]["basic"]["distinct"] == 2
    # the learning curve's level: the starting model on the periodic evaluation's own validation problems
    assert record["validation_before"]["set"] == "basic" and record["validation_before"]["n"] == cfg.eval.every_limit
    eval_json = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert eval_json["config"]["split"] == "validation" and eval_json["sets"]["basic"]["distinct"] == 2


def ev_sets(cfg):
    from grpo_exp.evaluation.run import held_out_split

    return held_out_split(cfg.stage, "validation", cfg.eval.limit, cfg.train.seed)[:cfg.eval.limit]


def test_init_from_figures_are_cached_until_its_model_changes(tmp_path, tiny_model, monkeypatch):
    """A sweep of later stages from one run scores that run's model once; a rewritten model/ is scored again."""
    import os

    import grpo_exp.evaluation.run as ev

    model, tokenizer = tiny_model
    start = tmp_path / "basic_run" / "model"
    model.save_pretrained(start)
    tokenizer.save_pretrained(start)
    cfg = compose_cfg(["debug=smoke", "eval.limit=2", "eval.max_new_tokens=4", f"paths.cache_dir={tmp_path / 'cache'}",
                       "eval.every_steps=null"], tmp_path / "a")
    first = evaluate_after_train(cfg, model, tokenizer, tmp_path / "a", start)
    assert len(list((tmp_path / "cache" / "start_eval").glob("basic_run-*.json"))) == 1
    loads = []
    real = ev.load_model
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    second = evaluate_after_train(cfg, model, tokenizer, tmp_path / "b", start)
    assert loads == [] and second["before_after"]["basic"]["before"] == first["before_after"]["basic"]["before"]
    [weights] = start.glob("*.safetensors")
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    evaluate_after_train(cfg, model, tokenizer, tmp_path / "c", start)
    assert len(loads) == 1 and len(list((tmp_path / "cache" / "start_eval").glob("basic_run-*.json"))) == 2
