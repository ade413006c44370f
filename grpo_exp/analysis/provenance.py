"""Where a results page's figures came from, read back rather than typed: the commands that made the runs
(from Hydra's records: the sweep's multirun.yaml, else each job's .hydra/hydra.yaml), the git commit of
this code and any the runs recorded, the date of the page and of the runs (history.jsonl's "time"), the
machine (a name from docs/machines.md, and what this CPU reports) and the library versions, here and as
the runs' base-model evaluations recorded them (before_after.json's before_source.settings). A bench's page
(analysis/bench/page.py) builds its header from bench.json with the same bullets (commit_line, date_line,
machine_line, versions_line)."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from grpo_exp.base import log

logger = log.get_logger(__name__)

REPO = Path(__file__).resolve().parents[2]
from grpo_exp.base.run_files import METRICS_FILE, SETTINGS_FILE, STATUS_FILE
MACHINES = Path("docs") / "machines.md"
CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # native bf16 matmuls: what makes bf16 training fast on a CPU
LIBRARIES = ("torch", "transformers", "trl")
# files a run might record the commit of its code in, and the keys it would use
COMMIT_FILES = (METRICS_FILE, STATUS_FILE, SETTINGS_FILE)
COMMIT_KEYS = ("git_commit", "commit")


def _yaml(path: Path) -> dict:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except Exception:  # a missing or half-written file: no record, not an error
        return {}


def _entry(hydra: dict) -> str:
    return f"grpo_exp.{(hydra.get('job') or {}).get('config_name') or 'train'}"


def _task(hydra: dict) -> list[str]:
    """The task overrides: hydra.overrides.task, else hydra.job.override_dirname split on its separator."""
    task = [str(o) for o in ((hydra.get("overrides") or {}).get("task") or [])]
    if task:
        return task
    job = hydra.get("job") or {}
    dirname = job.get("override_dirname")
    sep = ((job.get("config") or {}).get("override_dirname") or {}).get("item_sep", ",")
    return [o for o in str(dirname).split(sep) if o] if dirname else []


def _hydra_overrides(hydra: dict) -> list[str]:
    """Overrides of hydra.* given on the command line (hydra.sweep.dir=...), less the mode -m sets."""
    return [str(o) for o in ((hydra.get("overrides") or {}).get("hydra") or []) if str(o) != "hydra.mode=MULTIRUN"]


def _join(entry: str, multirun: bool, overrides: list[str]) -> str:
    return shlex.join(["python", "-m", entry, *(["-m"] if multirun else []), *overrides])


def _combined(jobs: list[dict]) -> list[str]:
    """One sweep's overrides rebuilt from its jobs' own (when it left no multirun.yaml): each key with
    its values in job order, comma-separated as Hydra's sweep syntax takes them."""
    values: dict[str, list[str]] = {}
    for hydra in jobs:
        for item in _task(hydra):
            key, _, value = item.partition("=")
            if value not in values.setdefault(key, []):
                values[key].append(value)
    return [f"{key}={','.join(v)}" for key, v in values.items()]


def _values(value: str) -> set[str]:
    """A sweep override's values: `a,b` is two; a list or a quoted value is one."""
    return {value} if value[:1] in "[{'\"" else set(value.split(","))


def _made_by(sweep: dict, job: dict) -> bool:
    """Whether the sweep's command (its multirun.yaml) gives this job's overrides: every key the command sets, the
    job has with one of its values; a key the job adds is one of the sweeper's params, with one of their values
    where the record holds them."""
    given = {k: _values(v) for k, _, v in (o.partition("=") for o in _task(sweep))}
    params = {str(k): _values(str(v)) for k, v in ((sweep.get("sweeper") or {}).get("params") or {}).items()}
    have = dict(o.partition("=")[::2] for o in _task(job))
    if any(key not in have or have[key] not in values for key, values in given.items()):
        return False
    return all(key in given or key not in params or value in params[key] for key, value in have.items())


def run_commands(job_dirs: list[Path]) -> list[str]:
    """The commands that made these job directories, one per sweep or single run, in first-seen order."""
    commands: list[str] = []
    sweeps: dict[Path, list[dict]] = {}
    for job in map(Path, job_dirs):
        own = _yaml(job / ".hydra" / "hydra.yaml").get("hydra") or {}
        sweep = (_yaml(job.parent / "multirun.yaml").get("hydra") or {}) if (job.parent / "multirun.yaml").is_file() \
            else None
        if sweep is not None and (not own or _made_by(sweep, own)):
            hydra = sweep
            command = _join(_entry(hydra), True, [*_hydra_overrides(hydra), *_task(hydra)])
        else:
            # a sweep directory's multirun.yaml is its last command's: a job an earlier command made (a resumed
            # sweep given other values) is told by its own overrides
            hydra = own
            if not hydra:
                continue  # not made by Hydra (e.g. a copied folder): nothing recorded
            if hydra.get("mode") == "MULTIRUN" or sweep is not None:
                sweeps.setdefault(job.parent, []).append(hydra)
                continue
            command = _join(_entry(hydra), False, [*_hydra_overrides(hydra), *_task(hydra)])
        if command not in commands:
            commands.append(command)
    for jobs in sweeps.values():
        command = _join(_entry(jobs[0]), True, [*_hydra_overrides(jobs[0]), *_combined(jobs)])
        if command not in commands:
            commands.append(command)
    return commands


def repo_commit(repo: Path = REPO) -> str | None:
    """The code's commit where the page is written (base.commit)."""
    from grpo_exp.base.commit import code_commit

    return code_commit(repo)


def run_commits(job_dirs: list[Path]) -> list[str]:
    """The commits the runs recorded in their files, if any did: a job's own, then its stages' (a curriculum job
    keeps each stage's metrics.json in a subdirectory)."""
    import json

    found = []
    for job in map(Path, job_dirs):
        stage_dirs = sorted(d for d in job.iterdir() if d.is_dir()) if job.is_dir() else []
        for path in [job / name for name in COMMIT_FILES] + [d / METRICS_FILE for d in stage_dirs]:
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for key in COMMIT_KEYS:
                if isinstance(data, dict) and isinstance(data.get(key), str) and data[key] not in found:
                    found.append(data[key])
    return found


def run_dates(jobs: list[dict]) -> tuple[datetime, datetime] | None:
    """The first and last `time` in the jobs' history.jsonl rows (UTC), None when none was logged."""
    times = [r["time"] for job in jobs for r in job["history"] if isinstance(r.get("time"), (int, float))]
    if not times:
        return None
    return tuple(datetime.fromtimestamp(t, timezone.utc) for t in (min(times), max(times)))


def cpu() -> dict:
    """What this CPU reports (lscpu, else /proc/cpuinfo): its model, logical CPUs, the CPUs this process
    may use, and whether it has each of CPU_FLAGS."""
    text = ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        pass
    if not text:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    model = re.search(r"^(?:Model name|model name)\s*:\s*(.+)$", text, re.M)
    listed = re.search(r"^(?:Flags|flags)\s*:\s*(.+)$", text, re.M)
    flags = set(listed.group(1).split()) if listed else set()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model.group(1).strip() if model else platform.processor() or "unknown",
            "cpus": os.cpu_count(), "usable": usable, **{flag: flag in flags for flag in CPU_FLAGS}}


def machine_line(name: str | None, repo: Path = REPO, tool: str = "grpo-report") -> str:
    """The machine: `name` (checked against docs/machines.md) and what this CPU reports (where `tool` ran)."""
    here = cpu()
    flags = ", ".join(f"{flag} {'yes' if here[flag] else 'no'}" for flag in CPU_FLAGS)
    detected = (f"{here['model']}, {here['usable']} of {here['cpus']} cores usable, {flags} "
                f"(lscpu, where {tool} ran)")
    if not name:
        logger.warning("no --machine given: the page names no entry of %s", MACHINES)
        return f"not named (pass --machine NAME, an entry of {MACHINES}); {detected}"
    listed = repo / MACHINES
    if not listed.is_file():
        logger.warning("%s does not exist: machine %r is not checked against it", MACHINES, name)
        where = f"{MACHINES} not found"
    elif re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", listed.read_text()):
        where = f"entry of {MACHINES}"
    else:
        logger.warning("machine %r is not an entry of %s", name, MACHINES)
        where = f"not an entry of {MACHINES}"
    return f"{name} ({where}); {detected}"


def versions() -> str:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return ", ".join([f"python {platform.python_version()}", *(f"{p} {version(p)}" for p in LIBRARIES)])


def run_versions(jobs: list[dict]) -> list[str]:
    """The libraries, ISA, threads and precision of the runs' starting-model evaluations, as recorded."""
    out = []
    for job in jobs:
        settings = ((job.get("before_after") or {}).get("before_source") or {}).get("settings") or {}
        parts = [f"{k} {settings[k]}" for k in (*LIBRARIES, "isa", "precision", "threads") if settings.get(k)]
        if parts and ", ".join(parts) not in out:
            out.append(", ".join(parts))
    return out


STAMP = "%Y-%m-%d %H:%M UTC"


def stamp(when: datetime) -> str:
    return when.strftime(STAMP)


def commit_line(source: str, recorded: list[str], none: str) -> str:
    """The Commit bullet: this code's commit, then the ones `source` (the runs, the bench) recorded, or `none`."""
    commit = repo_commit() or "unknown (not a git checkout)"
    return (f"- **Commit:** `{commit}` (this code, when the page was written); {source}: "
            + (", ".join(f"`{c}`" for c in recorded) if recorded else none))


def date_line(now: datetime | None, source: str | None = None) -> str:
    """The Date bullet: the page's date (now, UTC), then `source`'s (e.g. "runs logged from ... to ...")."""
    now = now or datetime.now(timezone.utc)
    return f"- **Date:** {stamp(now)} (page)" + (f"; {source}" if source else "")


def versions_line(tool: str, recorded: list[str], source: str) -> str:
    """The Versions bullet: the libraries where `tool` ran, then those `source` recorded."""
    line = f"- **Versions:** {versions()} (where {tool} ran)"
    return line + (f"; {source}: " + "; ".join(recorded) if recorded else "")


def header(jobs: list[dict], page_command: str, machine: str | None, now: datetime | None = None) -> list[str]:
    """The page's header block: one bullet each for the runs' commands, the page's command, the commit,
    the date, the machine and the versions."""
    dirs = [Path(job["row"]["dir"]) for job in jobs]
    commands = run_commands(dirs)
    dates = run_dates(jobs)
    return ["- **Runs made by:** " + ("; ".join(f"`{c}`" for c in commands) if commands
                                     else "not recorded (no .hydra/hydra.yaml or multirun.yaml)"),
            f"- **Page made by:** `{page_command}`",
            commit_line("runs", run_commits(dirs), "no commit recorded in their files"),
            date_line(now, f"runs logged from {stamp(dates[0])} to {stamp(dates[1])}" if dates else None),
            f"- **Machine:** {machine_line(machine)}",
            versions_line("grpo-report", run_versions(jobs), "runs' base-model evaluations")]
