"""dQ's atomics by whole 128-byte lines (`add_rows_atomically` in the Hopper backward, d256's dQ) without a GPU: the
two exchanges of a warp's accumulator values emulated lane by lane with the kernel's own formulas (quoted from the
rendered source by the last test), checking that every value lands once, at its own row and column, and that each
atomic instruction of the warp covers four whole lines. A wrong source lane, group or span sends a value to another
column; a wrong pairing of quads breaks the lines.

The GPU tests of the same code: `pytest -m gpu tests/test_kernel_backward_gpu.py -k "split_scores or d256"`.
"""

from __future__ import annotations

import pytest

import omnigen
from omnigen.jit import codegen
from omnigen.kernels.sm90 import resources
from omnigen.targets import KernelConfig

RULES = omnigen.Rules(name="hopper", modalities={"text": "causal", "image": "full"})
LINE_FLOATS = 32  # a 128-byte line of fp32


def fragment_position(i: int, lane: int) -> tuple[int, int]:
    """(row within the warp's 16, column) of accumulator register i of `lane` (omnigen/fragment.cuh's layout)."""
    return lane // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (lane % 4) + (i % 2)


# ---- the helper's formulas, one Python line each (the last test finds each in the rendered kernel)
def sources(lane: int) -> tuple[int, int]:
    c, quad = lane % 4, lane & ~3
    first_source = quad + ((3 - c) if c in (1, 2) else c)
    second_source = quad + (1 if c == 0 else 3 if c == 1 else 0 if c == 2 else 2)
    return first_source, second_source


def gather(fragment: dict, span: int, h: int) -> dict:
    """Every lane's float4 after the quad exchange of `span` (16 columns) and row half h."""
    out = {}
    for lane in range(32):
        first_source, second_source = sources(lane)

        def sent(source: int, first: bool) -> tuple:
            sends_upper = source % 4 % 2 == 1  # first_sends_upper of the sending lane
            lower = 8 * span + 2 * h
            upper = lower + 4
            index = (upper if sends_upper else lower) if first else (lower if sends_upper else upper)
            return fragment[source][index], fragment[source][index + 1]

        a, b = sent(first_source, True), sent(second_source, False)
        out[lane] = a + b if lane % 4 < 2 else b + a  # low_half_first = c < 2
    return out


def emulate(columns: int, row_end: int) -> tuple[dict, list]:
    """{(row, column): value} of every atomic addition of one warp (rows 0-15, first_row 0), and per instruction the
    set of (row, line) it touches with how many floats."""
    fragment = {lane: [("v", *fragment_position(i, lane)) for i in range(columns // 2)] for lane in range(32)}
    added, instructions = {}, []
    for h in range(2):
        for pair in range(columns // 32):
            first, second = gather(fragment, 2 * pair, h), gather(fragment, 2 * pair + 1, h)
            kept, sent_values = {}, {}
            for lane in range(32):
                odd_quad = (lane // 4) % 2 == 1
                kept[lane] = second[lane] if odd_quad else first[lane]
                sent_values[lane] = first[lane] if odd_quad else second[lane]
            got = {lane: sent_values[lane ^ 4] for lane in range(32)}
            for which in range(2):  # the two atomic instructions: rows 2k, then 2k + 1
                touched = {}
                for lane in range(32):
                    odd_quad = (lane // 4) % 2 == 1
                    row = (lane // 4 & ~1) + 8 * h + which
                    column = 4 * (lane % 4) + (16 if odd_quad else 0) + 32 * pair
                    four = (got[lane] if odd_quad else kept[lane]) if which == 0 else (kept[lane] if odd_quad else got[lane])
                    if row >= row_end:
                        continue
                    for j in range(4):
                        assert (row, column + j) not in added, "a column added twice"
                        added[row, column + j] = four[j]
                    key = (row, column // LINE_FLOATS)
                    touched[key] = touched.get(key, 0) + 4
                instructions.append(touched)
    return added, instructions


@pytest.mark.parametrize("columns", [32, 64, 128])
def test_every_value_lands_once_at_its_own_row_and_column(columns):
    added, _ = emulate(columns, row_end=16)
    assert len(added) == 16 * columns
    for (row, column), value in added.items():
        assert value == ("v", row, column)


@pytest.mark.parametrize("columns", [32, 64, 128])
def test_each_atomic_instruction_adds_four_whole_lines(columns):
    _, instructions = emulate(columns, row_end=16)
    assert len(instructions) == 2 * 2 * (columns // 32)
    for touched in instructions:
        assert len(touched) == 4 and all(count == LINE_FLOATS for count in touched.values()), touched


def test_rows_past_the_end_are_left_out():
    added, _ = emulate(64, row_end=11)
    assert {row for row, _ in added} == set(range(11)) and len(added) == 11 * 64


def test_the_rendered_kernel_uses_the_emulated_formulas():
    config = KernelConfig(256, "bf16", "sm_90a", resources.default_tile(256))
    backward = codegen.render(RULES, config)[codegen.source_names(RULES, config)["backward"]]
    for text in (
            "const int first_source = quad + ((c == 1 || c == 2) ? 3 - c : c);",
            "const int second_source = quad + (c == 0 ? 1 : c == 1 ? 3 : c == 2 ? 0 : 2);",
            "const bool first_sends_upper = c % 2 == 1, low_half_first = c < 2;",
            "const int lower = 8 * span + 2 * h, upper = lower + 4;",
            "__shfl_sync(0xffffffffu, first_sends_upper ? fragment[upper] : fragment[lower], first_source);",
            "__shfl_sync(0xffffffffu, first_sends_upper ? fragment[lower] : fragment[upper], second_source);",
            "return low_half_first ? make_float4(a0, a1, b0, b1) : make_float4(b0, b1, a0, a1);",
            "const bool odd_quad = (lane / 4) % 2 == 1;",
            "float* lines = columns + 4 * c + (odd_quad ? 16 : 0);",
            "const int row = first_row + (lane / 4 & ~1) + 8 * h;",
            "const float4 kept = odd_quad ? second : first, sent = odd_quad ? first : second;",
            "got.x = __shfl_xor_sync(0xffffffffu, sent.x, 4);",
            "float* at = lines + int64_t(row) * row_stride + 32 * pair;",
            "if (row < row_end) omnigen::atomic_add_four(at, odd_quad ? got : kept);",
            "if (row + 1 < row_end) omnigen::atomic_add_four(at + row_stride, odd_quad ? kept : got);",
            "add_rows_atomically<kColumns, kHalves>(dq, args.dq_accum + row_base * kHeadDim + first_column, kHeadDim,",
            # the head dims a warpgroup adds: alone, its half (128); paired dQ, a quarter (64) per round
            "add_atomically<kDqColumns>(dq, row_start, warpgroup * kDqColumns);",
            "add_under_next_scores<kPairColumns>(dq, row_start, box * kPairColumns, loaded, has_next);"):
        assert text in backward, text
