"""d256's dQ in pairs of CTAs (the paired_dq option, issue 30) without a GPU: the shared-memory ring of P^T and dS^T
slots (its formulas quoted from the rendered kernel) keeps every tile until its last reader is done, each warpgroup's
head dims of dQ (paired: over both CTAs' keys; alone: two rounds) add up to the whole dQ, the schedule columns the
kernel pairs are those whose query rows agree, the GPU tests' layouts hold pairs of both kinds and a kv-tile alone,
and the resource model fits the sm_90a shared memory.

The GPU tests of the same kernel: `pytest -m gpu tests/test_kernel_backward_gpu.py -k "split_scores or paired"`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import omnigen
from omnigen.jit import codegen
from omnigen.kernels.sm90 import FAMILY, resources
from omnigen.kernels.sm90.options import HopperOptions
from omnigen.targets import ARCH_TABLE, KernelConfig

sys.path.insert(0, str(Path(__file__).parent))
from kernel_cases import TRANSFUSION  # noqa: E402


def d256(**options) -> KernelConfig:
    return KernelConfig(256, "bf16", "sm_90a", resources.default_tile(256),
                        options=HopperOptions(**options) if options else None)


def rendered_backward(config: KernelConfig) -> str:
    return codegen.render(TRANSFUSION, config)[codegen.source_names(TRANSFUSION, config)["backward"]]


def ring_formulas(source: str) -> tuple[str, str]:
    """The slot expressions of probabilities_tile and score_gradient_tile under kPairedDq, as the kernel spells them."""
    found = re.findall(r"if constexpr \(kPairedDq\) return shared\.p\[(.+?)\];", source)
    assert len(found) == 2, found
    return found[0], found[1]


def slot(formula: str, loaded: int) -> int:
    return eval(formula, {}, {"loaded": loaded})  # the C expression is Python too (non-negative operands)


def test_the_ring_keeps_each_tile_until_its_readers_are_done():
    """Step n writes P^T into slot P(n) after both warpgroups passed its P^T barrier (so both finished step n - 1)
    and dS^T into slot D(n) after the dS^T barrier. Readers: P(n) by dV of step n in both warpgroups (the other may
    still read it while one writes P^T of n + 1); D(n) by dK and dQ of step n and by the copy to the peer, which is
    known to be done only during step n + 1 (the peer's dS^T of n + 1 comes after it). So: P(n + 1) must be neither
    P(n) nor D(n), D(n + 1) must not be D(n), and a slot of step n is written again no earlier than step n + 2 unless
    it was P(n), whose readers step n + 1's P^T barrier has outlived."""
    p_formula, d_formula = ring_formulas(rendered_backward(d256()))
    for n in range(60):
        p, d = slot(p_formula, n), slot(d_formula, n)
        p1, d1 = slot(p_formula, n + 1), slot(d_formula, n + 1)
        assert 0 <= p < 3 and 0 <= d < 3 and p != d
        assert p1 not in (p, d), n
        assert d1 != d, n
        # D(n) is rewritten first by P(n + 2) (step n + 2's stores), never within step n + 1
        assert d not in (p1, d1), n


@pytest.mark.parametrize("formulas", [("(2 * loaded) % 3", "(2 * loaded + 2) % 3"), ("loaded % 3", "(loaded + 1) % 3"),
                                      ("(2 * loaded) % 2", "(2 * loaded + 1) % 2")])
def test_the_ring_check_fails_on_rings_that_reuse_too_soon(formulas, monkeypatch):
    """Each of these would overwrite a tile that a reader still needs; the test above must say so."""
    monkeypatch.setattr(sys.modules[__name__], "ring_formulas", lambda source: formulas)
    with pytest.raises(AssertionError):
        test_the_ring_keeps_each_tile_until_its_readers_are_done()


def same_rows(bwd_ptr: list[int], bwd_q: list[int], column: int) -> bool:
    """The kernel's same_rows: kv-tiles 2i and 2i + 1 (columns from `column` = 3 (b kv_tiles + 2i) on) walk the same
    query rows in the same order."""
    first, middle, end = bwd_ptr[column], bwd_ptr[column + 3], bwd_ptr[column + 6]
    return middle - first == end - middle and bwd_q[first:middle] == bwd_q[middle:end]


def pair_counts(rules: omnigen.Rules, texts: list[str]) -> tuple[int, int, int]:
    """(pairs that walk together, pairs that do not, kv-tiles alone) of a layout at d256's tile."""
    layouts = [omnigen.Layout.parse(t) for t in texts]
    layout = layouts[0] if len(layouts) == 1 else omnigen.Layout.batch(layouts)
    tile = resources.default_tile(256)
    plan = omnigen.plan(rules, layout, block_m=tile.block_m, block_n=tile.block_n)
    ptr, q = plan.bwd_ptr.tolist(), plan.bwd_q.tolist()
    kv_tiles = -(-layout.seq_len // tile.block_n)
    together = apart = alone = 0
    for b in range(len(layouts)):
        for i in range(0, kv_tiles, 2):
            if i + 1 == kv_tiles:
                alone += 1
            elif same_rows(ptr, q, 3 * (b * kv_tiles + i)):
                together += 1
            else:
                apart += 1
    return together, apart, alone


def test_causal_columns_pair_whole_and_rows_that_differ_do_not():
    # Plain causal text: kv-tiles 2i and 2i + 1 share q-tile i's diagonal and every q-tile after it.
    assert pair_counts(TRANSFUSION, ["text:2048"]) == (16, 0, 0)
    assert pair_counts(TRANSFUSION, ["text:1950"]) == (15, 0, 1)
    # An image over tokens 200-499. kv-tiles 2 and 3 list q-tiles 2, 3 (full) then 1 (causal in 2, partial in 3):
    # the same rows in the same order, different kinds, so they pair. kv-tile 6 lists 2, 3 (full) then 1 (partial),
    # its partner 7 (image keys and the last text) 1, 2, 3 (all partial): the same q-tiles in another order, alone.
    assert pair_counts(TRANSFUSION, ["text:200 image:300 text:12"]) == (3, 1, 0)


def test_the_gpu_cases_hold_pairs_together_apart_and_alone():
    """The d256 GPU tests run every case of test_kernel_backward_gpu.CASES with the option on (its default), plus a
    causal layout with a kv-tile alone: between them, every path of the kernel (a pair in step, a pair apart, a
    kv-tile without a partner)."""
    from test_kernel_backward_gpu import CASES, PAIRED_DQ_CASES

    totals = [0, 0, 0]
    for _, rules, texts, _, _ in CASES + PAIRED_DQ_CASES:
        for i, count in enumerate(pair_counts(rules, texts)):
            totals[i] += count
    assert all(total > 0 for total in totals), totals


def test_paired_dq_is_on_with_split_scores_only_and_fits_shared_memory():
    on, off, no_split = d256(), d256(paired_dq=False), d256(split_scores=False)
    limit = ARCH_TABLE["sm_90a"].shared_memory
    r = resources.Resources(on)
    assert r.hopper_paired_dq and not r.backward_problems()
    assert r.hopper_shared_storage_bytes + 1024 <= limit
    assert not resources.Resources(off).hopper_paired_dq and not resources.Resources(no_split).hopper_paired_dq
    # The pair's extra tiles (the peer's K half, its dS^T twice) are paid for by dO's second stage and a P^T slot.
    assert r.hopper_shared_storage_bytes <= resources.Resources(off).hopper_shared_storage_bytes
    assert "paired_dq0" in off.label and "paired_dq" not in on.label
    d128 = KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128), options=HopperOptions(paired_dq=True))
    assert not resources.Resources(d128).hopper_paired_dq  # 128 keys a CTA: dQ goes by TMA, nothing to pair


def test_only_the_paired_kernel_launches_clusters():
    on, off = rendered_backward(d256()), rendered_backward(d256(paired_dq=False))
    assert "constexpr bool kPairedDq = true;" in on and "constexpr bool kPairedDq = false;" in off
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in on and "wgmma.mma_async.sync.aligned.m64n64k16" not in off
    assert "kv-tile pairs" in FAMILY.describe_backward(d256())
    assert "kv-tile pairs" not in FAMILY.describe_backward(d256(paired_dq=False))


# ---- which head dims each warpgroup adds, over which keys: the kernel's formulas (quoted from the rendered source by
# test_the_rendered_kernel_uses_these_formulas) emulated on small matrices, whose dQ must come out whole.
BOX = 64  # head dims of a K box (sm90::kBoxColumns), and of a warpgroup's paired dQ (kPairColumns at d256)


def first_box(paired: bool, rank: int, warpgroup: int) -> int:
    """Consumer's dq_box."""
    return rank * 2 + warpgroup if paired else warpgroup


def peer_k_columns(rank: int, box: int) -> int:
    """The first head dim of peer_k's box `box` (produce: column = rank * (kHeadDim / 2) + box * kBoxColumns)."""
    return rank * (256 // 2) + box * BOX


def emulate_dq(ds: list, k: list, paired: bool, torch) -> object:
    """dQ (queries x 256) added by the two CTAs of a pair, as paired_query_gradient computes and adds it: ds[r] is CTA
    r's dS (queries x its 64 keys), k[r] its K rows (64 x 256)."""
    dq = torch.zeros(ds[0].shape[0], 256, dtype=torch.float64)
    for rank in (0, 1):
        for warpgroup in (0, 1):
            box = first_box(paired, rank, warpgroup)
            part = ds[rank] @ k[rank][:, box * BOX:(box + 1) * BOX]  # this CTA's keys, K box dq_box
            if paired:  # the peer's keys: peer_k's box `warpgroup`
                peer = 1 - rank
                first = peer_k_columns(rank, warpgroup)
                part = part + ds[peer] @ k[peer][:, first:first + BOX]
            if not paired:  # alone: the first round out, then box + 2 over this CTA's keys
                dq[:, box * BOX:(box + 1) * BOX] += part
                box += 2
                part = ds[rank] @ k[rank][:, box * BOX:(box + 1) * BOX]
            dq[:, box * BOX:(box + 1) * BOX] += part
    return dq


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "alone"])
def test_the_warpgroups_add_every_head_dim_of_dq_once_over_both_key_sets(paired):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(5)
    ds = [torch.randn(64, 64, generator=g, dtype=torch.float64) for _ in range(2)]
    k = [torch.randn(64, 256, generator=g, dtype=torch.float64) for _ in range(2)]
    expected = ds[0] @ k[0] + ds[1] @ k[1]
    torch.testing.assert_close(emulate_dq(ds, k, paired, torch), expected)


MUTATIONS = {  # (paired, function, replacement): each sends some head dims' products to the wrong place
    "peer box of the other warpgroup": (True, "peer_k_columns", lambda rank, box: rank * 128 + (1 - box) * BOX),
    "peer half of the other rank": (True, "peer_k_columns", lambda rank, box: (1 - rank) * 128 + box * BOX),
    "alone: boxes 2w, 2w + 2": (False, "first_box", lambda paired, rank, warpgroup: 2 * warpgroup),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_dq_emulation_fails_on_wrong_boxes(mutation, monkeypatch):
    paired, name, replacement = MUTATIONS[mutation]
    monkeypatch.setattr(sys.modules[__name__], name, replacement)
    with pytest.raises(AssertionError):
        test_the_warpgroups_add_every_head_dim_of_dq_once_over_both_key_sets(paired)


def test_the_rendered_kernel_uses_these_formulas():
    source = rendered_backward(d256())
    for text in (
            "paired ? int(sm90::cluster_rank()) * 2 + warpgroup : warpgroup};",  # first_box
            "const int column = rank * (kHeadDim / 2) + box * sm90::kBoxColumns;",  # peer_k_columns
            "issue_paired_query_gradient(dq, gradients, shared.k + dq_box * kKvBoxBytes, false);",
            "issue_paired_query_gradient(dq, shared.peer_ds[buffer], shared.peer_k + warpgroup * kKvBoxBytes, true);",
            "box += 2;",
            "add_atomically<kPairColumns>(dq, row_start, box * kPairColumns);",
            "constexpr int kPairColumns = kHeadDim / 4;"):
        assert text in source, text
