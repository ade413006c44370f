"""A decoding step compiled for one owner (the rollout engine, the greedy decoder) through a code object of its own.

Why: dynamo keeps what it compiled on the code object it traced, and the decoding steps are compiled without guards
on the copy's modules. A second owner in the same process (the next stage of a curriculum, a sweep's next job under
Hydra's basic launcher) would then match the first one's compiled step, with the first one's tensors (its packed
layers' slots) baked in: it failed on a released slot and decoded eager from then on. An owner's own code object
keeps its own compiled step, which goes with it.
"""

from __future__ import annotations

import types

import torch


def own_code(function):
    """`function` again, through a code object of its own: what dynamo compiles for it is kept apart."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def compile_own_step(owner, method, **compile_kwargs):
    """`method` (a plain function of `owner`'s class) bound to `owner` through a fresh code object, compiled with
    `compile_kwargs`."""
    return torch.compile(types.MethodType(own_code(method), owner), **compile_kwargs)
