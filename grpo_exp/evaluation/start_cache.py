"""Where the starting model's figures are cached, keyed by everything that decides them: the model, the problems,
the evaluation settings and the machine's parts that change answers (evaluation_machine). run.starting_model_results
reads and writes the file; a second run on the same machine and settings skips scoring the base model."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf


def draws_samples(ev) -> bool:
    """Whether an evaluation draws samples (do_sample, pass@k or maj@k), so that its sampler settings matter."""
    return bool(ev.do_sample or ev.pass_k or ev.maj_k)


def cache_path(cfg, sets: list, start_model_dir: Path | None = None) -> tuple[Path, dict]:
    """Cache file of the starting model's figures (`sets`: run.EvalSet): keyed by everything that decides them. For an
    init_from model that includes its weight files' size and modification time, so a sweep of later
    stages from one run scores that run once, and a rewritten model/ is scored again."""
    import hashlib

    from grpo_exp.config.schema import pass_k_samples

    key = {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        # a prompts set adds its prompts and what decides its accuracy (an edited reward scores the model anew)
        "sets": [[s.name, s.dataset, s.max_new_tokens, [ex["question"] for ex in s.examples],
                  *([s.judge.record(), [ex["key"] for ex in s.examples]] if s.judge is not None else [])]
                 for s in sets],
        "system_prompt": cfg.reward.system_prompt,
        "eval": [cfg.eval.batch_size, cfg.eval.do_sample, cfg.eval.temperature, cfg.eval.seed,
                 list(cfg.eval.pass_k), pass_k_samples(cfg.eval), cfg.quantization.method],
        **evaluation_machine(cfg),
    }
    if draws_samples(cfg.eval):  # greedy figures do not depend on the filters (old keys stay valid)
        key["sampling_filters"] = [cfg.eval.top_k, cfg.eval.top_p]
    if cfg.eval.maj_k:  # likewise: keys without maj@k stay as they were
        key["maj_k"] = list(cfg.eval.maj_k)
    decode = cfg.eval.get("decode", "generate")
    if decode != "generate":  # greedy answers through the engine path (figures cached before it were generate's)
        key["decode"] = decode
    if start_model_dir is not None:
        model_dir = Path(start_model_dir).resolve()
        key["start_model"] = [str(model_dir), sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                                     for f in model_dir.iterdir() if f.is_file())]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder, name = ("base_eval", cfg.model.name) if start_model_dir is None else ("start_eval", model_dir.parent.name)
    return Path(cfg.paths.cache_dir) / folder / f"{name}-{digest}.json", key


def evaluation_machine(cfg) -> dict:
    """What besides the model and the problems can change a model's answers: the thread count (it changes
    the order of sums), the libraries' and the model package's versions, the precision evaluation decodes in
    and the CPU's instruction set as torch uses it."""
    from importlib import metadata

    import torch

    from grpo_exp.evaluation.generate import EVAL_PRECISION

    def version(package: str | None) -> str | None:
        try:
            return metadata.version(package) if package else None
        except metadata.PackageNotFoundError:
            return None

    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": version("transformers"),
            "trl": version("trl"), "model_package": [cfg.model.package, version(cfg.model.package)],
            "precision": EVAL_PRECISION, "isa": torch.backends.cpu.get_cpu_capability()}
