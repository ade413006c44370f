"""The package's floor plan holds: layers in folders, imports only point down, nothing imports an app.

Every `import` in every module counts, the ones inside functions too (a lazy import is still an
arrow). The layers, lowest first, are the ones docs/architecture.md, "Layers" draws."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_exp"
LAYERS = ["base", "kernels", "core", "config", "evaluation", "training", "analysis", "apps"]
# `python -m grpo_exp.train` / `grpo_exp.evaluate` / `grpo_exp.app`: the commands users know, kept as one-line shims over apps/
SHIMS = {"grpo_exp.train", "grpo_exp.evaluate", "grpo_exp.app", "grpo_exp.data", "grpo_exp.export_trl"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int | None:
    parts = module.split(".")
    if module in SHIMS:
        return len(LAYERS)
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def imports(module: str, path: Path) -> set[str]:
    """grpo_exp modules `module` imports (a `from pkg import name` counts as pkg.name where that is a module)."""
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("grpo_exp"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_exp"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
    return found - {module}


def test_every_module_sits_in_a_layer():
    homeless = [m for m in modules() if m != "grpo_exp" and layer(m) is None and m.count(".") >= 1
                and m.split(".")[1] not in LAYERS]
    assert not homeless, f"modules outside the layer folders: {homeless}"


def test_imports_point_down_and_never_at_an_app():
    wrong = []
    for module, path in modules().items():
        here = layer(module)
        for target in imports(module, path):
            there = layer(target)
            if there is None:
                continue
            if target.startswith("grpo_exp.apps") and not (module.startswith("grpo_exp.apps") or module in SHIMS):
                wrong.append(f"{module} imports the app {target}")
            elif here is not None and there > here:
                wrong.append(f"{module} ({LAYERS[here] if here < len(LAYERS) else 'shim'}) imports "
                             f"{target} ({LAYERS[there]}), a higher layer")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: {t for t in imports(m, p) if t in modules()} for m, p in modules().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("bad", ["grpo_exp.training.stage", "grpo_exp.apps.train"])
def test_the_check_catches_a_wrong_arrow(tmp_path, monkeypatch, bad):
    """The test can fail: a base module importing upwards, or a library importing an app, is caught."""
    global PACKAGE
    fake = tmp_path / "grpo_exp"
    for sub in ("", "base", "training", "apps"):
        (fake / sub).mkdir(parents=True, exist_ok=True)
        (fake / sub / "__init__.py").write_text("")
    (fake / "training" / "stage.py").write_text("")
    (fake / "apps" / "train.py").write_text("")
    (fake / "base" / "io.py").write_text(f"def f():\n    from {bad} import x\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake, raising=False)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    with pytest.raises(AssertionError, match="grpo_exp.base.io"):
        test_imports_point_down_and_never_at_an_app()


def _layer_cells() -> dict[str, str]:
    """docs/architecture.md's layer table: layer folder -> its modules cell."""
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = page.split("## Layers", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for line in table.splitlines() if (m := re.match(r"\| `(\w+)/` \| (.*?) \|", line))}


def _listed(cell: str, parts: tuple[str, ...], package: bool = False) -> bool:
    """Whether a module (parts of its dotted name below the layer; a package is written `name/`) is in the cell."""
    head, rest = parts[0], parts[1:]
    if not rest:
        return f"`{head}{'/' if package else ''}`" in cell
    marker = f"`{head}/`"  # a sub-package's modules follow it in parentheses
    return marker in cell and _listed(cell.split(marker, 1)[1].split(")", 1)[0], rest, package)


def test_docs_architecture_lists_every_module():
    cells = _layer_cells()
    assert set(cells) == set(LAYERS), f"layer rows: {sorted(cells)}"
    missing = []
    for module, path in modules().items():
        parts = module.split(".")[1:]
        is_package = path.name == "__init__.py"
        if len(parts) >= 2 and parts[0] in LAYERS and not _listed(cells[parts[0]], tuple(parts[1:]), is_package):
            missing.append(module)
    assert not missing, f"docs/architecture.md's layer table does not list: {missing}"


def late_imports(source: str) -> list[str]:
    """Module-level imports after the `if __name__ == "__main__":` block: `python -m` runs main() before them, so a
    name they bind is undefined there while an import of the module (as the tests do) finds it."""
    body, late, guarded = ast.parse(source).body, [], False
    for node in body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            guarded = True
        elif guarded and isinstance(node, (ast.Import, ast.ImportFrom)):
            late.append(ast.unparse(node))
    return late


def test_no_module_imports_after_its_main_block():
    late = {m: found for m, p in modules().items() if (found := late_imports(p.read_text()))}
    assert not late, f"imports after `if __name__ == '__main__':` (undefined when run with python -m): {late}"


def test_the_late_import_check_catches_one():
    source = 'import sys\n\ndef main():\n    return X\n\nif __name__ == "__main__":\n    main()\nfrom m import X\n'
    assert late_imports(source) == ["from m import X"]
    assert late_imports(source.replace("\nfrom m import X\n", "\n")) == []
