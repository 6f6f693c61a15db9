"""The kernel emulator (walking the plan's schedules) against float64 attention."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.plan import CAUSAL, FULL, PARTIAL
from omnigen.reference import (
    attention_reference,
    attention_reference_grads,
    emulate_backward,
    emulate_forward,
)

from strategies import block_sizes, layouts, rules


def _inputs(S, heads_q, heads_kv, dim, generator, batch=1):
    q = torch.randn(batch, heads_q, S, dim, generator=generator)
    k = torch.randn(batch, heads_kv, S, dim, generator=generator)
    v = torch.randn(batch, heads_kv, S, dim, generator=generator)
    d_out = torch.randn(batch, heads_q, S, dim, generator=generator)
    return q, k, v, d_out


def _close(actual, expected, what, tol=2e-5):
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().item() + 1e-6
    error = (actual.double() - expected).abs().max().item()
    assert error <= tol * max(scale, 1.0), f"{what}: max error {error:.3g} (scale {scale:.3g})"


@settings(max_examples=350)
@given(st.data(), block_sizes, block_sizes, st.sampled_from(((1, 1), (2, 1), (4, 2))), st.integers(0, 2**31 - 1))
def test_emulator_matches_float64(data, block_m, block_n, heads, seed):
    rule_set = data.draw(rules())
    layout = data.draw(layouts(rule_set))
    p = omnigen.plan(rule_set, layout, block_m, block_n)
    mask = rule_set.dense_mask(layout)
    q, k, v, d_out = _inputs(layout.seq_len, *heads, 16, torch.Generator().manual_seed(seed))
    scale = data.draw(st.sampled_from((None, 0.3)))
    out_ref, lse_ref = attention_reference(q, k, v, mask, scale)
    out, lse = emulate_forward(rule_set, p, q, k, v, scale)
    _close(out, out_ref, "out")
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse), empty) and not torch.isnan(lse).any()
    _close(lse[~empty], lse_ref[~empty], "lse")
    assert (out[empty[..., None].expand_as(out)] == 0).all()
    grads_ref = attention_reference_grads(q, k, v, mask, d_out, scale)
    grads = emulate_backward(rule_set, p, q, k, v, out, lse, d_out, scale)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        _close(g, g_ref, name, tol=1e-4)


def test_emulator_on_a_batch():
    rules = omnigen.Rules(name="t", modalities={"text": "causal", "image": "full"}, see={"text -> image": "all"})
    batch = omnigen.Layout.batch([omnigen.Layout.parse("text:20 image:30 text:13"), omnigen.Layout.parse("image:40 pad:3 text:20@2")])
    p = omnigen.plan(rules, batch, 16, 32)
    q, k, v, d_out = _inputs(63, 2, 2, 16, torch.Generator().manual_seed(0), batch=2)
    mask = rules.dense_mask(batch)
    out_ref, _ = attention_reference(q, k, v, mask)
    out, lse = emulate_forward(rules, p, q, k, v)
    _close(out, out_ref, "out")
    for g, g_ref in zip(emulate_backward(rules, p, q, k, v, out, lse, d_out), attention_reference_grads(q, k, v, mask, d_out)):
        _close(g, g_ref, "grad", tol=1e-4)


def _corrupted(p, position, new_kind_group):
    """A copy of plan p whose forward entry `position` moves to another kind group of its row."""
    import copy

    bad = copy.copy(p)
    ptr = p.fwd_ptr.clone()
    kv = p.fwd_kv.clone()
    row = int(torch.searchsorted(ptr[::3].contiguous(), torch.tensor(position), right=True)) - 1
    entries = {}
    for g, kind in enumerate((FULL, CAUSAL, PARTIAL)):
        entries[kind] = kv[ptr[3 * row + g] : ptr[3 * row + g + 1]].tolist()
    old_kind = next(kind for g, kind in enumerate((FULL, CAUSAL, PARTIAL)) if ptr[3 * row + g] <= position < ptr[3 * row + g + 1])
    tile = int(kv[position])
    entries[old_kind].remove(tile)
    if new_kind_group is not None:
        entries[new_kind_group].append(tile)
    start = int(ptr[3 * row])
    flat = entries[FULL] + entries[CAUSAL] + entries[PARTIAL]
    for g, kind in enumerate((FULL, CAUSAL, PARTIAL)):
        ptr[3 * row + g + 1] = start + sum(len(entries[x]) for x in (FULL, CAUSAL, PARTIAL)[: g + 1])
    shift = len(flat) - (int(p.fwd_ptr[3 * row + 3]) - start)
    ptr[3 * row + 3 :] = p.fwd_ptr[3 * row + 3 :] + shift
    bad.fwd_ptr = ptr
    bad.fwd_kv = torch.cat([kv[:start], torch.tensor(flat, dtype=kv.dtype), kv[int(p.fwd_ptr[3 * row + 3]) :]])
    return bad


@pytest.mark.parametrize("change", ["partial->full", "causal->full", "drop"])
def test_a_wrong_plan_gives_a_wrong_result(change):
    rules = omnigen.Rules(name="t", modalities={"text": "causal", "image": "full"})
    layout = omnigen.Layout.parse("text:40 image:37 text:30")
    p = omnigen.plan(rules, layout, 16, 16)
    q, k, v, _ = _inputs(layout.seq_len, 1, 1, 16, torch.Generator().manual_seed(1))
    out_ref, _ = attention_reference(q, k, v, rules.dense_mask(layout))
    _close(emulate_forward(rules, p, q, k, v)[0], out_ref, "correct plan")
    kinds = {FULL: 0, CAUSAL: 1, PARTIAL: 2}
    source, target = {"partial->full": (PARTIAL, FULL), "causal->full": (CAUSAL, FULL), "drop": (FULL, None)}[change]
    ptr = p.fwd_ptr.tolist()
    row = next(r for r in range(p.num_q_tiles) if ptr[3 * r + kinds[source] + 1] > ptr[3 * r + kinds[source]])
    bad = _corrupted(p, ptr[3 * row + kinds[source]], target)
    out_bad, _ = emulate_forward(rules, bad, q, k, v)
    assert (out_bad - out_ref).abs().max() > 1e-3
