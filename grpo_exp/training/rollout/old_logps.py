"""PPO's old log-probs on the engine's path: the sampler's own, or a scoring forward by the trained policy.

Where the rollout copy computes what the policy computes (an fp32 copy of a policy trained in fp32; the autocast
copy of one trained under bf16 autocast), the sampler's log-probs are the policy's up to kernel rounding, so they
serve as the old log-probs and TRL's scoring forward over the round is skipped. Elsewhere the policy scores the
round and importance weights (importance.py) correct for the copy's mismatch. Which of the two a run takes is
the speed plan's `old_logps` (config/speed.py).
"""

from __future__ import annotations

import torch


def padded_logps(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-completion log-probs as TRL's [batch, completion length] tensor, right-padded with 0 as TRL pads
    completions (the completion mask hides the padding)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise RuntimeError(f"a completion of {len(row)} tokens does not fit TRL's {width} completion positions")
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)
