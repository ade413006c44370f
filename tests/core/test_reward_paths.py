"""reward.funcs takes a user's reward by import path (`package.module:function`) beside the registered names, and
refuses a path that does not import or a function TRL could not call, in one line, when the config is checked
(before any model loads). Each module under test is a real file on a temporary Python path."""

from __future__ import annotations

import sys

import pytest

from grpo_exp.base.errors import ConfigError
from grpo_exp.core.rewards import REGISTRY, RewardConfigError, build, correctness

MODULE = '''
from grpo_exp.core.rewards import completion_text


def brevity(completions, **kwargs):
    return [min(1.0, max(0.0, (400 - len(completion_text(c))) / 200)) for c in completions]


def correctness(completions, answer, **kwargs):  # shares a registered reward's name
    return [0.0 for _ in completions]


def no_kwargs(completions, answer):
    return [0.0 for _ in completions]


def no_completions(texts, **kwargs):
    return [0.0 for _ in texts]


def positional_only(completions, extra, /, **kwargs):
    return [0.0 for _ in completions]


class Scorer:
    @staticmethod
    def length(completions, **kwargs):
        return [float(len(completion_text(c))) for c in completions]


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`my_rewards` (a module) and `my_pkg.graded` (a package's module) on the Python path."""
    (tmp_path / "my_rewards.py").write_text(MODULE)
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "graded.py").write_text(MODULE)
    (tmp_path / "broken.py").write_text("raise RuntimeError('this module fails\\non import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_rewards", "my_pkg", "my_pkg.graded", "broken"):
        sys.modules.pop(name, None)


def test_an_import_path_resolves_beside_registered_names(user_module):
    funcs, weights = build(["correctness", "my_rewards:brevity", "my_pkg.graded:Scorer.length"], [1.0, 0.2, 0.0])
    assert funcs[0] is correctness
    assert [f.__name__ for f in funcs] == ["correctness", "brevity", "length"]
    assert weights == [1.0, 0.2, 0.0]
    assert funcs[1](completions=["x" * 300, "short"], answer=["1", "2"], prompts=["p", "q"]) == [0.5, 1.0]
    assert "brevity" not in REGISTRY  # the registry is left as it was


@pytest.mark.parametrize(("entry", "fragments"), [
    ("no_such_module:fn", ["'no_such_module:fn'", "importing no_such_module failed", "ModuleNotFoundError",
                           "Python path"]),
    ("broken:fn", ["importing broken failed", "RuntimeError: this module fails on import"]),
    ("my_rewards:missing", ["my_rewards has no missing"]),
    ("my_rewards:NOT_A_FUNCTION", ["is a int, not a function", "fn(completions, **kwargs)"]),
    ("my_rewards:no_kwargs", ["takes no **kwargs", "fn(completions, **kwargs)"]),
    ("my_rewards:no_completions", ["has no completions parameter"]),
    ("my_rewards:positional_only", ["positional-only parameter completions"]),
    ("my_rewards:", ["not an import path of the form package.module:function"]),
    ("my rewards:brevity", ["not an import path"]),
    ("my_rewards:brevity:x", ["not an import path"]),
])
def test_a_bad_import_path_is_one_line_naming_it(user_module, entry, fragments):
    with pytest.raises(RewardConfigError) as info:
        build(["correctness", entry], None)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_two_functions_of_one_name_are_refused(user_module):
    """TRL logs rewards/<function name>/mean: the package's correctness and the module's would be one metric."""
    with pytest.raises(RewardConfigError, match=r"two functions named correctness \(correctness, my_rewards:correctness\)"):
        build(["correctness", "my_rewards:correctness"], None)


def test_an_unknown_name_mentions_import_paths():
    with pytest.raises(RewardConfigError, match="or an import path package.module:function"):
        build(["brevity"], None)


def test_the_config_check_refuses_a_bad_path_before_any_model_loads(user_module, tmp_path):
    from grpo_exp.config.checks import validate
    from tests.conftest import compose_cfg

    good = compose_cfg(["debug=smoke", "reward.funcs=[correctness,my_rewards:brevity]", "reward.weights=[1.0,0.2]"],
                       tmp_path / "good")
    validate(good)  # a path that imports and fits passes
    bad = compose_cfg(["debug=smoke", "reward.funcs=[correctness,my_rewards:no_kwargs]"], tmp_path / "bad")
    with pytest.raises(ConfigError, match="my_rewards:no_kwargs.*takes no \\*\\*kwargs"):
        validate(bad)


def test_the_web_app_refuses_import_paths(tmp_path):
    """Whoever reaches the app's page must not make it import a module: the app takes reward names only."""
    from grpo_exp.apps.launch_check import LaunchRefused, check_item

    with pytest.raises(LaunchRefused, match="reward.funcs takes names"):
        check_item("reward.funcs=[correctness,os:system]", tmp_path, tmp_path)
    assert check_item("reward.funcs=[correctness,answer_format]", tmp_path, tmp_path)
