"""kernels/small_rows.py's span cache: a span is found per shape and per thread count, so a sweep over cpu.threads in
one process never reuses a span checked under another count. The probe itself (which compiles the kernel) is
replaced by one that records what it was asked: only the cache is under test here."""

from __future__ import annotations

import pytest
import torch

from grpo_exp.kernels import small_rows


@pytest.fixture
def probes(monkeypatch):
    """The thread counts _find_span was called under; the cache starts empty and is restored afterwards."""
    asked: list[int] = []

    def probe(rows, weights, library_of):
        asked.append(torch.get_num_threads())
        return 8 * torch.get_num_threads()  # a span that tells the counts apart

    monkeypatch.setattr(small_rows, "_SPANS", {})
    monkeypatch.setattr(small_rows, "_find_span", probe)
    threads = torch.get_num_threads()
    yield asked
    torch.set_num_threads(threads)


def test_two_thread_counts_give_two_spans(probes):
    weights = [torch.zeros(4, 16)]
    spans = {}
    for count in (1, 2, 1, 2):
        torch.set_num_threads(count)
        spans.setdefault(count, set()).add(small_rows.span_for(3, weights, None))
    assert len(small_rows._SPANS) == 2
    assert sorted(key[-1] for key in small_rows._SPANS) == [1, 2]
    assert probes == [1, 2]  # each count probed once, then taken from the cache
    assert spans == {1: {8}, 2: {16}}
