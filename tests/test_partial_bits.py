"""Partial tiles' masks as bits (omnigen.plan.bits): every bit against the dense mask, slots in schedule order,
capacities, and (GPU) the Triton kernel against the torch reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.plan import bits as partial
from omnigen.semantics import PARTIAL

from strategies import layouts, rules

tile_m = st.sampled_from([16, 32, 64, 128])
tile_n = st.sampled_from([16, 32, 48, 64, 128, 176, 192])


def _batch(data, rule_set: omnigen.Rules) -> omnigen.LayoutBatch:
    items = [data.draw(layouts(rule_set, 10, 60)) for _ in range(data.draw(st.integers(1, 3)))]
    S = max(item.seq_len for item in items)
    return omnigen.Layout.batch([item.pad_end(S) for item in items])


def _unpack(bits: torch.Tensor, slot: int, rows: int, columns: int) -> torch.Tensor:
    """A slot's bits back as a bool [rows, columns] tile (the layout the module docstring gives)."""
    words = partial.mask_words(columns)
    view = bits.view(-1, words, rows, 4)[slot].long() & 0xFFFFFFFF  # [W, rows, 4]
    tile = torch.zeros(rows, columns, dtype=torch.bool)
    for t in range(4):
        for v in range(columns // 4):
            column = 8 * (v // 2) + 2 * t + v % 2
            tile[:, column] = ((view[v // 32, :, t] >> (v % 32)) & 1).bool()
    return tile


def _partial_entries(p, transposed: bool = False) -> list[tuple[int, int, int]]:
    """(batch, q-tile, kv-tile) of every partial entry, in the forward schedule's order (or the backward's)."""
    out = []
    for b in range(p.batch_size):
        if transposed:
            for j in range(p.num_kv_tiles):
                out += [(b, i, j) for i in p.backward_tiles(j, b)["partial"]]
        else:
            for i in range(p.num_q_tiles):
                out += [(b, i, j) for j in p.forward_tiles(i, b)["partial"]]
    return out


@settings(max_examples=120, deadline=None)
@given(st.data(), tile_m, tile_n, st.booleans())
def test_every_slot_is_its_tile_of_the_dense_mask(data, block_m, block_n, transposed):
    """Slot s holds the s-th partial entry of the schedule, bit for bit the dense mask (keys past the end: 0); the
    backward's (`transposed`) the tile's transpose, keys as rows."""
    rule_set = data.draw(rules())
    layout = _batch(data, rule_set)
    p = omnigen.plan(rule_set, layout, block_m, block_n)
    entries = _partial_entries(p, transposed)
    capacity = data.draw(st.integers(0, len(entries) + 2))
    ptr, index = (p.bwd_ptr, p.bwd_q) if transposed else (p.fwd_ptr, p.fwd_kv)
    starts, bits = partial.partial_bits(rule_set, p.tables, ptr, index, block_m, block_n, capacity, transposed)
    assert bits.dtype == torch.int32 and bits.numel() == capacity * partial.slot_words(block_m, block_n, transposed)
    if transposed:
        counts = [len(p.backward_tiles(j, b)["partial"]) for b in range(p.batch_size) for j in range(p.num_kv_tiles)]
    else:
        counts = [len(p.forward_tiles(i, b)["partial"]) for b in range(p.batch_size) for i in range(p.num_q_tiles)]
    assert starts.tolist() == [sum(counts[:r]) for r in range(len(counts) + 1)]
    rows, columns = (block_n, block_m) if transposed else (block_m, block_n)
    dense = rule_set.dense_mask(layout)
    S = layout.seq_len
    padded = torch.zeros(dense.shape[0], p.num_q_tiles * block_m, p.num_kv_tiles * block_n, dtype=torch.bool)
    padded[:, :S, :S] = dense
    for slot in range(capacity):
        tile = _unpack(bits, slot, rows, columns)
        if slot >= len(entries):
            assert not tile.any(), slot
            continue
        b, i, j = entries[slot]
        want = padded[b, i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n]
        assert torch.equal(tile, want.T if transposed else want), (slot, b, i, j)


def test_capacities():
    assert partial.capacity_for("auto", 2, 1000, 128, 128) == min(2 * 8 * 8, partial.DEFAULT_SLOTS_PER_ROW * 2 * 8)
    assert partial.capacity_for("all", 2, 1000, 128, 64) == 2 * 8 * 16
    assert partial.capacity_for("none", 2, 1000, 128, 64) == 0
    assert partial.capacity_for(5, 2, 1000, 128, 64) == 5
    assert partial.capacity_for(10**9, 1, 256, 128, 128) == 4
    assert partial.slot_words(128, 128) == 512 and partial.slot_words(128, 176) == 1024
    assert partial.slot_words(128, 176, transposed=True) == 176 * 4 and partial.slot_words(64, 256, True) == 1024
    for bad in (-1, 1.5, True, "some"):
        with pytest.raises(ValueError, match="partial_bits"):
            partial.capacity_for(bad, 1, 256, 128, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([64, 128]), tile_n, st.booleans())
def test_triton_bits_equal_the_reference(data, block_m, block_n, transposed):
    rule_set = data.draw(rules())
    layout = _batch(data, rule_set)
    p = omnigen.plan(rule_set, layout, block_m, block_n, device="cuda")
    capacity = data.draw(st.integers(0, p.counts()["partial"] + 3))
    ptr, index = (p.bwd_ptr, p.bwd_q) if transposed else (p.fwd_ptr, p.fwd_kv)
    got = partial.partial_bits(rule_set, p.tables, ptr, index, block_m, block_n, capacity, transposed)
    want = partial.partial_bits_reference(rule_set, p.tables, ptr, index, block_m, block_n, capacity, transposed)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())
