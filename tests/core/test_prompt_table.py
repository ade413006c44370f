"""stage=prompts (core/data/prompt_table.py): a JSONL file with a `prompt` column (text or chat messages) read into
problems whose other columns reach the rewards, cut by a seeded hash of each prompt; every bad input one line, in
the pre-check, before any model loads. No model here."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from grpo_exp.apps.train import check
from grpo_exp.base.errors import ConfigError
from grpo_exp.config.compose import check_overrides
from grpo_exp.core.data import DataFileError, build_examples, prompt_messages, prompt_table, to_dataset
from grpo_exp.evaluation.judge import RewardJudge, for_stage

SPLIT = {"test_fraction": 0.25, "validation_fraction": 0.25}


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mixed_rows(n: int = 200) -> list[dict]:
    """Text and chat prompts, with a text, a number and a list column (kept as they are)."""
    rows = []
    for i in range(n):
        prompt = f"What is {i} + 3?" if i % 2 else [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": f"Double {i}."}]
        rows.append({"prompt": prompt, "solution": str(i + 3 if i % 2 else 2 * i), "task": "add" if i % 2 else "double",
                     "weight": i, "tags": ["a", str(i)]})
    return rows


def split(path, name: str, seed: int = 42, size: int = 0) -> list[dict]:
    return build_examples("prompts", name, size=size, seed=seed, path=str(path), **SPLIT)


def test_text_and_chat_prompts_become_problems_with_their_columns(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", mixed_rows())
    train = split(path, "train")
    text = next(ex for ex in train if isinstance(ex["prompt"], str))
    chat = next(ex for ex in train if isinstance(ex["prompt"], list))
    i = int(text["question"].split()[2])
    assert text["columns"] == {"solution": str(i + 3), "task": "add", "weight": i, "tags": ["a", str(i)]}
    assert chat["question"].startswith("Double ") and chat["level"] == "prompts" and chat["answer"] == ""
    # a text prompt gets the system prompt as a question does; a chat prompt keeps its own system message, and one
    # without gets the system prompt first
    assert prompt_messages(text, "SYS") == [{"role": "system", "content": "SYS"},
                                            {"role": "user", "content": text["question"]}]
    assert prompt_messages(chat, "SYS") == chat["prompt"]
    bare = {**chat, "prompt": [chat["prompt"][1]]}
    assert prompt_messages(bare, "SYS")[0] == {"role": "system", "content": "SYS"}
    assert prompt_messages(bare, "") == [chat["prompt"][1]]


def test_the_training_dataset_holds_the_prompt_and_the_columns_as_trl_passes_them(tmp_path):
    train = split(write_rows(tmp_path / "rows.jsonl", mixed_rows()), "train")
    dataset = to_dataset(train, "SYS")
    assert dataset.column_names == ["prompt", "solution", "task", "weight", "tags"]
    # TRL hands a reward every column but the prompt, one value per row, as the row holds it
    kwargs = {key: [row[key] for row in dataset] for key in dataset.column_names if key != "prompt"}
    assert kwargs["weight"] == [ex["columns"]["weight"] for ex in train]
    assert kwargs["tags"][0] == train[0]["columns"]["tags"] and isinstance(kwargs["weight"][0], int)
    assert [row["prompt"] for row in dataset] == [prompt_messages(ex, "SYS") for ex in train]
    # a curriculum's mixed set: generated problems beside the rows, each with the other's columns empty
    mixed = to_dataset([{**train[0], "stage": "prompts"},
                        {"question": "What is 1 + 1?", "answer": "2", "level": "basic", "stage": "basic"}],
                       "", stage_column=True)
    assert mixed[1]["answer"] == "2" and mixed[1]["solution"] is None and mixed["stage"] == ["prompts", "basic"]


def test_the_hash_split_depends_on_the_prompt_and_the_seed_alone(tmp_path):
    rows = mixed_rows()
    first = {name: {ex["key"] for ex in split(write_rows(tmp_path / "a.jsonl", rows), name)}
             for name in ("train", "validation", "test")}
    assert set.union(*first.values()) == {prompt_table.prompt_key(r["prompt"]) for r in rows}
    assert not (first["train"] & first["validation"] or first["train"] & first["test"]
                or first["validation"] & first["test"])
    assert all(35 <= len(first[name]) <= 65 for name in ("validation", "test")), {k: len(v) for k, v in first.items()}
    # shuffled, with rows added and a prompt repeated: every prompt keeps its split, and a repeat goes with it
    more = rows + [{"prompt": f"Halve {i * 2}.", "solution": str(i)} for i in range(50)] + [{**rows[1], "weight": -1}]
    random.Random(1).shuffle(more)
    second = {name: [ex["key"] for ex in split(write_rows(tmp_path / "b.jsonl", more), name)]
              for name in ("train", "validation", "test")}
    for name in first:
        assert first[name] <= set(second[name])
    # the same prompt with other columns: the same split (the hash reads the prompt alone)
    assert [key for key in second[next(n for n in first if prompt_table.prompt_key(rows[1]["prompt"]) in first[n])]
            if key == prompt_table.prompt_key(rows[1]["prompt"])] == [prompt_table.prompt_key(rows[1]["prompt"])] * 2
    other_seed = {ex["key"] for ex in split(tmp_path / "a.jsonl", "test", seed=7)}
    assert other_seed != first["test"]
    # the training seed orders (and picks) the training rows, never which rows are held out
    picked = build_examples("prompts", "train", size=10, seed=42, path=str(tmp_path / "a.jsonl"), sample_seed=3,
                            **SPLIT)
    assert {ex["key"] for ex in picked} <= first["train"] and len(picked) == 10


@pytest.mark.parametrize("rows, needle", [
    ([{"question": "What is 1 + 1?", "solution": "2"}],
     "has no 'prompt' column (its columns: question, solution); rename the column holding the prompts to 'prompt'"),
    ([{"prompt": "What is 1 + 1?"}, {"prompt": ""}], "line 2: 'prompt' is empty"),
    ([{"prompt": "What is 1 + 1?"}, {"solution": "2"}], "line 2: 'prompt' must be text or a list of chat messages, "
                                                        "not missing"),
    ([{"prompt": [{"role": "user", "text": "hi"}]}], "line 1: 'prompt' message {\"role\": \"user\", \"text\": "
                                                     "\"hi\"} is not {\"role\": system|user|assistant"),
    ([{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]}],
     "ends with an assistant message"),
    ([{"prompt": "a", "completions": 1}], "a column named 'completions', a keyword TRL passes to every reward"),
    ([{"prompt": "a", "solution": "2"}, {"prompt": "b", "solution": 2}],
     "column 'solution' of {path} holds both text and number values (prompts file {path}, line 2); give it one type"),
    (["What is 1 + 1?"], "line 1: expected a JSON object, got str"),
    ([], "prompts file is empty"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, rows, needle):
    path = write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataFileError) as err:
        split(path, "train")
    line = str(err.value)
    assert needle.replace("{path}", str(path)) in line and "\n" not in line, line
    assert str(path) in line


def test_a_directory_is_its_jsonl_files_in_name_order(tmp_path):
    rows = mixed_rows(40)
    write_rows(tmp_path / "b.jsonl", rows[20:])
    write_rows(tmp_path / "a.jsonl", rows[:20])
    (tmp_path / "notes.txt").write_text("not read")
    table = prompt_table.load(tmp_path)
    assert [r["solution"] for r in table.rows] == [r["solution"] for r in rows]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileError, match=r"prompts directory .*empty holds no \.jsonl file"):
        prompt_table.load(tmp_path / "empty")


def test_splits_too_small_for_their_sizes_are_one_line(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", mixed_rows(40))
    with pytest.raises(DataFileError) as err:
        split(path, "validation", size=30)
    assert str(err.value).startswith(f"the validation split of {path} holds ")
    assert "fewer than the 30 asked for (stage.num_validation); lower stage.num_validation" in str(err.value)
    with pytest.raises(DataFileError, match="the train split of .* is empty"):
        build_examples("prompts", "train", size=0, seed=42, path=str(path), test_fraction=0.5,
                       validation_fraction=0.4999999)  # nothing left for training in 40 rows


def test_a_reward_needing_a_column_the_file_lacks_is_named(tmp_path):
    table = prompt_table.load(write_rows(tmp_path / "rows.jsonl", mixed_rows(20)))

    def uses_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    def uses_solution(completions, solution, log_extra=None, **kwargs):
        return [0.0] * len(completions)

    prompt_table.check_columns(table, [("mine:uses_solution", uses_solution)])  # solution is there; log_extra is TRL's
    with pytest.raises(DataFileError) as err:
        prompt_table.check_columns(table, [("mine:uses_answer", uses_answer)])
    assert str(err.value).startswith("reward.funcs entry 'mine:uses_answer' needs the column 'answer', which ")
    assert "(its columns: prompt, solution, task, weight, tags)" in str(err.value)


def test_the_eval_reward_scores_with_the_rows_columns_and_none_is_not_solved(tmp_path):
    train = split(write_rows(tmp_path / "rows.jsonl", mixed_rows(20)), "train")
    seen = {}

    def graded(completions, prompts, solution, task, **kwargs):
        seen.update(prompts=prompts, kwargs=kwargs)
        kwargs["log_extra"]("col", [1] * len(completions))  # a no-op at evaluation, as the page says
        return [None if t == "double" else (1.0 if c[0]["content"] == s else 0.5)
                for c, s, t in zip(completions, solution, task)]

    judge = RewardJudge("mine:graded", graded, 1.0)
    prompts = [prompt_messages(ex, "") for ex in train]
    texts = [ex["columns"]["solution"] if i % 2 else "nope" for i, ex in enumerate(train)]
    scores = judge.scores(train, prompts, texts)
    assert seen["prompts"] == prompts and seen["kwargs"]["weight"] == [ex["columns"]["weight"] for ex in train]
    for ex, text, value in zip(train, texts, scores):
        if ex["columns"]["task"] == "double":
            assert value is None and not judge.solved(value)
        else:
            assert value == (1.0 if text == ex["columns"]["solution"] else 0.5)
            assert judge.solved(value) == (value == 1.0)
    assert RewardJudge("mine:graded", graded, 0.5).solved(0.5)


def test_which_reward_decides_accuracy():
    from omegaconf import OmegaConf

    stage = OmegaConf.create({"dataset": "prompts", "eval_reward": None, "eval_threshold": 0.5})
    judge = for_stage(stage, ["answer_format", "correctness"])
    assert (judge.name, judge.threshold) == ("answer_format", 0.5)  # null: the first of reward.funcs
    stage.eval_reward = "correctness"
    assert for_stage(stage, ["answer_format"]).name == "correctness"
    assert for_stage(OmegaConf.create({"dataset": "basic"}), ["answer_format"]) is None  # scored by its answer


@pytest.mark.usefixtures("fresh_hydra")
@pytest.mark.parametrize("args, needle", [
    ([], "stage=prompts needs its data: stage.path=<JSONL file with a prompt column, or a directory of .jsonl "
         "files>, or stage.hub_id=<hub dataset id>"),
    (["stage.path={tmp}/missing.jsonl"], "stage.path={tmp}/missing.jsonl does not exist; give a JSONL file with a "
                                         "prompt column"),
    (["stage.path={tmp}/questions.jsonl"], "{tmp}/questions.jsonl has no 'prompt' column (its columns: question, "
                                           "answer)"),
    (["stage.path={tmp}/rows.jsonl", "stage.num_test=100"], "fewer than the 100 asked for (stage.num_test)"),
    (["stage.path={tmp}/rows.jsonl", "eval.limit=100", "stage.num_test=8"],
     "test problems but 100 were asked for (eval.limit=100)"),
    (["stage.path={tmp}/rows.jsonl", "reward.funcs=[correctness]"],
     "reward.funcs entry 'correctness' needs the column 'answer', which {tmp}/rows.jsonl lacks (its columns: prompt, "
     "solution, task, weight, tags)"),
    (["stage.path={tmp}/rows.jsonl", "stage.eval_reward=corectness"],
     "unknown reward function 'corectness' in stage.eval_reward; valid names: answer_format, "),
    (["stage.path={tmp}/rows.jsonl", "stage.eval_reward=no_such_module:fn"],
     "stage.eval_reward 'no_such_module:fn': importing no_such_module failed"),
    (["stage.path={tmp}/rows.jsonl", "stage.eval_threshold=nan"], "stage.eval_threshold=nan must be a finite number"),
    (["stage=basic", "stage.eval_reward=correctness"], "stage.eval_reward=correctness scores the held-out sets of "
                                                       "stage.dataset=prompts; a basic stage is scored by its answer"),
])
def test_bad_input_is_one_line_before_any_model_loads(tmp_path, args, needle):
    write_rows(tmp_path / "questions.jsonl", [{"question": "What is 1 + 1?", "answer": "#### 2"}])
    write_rows(tmp_path / "rows.jsonl", mixed_rows(200))
    args = [a.format(tmp=tmp_path) for a in args]
    if not any(a.startswith("reward.funcs=") for a in args):  # reward=correctness needs an answer column
        args.append("reward.funcs=[answer_format]")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        check_overrides("train", ["model=tiny_random", "logger=none", "stage=prompts", "reward=correctness",
                                  "debug=smoke", f"hydra.run.dir={run_dir}", *args], check)
    line = str(err.value)
    assert needle.replace("{tmp}", str(tmp_path)) in line and "\n" not in line, line
    assert not run_dir.exists()


@pytest.mark.usefixtures("fresh_hydra")
def test_a_good_prompts_stage_passes_the_pre_check(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", mixed_rows(200))
    check_overrides("train", ["model=tiny_random", "logger=none", "stage=prompts", f"stage.path={path}",
                              "debug=smoke", "reward.funcs=[answer_format]", "reward.weights=null",
                              f"hydra.run.dir={tmp_path / 'run'}"], check)
    assert not (tmp_path / "run").exists()


@pytest.mark.usefixtures("fresh_hydra")
def test_a_hub_dataset_out_of_reach_is_one_line_saying_how_to_give_a_local_copy(tmp_path, monkeypatch):
    from grpo_exp.training import hub

    monkeypatch.setattr(hub, "hub_silent", lambda: "HF_HUB_OFFLINE is set")
    monkeypatch.setattr(hub, "_cached", lambda hub_id: False)
    with pytest.raises(ConfigError) as err:
        check_overrides("train", ["model=tiny_random", "logger=none", "stage=prompts", "stage.hub_id=org/rows",
                                  f"hydra.run.dir={tmp_path / 'run'}"], check)
    line = str(err.value)
    assert line.startswith("stage.hub_id=org/rows is read from the hub, which cannot be reached (HF_HUB_OFFLINE is "
                           "set)") and "load_dataset('org/rows', split='train')" in line and "\n" not in line
