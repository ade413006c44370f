"""Rules of the test suite itself, read from the test files' syntax: a test that starts a process is marked slow
(or long), so that `make test-fast` stays fast; every test asserts something, directly or through a helper of its
module, so that it can fail."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# calls that start a process, and the suite's helpers that do (tests/conftest.py, tests/apps/test_app.py)
STARTS_A_PROCESS = {"subprocess.run", "subprocess.Popen", "subprocess.check_output", "subprocess.check_call",
                    "run_module", "start_app"}
ASSERTING_CALLS = ("raises", "fail", "assert", "warns", "testing.")


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _calls(node: ast.AST) -> set[str]:
    return {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}


def _module_marked(tree: ast.Module, *marks: str) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
               and any(m in ast.unparse(n.value) for m in marks) for n in tree.body)


def test_a_test_that_starts_a_process_is_marked_slow():
    unmarked = []
    for path in _test_files():
        tree = ast.parse(path.read_text())
        if _module_marked(tree, "slow", "long"):
            continue
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        starters = set(STARTS_A_PROCESS)
        grew = True
        while grew:  # the module's own helpers that start one, however deep
            grew = False
            for name, fn in functions.items():
                if not name.startswith("test_") and name not in starters and _calls(fn) & starters:
                    starters.add(name)
                    grew = True
        for name, fn in functions.items():
            marks = " ".join(ast.unparse(d) for d in fn.decorator_list)
            if name.startswith("test_") and _calls(fn) & starters and "slow" not in marks and "long" not in marks:
                unmarked.append(f"{path.relative_to(TESTS.parent)}:{fn.lineno} {name}")
    assert not unmarked, f"these tests start a process but are not marked slow: {unmarked}"


def test_every_test_asserts_something():
    silent = []
    for path in _test_files():
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

        def asserts(fn, seen: tuple = ()) -> bool:
            for node in ast.walk(fn):
                if isinstance(node, ast.Assert):
                    return True
                if isinstance(node, ast.Call):
                    called = ast.unparse(node.func)
                    if any(word in called for word in ASSERTING_CALLS):
                        return True
                    name = called.split(".")[-1]
                    if name in functions and name not in seen and asserts(functions[name], (*seen, name)):
                        return True
            return False

        silent += [f"{path.relative_to(TESTS.parent)}:{fn.lineno} {name}" for name, fn in functions.items()
                   if name.startswith("test_") and not asserts(fn)]
    assert not silent, f"these tests assert nothing: {silent}"
