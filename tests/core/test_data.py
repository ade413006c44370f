"""Tests for grpo_exp.data: generators, GSM8K loading, prompts and dataset building."""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path

import pytest

from grpo_exp.core.data import (
    DATASETS,
    DEFAULT_SYSTEM_PROMPT,
    DataFileError,
    build_examples,
    to_dataset,
    to_messages,
)
from grpo_exp.core.data import generators, templates
from grpo_exp.core.data.generators import LEVELS, SPLITS, generate, generate_split
from grpo_exp.core.data.gsm8k import load_jsonl, parse_gsm8k_answer
from tests.conftest import SHARED_GSM8K

SHARED_GSM8K_TEST = SHARED_GSM8K / "test.jsonl"

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv}


def safe_eval(expression: str) -> int:
    """Evaluate integer + - * // arithmetic only; anything else is rejected."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv):
                # Ground truth divisions must be exact, so // never truncates.
                assert right != 0 and left % right == 0, expression
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"disallowed node {type(node).__name__} in {expression!r}")

    return ev(ast.parse(expression, mode="eval"))


# --- generators ---------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_generate_is_deterministic(level):
    assert generate(level, 50, seed=3) == generate(level, 50, seed=3)
    assert generate(level, 50, seed=3) != generate(level, 50, seed=4)


@pytest.mark.parametrize("level", LEVELS)
def test_answers_recompute_from_expression(level):
    problems = generate(level, 300, seed=11)
    assert len(problems) == 300
    for p in problems:
        assert set(p) >= {"question", "answer", "level", "expression"}
        assert p["level"] == level
        assert re.fullmatch(r"[0-9+\-*/() ]+", p["expression"]), p
        assert "/" not in p["expression"].replace("//", ""), p
        assert re.fullmatch(r"-?\d+", p["answer"]), p
        assert str(safe_eval(p["expression"])) == p["answer"], p


@pytest.mark.parametrize("level", LEVELS)
def test_numbers_in_expression_appear_in_question(level):
    # Guards against a template computing with numbers the question never states.
    for p in generate(level, 200, seed=5):
        stated = re.findall(r"\d+", p["question"])
        for number in re.findall(r"\d+", p["expression"]):
            assert number in stated or number == "2", p


def test_basic_answers_are_non_negative():
    assert all(int(p["answer"]) >= 0 for p in generate("basic", 500, seed=0))


@pytest.mark.parametrize("level, minimum", [("basic", 12), ("intermediate", 6), ("multi_step", 6), ("advanced", 6)])
def test_several_phrasings(level, minimum):
    openings = {" ".join(p["question"].split()[:3]) for p in generate(level, 400, seed=2)}
    # Names vary in word problems, so drop them to count templates rather than people.
    openings = {re.sub(r"^[A-Z][a-z]+ ", "", o) for o in openings}
    assert len(openings) >= minimum, openings


def test_intermediate_is_one_operation_in_words():
    problems = generate("intermediate", 400, seed=3)
    assert all(len(re.findall(r" (?:[-+*]|//) ", p["expression"])) == 1 for p in problems)
    assert all(re.search(r"[a-z]{3,} [a-z]{3,} [a-z]{3,}", p["question"]) for p in problems)  # words, not "What is 7 + 5?"
    assert {re.search(r"[-+*]|//", p["expression"]).group() for p in problems} == {"+", "-", "*", "//"}


def test_basic_has_three_phrasings_per_operation():
    by_op: dict[str, set[str]] = {}
    for p in generate("basic", 600, seed=9):
        op = re.search(r"[-+*]|//", p["expression"]).group()
        by_op.setdefault(op, set()).add(" ".join(p["question"].split()[:2]))
    assert set(by_op) == {"+", "-", "*", "//"}
    assert all(len(v) >= 3 for v in by_op.values()), by_op


@pytest.mark.parametrize("level", LEVELS)
def test_generated_questions_are_unique(level):
    questions = [p["question"] for p in generate(level, 500, seed=1)]
    assert len(set(questions)) == len(questions)


def splits(level: str, seed: int, train: int = 2000, held_out: int = 200) -> dict[str, list[dict]]:
    return {split: generate_split(level, split, train if split == "train" else held_out, seed) for split in SPLITS}


@pytest.mark.parametrize("seed", [0, 1, 42, 1234])
@pytest.mark.parametrize("level", LEVELS)
def test_three_partitions_are_disjoint_and_held_out_sets_distinct(level, seed):
    """Held out means held out: no computation of validation or test is trained on (not in other words, nor
    with operands swapped), validation and test share none, and neither repeats one."""
    drawn = splits(level, seed)
    keys = {split: [generators.canonical(p["expression"]) for p in rows] for split, rows in drawn.items()}
    assert all(p["key"] == generators.canonical(p["expression"]) for rows in drawn.values() for p in rows)
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        assert not set(keys[a]) & set(keys[b]), (a, b)
    for split in ("validation", "test"):
        assert len(keys[split]) == 200 and len(set(keys[split])) == 200, split
        assert {generators.split_of(k, seed) for k in keys[split]} == {split}
    assert {generators.split_of(k, seed) for k in keys["train"]} == {"train"}
    # A commuted copy of a held-out problem is recognised as the same computation.
    for p in drawn["test"]:
        if p["expression"].count(" ") == 2 and p["expression"].split()[1] in "+*":
            a, op, b = p["expression"].split()
            assert generators.canonical(f"{b} {op} {a}") in set(keys["test"])


def test_three_step_word_problems_share_their_keys_with_the_same_expressions():
    """A three_step story and the expression it stands for are one computation: the same key, whichever template
    asks it and in whichever order the products and sums are written."""
    problems = generate("three_step", 2000, seed=8)
    by_template: dict[str, set[str]] = {}
    for p in problems:
        by_template.setdefault(p["template"], set()).add(p["key"])
        assert int(p["answer"]) >= 0 and len(re.findall(r" [-+*] ", p["expression"])) == 3, p
    assert set(by_template) == {"expr_three", "more_less_more", "groups_plus_minus", "two_groups"}
    for story in ("more_less_more", "groups_plus_minus", "two_groups"):
        assert by_template[story] & by_template["expr_three"], story  # asked in words and as an expression
    assert generators.canonical("3 * 4 + 5 * 2") == generators.canonical("2 * 5 + 4 * 3")
    assert generators.canonical("3 + 4 - 2 + 5") != generators.canonical("3 + 4 + 5 - 2")  # another computation


def test_the_partition_is_the_same_for_every_level():
    """A computation's split depends on it and the seed only: held out at one level, never trained at another."""
    assert generators.split_of("(Add 3 4)", 7) == generators.split_of(generators.canonical("4 + 3"), 7)
    shared = {}
    for level in LEVELS:
        for split, rows in splits(level, 5, train=300, held_out=50).items():
            for p in rows:
                assert shared.setdefault(p["key"], split) == split, (level, p["key"])


def test_band_shares_follow_the_fractions():
    positions = [generators.split_of(str(i), 3) for i in range(20_000)]
    for split, share in (("test", 0.25), ("validation", 0.25), ("train", 0.5)):
        assert abs(positions.count(split) / len(positions) - share) < 0.02, split
    assert {generators.split_of(str(i), 3, 0.1, 0.3) for i in range(100)} == {"train", "validation", "test"}


@pytest.mark.parametrize("level", LEVELS)
def test_held_out_sets_keep_the_level_mix(level):
    """Each template gets its share of the set (templates listed twice, twice the share)."""
    from collections import Counter

    weights = Counter(generators._TEMPLATES[level])
    for split in ("validation", "test"):
        counts = Counter(p["template"] for p in generate_split(level, split, 200, seed=42))
        for template, weight in weights.items():
            expected = 200 * weight / len(generators._TEMPLATES[level])
            assert abs(counts[template.__name__.lstrip("_")] - expected) <= 1, (split, template.__name__, counts)


def test_splits_do_not_depend_on_each_other_or_on_size_beyond_their_own():
    small, large = splits("basic", 7, train=10, held_out=40), splits("basic", 7, train=400, held_out=40)
    assert small["test"] == large["test"] and small["validation"] == large["validation"]
    assert generate_split("basic", "test", 40, seed=8) != small["test"]


def test_a_band_too_small_gives_a_smaller_set_with_the_same_mix(monkeypatch, caplog):
    """Where a template's band holds too few distinct computations, every template's quota shrinks alike."""
    def _few(rng):  # 9 computations in all, about 2 per held-out band
        a = rng.randint(1, 9)
        return f"What is {a} + 100?", f"{a} + 100", a + 100

    monkeypatch.setitem(generators._TEMPLATES, "basic", (templates._sub, _few))
    with caplog.at_level("WARNING"):
        rows = generate_split("basic", "test", 40, seed=0)
    few = [p for p in rows if p["template"] == "few"]
    assert 0 < len(few) <= 9 and len(rows) == 2 * len(few)
    assert len({p["key"] for p in rows}) == len(rows)
    assert "instead of 40" in caplog.text


@pytest.mark.parametrize("level", LEVELS)
def test_every_template_keeps_training_problems(level):
    """The partition holds out a share of each template's expressions, never a whole template."""
    train = generate_split(level, "train", 2000, seed=42)
    templates = generators._TEMPLATES[level]
    shapes = {re.sub(r"\d+", "N", p["expression"]) for p in train}
    import random

    expected = {re.sub(r"\d+", "N", t(random.Random(0))[1]) for t in templates}
    assert expected <= shapes


def test_impossible_request_raises(monkeypatch):
    def _three(rng):  # 3 distinct questions in all
        a = rng.randint(1, 3)
        return f"What is {a} + 1?", f"{a} + 1", a + 1

    monkeypatch.setitem(generators._TEMPLATES, "basic", (_three,))
    assert len(generate("basic", 3, seed=0)) == 3
    with pytest.raises(ValueError, match="distinct"):
        generate("basic", 4, seed=0)


def test_unknown_level():
    with pytest.raises(ValueError, match=r"'expert'.*basic, intermediate, two_step, three_step, multi_step, advanced"):
        generate("expert", 3, seed=0)


# --- GSM8K parsing and loading ------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("so 6 + 12 = 18\n#### 18", "18"),
    ("#### 1,000", "1000"),
    ("#### -5", "-5"),
    ("#### 2.5", "2.5"),
    ("#### $1,234 ", "1234"),
])
def test_parse_gsm8k_answer(text, expected):
    assert parse_gsm8k_answer(text) == expected


@pytest.mark.parametrize("text", ["the answer is 4", "#### four", "####"])
def test_parse_gsm8k_answer_rejects(text):
    with pytest.raises(ValueError):
        parse_gsm8k_answer(text)


# Made-up problems in GSM8K format (no real GSM8K content in the repo).
ROWS = [
    {"question": "A jar holds 7 red and 5 blue beads. How many beads?",
     "answer": "7 + 5 = <<7+5=12>>12\n#### 12"},
    {"question": "A farm sells 1,234 eggs a week. How many eggs?",
     "answer": "It sells 1,234 eggs.\n#### 1,234"},
    {"question": "A kite costs $3 and a ball $2. What is the difference?",
     "answer": "3 - 2 = 1\n#### $1"},
]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "mini.jsonl", [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]),
                                                 "   ", json.dumps(ROWS[2])])
    examples = load_jsonl(path)
    assert [e["answer"] for e in examples] == ["12", "1234", "1"]
    assert examples[0]["rationale"] == "7 + 5 = <<7+5=12>>12"
    assert examples[1]["question"] == ROWS[1]["question"]
    assert all(e["level"] == "gsm8k" for e in examples)


@pytest.mark.parametrize("lines, line_no, fragment", [
    ([json.dumps(ROWS[0]), '{"question": "x", "answer": '], 2, "malformed JSON"),
    ([json.dumps(ROWS[0]), "", json.dumps({"answer": "#### 3"})], 3, "'question'"),
    ([json.dumps({"question": "q"})], 1, "'answer'"),
    ([json.dumps(ROWS[0]), json.dumps({"question": "q", "answer": "it is 3"})], 2, "####"),
    ([json.dumps({"question": "q", "answer": "#### three\nmore"})], 1, "not a number"),
    ([json.dumps(["question", "answer"])], 1, "JSON object"),
])
def test_load_jsonl_errors_name_file_and_line(tmp_path, lines, line_no, fragment):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFileError) as info:
        load_jsonl(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and f"line {line_no}" in message and fragment in message


def test_load_jsonl_missing_and_empty(tmp_path):
    with pytest.raises(DataFileError, match="GSM8K file not found: .*nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataFileError, match="empty.*empty.jsonl") as info:
        load_jsonl(empty)
    assert "\n" not in str(info.value)


# Defined only when the shared copy exists: an empty parametrize would still report a skip.
if SHARED_GSM8K_TEST.is_file():

    def test_shared_gsm8k_test_split_loads():
        examples = load_jsonl(SHARED_GSM8K_TEST)
        assert len(examples) == 1319
        assert all(re.fullmatch(r"-?\d+(\.\d+)?", e["answer"]) for e in examples)


# --- build_examples, prompts, to_dataset --------------------------------------------------

@pytest.fixture
def gsm8k_dir(tmp_path):
    train = [{"question": f"Train {i}: what is {i} + 1?", "answer": f"{i} + 1\n#### {i + 1}"}
             for i in range(20)]
    test = [{"question": f"Test {i}: what is {i} * 2?", "answer": f"{i} * 2\n#### {i * 2:,}"}
            for i in range(600, 610)]
    write_jsonl(tmp_path / "train.jsonl", [json.dumps(r) for r in train])
    write_jsonl(tmp_path / "test.jsonl", [json.dumps(r) for r in test])
    return tmp_path


def test_build_examples_gsm8k_directory(gsm8k_dir):
    train = build_examples("gsm8k", "train", size=5, seed=1, path=str(gsm8k_dir))
    assert len(train) == 5 and all(e["question"].startswith("Train") for e in train)
    assert train == build_examples("gsm8k", "train", size=5, seed=1, path=gsm8k_dir)
    test = build_examples("gsm8k", "test", size=0, seed=1, path=gsm8k_dir)
    assert len(test) == 10 and all(e["question"].startswith("Test") for e in test)
    assert {e["answer"] for e in test} == {str(i * 2) for i in range(600, 610)}
    # A shuffle, not the file order.
    assert [e["question"] for e in test] != sorted(e["question"] for e in test)
    # Validation is carved out of the train split by a hash of the question; training keeps the rest.
    validation = build_examples("gsm8k", "validation", size=0, seed=1, path=gsm8k_dir, validation_fraction=0.5)
    rest = build_examples("gsm8k", "train", size=0, seed=1, path=gsm8k_dir, validation_fraction=0.5)
    assert validation and all(e["question"].startswith("Train") for e in validation)
    assert not {e["question"] for e in validation} & {e["question"] for e in rest}
    assert len(validation) + len(rest) == 20


def test_gsm8k_split_smaller_than_asked_is_one_line(gsm8k_dir):
    with pytest.raises(DataFileError, match=r"GSM8K test split holds 10 problems .* fewer than the 11 asked for "
                                            r"\(stage.num_test\)") as info:
        build_examples("gsm8k", "test", size=11, seed=1, path=gsm8k_dir)
    assert "\n" not in str(info.value)
    with pytest.raises(DataFileError, match=r"stage.num_validation"):
        build_examples("gsm8k", "validation", size=50, seed=1, path=gsm8k_dir)


def test_build_examples_gsm8k_single_file_is_split_in_three(tmp_path):
    rows = [{"question": f"Problem {i}: what is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(400)]
    file = tmp_path / "all.jsonl"
    write_jsonl(file, [json.dumps(r) for r in rows])
    parts = {split: {e["question"] for e in build_examples("gsm8k", split, size=0, seed=3, path=str(file))}
             for split in SPLITS}
    assert not parts["train"] & parts["test"] and not parts["train"] & parts["validation"]
    assert not parts["validation"] & parts["test"]
    assert sum(map(len, parts.values())) == 400
    assert 0.18 < len(parts["test"]) / 400 < 0.32 and 0.18 < len(parts["validation"]) / 400 < 0.32
    half = build_examples("gsm8k", "test", size=0, seed=3, path=str(file), test_fraction=0.5)
    assert 0.4 < len(half) / 400 < 0.6
    # another seed draws another partition, still disjoint
    other = build_examples("gsm8k", "train", size=0, seed=4, path=str(file))
    assert {e["question"] for e in other} != parts["train"]


def test_build_examples_generated_levels():
    for split in SPLITS:
        assert build_examples("intermediate", split, size=30, seed=4) == generate_split("intermediate", split, 30, 4)


def test_build_examples_rejects_bad_names():
    with pytest.raises(ValueError, match=r"'mathqa'.*gsm8k"):
        build_examples("mathqa", "train", size=1, seed=0)
    with pytest.raises(ValueError, match=r"'dev'.*train, validation, test"):
        build_examples("basic", "dev", size=1, seed=0)
    assert DATASETS == ("basic", "intermediate", "two_step", "three_step", "multi_step", "advanced", "gsm8k", "prompts")


def test_to_messages():
    assert to_messages("What is 2 + 2?", "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    assert to_messages("What is 2 + 2?", "") == [{"role": "user", "content": "What is 2 + 2?"}]


def test_to_dataset():
    examples = generate("basic", 4, seed=0)
    ds = to_dataset(examples, DEFAULT_SYSTEM_PROMPT)
    assert set(ds.column_names) == {"prompt", "answer", "question", "level"}
    assert len(ds) == 4
    row = ds[1]
    assert row["prompt"] == to_messages(examples[1]["question"], DEFAULT_SYSTEM_PROMPT)
    assert row["answer"] == examples[1]["answer"] and row["level"] == "basic"
    assert row["question"] == examples[1]["question"]
    assert to_dataset([], "").column_names == ds.column_names


def test_load_hub_failure_is_one_line(monkeypatch):
    import datasets

    from grpo_exp.core.data.gsm8k import load_hub

    def offline(*args, **kwargs):
        raise ConnectionError("no route to host\nretry later")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataFileError) as info:
        load_hub()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("could not load GSM8K from the hub (openai/gsm8k): ")
    assert message.endswith("pass stage.path=<local JSONL> instead")


def test_load_hub_parses_rows(monkeypatch):
    import datasets

    from grpo_exp.core.data.gsm8k import load_hub

    calls = []

    def fake(hub_id, config, split):
        calls.append((hub_id, config, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert [e["answer"] for e in load_hub(split="train")] == ["12", "1234", "1"]
    assert calls == [("openai/gsm8k", "main", "train")]


def test_held_out_sets_are_one_fixed_partition_whatever_the_training_seed(tmp_path):
    """stage.split_seed draws the bands: every training seed scores the same validation and test problems, and
    no seed trains on a computation held out; another split seed is another partition; old records (no
    split_seed) keep the partition of their training seed."""
    from grpo_exp.core.data import split_seed, stage_split
    from tests.conftest import compose_cfg

    for level in ("basic", "intermediate"):
        stage = compose_cfg([f"stage={level}"], tmp_path).stage
        held = {s: [ex["key"] for ex in stage_split(stage, s, 42)] for s in ("validation", "test")}
        trained = set()
        for seed in (42, 1, 2, 3, 4):
            for s in ("validation", "test"):
                assert [ex["key"] for ex in stage_split(stage, s, seed)] == held[s]
            train = stage_split(stage, "train", seed)
            trained |= {ex["key"] for ex in train}
        assert not trained & (set(held["validation"]) | set(held["test"]))
        assert not set(held["validation"]) & set(held["test"])
        # the training seed still picks which training problems a run draws
        assert stage_split(stage, "train", 1) != stage_split(stage, "train", 2)
        moved = compose_cfg([f"stage={level}", "stage.split_seed=7"], tmp_path).stage
        assert [ex["key"] for ex in stage_split(moved, "test", 42)] != held["test"]
    old = {"name": "basic"}  # a stage node recorded before split_seed existed
    assert split_seed(old, 3) == 3 and split_seed({"split_seed": 42}, 3) == 42


def test_split_seed_must_be_an_integer(tmp_path):
    from tests.conftest import assert_fails_fast_with_one_line

    assert_fails_fast_with_one_line(tmp_path / "run", ["stage.split_seed=abc"], "stage.split_seed")
