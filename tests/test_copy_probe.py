"""scripts/copy_probe.py's data: the scored tokens are exactly a second occurrence of a span, and with --gap
that occurrence is at no fixed offset from the first (docs/embedded_model.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from copy_probe import copy_batch

FIRST, SEPARATOR = 100, 4000


def test_without_gap_rows_are_span_separator_span_all_scored():
    torch.manual_seed(0)
    x, scored = copy_batch(4, 12, 3000, FIRST, SEPARATOR, gap=0)
    assert x.shape == (4, 25)
    assert (x[:, 12] == SEPARATOR).all() and torch.equal(x[:, :12], x[:, 13:])
    assert scored[:, 13:].all() and not scored[:, :13].any()


def test_with_gap_each_scored_token_continues_the_earlier_occurrence_of_its_predecessor():
    torch.manual_seed(0)
    x, scored = copy_batch(64, 12, 3000, FIRST, SEPARATOR, gap=32)
    assert x.shape == (64, 12 * 2 + 1 + 64)
    assert (scored.sum(1) == 11).all()  # the copy's first token cannot be foreseen, so it is not scored
    starts = set()
    for row, mask in zip(x.tolist(), scored.tolist()):
        positions = [i for i, m in enumerate(mask) if m]
        assert positions == list(range(positions[0], positions[0] + 11))
        sep = row.index(SEPARATOR)
        copy = row[positions[0] - 1: positions[-1] + 1]
        original = row[sep - 12: sep]
        assert copy == original
        starts.add(positions[0] - sep)
        assert all(FIRST <= t < FIRST + 3000 for i, t in enumerate(row) if i != sep)
    assert len(starts) > 10  # the distance between the two copies varies
