"""The Hopper backward's dQ staging by stmatrix, and the conversion pass that undoes its column order, without a GPU.

A consumer warp writes its dQ accumulator (16 query rows x its head dims, fp32) into 128-byte-swizzled boxes of
[16 rows][32 fp32] by stmatrix, one fp32 a register; TMA adds each box into dq_accum as it lies. So dq_accum holds
each 8-column group as 0, 2, 4, 6, 1, 3, 5, 7, and the conversion pass (omnigen/delta.cuh, `interleaved`) must put
every value back at its column. The formulas are quoted from the rendered kernel and the header, and an emulation
of stmatrix, the TMA box and the conversion checks every element lands where it belongs; wrong formulas fail it.

The GPU tests of the same path: every Hopper backward case of `pytest -m gpu tests/test_kernel_backward_gpu.py`.
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

ROW_BYTES = 128
BOX_COLUMNS = 32  # fp32 columns of a box row
BOX_BYTES = 16 * ROW_BYTES  # [16 rows][32 fp32]: a warp's rows
DELTA_HEADER = Path(__file__).parents[1] / "omnigen/kernels/common/include/omnigen/delta.cuh"


def rendered_backward(head_dim: int) -> str:
    config = KernelConfig(head_dim, "bf16", "sm_90a", resources.default_tile(head_dim))
    return codegen.render(TRANSFUSION, config)[codegen.source_names(TRANSFUSION, config)["backward"]]


def formulas(source: str) -> dict[str, object]:
    """stage()'s row, chunk and box expressions and its stmatrix operands, as the kernel spells them."""
    start = source.index("void stage(const float (&dq)")
    body = source[start:source.index("\n  }\n", start)]
    operands = re.search(r"store_matrices\(.*?,\s*x\[(\d)\], x\[(\d)\], x\[(\d)\], x\[(\d)\]\);", body, re.S).groups()
    row = re.search(r"const int row = (.+?);", body).group(1)
    opaque = re.fullmatch(r"int\(sm90::opaque\(uint32_t\((.+)\)\)\)", row)  # (a value kept from hoisting)
    return {"row": opaque.group(1) if opaque else row,
            "chunk": re.search(r"const int chunk = (.+?);", body).group(1),
            "box": re.search(r"staging_box\((.+?)\)", body).group(1),
            "first": re.search(r"const float\* x = dq \+ (.+?);", body).group(1),
            "operands": [int(i) for i in operands]}


def conversion_order() -> list[tuple[str, str]]:
    """The interleaved branch's pack operands, in output order: ('low', 'x'), ('high', 'x'), ..."""
    text = DELTA_HEADER.read_text()
    branch = text[text.index("args.interleaved"):]
    branch = branch[:branch.index(":")]
    return re.findall(r"(low|high)\.([xyzw])", branch)


def staged_columns(columns: int, found: dict[str, object]) -> list[list[object]]:
    """One warp's 16 rows x `columns` of dq_accum after the boxes are added as they lie, each value tagged with the
    (row, column) the wgmma fragment gave it: lane l holds rows l / 4 (+ 8 h) and columns 8 p + 2 (l % 4) + e in
    register 4 p + 2 h + e."""
    buffer: dict[int, tuple[int, int]] = {}  # byte offset over the warp's boxes -> tag of the fp32 there
    for pair in range(columns // 8):
        first = evaluate(found["first"], pair=pair)
        box = evaluate(found["box"], pair=pair)
        addresses, registers = {}, {}
        for lane in range(32):
            matrix = lane // 8
            row = evaluate(found["row"], matrix=matrix, lane=lane)
            chunk = evaluate(found["chunk"], pair=pair, matrix=matrix, row=row)
            addresses[lane] = box * BOX_BYTES + row * ROW_BYTES + chunk * 16
            tags = []
            for index in found["operands"]:
                i = first + index
                group, h, e = i // 4, (i % 4) // 2, i % 2
                tags.append([(lane // 4 + 8 * h, 8 * group + 2 * (lane % 4) + e)])  # one fp32 a register
            registers[lane] = tags
        store_matrices(buffer, addresses, registers)
    # a TMA box of [16][32] fp32 with the 128-byte swizzle: element (r, c) at chunk (4 c / 16) ^ (r % 8) of row r
    out: list[list[object]] = [[None] * columns for _ in range(16)]
    for box in range(columns // BOX_COLUMNS):
        for r in range(16):
            for c in range(BOX_COLUMNS):
                at = box * BOX_BYTES + r * ROW_BYTES + (((4 * c) // 16) ^ (r % 8)) * 16 + (4 * c) % 16
                out[r][box * BOX_COLUMNS + c] = buffer.get(at)
    return out


def converted(row: list[object], order: list[tuple[str, str]]) -> list[object]:
    """The conversion's output row: each 8-column chunk read as low (4 fp32) and high (4 fp32), packed in `order`."""
    lanes = "xyzw"
    out = []
    for chunk in range(len(row) // 8):
        values = {"low": row[8 * chunk:8 * chunk + 4], "high": row[8 * chunk + 4:8 * chunk + 8]}
        out.extend(values[half][lanes.index(lane)] for half, lane in order)
    return out


def check(columns: int, found: dict[str, object], order: list[tuple[str, str]]) -> None:
    staged = staged_columns(columns, found)
    for r in range(16):
        row = converted(staged[r], order)
        for column in range(columns):
            assert row[column] == (r, column), (r, column, row[column])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_each_dq_value_reaches_its_column(head_dim):
    # (a warp computes 64 head dims a step at both: all of d64's in turns, half of d128's; here every head dim)
    check(head_dim, formulas(rendered_backward(head_dim)), conversion_order())


def test_the_columns_are_interleaved_before_conversion():
    """Without the conversion's reordering the staged rows are not dQ: the pass is what makes them right."""
    with pytest.raises(AssertionError):
        check(64, formulas(rendered_backward(128)), [("low", "x"), ("low", "y"), ("low", "z"), ("low", "w"),
                                                      ("high", "x"), ("high", "y"), ("high", "z"), ("high", "w")])


@pytest.mark.parametrize("mutation", [
    ("chunk", "(2 * (pair % 4) + matrix % 2) ^ (row % 4)"),  # the 64-byte swizzle's period
    ("chunk", "(2 * (pair % 4) + matrix / 2) ^ (row % 8)"),  # column halves from the row bit
    ("row", "8 * (matrix % 2) + lane % 8"),  # row halves from the column bit
    ("operands", [0, 2, 1, 3]),  # matrices 1 and 2 swapped
    ("box", "pair / 2"),
])
def test_the_emulation_fails_on_wrong_addresses(mutation):
    found = formulas(rendered_backward(128))
    found[mutation[0]] = mutation[1]
    with pytest.raises(AssertionError):
        check(64, found, conversion_order())


def test_a_module_without_the_conversion_pass_reorders_on_the_host():
    """convert_gradient's fallback (a stand-in module with no CONVERT_LAUNCH copies with torch) undoes the same
    interleaving as the pass."""
    import torch

    from omnigen.kernels.launch import convert_gradient

    stand_in = type("StandIn", (), {})()
    source = torch.randn(2, 3, 5, 64)
    interleaved = source.view(2, 3, 5, 8, 4, 2).transpose(-1, -2).reshape(2, 3, 5, 64)
    assert interleaved[0, 0, 0, :8].tolist() == source[0, 0, 0, [0, 2, 4, 6, 1, 3, 5, 7]].tolist()
    out = convert_gradient(stand_in, interleaved, torch.empty(2, 3, 5, 64, dtype=torch.bfloat16), interleaved=True)
    assert torch.equal(out, source.to(torch.bfloat16))
    assert not torch.equal(convert_gradient(stand_in, interleaved, torch.empty_like(out)), out)
