"""Worked solutions (core/data/solutions.py): every generated level's problems get a solution that writes each
operation in evaluation order and that the stage's own rewards score as right and well formatted."""

from __future__ import annotations

import pytest

from grpo_exp.core import rewards
from grpo_exp.core.data import LEVELS, generate
from grpo_exp.core.data.solutions import worked_solution


def test_a_solution_writes_each_operation_in_the_order_it_is_evaluated():
    assert worked_solution({"expression": "47 - 19", "answer": "28"}) == "47 - 19 = 28.\nThe answer is 28."
    assert worked_solution({"expression": "(3 + 4) * 5 - 6", "answer": "29"}) == (
        "3 + 4 = 7. 7 * 5 = 35. 35 - 6 = 29.\nThe answer is 29.")
    assert worked_solution({"expression": "12 // 4 + 2", "answer": "5"}) == "12 / 4 = 3. 3 + 2 = 5.\nThe answer is 5."


@pytest.mark.parametrize("level", LEVELS)
def test_every_levels_solutions_score_right_and_formatted_with_the_stage_rewards(level):
    problems = generate(level, 40, seed=3)
    completions = [[{"role": "assistant", "content": worked_solution(p)}] for p in problems]
    answers = [p["answer"] for p in problems]
    assert rewards.correctness(completions, answers) == [1.0] * len(problems)
    assert rewards.answer_format(completions, answers) == [1.0] * len(problems)


def test_a_gsm8k_rationale_loses_its_calculator_notes_and_ends_with_the_answer_line():
    problem = {"question": "q", "answer": "1200", "rationale": "He buys 3*400=<<3*400=1200>>1200 g."}
    assert worked_solution(problem) == "He buys 3*400=1200 g.\nThe answer is 1200."


def test_a_problem_whose_computation_disagrees_or_is_missing_is_refused():
    with pytest.raises(ValueError, match="evaluates to 28, not the problem's answer 29"):
        worked_solution({"expression": "47 - 19", "answer": "29"})
    with pytest.raises(ValueError, match="needs a generated problem's 'expression' or a GSM8K 'rationale'"):
        worked_solution({"question": "q", "answer": "1"})
