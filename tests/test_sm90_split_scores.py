"""The d256 Hopper backward's split scores (the split_scores option, issue 30) without a GPU: which query columns of
S^T and dP^T each consumer warpgroup owns, and how P^T and dS^T of the two halves meet in shared memory for dV, dK
and dQ, emulated thread by thread and register by register in float64 with the kernel's own index formulas (each
quoted from the rendered source by the last test, so that the emulation and the kernel cannot drift apart). A wrong
column offset, swizzle chunk, mask-bit shift or run boundary makes the emulated gradients or masks differ from the
dense ones.

The GPU tests of the same kernel: `pytest -m gpu tests/test_kernel_backward_gpu.py -k split_scores`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omnigen
from omnigen.jit import codegen
from omnigen.kernels.sm90 import resources
from omnigen.kernels.sm90.options import HopperOptions
from omnigen.plan.bits import pack_thread_values
from omnigen.targets import ARCH_TABLE, KernelConfig

RULES = omnigen.Rules(name="hopper", modalities={"text": "causal", "image": "full"})
STEP_ROWS, KEYS, BOX_ROW_BYTES = 64, 64, 128
SCORE_COLUMNS = STEP_ROWS // 2  # kScoreColumns with split scores


def d256(**options) -> KernelConfig:
    return KernelConfig(256, "bf16", "sm_90a", resources.default_tile(256), options=HopperOptions(**options))


# ---- the kernel's index formulas (backward.cu.j2 and omnigen/fragment.cuh), one Python line each
def query_offset_of(warpgroup: int) -> int:
    return warpgroup * SCORE_COLUMNS


def column_of(i: int, lane: int) -> int:
    return 8 * (i // 4) + 2 * (lane % 4) + (i % 2)


def half_of(i: int) -> int:
    return (i // 2) % 2


def fragment_rows_columns(warpgroup: int):
    """(thread, register, key row, step query column) of every S^T / dP^T accumulator register of a warpgroup."""
    for warp in range(4):
        for lane in range(32):
            for i in range(SCORE_COLUMNS // 2):
                yield (warp, lane), i, 16 * warp + lane // 4 + 8 * half_of(i), query_offset_of(warpgroup) + column_of(i, lane)


def store_transposed(tile: np.ndarray, written: np.ndarray, values: dict, warpgroup: int) -> None:
    """Consumer::store_transposed: per warp and k16, one stmatrix .x4 whose matrix m takes register m of every lane
    (the pair x[8 k16 + 2 m], x[8 k16 + 2 m + 1]: row lane / 4, columns 2 (lane % 4) + {0, 1} of matrix m) at the
    address lane 8 m + row gives: key row 16 warp + 8 (m % 2) + row, 16-byte chunk (query_offset / 8 + 2 k16 + m / 2)
    ^ (row % 8). `tile`: [64 keys][64 queries] as 128-byte rows of bf16 slots (one float64 per slot here)."""
    for warp in range(4):
        for k16 in range(SCORE_COLUMNS // 16):
            addresses = {}
            for lane in range(32):  # the addresses lanes give (key_block_of = 0: split columns)
                matrix = lane // 8
                row = 16 * warp + 8 * (matrix % 2) + lane % 8
                chunk = (query_offset_of(warpgroup) // 8 + 2 * k16 + matrix // 2) ^ (row % 8)
                addresses[lane] = row * BOX_ROW_BYTES + chunk * 16
            for lane in range(32):
                for m in range(4):
                    for e in range(2):
                        at = addresses[8 * m + lane // 4] + 2 * (2 * (lane % 4) + e)
                        row, slot = divmod(at, BOX_ROW_BYTES)
                        tile[row, slot // 2] = values[(warp, lane), 8 * k16 + 2 * m + e]
                        written[row, slot // 2] += 1


def read_k_major(tile: np.ndarray) -> np.ndarray:
    """What wgmma reads as A (64 keys x 64 queries, K-major, 128-byte swizzle: logical chunk c of row r at c ^ (r % 8))."""
    out = np.empty((KEYS, STEP_ROWS))
    for r in range(KEYS):
        for c in range(STEP_ROWS):
            out[r, c] = tile[r, 8 * ((c // 8) ^ (r % 8)) + c % 8]
    return out


def test_the_warpgroups_own_disjoint_halves_of_the_step():
    owned = np.zeros((KEYS, STEP_ROWS), dtype=int)
    for warpgroup in range(2):
        for _, _, row, column in fragment_rows_columns(warpgroup):
            assert query_offset_of(warpgroup) <= column < query_offset_of(warpgroup) + SCORE_COLUMNS
            owned[row, column] += 1
    assert (owned == 1).all()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rows_inside", [64, 40, 20])
def test_a_split_scores_step_gives_the_dense_gradients(seed, rows_inside):
    """One step of one CTA (64 keys, 64 queries of which `rows_inside` lie inside the sequence, one query row with
    lse = -inf, a random mask), emulated per warpgroup: S^T and dP^T of its query half, P^T and dS^T through the
    shared tiles, dV and dK of its head-dim half from them, dQ of its head-dim half = dS K. Against dense float64."""
    rng = np.random.default_rng(seed)
    D, scale = 256, 256**-0.5
    k, v = rng.standard_normal((KEYS, D)), rng.standard_normal((KEYS, D))
    q, d_o = rng.standard_normal((STEP_ROWS, D)), rng.standard_normal((STEP_ROWS, D))
    q[rows_inside:] = 0  # TMA's zero fill past the end
    d_o[rows_inside:] = 0
    keep = rng.random((KEYS, STEP_ROWS)) < 0.7
    lse = rng.standard_normal(STEP_ROWS) + 3.0
    lse[5] = -np.inf
    delta = rng.standard_normal(STEP_ROWS)
    # Dense reference: queries past the end and the lse = -inf row contribute nothing.
    live = (np.arange(STEP_ROWS) < rows_inside) & np.isfinite(lse)
    s = k @ q.T
    p = np.where(keep & live[None, :], np.exp(s * scale - np.where(live, lse, 0)[None, :]), 0.0)
    dp = v @ d_o.T
    ds = p * (dp - np.where(live, delta, 0)[None, :]) * scale
    expected = {"dv": p @ d_o, "dk": ds @ q, "dq": ds.T @ k}

    p_tile, ds_tile = np.full((KEYS, STEP_ROWS), np.nan), np.full((KEYS, STEP_ROWS), np.nan)
    p_written, ds_written = np.zeros((KEYS, STEP_ROWS), int), np.zeros((KEYS, STEP_ROWS), int)
    for warpgroup in range(2):
        p_values, ds_values = {}, {}
        for thread, i, row, column in fragment_rows_columns(warpgroup):
            inside = column < rows_inside  # load_offsets / score_gradient: ragged steps' columns past the end
            offset = np.inf if not inside or lse[column] == -np.inf else lse[column] * np.log2(np.e)
            score = s[row, column] if keep[row, column] else -np.inf
            p_values[thread, i] = np.exp2(score * scale * np.log2(np.e) - offset)
            ds_values[thread, i] = p_values[thread, i] * (dp[row, column] * scale - (delta[column] if inside else 0) * scale)
        store_transposed(p_tile, p_written, p_values, warpgroup)
        store_transposed(ds_tile, ds_written, ds_values, warpgroup)
    assert (p_written == 1).all() and (ds_written == 1).all()
    p_seen, ds_seen = read_k_major(p_tile), read_k_major(ds_tile)
    got = {name: np.zeros_like(value) for name, value in expected.items()}
    for warpgroup in range(2):
        half = slice(warpgroup * D // 2, (warpgroup + 1) * D // 2)  # column_block_of: this warpgroup's head dims
        got["dv"][:, half] = p_seen @ d_o[:, half]
        got["dk"][:, half] = ds_seen @ q[:, half]
        got["dq"][:, half] = ds_seen.T @ k[:, half]  # issue_query_gradient: dS^T from the shared tile, transposed
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12, atol=1e-12, err_msg=name)


def low_bits(count: int) -> int:
    return 0xFFFFFFFF if count >= 32 else 0 if count <= 0 else (1 << count) - 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mask_bits_reach_each_warpgroups_columns(seed):
    """StepMask::load_bits with query0: the words omnigen.plan.bits packs for a kv-tile (64 keys x a 128-query q-tile,
    transposed), shifted by v = ((row_start + query0) % 128) / 4, give each register of each warpgroup the bit of its
    own (key, query)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(KEYS, 128, generator=gen) < 0.5  # [keys][q-tile queries]
    # pack_thread_values' input: [slots, rows, thread, value] with value v of thread t = column 8 (v / 2) + 2 t + v % 2
    values = torch.zeros(1, KEYS, 4, 32, dtype=torch.bool)
    for t in range(4):
        for value in range(32):
            values[0, :, t, value] = allowed[:, 8 * (value // 2) + 2 * t + value % 2]
    words = pack_thread_values(values)[0, 0].numpy().astype(np.int64) & 0xFFFFFFFF  # [keys][4] (one word a row)
    for step in range(2):  # the q-tile's two 64-row steps: row_start % 128
        row_start = 64 * step
        for warpgroup in range(2):
            v = ((row_start + query_offset_of(warpgroup)) % 128) // 4
            for (_, lane), i, row, column in fragment_rows_columns(warpgroup):
                keep = (int(words[row, lane % 4]) >> (v % 32)) & low_bits(SCORE_COLUMNS // 4)
                bit = (keep >> (2 * (i // 4) + i % 2)) & 1
                assert bit == int(allowed[row, row_start + column]), (step, warpgroup, lane, i)


def columns_below(x: int, lane: int, width: int = SCORE_COLUMNS) -> int:
    y = min(x, width) - 2 * (lane % 4)
    return 0 if y <= 0 else 2 * (y >> 3) + min(y & 7, 2)


@pytest.mark.parametrize("seed", range(6))
def test_runs_of_query_segments_per_warpgroup(seed):
    """StepMask::from_runs with query0: runs of one query segment among the warpgroup's columns (tables read from
    query0 on, positions from row_start + query0), a causal or full rule per run (self_reach 0 or the whole
    sequence), earlier segments of the document seen; against the pair-by-pair predicate. Includes a last step whose
    second half lies wholly past the end (valid <= 0)."""
    rng = np.random.default_rng(seed)
    seq_len = int(rng.integers(70, 128))
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(int(rng.integers(1, 12)))
    segment = np.repeat(np.arange(len(lengths)), lengths)[:seq_len]
    full = rng.random(len(lengths)) < 0.5  # image (full) or text (causal) per segment
    document = np.cumsum(rng.random(len(lengths)) < 0.2)[segment]

    def allowed(query, key):
        if segment[query] == segment[key]:
            return bool(full[segment[query]]) or key <= query
        return segment[key] < segment[query] and document[key] == document[query]

    row_start = 64  # the q-tile's second step: rows 64.. (past seq_len in part, or wholly for the second half)
    tables = np.zeros(STEP_ROWS, dtype=np.int64)
    inside = min(STEP_ROWS, seq_len - row_start)
    tables[:inside] = segment[row_start:row_start + inside]
    for warpgroup in range(2):
        query0 = query_offset_of(warpgroup)
        column_start = row_start + query0
        valid = min(SCORE_COLUMNS, seq_len - column_start)
        starts = [c for c in range(max(valid, 0)) if c == 0 or tables[query0 + c] != tables[query0 + c - 1]]
        for key in rng.integers(0, seq_len, 12):
            for lane in range(32):
                keep = 0
                for n, first in enumerate(starts):
                    nxt = starts[n + 1] if n + 1 < len(starts) else valid
                    run = low_bits(columns_below(nxt, lane)) & ~low_bits(columns_below(first, lane))
                    run_segment = tables[query0 + first]
                    own = run_segment == segment[key]
                    reach = seq_len if full[run_segment] else 0
                    other = not own and run_segment > segment[key] and document[row_start + query0 + first] == document[key]
                    from_reach = ~low_bits(columns_below(int(key) - reach - column_start, lane)) & 0xFFFFFFFF
                    keep |= run if other else (run & from_reach) if own else 0
                for i in range(SCORE_COLUMNS // 2):
                    column = column_of(i, lane)
                    query = column_start + column
                    expected = query < seq_len and allowed(query, int(key))
                    assert ((keep >> (2 * (i // 4) + i % 2)) & 1) == expected, (warpgroup, int(key), lane, i)


def test_the_option_is_on_by_default_and_only_splits_d256():
    assert HopperOptions().split_scores is True and d256().options is None
    on, off = d256(), d256(split_scores=False)
    assert "split_scores0" in off.label and "split_scores" not in on.label
    assert codegen.module_name(RULES, on) != codegen.module_name(RULES, off)
    r = resources.Resources(on)
    assert r.hopper_split_scores and r.hopper_score_columns == 32 and not r.backward_problems()
    assert not resources.Resources(off).hopper_split_scores and resources.Resources(off).hopper_score_columns == 64
    # dS^T once and P^T twice (8 KB each) where the split-columns kernel alone has dS^T twice: 8 KB more, and still
    # inside sm_90a's limit.
    assert r.hopper_shared_storage_bytes == resources.Resources(off).hopper_shared_storage_bytes + 8192
    assert r.hopper_shared_storage_bytes + 1024 <= ARCH_TABLE["sm_90a"].shared_memory
    d128 = KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128), options=HopperOptions(split_scores=True))
    assert not resources.Resources(d128).hopper_split_scores  # 128 keys: no split columns, nothing to split


def test_the_rendered_kernel_uses_the_emulated_formulas():
    """The formulas above, as the rendered split-scores kernel (d256's default) spells them; with the option off it
    renders the 64-column scores and no shared-A key gradient."""
    config = d256()
    backward = codegen.render(RULES, config)[codegen.source_names(RULES, config)["backward"]]
    for text in (
            "constexpr bool kSplitScores = true;", "constexpr int kScoreColumns = 32;",
            "return kSplitScores ? warpgroup * kScoreColumns : 0;",
            "const int chunk = (query_offset_of(warpgroup) / 8 + 2 * k16 + matrix / 2) ^ (row % 8);",
            "const int row = int(sm90::opaque(uint32_t(key_block_of(warpgroup) * kKeysPerWarpgroup + 16 * warp + 8 * (matrix % 2) + lane % 8)));",
            "const int v = ((row_start + query0) % kBlockM) / 4;",
            "keep[h] = (word >> (v % 32)) & low_bits(kScoreColumns / 4, 0);",
            "const int column_start = row_start + query0;",
            "const RunStarts<kScoreColumns> starts(rows.segment + query0, valid, lane);",
            "const int segment = rows.segment[query0 + first], document = rows.document[query0 + first];",
            "columns_below<kScoreColumns>(key - rule.self_reach - column_start, lane)",
            "sm90::opaque(sm90::shared_address(b_tile) + query_offset_of(warpgroup) * sm90::kBoxRowBytes), 16, 1024);",
            "const int column_start = row_start + query_offset_of(warpgroup);",
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",
            "void wgmma_key_gradient_from_shared(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {",
            "wgmma_key_gradient_from_shared(gradient, sm90::advance(a0, k16 * 32), sm90::advance(b0, k16 * 16 * sm90::kBoxRowBytes), 1);",
            "alignas(1024) uint8_t p[kPBuffers][kDsBytes];"):
        assert text in backward, text
    off = d256(split_scores=False)
    default = codegen.render(RULES, off)[codegen.source_names(RULES, off)["backward"]]
    assert "constexpr bool kSplitScores = false;" in default and "m64n64k16.f32.bf16.bf16" in default
    assert "m64n32k16" not in default and "void wgmma_key_gradient_from_shared(float (&d)[64], uint64_t a, uint64_t b, int accumulate);" in default


def test_the_option_changes_constants_and_wgmma_shapes_only():
    """As tests/test_template_shape.py asks of every Hopper option: split scores change the rendered backward only
    where a constant is declared, in comments, and in the variant's wgmma instruction definitions (their register
    lists follow N: m64n32 scores, the shared-A key gradient); the code paths are C++ branches on kSplitScores."""
    import difflib
    import re

    def code(config):
        names = codegen.source_names(RULES, config)
        text = codegen.render(RULES, config)[names["backward"]]
        text = text.replace(codegen.module_name(RULES, config), "MODULE").replace(config.label, "LABEL")
        ops = re.compile(r"// ---- wgmma instructions of this variant.*?// ---- the consumer's view", re.S)
        return ops.sub("", text).splitlines()

    diff = [line[1:] for line in difflib.unified_diff(code(d256(split_scores=False)), code(d256()), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    other = [line for line in diff if not line.lstrip().startswith("//") and "constexpr" not in line
             and "static_assert(sizeof(SharedStorage)" not in line]
    assert diff and not other, other[:6]
