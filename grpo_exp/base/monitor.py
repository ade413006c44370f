"""Resource and progress measurement from the process itself: psutil sampling, a step clock,
`history.jsonl` (one line per logged step) and the summary written to `metrics.json`."""

from __future__ import annotations

import json
import math
import resource
import statistics
import threading
import time
from pathlib import Path

import psutil
from transformers import TrainerCallback


def peak_rss_mb() -> float:
    """The kernel's high-water mark of this process's resident memory since the last `reset_peak_rss()`
    (VmHWM; ru_maxrss, in KiB on Linux, where /proc is missing)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Restart the high-water mark at the current RSS (Linux >= 4.0), so each stage and each job of a
    Hydra multirun (all in one process) reports its own peak, not the largest of the earlier ones."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class ResourceSampler:
    """Samples RSS and per-core CPU use in a daemon thread, so peaks between log lines are caught."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.max_rss_mb = 0.0
        self._cpu_samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        psutil.cpu_percent(percpu=True)  # the first call only sets the baseline

    def start(self) -> "ResourceSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        self.max_rss_mb = max(self.max_rss_mb, self.rss_mb())
        self._cpu_samples.append(psutil.cpu_percent(percpu=True))

    def rss_mb(self) -> float:
        return self.process.memory_info().rss / 2**20

    def take_cpu_percent(self) -> list[float]:
        """Mean utilisation per core since the last call."""
        samples, self._cpu_samples = self._cpu_samples, []
        if not samples:
            return psutil.cpu_percent(percpu=True)
        return [round(sum(core) / len(samples), 1) for core in zip(*samples)]


class MonitorCallback(TrainerCallback):
    """Times optimizer steps, adds resource figures to every log line and appends it to history.jsonl.

    `step_offset` lets curriculum stages share one cumulative step axis; `extra_rounds_key` names the logged figure
    of extra generation rounds a step drew beside its own (training's dynamic sampling), whose completions count
    towards its throughput.
    """

    def __init__(self, history_path: str | Path, completions_per_step: int, step_offset: int = 0, stage: str = "",
                 completions_per_generation: int | None = None, extra_rounds_key: str | None = None):
        self.history_path = Path(history_path)
        self.completions_per_step = completions_per_step
        # With train.steps_per_generation > 1, TRL generates for several steps at once: the generating step
        # logs the mean length of all those completions and the steps that reuse them log none.
        self.completions_per_generation = max(completions_per_generation or 0, completions_per_step)
        self.step_offset = step_offset
        self.extra_rounds_key = extra_rounds_key
        self.stage = stage
        self.sampler = ResourceSampler()
        self.step_times: list[float] = []
        self.completion_tokens: list[float] = []
        self.rows: list[dict] = []
        self._step_start: float | None = None
        self._last_step_time: float | None = None
        # training compute: this process's CPU seconds (every thread's) inside optimizer steps, summed over the run
        self._cpu_start: float | None = None
        self._last_cpu_s: float | None = None
        self.cpu_s_total = 0.0

    def continue_from(self, rows: list[dict]) -> None:
        """A resumed run: the history up to its checkpoint counts towards the summary."""
        self.rows = list(rows)
        self.step_times = [r["step_time_s"] for r in rows if r.get("step_time_s")]
        self.completion_tokens = [r["completion_tokens"] for r in rows if r.get("completion_tokens") is not None]
        self.cpu_s_total = next((r["cpu_s_total"] for r in reversed(rows) if r.get("cpu_s_total") is not None), 0.0)

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.sampler._thread.is_alive() and not self.sampler._stop.is_set():
            self.sampler.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()
        self._cpu_start = process_cpu_s()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self._last_step_time = time.perf_counter() - self._step_start
            self.step_times.append(self._last_step_time)
        if self._cpu_start is not None:
            self._last_cpu_s = process_cpu_s() - self._cpu_start
            self.cpu_s_total += self._last_cpu_s

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if "train_runtime" in logs:  # the end-of-training summary line, not a step
            return
        self.sampler.sample()
        row = {"step": state.global_step, "global_step": state.global_step + self.step_offset, "stage": self.stage}
        row.update({k: v for k, v in logs.items() if _jsonable(v)})
        mean_len = logs.get("completions/mean_length")
        buffered_step = mean_len is None and self.completions_per_generation > self.completions_per_step
        if (mean_len is not None or buffered_step) and self._last_step_time:
            # extra rounds of as many completions (their mean length is in mean_len)
            rounds = 1.0 + float(logs.get(self.extra_rounds_key) or 0.0) if self.extra_rounds_key else 1.0
            tokens = float(mean_len) * self.completions_per_generation * rounds if mean_len is not None else 0.0
            self.completion_tokens.append(tokens)
            row["completion_tokens"] = tokens
            row["completion_tokens_per_s"] = tokens / self._last_step_time
        row["step_time_s"] = self._last_step_time
        if self._last_cpu_s is not None:
            row["cpu_s"] = round(self._last_cpu_s, 3)
            row["cpu_s_total"] = round(self.cpu_s_total, 3)
        row["rss_mb"] = round(self.sampler.rss_mb(), 1)
        row["peak_rss_mb"] = round(max(self.sampler.max_rss_mb, peak_rss_mb()), 1)
        cores = self.sampler.take_cpu_percent()
        row["cpu_percent_mean"] = round(sum(cores) / max(len(cores), 1), 1)
        row.update(gpu_memory_mb())
        row.update({f"cpu_percent/core{i}": v for i, v in enumerate(cores)})
        row["time"] = time.time()
        self.rows.append(row)
        with self.history_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self.sampler.stop()

    def summary(self, reward_names: list[str]) -> dict:
        return summarize(self.rows, self.step_times, self.completion_tokens, reward_names,
                         max(self.sampler.max_rss_mb, peak_rss_mb()))


def process_cpu_s() -> float:
    """CPU seconds this process has used, all its threads together (user and system): core-seconds of compute.

    The process CPU clock, not psutil's tick-counted times: a step's share must not be off by a clock tick."""
    return time.process_time()


def gpu_memory_mb() -> dict:
    """GPU memory of this process where training runs on CUDA (allocated now and at its peak), else {}."""
    import sys

    torch = sys.modules.get("torch")  # loaded by then wherever a GPU is in use; never imported just for this
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"gpu_mem_mb": round(torch.cuda.memory_allocated() / 2**20, 1),
            "gpu_peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def _jsonable(value) -> bool:
    return isinstance(value, (int, float, str, bool)) and not (isinstance(value, float) and not math.isfinite(value))


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def first_last_means(values: list[float], fraction: float = 0.2) -> tuple[float | None, float | None]:
    """Means over the first and last `fraction` of the logged steps (at least one step each)."""
    if not values:
        return None, None
    k = max(1, int(round(len(values) * fraction)))
    return _mean(values[:k]), _mean(values[-k:])


def summarize(rows: list[dict], step_times: list[float], completion_tokens: list[float],
              reward_names: list[str], peak_rss: float) -> dict:
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = first_last_means(rewards)
    total_time = sum(step_times[: len(completion_tokens)])
    out = {
        "steps": len(step_times),
        "step_time_s_median": statistics.median(step_times) if step_times else None,
        "step_time_s_mean": _mean(step_times),
        "completion_tokens_total": sum(completion_tokens),
        "completion_tokens_per_s": sum(completion_tokens) / total_time if total_time > 0 else None,
        "peak_rss_mb": round(peak_rss, 1),
        "reward_mean_first": first,
        "reward_mean_last": last,
        "reward_mean": _mean(rewards),
    }
    for name in reward_names:
        key = f"rewards/{name}/mean"
        values = [r[key] for r in rows if r.get(key) is not None]
        f, l = first_last_means(values)
        out[f"reward_{name}_mean"] = _mean(values)
        out[f"reward_{name}_first"] = f
        out[f"reward_{name}_last"] = l
    return out
