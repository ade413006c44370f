"""Every command in grpo_exp/apps/ answers `--help` with a whole description, under its console-script name, and
is documented in docs/getting-started.md's command table; `grpo-report --help` loads none of the heavy libraries.

The descriptions of grpo-report and grpo-export-trl once stopped mid-sentence (the first line of a docstring that
went on), and `grpo-report --help` took 8 s on a cold start because it imported pandas for the table names."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "grpo_exp" / "apps"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
# module -> the name `--help` shows as the program (the console script where there is one)
ARGPARSE_TOOLS = {"report": "grpo-report", "export_trl": "grpo-export-trl", "bench": "grpo-bench",
                  "compare": "grpo-compare", "profile": "grpo-profile",
                  "sampling_gap": "python -m grpo_exp.apps.sampling_gap", "data": "python -m grpo_exp.data",
                  "sources": "python -m grpo_exp.apps.sources",
                  "run_signals": "python -m grpo_exp.apps.run_signals"}


def tools() -> list[str]:
    """The modules of grpo_exp/apps/ that a user runs: those with a main() of their own or imported (app.py)."""
    found = []
    for path in sorted(APPS.glob("*.py")):
        tree = ast.parse(path.read_text())
        defines = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        imports = any(isinstance(n, ast.ImportFrom) and any(a.name == "main" for a in n.names) for n in tree.body)
        if defines or imports:
            found.append(path.stem)
    return found


def help_text(module: str) -> tuple[int, str]:
    """What `<tool> --help` prints, run in this process (argparse exits after printing)."""
    mod = __import__(f"grpo_exp.apps.{module}", fromlist=["main"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = mod.main(["--help"])
        except SystemExit as stop:
            code = stop.code
    return code or 0, out.getvalue()


def test_the_tool_list_is_what_the_package_holds():
    assert set(ARGPARSE_TOOLS) | {"train", "evaluate", "app"} == set(tools())


@pytest.mark.parametrize("module", sorted(ARGPARSE_TOOLS))
def test_help_describes_the_tool_in_whole_sentences(module):
    code, text = help_text(module)
    assert code == 0, f"{module} --help exited {code}"
    assert text.startswith(f"usage: {ARGPARSE_TOOLS[module]} "), f"{module} --help names another program: {text[:80]}"
    # the description: the first paragraph after the usage lines
    description = " ".join(text.split("\n\n")[1].split())
    assert description[:1].isupper(), f"{module}'s description does not start a sentence: {description[:80]}"
    assert description.endswith("."), f"{module}'s description stops mid-sentence: ...{description[-80:]}"


@pytest.mark.parametrize("module", tools())
def test_every_tool_is_in_the_command_table(module):
    text = GETTING_STARTED.read_text()
    start = text.index("## Commands")
    table = text[start:text.index("\n## ", start + 1)]
    names = {f"grpo_exp.apps.{module}", f"grpo_exp.{module}"} | ({ARGPARSE_TOOLS[module]} if module in ARGPARSE_TOOLS
                                                                  else {f"grpo-{module}"})
    assert any(f"`{name}" in table or f"{name}`" in table for name in names), (
        f"grpo_exp/apps/{module}.py is not in docs/getting-started.md's Commands table")


@pytest.mark.slow
def test_report_help_loads_no_heavy_library():
    """In a fresh interpreter, as a user's first call: --help must not wait for pandas, matplotlib, torch or TRL."""
    probe = ("import sys\nfrom grpo_exp.apps import report\ntry:\n    report.main(['--help'])\nexcept SystemExit:\n"
             "    pass\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'trl', 'transformers', "
             "'matplotlib', 'pandas', 'numpy'}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(r"usage: grpo-report", done.stdout)
    assert done.stdout.strip().splitlines()[-1] == "[]", f"grpo-report --help imported {done.stdout.splitlines()[-1]}"


@pytest.mark.slow
@pytest.mark.parametrize("module", ["train", "evaluate"])
def test_hydra_mains_say_what_they_do(module):
    """Hydra's own header ("train is powered by Hydra.") said nothing; the root config's hydra.help says what runs."""
    done = subprocess.run([sys.executable, "-m", f"grpo_exp.{module}", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"python -m grpo_exp.{module} (also grpo-{module}): "), done.stdout[:200]
    header = " ".join(done.stdout.split("== Configuration groups ==")[0].split())
    assert header.endswith("."), header
    assert "powered by Hydra" not in done.stdout


def test_every_reproduce_command_of_a_results_page_names_a_table_grpo_report_takes():
    """The pages' compute-curve tables once ended with `grpo-report <dir> --table compute_curve_basic`, a name the
    command refused (its choices were the fixed tables only)."""
    from grpo_exp.apps import report

    pages = sorted((ROOT / "docs" / "results").rglob("*.md"))
    found = [(page.name, name) for page in pages
             for name in re.findall(r"^Reproduce: `grpo-report \S+(?: \S+)* --table (\S+)`", page.read_text(), re.M)]
    assert any(name.startswith("compute_curve_") for _, name in found)
    for page, name in found:
        assert report.parse_args(["outputs/none", "--table", name]).table == name, page
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        report.parse_args(["outputs/none", "--table", "compute_curve_"])
    assert "compute_curve_<set>" in err.getvalue()
