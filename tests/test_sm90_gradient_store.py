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
                  buffer_per_warpgroup: bool) -> list[list[object]]:
    """[128 rows][head_dim] as TMA stores of each warpgroup's boxes would write them, every accumulator element
    tagged by its (row, column) per the wgmma fragment layout: lane l of warp w holds rows 16 w + l / 4 (+ 8 h) and
    columns 8 g + 2 (l % 4) + e in register 4 g + 2 h + e. The backward stages both warpgroups' keys in K's (V's)
    buffer, boxes of 128 rows; the forward gives each warpgroup its own boxes of 64 rows (buffer_per_warpgroup)."""
    boxes = head_dim // BOX_COLUMNS
    box_rows = KEYS_PER_WARPGROUP if buffer_per_warpgroup else 128
    shared: dict[int, object] = {}
    buffers = [{}, {}] if buffer_per_warpgroup else [shared, shared]  # byte offset -> tag of the 16-bit element
    for warpgroup in range(2):
        for warp in range(4):
            # per k16: the four registers each lane gives stmatrix, and the row addresses lanes 8 m .. 8 m + 7 give
            for k16 in range(head_dim // 16):
                first = evaluate(found["first"], k16=k16)
                box = evaluate(found["box"], k16=k16)
                registers, addresses = {}, {}
                for lane in range(32):
                    matrix = lane // 8
                    row = evaluate(found["row"], **helpers, warpgroup=warpgroup, warp=warp, matrix=matrix, lane=lane)
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
    out: list[list[object]] = [[None] * head_dim for _ in range(128)]
    for warpgroup in range(2):
        for box in range(boxes):
            for r in range(KEYS_PER_WARPGROUP):
                row = r if buffer_per_warpgroup else 64 * warpgroup + r  # the row within the staging buffer
                for c in range(BOX_COLUMNS):
                    byte = 2 * c
                    at = box * box_rows * ROW_BYTES + row * ROW_BYTES + ((byte // 16) ^ (row % 8)) * 16 + byte % 16
                    out[64 * warpgroup + r][box * BOX_COLUMNS + c] = buffers[warpgroup].get(at)
    return out


def check(head_dim: int, found: dict[str, object], helpers: dict[str, object] = HELPERS,
          buffer_per_warpgroup: bool = False) -> None:
    out = stored_by_tma(head_dim, found, helpers, buffer_per_warpgroup)
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
            "box": re.search(r"boxes \+ \((.+?)\) \* kOutputBoxBytes", body).group(1),
            "operands": operands,
            "first": re.search(r"x = o \+ (.+?);", body).group(1)}


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_forward_boxes_hold_each_output_element_in_place(head_dim):
    # (d64 does not take the path by default; the formulas are the same template's at any head dim)
    source = rendered_forward(128)
    check(head_dim, forward_formulas(source), {}, buffer_per_warpgroup=True)


@pytest.mark.parametrize("mutation", [
    ("chunk", "(2 * (k16 % 4) + matrix / 2) ^ (row % 4)"),
    ("row", "16 * warp + 8 * (matrix / 2) + lane % 8"),
    ("box", "k16 / 2"),
    ("operands", [(0, 1), (4, 5), (2, 3), (6, 7)]),
])
def test_the_forward_emulation_fails_on_wrong_addresses(mutation):
    found = forward_formulas(rendered_forward(128))
    found[mutation[0]] = mutation[1]
    with pytest.raises(AssertionError):
        check(128, found, {}, buffer_per_warpgroup=True)


def test_which_forward_variants_store_o_by_tma():
    """On by default at d128 (FP8's too): a staging buffer of 128 rows x head_dim x 2 bytes, an O map encoded for the
    output type (FP8's bf16), the exit waiting for the last reads. Off with the option, at d64 (slower there), and where
    the buffer does not fit beside Q and the K/V ring (d256, 3 stages at d128): the stores, no buffer, no O map."""
    def variant(head_dim, dtype="bf16", stages=2, **options):
        tile = resources.default_tile(head_dim, dtype)
        return resources.Resources(KernelConfig(head_dim, dtype, "sm_90a",
                                                TileConfig(tile.block_m, tile.block_n, tile.warps, stages),
                                                options=HopperOptions(**options), forward_only=dtype == "e4m3"))
    source = rendered_forward(128)
    assert "constexpr bool kOutputByTma = true;" in source
    assert "if constexpr (kOutputByTma) {\n    c.store_by_tma(maps, head);\n  } else {\n    c.store(head);" in source
    assert "using TensorMaps = TensorMapsOf<kOutputByTma>;" in source and "CUtensorMap q, k, v, o;" in source
    assert "tensor_map<Output>(&maps.o, o, message, message_size)" in source
    assert "if (!output_map(maps, args, message, message_size)) return int(cudaErrorInvalidValue);" in source
    assert "uint8_t o[kOutputByTma ? 2 : 0][kOutputBoxes * kOutputBoxBytes];" in source
    assert source.count("end_output();") == 2  # the persistent loop's end and the grid's one tile
    assert variant(128).shared_storage_bytes == variant(128, output_by_tma=False).shared_storage_bytes + 128 * 128 * 2
    assert variant(128).output_by_tma and variant(128, "e4m3").output_by_tma
    for off in (variant(128, output_by_tma=False), variant(64), variant(256), variant(128, stages=3)):
        assert not off.output_by_tma
    assert variant(64).shared_storage_bytes == variant(64, output_by_tma=False).shared_storage_bytes
    for stores in (rendered_forward(128, output_by_tma=False), rendered_forward(64), rendered_forward(256)):
        assert "constexpr bool kOutputByTma = false;" in stores  # no buffer bytes, TensorMapsOf<false>: q, k, v
