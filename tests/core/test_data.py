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
from grpo_exp.core.data import generators
from grpo_exp.core.data.generators import LEVELS, generate, generate_splits
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


def test_multi_step_keeps_the_problems_it_had_as_intermediate():
    # The README's EWC figures were measured on this stage under the name intermediate (seed 42);
    # these are the first problems of that split, as generated before the rename.
    train, test = generate_splits("multi_step", 30, 10, seed=42)
    assert train[0]["question"] == ("A shelf holds 10 books. Liam takes away 4 books, puts back 1 books "
                                    "and then takes away 1 more. How many books are on the shelf now?")
    assert test[0]["question"] == ("Diego buys 3 of the same mug at 7 dollars each and pays with 50 dollars. "
                                   "How much change, in dollars, does Diego get back?")
    assert {p["level"] for p in train + test} == {"multi_step"}


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


@pytest.mark.parametrize("level", LEVELS)
def test_splits_disjoint_and_test_independent_of_num_train(level):
    train, test = generate_splits(level, 400, 100, seed=7)
    assert len(train) == 400 and len(test) == 100
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    _, test_small = generate_splits(level, 10, 100, seed=7)
    assert test_small == test
    assert generate_splits(level, 400, 100, seed=8)[1] != test


@pytest.mark.parametrize("seed", [0, 1, 42, 1234])
@pytest.mark.parametrize("level", LEVELS)
def test_no_test_expression_occurs_in_training(level, seed):
    """Held out means held out: not the same computation in other words, nor with operands swapped."""
    train, test = generate_splits(level, 2000, 200, seed=seed)
    train_keys = {generators.canonical(p["expression"]) for p in train}
    test_keys = [generators.canonical(p["expression"]) for p in test]
    assert not train_keys & set(test_keys)
    # A commuted copy of a test problem is recognised as the same computation.
    for p in test:
        if p["expression"].count(" ") == 2 and p["expression"].split()[1] in "+*":
            a, op, b = p["expression"].split()
            assert generators.canonical(f"{b} {op} {a}") in set(test_keys)


@pytest.mark.parametrize("level", LEVELS)
def test_test_split_keeps_the_stage_mix(level):
    """The held-out split is scored as the stage: each template about as common as in training.

    (Requiring distinct computations in the test split once left basic with 3% products, whose
    held-out space is a handful of one-digit pairs, against 13% in training.)
    """
    train, test = generate_splits(level, 2000, 200, seed=42)

    def shares(problems):
        shapes = [re.sub(r"\d+", "N", p["expression"]) for p in problems]
        return {s: shapes.count(s) / len(shapes) for s in set(shapes)}

    train_share, test_share = shares(train), shares(test)
    for shape, share in train_share.items():
        assert test_share.get(shape, 0.0) >= share / 2, (shape, share, test_share.get(shape))


def test_canonical_expression_key():
    c = generators.canonical
    assert c("3 + 4") == c("4 + 3") and c("2 * 9") == c("9 * 2")
    assert c("(1 + 2) + 3") == c("3 + (2 + 1)") and c("2 * (4 + 3) - 1") == c("(3 + 4) * 2 - 1")
    assert c("7 - 3") != c("3 - 7") and c("12 // 3") != c("3 // 12") and c("3 + 4") != c("3 * 4")


@pytest.mark.parametrize("level", LEVELS)
def test_every_template_keeps_training_problems(level):
    """The partition holds out a share of each template's expressions, never a whole template."""
    train, _ = generate_splits(level, 2000, 200, seed=42)
    templates = generators._TEMPLATES[level]
    shapes = {re.sub(r"\d+", "N", p["expression"]) for p in train}
    import random

    expected = {re.sub(r"\d+", "N", t(random.Random(0))[1]) for t in templates}
    assert expected <= shapes


def test_impossible_request_raises(monkeypatch):
    # Single-digit products only: 81 numbers x 4 phrasings = 324 distinct questions.
    monkeypatch.setitem(generators._TEMPLATES, "basic", (generators._mul,))
    assert len(generate("basic", 324, seed=0)) == 324
    with pytest.raises(ValueError, match="distinct"):
        generate("basic", 325, seed=0)


def test_unknown_level():
    with pytest.raises(ValueError, match=r"'expert'.*basic, intermediate, two_step, multi_step, advanced"):
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
    train = build_examples("gsm8k", "train", num_train=5, num_test=0, seed=1, path=str(gsm8k_dir))
    assert len(train) == 5 and all(e["question"].startswith("Train") for e in train)
    assert train == build_examples("gsm8k", "train", num_train=5, num_test=0, seed=1,
                                   path=gsm8k_dir)
    test = build_examples("gsm8k", "test", num_train=5, num_test=0, seed=1, path=gsm8k_dir)
    assert len(test) == 10 and all(e["question"].startswith("Test") for e in test)
    assert {e["answer"] for e in test} == {str(i * 2) for i in range(600, 610)}
    # A shuffle, not the file order.
    assert [e["question"] for e in test] != sorted(e["question"] for e in test)


def test_build_examples_gsm8k_single_file_is_split_disjointly(tmp_path):
    rows = [{"question": f"Problem {i}: what is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(400)]
    file = tmp_path / "all.jsonl"
    write_jsonl(file, [json.dumps(r) for r in rows])
    train = build_examples("gsm8k", "train", num_train=0, num_test=0, seed=3, path=str(file))
    test = build_examples("gsm8k", "test", num_train=0, num_test=0, seed=3, path=str(file))
    assert not {e["question"] for e in train} & {e["question"] for e in test}
    assert len(train) + len(test) == 400
    assert 0.12 < len(test) / 400 < 0.28  # the stated test_fraction, 0.2
    half = build_examples("gsm8k", "test", num_train=0, num_test=0, seed=3, path=str(file), test_fraction=0.5)
    assert 0.4 < len(half) / 400 < 0.6
    # another seed draws another partition, still disjoint
    other = build_examples("gsm8k", "train", num_train=0, num_test=0, seed=4, path=str(file))
    assert {e["question"] for e in other} != {e["question"] for e in train}


def test_build_examples_generated_levels():
    train = build_examples("intermediate", "train", num_train=30, num_test=10, seed=4)
    test = build_examples("intermediate", "test", num_train=30, num_test=10, seed=4)
    assert (train, test) == generate_splits("intermediate", 30, 10, seed=4)


def test_build_examples_rejects_bad_names():
    with pytest.raises(ValueError, match=r"'mathqa'.*gsm8k"):
        build_examples("mathqa", "train", num_train=1, num_test=1, seed=0)
    with pytest.raises(ValueError, match="'validation'"):
        build_examples("basic", "validation", num_train=1, num_test=1, seed=0)
    assert DATASETS == ("basic", "intermediate", "two_step", "multi_step", "advanced", "gsm8k")


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
