"""Context parallelism on CPUs: `omnigen.distributed` over gloo with 2 and 4 processes against single-process
float64 attention (outputs and gradients), on hypothesis-generated rules x layouts and every examples/rules file;
the rectangles' masks through the op's own PyTorch path; plan_shards' balance and errors."""

from __future__ import annotations

import functools
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.distributed import Shard, chunk_attention, merge, plan_shards
from omnigen.distributed.attention import _make_rectangle
from omnigen.distributed.rectangle import batched
from omnigen.reference import attention_reference
from omnigen.tune.layouts import synthetic_layout

cp_attention = sys.modules["omnigen.distributed.attention"]  # the module (the package's `attention` is the function)

sys.path.insert(0, os.path.dirname(__file__))
import strategies  # noqa: E402
from ranks import run_ranks  # noqa: E402

RULES_DIR = Path(__file__).resolve().parent.parent / "examples" / "rules"
CHUNK = 16


def _fit(layout: omnigen.Layout, world: int) -> omnigen.Layout:
    """At least one chunk per rank."""
    return layout.pad_end(CHUNK * world) if layout.seq_len < CHUNK * world else layout


def _check_against_reference(rules, layout, world: int, method: str, heads=(4, 2), batch: int = 1,
                             seed: int = 0, block_tokens: int = 2 * CHUNK, chunk: int = CHUNK,
                             tolerance: float = 1e-9) -> None:
    """Runs on every rank (each compares, so a failure stops every rank at once rather than leaving peers waiting)."""
    S = layout.seq_len
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q, k, v, d_out = (torch.randn(batch, h, S, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    shard = plan_shards(rules, layout, world, chunk=chunk, method=method)
    leaves = [shard.scatter(x).detach().requires_grad_() for x in (q, k, v)]
    out, lse = omnigen.distributed.attention(*leaves, shard, rules, return_lse=True, block_tokens=block_tokens)
    out.backward(shard.scatter(d_out))
    mine = [shard.gather(x) for x in (out.detach(), *(x.grad for x in leaves))]
    full_lse = shard.gather(lse.unsqueeze(-1)).squeeze(-1)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = attention_reference(*ref_leaves, layout, rules)
    ref.backward(d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), mine, [ref.detach()] + [x.grad for x in ref_leaves]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=lambda m, n=name: f"{n} ({method}): {m}")
    assert torch.equal(torch.isinf(full_lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(full_lse[finite], ref_lse[finite], rtol=tolerance, atol=tolerance)


def _rules_files() -> list[omnigen.Rules]:
    return [omnigen.Rules.load(path) for path in sorted(RULES_DIR.glob("*.yaml"))]


def _worker_cases(rank: int, world: int) -> None:
    # Every examples/rules file, a synthetic layout each, all three deals.
    for index, rules in enumerate(_rules_files()):
        layout = synthetic_layout(rules, 200 + 37 * index, random.Random(index))
        for method in ("balanced", "even", "zigzag"):
            _check_against_reference(rules, layout, world, method, seed=index,
                                     block_tokens=(CHUNK, 3 * CHUNK, 10 ** 6)[index % 3])
    # Ranks whose queries have no allowed pair at all: the even deal gives the first ranks only padding.
    transfusion = omnigen.Rules.load(RULES_DIR / "transfusion.yaml")
    padded = omnigen.Layout.from_segments([("pad", CHUNK * world), ("text", 30), ("image", 17), ("text", 9)])
    _check_against_reference(transfusion, padded, world, "even", heads=(2, 2))
    # A batch of two different layouts, and a rank holding the short last chunk.
    pair = omnigen.Layout.batch([omnigen.Layout.parse("text:40 image:33 text:30@1"),
                                 omnigen.Layout.parse("image:20 text:60 image:23")])
    _check_against_reference(transfusion, pair, world, "balanced", batch=2)

    # The kernels' rectangles (masks made from data on overlaid squares, blocks and pieces), through the op's own
    # PyTorch path, in the same distributed flow.
    original = cp_attention._make_rectangle
    cp_attention._make_rectangle = functools.partial(original, kernels=True)
    try:
        layout = synthetic_layout(transfusion, 1100, random.Random(5))
        # (the op's path runs float32 tiles and returns a float32 LSE)
        _check_against_reference(transfusion, layout, world, "balanced", chunk=128, block_tokens=256,
                                 tolerance=2e-5)
    finally:
        cp_attention._make_rectangle = original

    # Hypothesis: the same derandomised examples on every rank, in the same order, no shrinking (a shrink could
    # take ranks down different paths).
    @settings(max_examples=12 if world == 2 else 6, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate])
    @given(st.data())
    def random_rules(data):
        rules = data.draw(strategies.rules())
        layout = _fit(data.draw(strategies.layouts(rules, max_length=60)), world)
        method = data.draw(st.sampled_from(("balanced", "even", "zigzag")))
        heads = data.draw(st.sampled_from(((2, 2), (4, 2), (3, 1))))
        block_tokens = data.draw(st.sampled_from((CHUNK, 2 * CHUNK, 5 * CHUNK)))
        _check_against_reference(rules, layout, world, method, heads=heads, block_tokens=block_tokens)

    random_rules()


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process_float64(world):
    run_ranks(_worker_cases, world)


# ---- one process ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rules_file", ["transfusion.yaml", "sliding_window.yaml", "three_modalities.yaml"])
def test_rectangle_masks_through_the_op(rules_file):
    """The kernels' rectangles (a mask made from data on the L-token square, padding rows and columns, the short
    last chunk anywhere) run through the op's PyTorch path agree with the float64 rectangle."""
    import omnigen.op  # noqa: F401

    rules = omnigen.Rules.load(RULES_DIR / rules_file)
    layout = synthetic_layout(rules, 1100, random.Random(3))
    shard = plan_shards(rules, layout, 3, chunk=128)
    last = shard.num_chunks - 1
    g = torch.Generator().manual_seed(0)
    cases = [(shard.chunks(0), shard.chunks(0)), (shard.chunks(1), shard.chunks(2)),
             (np.array([last, 4, 1]), np.array([1, 0, last, 5])), (np.array([last, 2]), np.array([last, 2]))]
    for q_chunks, kv_chunks in cases:
        q = torch.randn(2, 4, int(shard.lengths[q_chunks].sum()), 16, generator=g)
        k = torch.randn(2, 2, int(shard.lengths[kv_chunks].sum()), 16, generator=g)
        v, d_out = torch.randn_like(k), torch.randn_like(q)
        layout_b = batched(layout, 2)
        kernels = _make_rectangle(shard, layout_b, q_chunks, kv_chunks, q, 0.25, kernels=True)
        reference = _make_rectangle(shard, layout_b, q_chunks, kv_chunks, q, 0.25, kernels=False)
        assert kernels.mask.allowed_pairs == int(reference.allowed.sum())  # full and causal tiles counted, not walked
        out, lse = kernels.forward(q, k, v)
        ref_out, ref_lse = reference.forward(q, k, v)
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        grads = kernels.backward(d_out, q, k, v, ref_out.float(), ref_lse.float())
        for a, b in zip(grads, reference.backward(d_out, q, k, v, ref_out, ref_lse)):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_chunk_attention_merges_to_the_whole():
    """Two rectangles of the same queries, merged by LSE, are attention over both key sets (chunked prefill)."""
    rules = omnigen.Rules.load(RULES_DIR / "transfusion.yaml")
    layout = omnigen.Layout.parse("text:50 image:32 text:40 image:16 text:22")
    shard = plan_shards(rules, layout, 2, chunk=16, method="even")
    g = torch.Generator().manual_seed(4)
    q_all, k_all, v_all = (torch.randn(1, 2, layout.seq_len, 8, generator=g, dtype=torch.float64) for _ in range(3))
    queries = np.array([6, 7, 8, 9])
    q = q_all[:, :, 96:160].requires_grad_()
    parts = [chunk_attention(q, k_all[:, :, 16 * a:16 * b], v_all[:, :, 16 * a:16 * b], shard, queries,
                             np.arange(a, b)) for a, b in ((0, 5), (5, 10))]
    out, lse = merge(*parts[0], *parts[1])
    ref, ref_lse = attention_reference(q_all, k_all, v_all, layout, rules)
    torch.testing.assert_close(out, ref[:, :, 96:160], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse[:, :, 96:160], rtol=1e-10, atol=1e-10)


def test_plan_shards_balances_and_explains():
    rules = omnigen.Rules.load(RULES_DIR / "transfusion.yaml")
    layout = synthetic_layout(rules, 16384, random.Random(0))
    balanced = plan_shards(rules, layout, 4)
    even = plan_shards(rules, layout, 4, method="even")
    assert isinstance(balanced, Shard) and balanced.chunk == 512
    assert balanced.imbalance < 0.01 < even.imbalance
    assert sorted(np.concatenate([balanced.chunks(r) for r in range(4)]).tolist()) == list(range(32))
    assert all(balanced.tokens(r) == 4096 for r in range(4))
    # what a rank receives: exactly the other ranks' chunks its queries need
    for rank in range(4):
        wanted = sum(balanced.lengths[balanced.needed_from(rank, other)].sum() for other in range(4) if other != rank)
        assert balanced.received_tokens[rank] == wanted
    zigzag = plan_shards(rules, layout, 4, method="zigzag")
    assert zigzag.chunks(0).tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    x = torch.arange(16384.0).view(1, 1, -1, 1)
    assert (balanced.scatter(x, rank=2)[0, 0, :, 0].long().numpy() == balanced.positions(2)).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_shards(rules, layout, 4, chunk=100)
    with pytest.raises(ValueError, match="method must be one of"):
        plan_shards(rules, layout, 4, method="round_robin")
    with pytest.raises(ValueError, match="cannot give each of 32 ranks"):
        plan_shards(rules, omnigen.Layout.parse("text:1000"), 32, chunk=64)
    with pytest.raises(ValueError, match="too short for 64 ranks"):
        plan_shards(rules, omnigen.Layout.parse("text:1000"), 64, chunk=16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        omnigen.distributed.attention(x, x, x, balanced, rules)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_chunk_work_sums_the_plans_tiles(data):
    """balance.chunk_work (band by band, no schedules) against the plan's dense tile kinds summed per chunk pair."""
    from omnigen.distributed import balance

    rules = data.draw(strategies.rules())
    layout = data.draw(st.one_of(strategies.layouts(rules, max_length=60),
                                 st.lists(strategies.layouts(rules, max_segments=3, max_length=20), min_size=2,
                                          max_size=3).map(lambda items: omnigen.Layout.batch(
                                              [x.pad_end(max(i.seq_len for i in items)) for x in items]))))
    chunk = data.draw(st.sampled_from((16, 32, 48, 64)))
    work, needs = balance.chunk_work(rules, layout, chunk)
    tile = balance.planning_tile(chunk)
    kinds = omnigen.plan(rules, layout, tile, tile, device="cpu").kinds.numpy()
    kinds = kinds if kinds.ndim == 3 else kinds[None]
    cost = np.array([balance.TILE_COST[k] for k in range(4)])
    per = chunk // tile
    n = -(-layout.seq_len // chunk)
    expected = np.zeros((n, n))
    touched = np.zeros((n, n), dtype=bool)
    for b, i, j in zip(*np.nonzero(kinds)):
        expected[i // per, j // per] += cost[kinds[b, i, j]]
        touched[i // per, j // per] = True
    np.testing.assert_allclose(work, expected, rtol=1e-12)
    assert np.array_equal(needs, touched)


def test_rows_move_alike_as_slices_and_indices():
    """Pieces of consecutive rows move as slices (a strided copy, a contiguous add), others by gather and
    index_add: the same messages and sums either way, whatever the gradient's layout."""
    from omnigen.distributed.attention import _add_rows, _take_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 40, 8, generator=g)
    for rows in (slice(7, 19), torch.arange(7, 19)):
        for message in (x, x.bfloat16(), x.bfloat16().transpose(1, 2).contiguous().transpose(1, 2)):
            taken = _take_rows(message, rows)  # (16-bit rows move as 8-byte words)
            assert taken.is_contiguous() and taken.dtype == message.dtype
            assert torch.equal(taken, message[:, :, 7:19])
        incoming = torch.randn(2, 12, 3, 8, generator=g)
        for grad in (x.clone(), x.transpose(1, 2).contiguous().transpose(1, 2)):  # [B, H, S, D] and heads-inner
            expected = grad.clone()
            expected[:, :, 7:19] += incoming.transpose(1, 2)
            _add_rows(grad, rows, incoming)
            torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)
