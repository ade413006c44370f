"""Table-driven tests for grpo_exp.rewards: number parsing, answer extraction and every reward."""

import math

import pytest

from grpo_exp.core import rewards
from grpo_exp.core.rewards import (
    REASONING_END,
    REASONING_START,
    REGISTRY,
    SOLUTION_END,
    SOLUTION_START,
    RewardConfigError,
    answers_match,
    build,
    completion_text,
    extract_answer,
    parse_number,
)

# The package's own rewards, as this module is collected (before any test runs): the test_rewards fixture
# (tests/conftest.py) adds the tests' rewards to REGISTRY for the rest of a session.
PACKAGE_REWARDS = dict(REGISTRY)


def chat(text):
    return [{"role": "assistant", "content": text}]


def both_formats(texts):
    """The same completions as plain strings and as conversational message lists."""
    return [pytest.param(list(texts), id="plain"), pytest.param([chat(t) for t in texts], id="chat")]


def cookbook(solution, reasoning="12 + 5 = 17", start=True):
    head = REASONING_START if start else ""
    return f"{head}{reasoning}{REASONING_END}{SOLUTION_START}{solution}{SOLUTION_END}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$1,234.50", 1234.5),
        ("1,234", 1234.0),
        ("-7", -7.0),
        ("\u22127", -7.0),
        ("-$5", -5.0),
        ("$-5", -5.0),
        ("€20", 20.0),
        ("£3.5", 3.5),
        ("  42  ", 42.0),
        ("17.", 17.0),
        ("12 apples", 12.0),
        ("5 dollars", 5.0),
        ("45%", 45.0),
        ("3 cm", 3.0),
        ("2.50", 2.5),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("1,000,000", 1000000.0),
        ("5-3", 5.0),
        ("no numbers here", None),
        ("", None),
        ("3/0", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<SOLUTION>42</SOLUTION>", 42.0),
        ("<solution> 42 </Solution>", 42.0),
        ("#### 1,000", 1000.0),
        ("Some work: 3 + 4 = 7\n#### 7", 7.0),
        ("\\boxed{8}", 8.0),
        ("so $\\boxed{\\frac{3}{4}}$", 0.75),
        ("The answer is 12 apples.", 12.0),
        ("The final answer is: **$18**", 18.0),
        ("The final answer is: **$1,200**", 1200.0),
        ("Answer: -3", -3.0),
        ("12 + 5 = 17. So the answer is 17.", 17.0),
        # The answer phrase wins over numbers that come after it.
        ("The answer is 5. Check: 2 + 3 = 5, and 10 - 5 = 5, so 99 bottles.", 5.0),
        # The last answer phrase wins over an earlier one.
        ("First guess: the answer is 4. Wait, recount: the answer is 6 in total, 3 pairs.", 6.0),
        # Tags outrank later phrases and numbers.
        ("<SOLUTION>9</SOLUTION> The answer is 10, or 11.", 9.0),
        ("#### 3\nThe answer is 4", 3.0),
        ("He had 3 apples and bought 4 more, 7 in total", 7.0),
        ("It is \u22127 degrees", -7.0),
        ("It costs $1,234.50 in total", 1234.5),
        ("45%", 45.0),
        ("3/4", 0.75),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("pred", "truth", "expected"),
    [
        (2.5, "2.50", True),
        (2.5, "2.5", True),
        (1234.0, "1,234", True),
        (-3.5, "-3.5", True),
        (17.0, 17, True),
        (1e9 + 0.5, "1000000000", True),  # within the relative tolerance
        (0.0000001, "0", True),  # within the absolute tolerance
        (17.001, "17", False),
        (None, "17", False),
        (17.0, "n/a", False),
    ],
)
def test_answers_match(pred, truth, expected):
    assert answers_match(pred, truth) is expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("plain", "plain"),
        (None, ""),
        (chat("hello"), "hello"),
        (chat(None), ""),
        ([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "a\nb"),
        ([{"role": "tool", "content": "99"}, {"role": "assistant", "content": "7"}], "7"),
        ([{"role": "assistant", "content": [{"type": "text", "text": "5"}]}], "5"),
        ([], ""),
    ],
)
def test_completion_text(completion, expected):
    assert completion_text(completion) == expected


@pytest.mark.parametrize("completions", both_formats([
    "12 + 5 = 17. So the answer is 17.",
    "The answer is 18.",
    "<SOLUTION>2.50</SOLUTION>",
    "#### 1,000",
    "\\boxed{8}",
    "The final answer is: **$18**",
    "no numbers here",
    "",
]))
def test_correctness(completions):
    answer = ["17", "17", "2.5", "1000", "8", "18", "0", "0"]
    assert REGISTRY["correctness"](completions, answer=answer) == [
        1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0,
    ]


@pytest.mark.parametrize("completions", both_formats([
    "The answer is 12 apples.",
    "the answer is: **$-3**",
    "Final answer: 4",
    "<SOLUTION>42</SOLUTION>",
    "The answer is unknown.",
    "It is 12.",
    "",
]))
def test_answer_format(completions):
    assert REGISTRY["answer_format"](completions, answer=["0"] * 7) == [
        1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0,
    ]


@pytest.mark.parametrize("completions", both_formats([
    "3 * 5 = 15, 15 + 2 = 17.\nThe answer is 17.",
    "3 * 5 + 2 = 17",  # right, but not stated as asked
    "The answer is 15.",  # stated, but wrong
    "The answer is 17. Then again, the answer is 15.",  # the last statement is the answer
    "<SOLUTION>17</SOLUTION>",
    "",
]))
def test_stated_correctness_needs_a_right_answer_stated_as_asked(completions):
    answer = ["17"] * 6
    assert REGISTRY["stated_correctness"](completions, answer=answer) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    # it is the product of the two rewards it combines, on every completion
    assert REGISTRY["stated_correctness"](completions, answer=answer) == [
        c * f for c, f in zip(REGISTRY["correctness"](completions, answer=answer),
                              REGISTRY["answer_format"](completions, answer=answer))]


@pytest.mark.parametrize("completions", both_formats([
    cookbook("17"),
    cookbook("17", start=False),
    "  \n" + cookbook("17") + "\n\n",
    cookbook("17") + " and more text",
    f"{SOLUTION_START}17{SOLUTION_END}",  # no reasoning-end tag
    f"{REASONING_END}{SOLUTION_START}{SOLUTION_END}",  # empty solution
    "The answer is 17.",
    "",
]))
def test_cookbook_format_exact(completions):
    assert REGISTRY["cookbook_format_exact"](completions, answer=["17"] * 8) == [
        3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    ]


@pytest.mark.parametrize("completions", both_formats([
    cookbook("17"),  # all three tags once
    cookbook("17", start=False),
    f"{SOLUTION_START}17{SOLUTION_END}",  # missing reasoning end
    f"{REASONING_END}{SOLUTION_START}1{SOLUTION_END}{SOLUTION_START}2{SOLUTION_END}",
    "The answer is 17.",
    "",
]))
def test_cookbook_format_approx(completions):
    assert REGISTRY["cookbook_format_approx"](completions, answer=["17"] * 6) == [
        1.5, 1.5, 0.5, -0.5, -1.5, -1.5,
    ]


@pytest.mark.parametrize("completions", both_formats([
    cookbook("100"),  # exact string
    cookbook(" 100 "),  # exact after strip
    cookbook("105"),  # ratio 1.05
    cookbook("100.0"),  # numerically equal but not the same string: notebook tier 2
    cookbook("115"),  # ratio 1.15
    cookbook("85"),  # ratio 0.85
    cookbook("150"),  # far off
    cookbook("-100"),  # wrong sign
    cookbook("a hundred"),  # unparsable
    f"{SOLUTION_START}100{SOLUTION_END}",  # not in the exact format: no answer given
    "The answer is 100.",
    "",
]))
def test_cookbook_answer(completions):
    assert REGISTRY["cookbook_answer"](completions, answer=["100"] * 12) == [
        3.0, 3.0, 1.5, 1.5, 0.5, 0.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0,
    ]


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("0", "0", 3.0),
        ("0.0", "0", 1.5),
        ("0.05", "0", -0.5),
        ("-3", "-3", 3.0),
        ("-3.2", "-3", 1.5),
        ("2.50", "2.5", 1.5),
    ],
)
def test_cookbook_answer_edge_truths(solution, truth, expected):
    assert REGISTRY["cookbook_answer"]([cookbook(solution)], answer=[truth]) == [expected]


@pytest.mark.parametrize("completions", both_formats([
    cookbook("17"),
    f"{SOLUTION_START} 1,234 {SOLUTION_END}",
    f"{SOLUTION_START}-3 degrees{SOLUTION_END}",
    f"{SOLUTION_START}2.50{SOLUTION_END}",
    cookbook("18"),
    f"{SOLUTION_START}seventeen{SOLUTION_END}",  # no number right after the tag
    "The answer is 17.",  # no tag at all
    "",
]))
def test_cookbook_numbers(completions):
    answer = ["17", "1234", "-3", "2.5", "17", "17", "17", "17"]
    assert REGISTRY["cookbook_numbers"](completions, answer=answer) == [
        1.5, 1.5, 1.5, 1.5, -0.5, 0.0, 0.0, 0.0,
    ]


@pytest.mark.parametrize("completions", both_formats([
    "",
    "   \n ",
    "17",
    "12 + 5 = 17",
    "So 17",
    "First, 12 + 5 = 17.\nThen 17 * 2 = 34.\nTherefore the answer is 34.",
    "12 + 5 = 17\n17 - 2 = 15",
    "line one\nline two",
]))
def test_heuristic_reasoning(completions):
    assert REGISTRY["heuristic_reasoning"](completions, answer=["0"] * 8) == [
        0.0, 0.0, 0.0, 0.25, 0.25, 1.0, 0.75, 0.25,
    ]


def test_heuristic_reasoning_is_documented_as_heuristic():
    assert "heuristic" in rewards.heuristic_reasoning.__doc__.lower()


@pytest.mark.parametrize("name", sorted(PACKAGE_REWARDS))
@pytest.mark.parametrize(
    "completions",
    [
        [],
        ["", None, "no numbers here", "<SOLUTION></SOLUTION>", "####", "\\boxed{}"],
        [chat(None), chat(""), [], [{"role": "assistant"}], chat("answer: ?"), chat("5")],
    ],
    ids=["empty-batch", "plain-junk", "chat-junk"],
)
def test_every_reward_survives_junk(name, completions):
    scores = REGISTRY[name](completions, answer=["5"] * len(completions))
    assert len(scores) == len(completions)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)


@pytest.mark.parametrize("name", sorted(PACKAGE_REWARDS))
def test_registry_names_match_function_names(name):
    assert REGISTRY[name].__name__ == name


def test_registry_contents():
    assert sorted(PACKAGE_REWARDS) == [
        "answer_format",
        "cookbook_answer",
        "cookbook_format_approx",
        "cookbook_format_exact",
        "cookbook_numbers",
        "correctness",
        "heuristic_reasoning",
        "stated_correctness",
    ]


def test_answer_rewards_reject_mismatched_answer_column():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        REGISTRY["correctness"](["1", "2"], answer=["1"])


def test_build_defaults_weights_to_one():
    funcs, weights = build(["correctness", "heuristic_reasoning"], None)
    assert funcs == [rewards.correctness, rewards.heuristic_reasoning]
    assert weights == [1.0, 1.0]


def test_build_keeps_given_weights():
    funcs, weights = build(["cookbook_answer", "answer_format"], [2, 0.5])
    assert [f.__name__ for f in funcs] == ["cookbook_answer", "answer_format"]
    assert weights == [2.0, 0.5]


def test_build_rejects_unknown_name():
    with pytest.raises(RewardConfigError) as info:
        build(["correctness", "foo"], None)
    message = str(info.value)
    assert "'foo'" in message
    assert "valid names: " + ", ".join(sorted(REGISTRY)) in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_build_rejects_wrong_length_weights():
    with pytest.raises(RewardConfigError) as info:
        build(["correctness", "answer_format"], [1.0, 2.0, 3.0])
    message = str(info.value)
    assert "3 entries" in message and "has 2" in message
    assert "correctness, answer_format" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("funcs", "weights", "fragment"),
    [
        ([], None, "empty"),
        (["correctness"], [float("nan")], "finite"),
        (["correctness"], [float("inf")], "finite"),
        (["correctness"], ["heavy"], "'heavy'"),
        (["correctness", "correctness"], None, "more than once"),
    ],
)
def test_build_rejects_bad_config(funcs, weights, fragment):
    with pytest.raises(RewardConfigError, match=fragment):
        build(funcs, weights)
