"""How long one training step of a run's shape takes on this machine: each finished stage records its median step
time in `<paths.cache_dir>/pace.json`, and the next run of the same shape on the same machine reads it for the one
line it starts with (about how many minutes its steps will take). A shape is what decides a step's time: the CPU,
the threads and processes, the model, the stage, the speed plan in a few words and the batch's sizes."""

from __future__ import annotations

import json
import statistics
from datetime import date
from pathlib import Path

from grpo_exp.base import cpu, dist, log
from grpo_exp.base.io import write_json

logger = log.get_logger(__name__)

PACE_FILE = "pace.json"
KEEP = 200  # shapes kept, the most recent first: a sweep over sizes makes many


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (another OS: its platform string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def shape_key(cfg, plan_summary: str) -> str:
    """The shape of `cfg`'s training step on this machine, as one string."""
    t = cfg.train
    threads = cpu.applied().get("threads", cfg.cpu.threads)
    return (f"{cpu_name()}; {threads} threads x {dist.world_size()} process(es); {cfg.model.name}; {cfg.stage.name}; "
            f"{plan_summary}; {t.num_generations} completions of at most {t.max_completion_length} tokens; batch "
            f"{t.per_device_train_batch_size} x {t.gradient_accumulation_steps}; steps_per_generation "
            f"{t.steps_per_generation}; beta {t.beta}"
            # dynamic sampling draws extra rounds: its steps run longer than the same shape's without it
            + (f"; dynamic sampling, at most {t.dynamic_sampling_max_draws} extra rounds" if t.dynamic_sampling else ""))


def pace_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / PACE_FILE


def _read(cache_dir: str | Path) -> dict:
    path = pace_path(cache_dir)
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a file cut short by a crash elsewhere: no estimate
        return {}
    return records if isinstance(records, dict) else {}


def estimate(cache_dir: str | Path, key: str, steps: int) -> str:
    """The start line's words on time: about how many minutes `steps` steps take, from this shape's last record."""
    record = _read(cache_dir).get(key)
    if not record:
        return "no time estimate yet (no run of this shape has finished on this machine)"
    minutes = steps * record["step_s"] / 60
    return (f"its steps take about {minutes:.0f} min here ({record['step_s']:.1f} s each in the last run of this "
            f"shape, {record['date']})" if minutes >= 1 else
            f"its steps take under a minute here ({record['step_s']:.1f} s each in the last run of this shape)")


def record(cache_dir: str | Path, key: str, step_times: list[float]) -> float | None:
    """Keep the median of `step_times` (the first step left out: it compiles and warms up) as `key`'s pace;
    returns it, or None when there were too few steps to say."""
    steps = step_times[1:]
    if not steps or not dist.is_main():
        return None
    step_s = statistics.median(steps)
    records = _read(cache_dir)
    records.pop(key, None)
    records = {key: {"step_s": round(step_s, 3), "steps": len(steps), "date": date.today().isoformat()}, **records}
    try:
        path = pace_path(cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, dict(list(records.items())[:KEEP]))
    except OSError as err:  # a read-only cache costs the next run its estimate, not this run its result
        logger.debug("pace not recorded in %s: %s", cache_dir, err)
    return step_s
