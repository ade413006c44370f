"""A run's stop request: the first Ctrl-C or SIGTERM asks the run to stop, a second one exits at once.

A step of the default model can take minutes on a CPU, so a stop does not wait for the step in progress:
the run's long loops poll the request (`check`: each decoding step, each forward of the policy, each
evaluation batch, around each reward function) and raise `Stopped` out of whatever they were doing. The
step in progress is abandoned; nothing it did is kept (the optimizer step, the only thing that changes the
weights, is never cut short: it runs no poll). Where polling is impossible, as inside torch.compile, the
region is marked `urgent` and the signal handler raises `Stopped` itself.

`Stopped` is a SystemExit (exit code 128 + the signal, as a shell reports a process killed by it), so no
`except Exception` on the way up swallows it, and a process that does not catch it exits with that code.

Data-parallel runs do not abandon a step (`install(abandon=False)`): a rank that left mid-step would leave
the others waiting in a collective. They stop at the end of the step, all ranks together
(training/guards.GracefulStop). Importing this module imports no torch: the task wrapper reads `Stopped`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Iterator

from grpo_exp.base import log

logger = log.get_logger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(SystemExit):
    """A stop request ended the run: raised out of the loop that noticed it, with exit code 128 + signal."""

    def __init__(self, signum: int, where: str = ""):
        super().__init__(128 + signum)
        self.signum, self.where = signum, where

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"stopped by {name}" + (f" during {self.where}" if self.where else "")


class _State:
    """The process's one stop request and its handlers (signals reach the main thread only)."""

    def __init__(self):
        self.signum: int | None = None  # the first signal received, None until one is
        self.abandon = True  # whether a stop may cut the step in progress short (False: data-parallel)
        self.urgent: list[str] = []  # the regions the main thread is in where the handler itself raises
        self.depth = 0  # nested installs: only the outermost one sets and restores the handlers
        self.previous: dict = {}


_state = _State()


def requested() -> int | None:
    """The signal that asked this run to stop, or None."""
    return _state.signum


def check(where: str) -> None:
    """Raise Stopped if a stop was asked for and the step in progress may be abandoned: called by the long
    loops between two units of work (a decoding step, a forward, an evaluation batch)."""
    if _state.signum is not None and _state.abandon:
        raise Stopped(_state.signum, where)


@contextlib.contextmanager
def urgent(where: str) -> Iterator[None]:
    """A region that cannot poll and may take long (compilation, a reward function): a stop asked for
    inside it raises Stopped at once, from the signal handler; one asked for before it raises on entry."""
    check(where)
    if threading.current_thread() is not threading.main_thread():  # the handler runs in the main thread
        yield
        return
    _state.urgent.append(where)
    try:
        yield
    finally:
        _state.urgent.pop()


def _handle(signum, frame) -> None:
    name = signal.Signals(signum).name
    if _state.signum is not None:
        # a second signal: exit now, without clean-up; checkpoints are published whole or not at all
        # (training/checkpoints.py), so the last complete one stays and resume removes a staging directory
        logger.warning("%s again: exiting at once (exit %d); the last complete checkpoint is kept", name,
                       128 + signum)
        _flush()
        os._exit(128 + signum)
    _state.signum = signum
    again = "Ctrl-C" if signum == signal.SIGINT else name
    if _state.abandon:
        logger.warning("%s received: stopping now (the step in progress is abandoned; a checkpoint is written "
                       "only if a step finished since the last one); %s again exits at once", name, again)
    else:
        logger.warning("%s received: stopping after this step with a checkpoint (data-parallel: every process "
                       "stops at the same step); %s again exits at once", name, again)
    if _state.urgent and _state.abandon:
        raise Stopped(signum, _state.urgent[-1])


def _flush() -> None:
    """What the log handlers and the standard streams hold, written before os._exit skips it."""
    for logger_ in (logging.getLogger(), logging.getLogger(log.ROOT)):
        for handler in logger_.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def install(abandon: bool = True) -> None:
    """Take Ctrl-C and SIGTERM over for a run (a fresh request: none asked for yet). Nested installs are
    counted; the outermost one alone sets the handlers. Outside the main thread (where Python cannot set
    handlers) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state.depth += 1
    if _state.depth > 1:
        return
    _state.signum, _state.abandon, _state.urgent = None, abandon, []
    _state.previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS}


def uninstall() -> None:
    """Give the signals back to the handlers they had before `install`, and forget the request: what it stopped
    has raised Stopped by now, and code run later in the process (the next job of a sweep, a test) must not find
    it pending."""
    if threading.current_thread() is not threading.main_thread() or _state.depth == 0:
        return
    _state.depth -= 1
    if _state.depth == 0:
        for sig, handler in _state.previous.items():
            signal.signal(sig, handler)
        _state.previous, _state.signum, _state.urgent = {}, None, []


@contextlib.contextmanager
def handling(abandon: bool = True) -> Iterator[None]:
    """`install` for the duration of a block."""
    install(abandon)
    try:
        yield
    finally:
        uninstall()


def request(signum: int = signal.SIGTERM) -> None:
    """Ask for a stop as a signal would (data-parallel: a stop another rank received; tests)."""
    if _state.signum is None:
        _state.signum = signum
