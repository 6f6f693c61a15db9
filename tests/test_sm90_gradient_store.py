"""The Hopper epilogues by TMA without a GPU: the backward's dK/dV (store_gradients_by_tma) and the forward's O
(store_by_tma, the output_by_tma option). Each warpgroup's accumulator fragments, written by stmatrix at the addresses
the rendered kernel computes (its formulas quoted from the source), land where a TMA store of [64 rows][64 head dims]
boxes with the 128-byte swizzle reads each element, so the tensor in global memory is dK (dV, O) itself; wrong
swizzles or row halves fail the same check. Also: which variants take the paths (the backward: element-type gradients
of one kv head per query head, not split columns; the forward: where its staging buffer fits).

The GPU tests of the same epilogues: `pytest -m gpu tests/test_kernel_backward_gpu.py` (every MHA case stores this
way; GQA keeps the fp32 stores) and `-k output_by_tma` in tests/test_kernel_forward_gpu.py and tests/test_fp8_gpu.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from omnigen import kernels
from omnigen.jit import codegen
from omnigen.kernels.sm90 import resources
from omnigen.kernels.sm90.options import HopperOptions
from omnigen.targets import KernelConfig, TileConfig

sys.path.insert(0, str(Path(__file__).parent))
from kernel_cases import TRANSFUSION  # noqa: E402
from stmatrix_model import evaluate, store_matrices  # noqa: E402

KEYS_PER_WARPGROUP = 64
BOX_COLUMNS = 64  # head dims of a box: 128 bytes of 16-bit elements
ROW_BYTES = 128
BOX_BYTES = 128 * ROW_BYTES  # a box of K's (V's) buffer: the CTA's 128 keys x 64 head dims


def rendered_backward(head_dim: int) -> str:
    config = KernelConfig(head_dim, "bf16", "sm_90a", resources.default_tile(head_dim))
    return codegen.render(TRANSFUSION, config)[codegen.source_names(TRANSFUSION, config)["backward"]]


def epilogue(source: str) -> str:
    start = source.index("void store_gradients_by_tma(")
    return source[start:source.index("\n  }\n", start)]


def formulas(source: str) -> dict[str, object]:
    """The epilogue's row, chunk and box expressions and its stmatrix operand order, as the kernel spells them."""
    body = epilogue(source)
    row = re.search(r"const int row = (.+?);", body).group(1)
    chunk = re.search(r"const int chunk = (.+?);", body).group(1)
    box = re.search(r"buffer \+ \((.+?)\) \* kKvBoxBytes", body).group(1)
    operands = [(int(a), int(b)) for a, b in re.findall(r"pack\(x\[(\d)\], x\[(\d)\]\)", body)]
    first = re.search(r"x = fragment \+ (.+?);", body).group(1)
    return {"row": row, "chunk": chunk, "box": box, "operands": operands, "first": first}


# The row formula's helpers as the kernel defines them without split columns
HELPERS = {"key_block_of": lambda w: w, "kKeysPerWarpgroup": KEYS_PER_WARPGROUP}


def stored_by_tma(head_dim: int, found: dict[str, object], helpers: dict[str, object],
                  buffer_per_warpgroup: bool, staged_boxes: int = 0) -> list[list[object]]:
    """[128 rows][head_dim] as TMA stores of each warpgroup's boxes would write them, every accumulator element
    tagged by its (row, column) per the wgmma fragment layout: lane l of warp w holds rows 16 w + l / 4 (+ 8 h) and
    columns 8 g + 2 (l % 4) + e in register 4 g + 2 h + e. The backward stages both warpgroups' keys in K's (V's)
    buffer, boxes of 128 rows; the forward gives each warpgroup its own boxes of 64 rows (buffer_per_warpgroup),
    `staged_boxes` of them (0: all), in as many rounds as it takes: each round's stmatrix writes, then its TMA stores
    read, the same buffer (found["box"] and found["column"] are the kernel's expressions in k16 / box and round)."""
    boxes = head_dim // BOX_COLUMNS
    staged = staged_boxes or boxes
    box_rows = KEYS_PER_WARPGROUP if buffer_per_warpgroup else 128
    out: list[list[object]] = [[None] * head_dim for _ in range(128)]
    for round_ in range(boxes // staged):
        shared: dict[int, object] = {}
        buffers = [{}, {}] if buffer_per_warpgroup else [shared, shared]  # byte offset -> tag of the 16-bit element
        for warpgroup in range(2):
            for warp in range(4):
                # per k16: the four registers each lane gives stmatrix, and the row addresses lanes 8 m .. 8 m + 7 give
                for k16 in range(4 * staged * round_, 4 * staged * (round_ + 1)):
                    first = evaluate(found["first"], k16=k16)
                    box = evaluate(found["box"], k16=k16, round=round_, kStagedBoxes=staged)
                    registers, addresses = {}, {}
                    for lane in range(32):
                        matrix = lane // 8
                        row = evaluate(found["row"], **helpers, warpgroup=warpgroup, warp=warp, matrix=matrix,
                                       lane=lane)
                        chunk = evaluate(found["chunk"], k16=k16, matrix=matrix, row=row)
                        addresses[lane] = box * box_rows * ROW_BYTES + row * ROW_BYTES + chunk * 16
                        tags = []
                        for index_pair in found["operands"]:
                            pair_tags = []
                            for index in index_pair:
                                i = first + index
                                group, h, e = i // 4, (i % 4) // 2, i % 2
                                key = 64 * warpgroup + 16 * warp + lane // 4 + 8 * h
                                pair_tags.append((key, 8 * group + 2 * (lane % 4) + e))
                            tags.append(pair_tags)
                        registers[lane] = tags
                    store_matrices(buffers[warpgroup], addresses, registers)
        # TMA store of box b, rows 64 w on: element (r, c) of the box sits at chunk (2 c / 16) ^ (r % 8) of its row
        for warpgroup in range(2):
            for box in range(staged):
                column = evaluate(found.get("column", "box * 64"), box=box, round=round_, kStagedBoxes=staged)
                for r in range(KEYS_PER_WARPGROUP):
                    row = r if buffer_per_warpgroup else 64 * warpgroup + r  # the row within the staging buffer
                    for c in range(BOX_COLUMNS):
                        byte = 2 * c
                        at = box * box_rows * ROW_BYTES + row * ROW_BYTES + ((byte // 16) ^ (row % 8)) * 16 + byte % 16
                        out[64 * warpgroup + r][column + c] = buffers[warpgroup].get(at)
    return out


def check(head_dim: int, found: dict[str, object], helpers: dict[str, object] = HELPERS,
          buffer_per_warpgroup: bool = False, staged_boxes: int = 0) -> None:
    out = stored_by_tma(head_dim, found, helpers, buffer_per_warpgroup, staged_boxes)
    for key in range(128):
        for column in range(head_dim):
            assert out[key][column] == (key, column), (key, column, out[key][column])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_tma_boxes_hold_each_gradient_element_in_place(head_dim):
    check(head_dim, formulas(rendered_backward(head_dim)))


@pytest.mark.parametrize("mutation", [
    ("chunk", "(2 * (k16 % 4) + matrix / 2) ^ (row % 4)"),  # the 64-byte swizzle's period
    ("chunk", "(2 * (k16 % 4) + matrix % 2) ^ (row % 8)"),  # head-dim halves from the row bit
    ("row", "key_block_of(warpgroup) * kKeysPerWarpgroup + 16 * warp + 8 * (matrix / 2) + lane % 8"),
    ("operands", [(0, 1), (4, 5), (2, 3), (6, 7)]),  # matrices 1 and 2 swapped
])
def test_the_emulation_fails_on_wrong_addresses(mutation):
    found = formulas(rendered_backward(128))
    found[mutation[0]] = mutation[1]
    with pytest.raises(AssertionError):
        check(128, found)


def test_which_variants_store_by_tma():
    """MHA's gradients (element type, one per kv head) go by TMA; GQA's fp32 ones by the consumers' stores (kernel and
    host both decide by heads_q != heads_kv); split columns (d256) have no dK/dV maps and never take the path."""
    source = rendered_backward(128)
    assert "if (args.heads_q != args.heads_kv) return true;  // GQA's fp32 gradients" in source
    assert "const bool partials = args.heads_q != args.heads_kv;\n    if constexpr (kDqByTma) {" in source
    assert "      if (!partials) {\n        store_gradients_by_tma(maps);" in source
    assert "CUtensorMap q, k, v, d_o, dq, dk, dv;" in source
    d256 = rendered_backward(256)
    assert "constexpr bool kDqByTma = !kSplitColumns;" in d256 and "constexpr bool kSplitColumns = true;" in d256
    assert "const CUtensorMap* dk_map(const TensorMapsOf<false>&) { return nullptr; }" in d256


# ---- the forward's O (store_by_tma)


def rendered_forward(head_dim: int, dtype: str = "bf16", stages: int = 2, **options: bool) -> str:
    tile = resources.default_tile(head_dim, dtype)
    config = KernelConfig(head_dim, dtype, "sm_90a", TileConfig(tile.block_m, tile.block_n, tile.warps, stages),
                          options=HopperOptions(**options), forward_only=dtype == "e4m3")
    return codegen.render(TRANSFUSION, config)[codegen.source_names(TRANSFUSION, config)["kernel"]]


def forward_formulas(source: str) -> dict[str, object]:
    """store_by_tma's row, chunk and box expressions and stmatrix operands; checks on the way that each value is
    scaled by its own row's 1 / sum (inverse[h] for register half h)."""
    start = source.index("void store_by_tma(")
    body = source[start:source.index("\n  }\n", start)]
    operands = []
    for a, ia, b, ib in re.findall(r"pack<Output>\(x\[(\d)\] \* inverse\[(\d)\], x\[(\d)\] \* inverse\[(\d)\]\)", body):
        assert int(ia) == int(a) % 4 // 2 and int(ib) == int(b) % 4 // 2, (a, ia, b, ib)
        operands.append((int(a), int(b)))
    return {"row": re.search(r"const int row = (.+?);", body).group(1),
            "chunk": re.search(r"const int chunk = (.+?);", body).group(1),
            "box": re.search(r"boxes \+ \((.+?)\) \* kBoxStride", body).group(1),
            "column": "(" + re.search(r"const int column = \((.+?)\) \* sm90::kBoxColumns;", body).group(1) + ") * 64",
            "operands": operands,
            "first": re.search(r"x = o \+ (.+?);", body).group(1)}


@pytest.mark.parametrize("head_dim,staged", [(64, 1), (128, 2), (256, 2)])
def test_the_forward_boxes_hold_each_output_element_in_place(head_dim, staged):
    """Every head dim the option takes, d256 in two rounds through a buffer of half its boxes."""
    source = rendered_forward(head_dim, output_by_tma=2)
    assert f"constexpr int kStagedBoxes = {staged};" in source
    check(head_dim, forward_formulas(source), {}, buffer_per_warpgroup=True, staged_boxes=staged)


def test_folded_tiles_stage_each_warpgroups_o_in_its_own_rows_of_q():
    """fold_tiles with O by TMA: warpgroup w's box b goes to Q's box b at w's 64 rows (w x 8 KB into a 16 KB box at
    d128), 1024-byte aligned as the swizzle needs, so the two warpgroups' boxes never overlap and neither touches the
    other's Q rows; the buffer has no bytes of its own."""
    source = rendered_forward(128, fold_tiles=True)
    assert "constexpr bool kOutputInQ = kFoldTiles && kOutputByTma;" in source and "kFoldTiles = true;" in source
    assert "boxes = shared.q[q_buffer] + warpgroup * kOutputBoxBytes;" in source
    q_box, o_box = 128 * 128, 64 * 128  # kQBoxBytes, kOutputBoxBytes
    starts = {(w, b): b * q_box + w * o_box for w in (0, 1) for b in range(128 // 64)}
    assert all(start % 1024 == 0 for start in starts.values())
    spans = sorted((start, start + o_box) for start in starts.values())
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert all(starts[(w, b)] // q_box == b and starts[(w, b)] % q_box // o_box == w for w, b in starts)
    # the emulation of the stmatrix addresses holds for the folded variant's formulas too
    check(128, forward_formulas(source), {}, buffer_per_warpgroup=True, staged_boxes=2)


@pytest.mark.parametrize("mutation", [
    ("chunk", "(2 * (k16 % 4) + matrix / 2) ^ (row % 4)"),
    ("row", "16 * warp + 8 * (matrix / 2) + lane % 8"),
    ("box", "k16 / 4"),  # no round: the second round's boxes past the buffer
    ("column", "box * 64"),  # every round at the first head dims
    ("operands", [(0, 1), (4, 5), (2, 3), (6, 7)]),
])
def test_the_forward_emulation_fails_on_wrong_addresses(mutation):
    found = forward_formulas(rendered_forward(256, output_by_tma=2))
    found[mutation[0]] = mutation[1]
    with pytest.raises(AssertionError):
        check(256, found, {}, buffer_per_warpgroup=True, staged_boxes=2)


def test_which_forward_variants_store_o_by_tma():
    """By default at d128 (FP8's too): a staging buffer of all a warpgroup's boxes (128 rows x head_dim x 2 bytes), an
    O map in the output type (FP8's bf16), the exit waiting for the last reads; and at d256 with half its boxes (two
    rounds; 32 KB, exactly what is left of 227 KB). output_by_tma=2 anywhere a buffer fits: d64 too; never with 3
    stages at d128. output_by_tma=0 (False), and the default at d64: the stores, no buffer bytes, no O map."""
    def variant(head_dim, dtype="bf16", stages=2, **options):
        tile = resources.default_tile(head_dim, dtype)
        return resources.Resources(KernelConfig(head_dim, dtype, "sm_90a",
                                                TileConfig(tile.block_m, tile.block_n, tile.warps, stages),
                                                options=HopperOptions(**options), forward_only=dtype == "e4m3"))
    source = rendered_forward(128)
    assert "constexpr int kStagedBoxes = 2;" in source and "constexpr bool kOutputByTma = kStagedBoxes > 0;" in source
    assert "if constexpr (kOutputByTma) {\n    c.store_by_tma(maps, head);\n  } else {\n    c.store(head);" in source
    assert "using TensorMaps = TensorMapsOf<kOutputByTma>;" in source and "CUtensorMap q, k, v, o;" in source
    assert "tensor_map<Output>(&maps.o, o, message, message_size)" in source
    assert "if (!output_map(maps, args, message, message_size)) return int(cudaErrorInvalidValue);" in source
    assert "uint8_t o[kOutputByTma && !kOutputInQ ? 2 : 0][kStagedBoxes * kOutputBoxBytes];" in source
    assert "constexpr int kBoxStride = kOutputInQ ? kQBoxBytes : kOutputBoxBytes;" in source
    assert source.count("end_output();") == 3  # the persistent loop's end, the folded loop's and the grid's one tile
    def stores(head_dim: int, **options) -> int:
        return variant(head_dim, output_by_tma=0, **options).shared_storage_bytes
    for head_dim, options, staged in ((128, {}, 2), (128, {"dtype": "e4m3"}, 2), (64, {"output_by_tma": 2}, 1),
                                      (256, {"output_by_tma": 2}, 2), (256, {}, 2)):
        r = variant(head_dim, **options)
        assert r.output_staged_boxes == staged and r.output_by_tma
        dtype = {k: v for k, v in options.items() if k == "dtype"}
        assert r.shared_storage_bytes == stores(head_dim, **dtype) + 2 * staged * 64 * 128
    assert variant(256, output_by_tma=2).shared_memory_bytes == 227 * 1024
    for off in (variant(128, output_by_tma=0), variant(128, output_by_tma=False), variant(64),
                variant(256, output_by_tma=0), variant(128, stages=3, output_by_tma=2)):
        assert off.output_staged_boxes == 0 and not off.output_by_tma
    for wrong in (3, -1):
        assert any("output_by_tma must be 1" in p for p in kernels.problems(variant(128, output_by_tma=wrong).config))
    for head_dim, options in ((128, {"output_by_tma": 0}), (64, {}), (256, {"output_by_tma": 0})):
        assert "constexpr int kStagedBoxes = 0;" in rendered_forward(head_dim, **options)
