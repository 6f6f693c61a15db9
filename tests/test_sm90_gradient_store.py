"""The Hopper backward's dK/dV epilogue by TMA (store_gradients_by_tma) without a GPU: each warpgroup's accumulator
fragments, written by stmatrix at the addresses the rendered kernel computes (its formulas quoted from the source),
land where a TMA store of [64 keys][64 head dims] boxes with the 128-byte swizzle reads each element, so the tensor
in global memory is dK (dV) itself; wrong swizzles or row halves fail the same check. Also: which variants take the
path (element-type gradients of one kv head per query head, not split columns).

The GPU tests of the same epilogue: `pytest -m gpu tests/test_kernel_backward_gpu.py` (every MHA case stores this
way; GQA keeps the fp32 stores).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from omnigen.jit import codegen
from omnigen.kernels.sm90 import resources
from omnigen.targets import KernelConfig

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


def stored_gradient(head_dim: int, found: dict[str, object]) -> list[list[int | None]]:
    """[128 keys][head_dim] as a TMA store of each warpgroup's boxes would write it, every accumulator element
    tagged by its (key, head dim) per the wgmma fragment layout: lane l of warp w holds rows 16 w + l / 4 (+ 8 h) and
    columns 8 g + 2 (l % 4) + e in register 4 g + 2 h + e."""
    boxes = head_dim // BOX_COLUMNS
    buffer: dict[int, tuple[int, int]] = {}  # byte offset in K's buffer -> tag of the 16-bit element there
    for warpgroup in range(2):
        for warp in range(4):
            # per k16: the four registers each lane gives stmatrix, and the row addresses lanes 8 m .. 8 m + 7 give
            for k16 in range(head_dim // 16):
                first = evaluate(found["first"], k16=k16)
                box = evaluate(found["box"], k16=k16)
                registers, addresses = {}, {}
                for lane in range(32):
                    matrix = lane // 8
                    row = evaluate(found["row"], **HELPERS, warpgroup=warpgroup, warp=warp, matrix=matrix, lane=lane)
                    chunk = evaluate(found["chunk"], k16=k16, matrix=matrix, row=row)
                    addresses[lane] = box * BOX_BYTES + row * ROW_BYTES + chunk * 16
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
                store_matrices(buffer, addresses, registers)
    # TMA store of box b, rows 64 w on: element (r, c) of the box sits at chunk (2 c / 16) ^ (r % 8) of its row
    out: list[list[object]] = [[None] * head_dim for _ in range(128)]
    for warpgroup in range(2):
        for box in range(boxes):
            for r in range(KEYS_PER_WARPGROUP):
                row = 64 * warpgroup + r
                for c in range(BOX_COLUMNS):
                    byte = 2 * c
                    at = box * BOX_BYTES + row * ROW_BYTES + ((byte // 16) ^ (row % 8)) * 16 + byte % 16
                    out[row][box * BOX_COLUMNS + c] = buffer.get(at)
    return out


def check(head_dim: int, found: dict[str, object]) -> None:
    out = stored_gradient(head_dim, found)
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
