"""Seeded sampling from a policy's untruncated distribution (top_k=0, top_p=1), batch by batch: the
expectations the EWC Fisher (training/ewc.py) and the forgetting KL (training/forgetting.py) estimate
are over these samples.

Each batch is seeded with seed + its start index, so any subset of the batches (one process's shard of
a data-parallel run) samples exactly what a single pass over all of them does. The global random state is put
back afterwards: a measurement taken between a trainer's construction and its first step (the forgetting
reference) must not change the training that follows.
"""

from __future__ import annotations

from typing import Iterator

import torch
from tqdm.auto import tqdm

from grpo_exp.evaluation.generate import model_device


@torch.no_grad()
def sample_batches(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, temperature: float,
                   batch_size: int, seed: int, shard: tuple[int, int] = (0, 1),
                   desc: str | None = None) -> Iterator[tuple[dict, torch.Tensor]]:
    """Yields (left-padded chat-template encoding of a batch of prompts, its sampled completion ids).

    shard=(i, n): only batches i, i + n, ... The model is in eval mode and the tokenizer pads on the
    left while this runs; both are put back afterwards."""
    padding_side, was_training = tokenizer.padding_side, model.training
    tokenizer.padding_side = "left"
    model.eval()
    device = model_device(model)
    index, count = shard
    starts = range(0, len(prompts), batch_size)[index::count]
    devices = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):  # the caller's random state, restored when the last batch is done
            for start in tqdm(starts, desc=desc, leave=False, disable=desc is None):
                enc = tokenizer.apply_chat_template(prompts[start:start + batch_size], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True, padding=True).to(device)
                torch.manual_seed(seed + start)
                out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                     max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     use_cache=True)
                yield enc, out[:, enc["input_ids"].shape[1]:]
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
