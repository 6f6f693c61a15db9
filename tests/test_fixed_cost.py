"""scripts/fixed_cost.py without a GPU: the work it counts from a plan, and the fit that splits a time into a cost
per tile and a cost per step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import omnigen

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
fixed_cost = pytest.importorskip("fixed_cost")  # (imports triton's timer lazily; the module itself needs torch only)


def test_counts_of_a_causal_batch():
    rules = omnigen.Rules(name="causal", modalities={"text": "causal"})
    layout = omnigen.Layout.batch([omnigen.Layout.from_segments([("text", 1024)]) for _ in range(2)])
    work = fixed_cost.counts(omnigen.plan(rules, layout, 128, 128, device="cpu"), heads=3)
    # 8 q-tiles and 8 kv-tiles a sequence, 36 visited pairs (the lower triangle with its diagonal)
    assert work == fixed_cost.Counts(forward_tiles=3 * 2 * 8, forward_steps=3 * 2 * 36,
                                     backward_tiles=3 * 2 * 8, backward_steps=3 * 2 * 36 * 2)


def test_counts_skip_tiles_with_nothing_to_visit():
    rules = omnigen.Rules(name="docs", modalities={"text": "causal"})
    # two documents of 128 tokens: each q-tile sees only its own kv-tile
    layout = omnigen.Layout.parse("text:128 text:128@1")
    work = fixed_cost.counts(omnigen.plan(rules, layout, 128, 128, device="cpu"), heads=1)
    assert (work.forward_tiles, work.forward_steps, work.backward_tiles) == (2, 2, 2)


def test_the_fit_recovers_a_known_split():
    units = [4096, 4096, 4096, 4160]
    steps = [69_632, 135_168, 266_240, 528_384]
    times = [7.5 * u + 2.25 * s for u, s in zip(units, steps)]
    per_tile, per_step, residual = fixed_cost.fit(units, steps, times)
    assert per_tile == pytest.approx(7.5, rel=1e-6) and per_step == pytest.approx(2.25, rel=1e-9)
    assert residual < 1e-9
    noisy = [t * (1.02 if i == 1 else 1.0) for i, t in enumerate(times)]
    assert fixed_cost.fit(units, steps, noisy)[2] > 0.005
