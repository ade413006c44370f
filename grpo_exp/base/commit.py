"""The code's git commit, so that a run's files and a results page say which code made them."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def code_commit(repo: Path = REPO) -> str | None:
    """`git rev-parse --short HEAD` of the code's repository, marked when tracked files differ from it;
    None outside a git checkout (an installed wheel)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        import hashlib

        diff = git("diff", "HEAD") or ""
        commit += f" (with uncommitted changes, diff {hashlib.sha256(diff.encode()).hexdigest()[:12]})"
    return commit


def is_dirty(commit: str | None) -> bool:
    """Whether a recorded commit says the code had uncommitted changes (code_commit's mark)."""
    return bool(commit) and "uncommitted changes" in commit


# The commit when this process imported the package: what a sweep's later jobs run, whatever HEAD is by then.
AT_START = code_commit()
