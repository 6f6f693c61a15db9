"""The sm80 kernels' reading of partial tiles' bits (include/omnigen/sm80/partial_bits.cuh), without a GPU.

The slots (omnigen.plan.bits) are laid out for the sm90 kernels; the sm80 kernels read the same words with their
mma.sync fragments: the forward and the dQ kernel hold query rows first_row + 16 a + 8 h, dkdv_kernel key rows of S^T,
and the dQ kernel reads the backward's transposed slots across. Here every thread of each kernel is emulated (its
rows, columns and steps as the templates give them, from the variant's constants) through the header's own index
functions, compiled for the host by nvcc, and through a Python transcription of them that runs everywhere: each
must find every element of random tiles, packed by plan.tile_bits, exactly once and right.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from omnigen.jit import codegen
from omnigen.kernels.sm80 import resources
from omnigen.kernels.sm80.space import DEFAULT_SPACE
from omnigen.plan.ruleless import RULELESS_RULES
from omnigen.plan.tile_bits import pack
from omnigen.rules import Rules
from omnigen.targets import KernelConfig, TileConfig

ROOT = Path(__file__).resolve().parent.parent
HAS_NVCC = shutil.which("nvcc") is not None
STEP_ROWS = resources.Resources.BACKWARD_STEP_ROWS

# Every tile of the sm80 candidate space (and a few more shapes the templates accept), at the head dims that change
# a kernel's steps (the forward's half-tiles at d128 and d256).
TILES = sorted({t for tiles in DEFAULT_SPACE.values() for t in tiles} | {TileConfig(64, 16, 4, 2), TileConfig(128, 32, 8, 2),
                                                                          TileConfig(64, 256, 4, 2)},
               key=lambda t: (t.block_m, t.block_n, t.warps, t.stages))
CASES = [(t, d) for t in TILES for d in (64, 128, 256)]


# ---- the header's index functions, transcribed (FragmentBits, TransposedBits, SlotShape) -----------------------------


def value_of(column: int) -> int:
    return 2 * (column // 8) + column % 2


def word_offset(rows: int, row: int, t: int, v: int) -> int:
    return ((v // 32) * rows + row) * 4 + t


def fragment_kept(slot: list[int], rows: int, span: int, first_row: int, first_column: int, lane: int, a: int, n: int,
                  e: int) -> bool:
    """FragmentBits<rows, columns, blocks, span>::load then kept(a, n, e)."""
    words = -(-span // 128)
    shift = (first_column // 4) % 32 if words == 1 else 0
    v = 2 * n + e % 2
    word = slot[word_offset(rows, first_row + 16 * a + 8 * (e // 2), lane % 4, first_column // 4 + 32 * (v // 32))]
    return bool(((word & 0xFFFFFFFF) >> shift >> (v % 32)) & 1)


def transposed_kept(slot: list[int], rows: int, first_row: int, first_key: int, lane: int, n: int, e: int) -> bool:
    """TransposedBits<rows, columns, span>::load then kept(n, e)."""
    c = e % 2
    word = slot[word_offset(rows, first_key + 8 * n + 2 * (lane % 4) + c, (first_row % 8) // 2, value_of(first_row))]
    return bool(((word & 0xFFFFFFFF) >> (value_of(first_row) % 32) >> (2 * (e // 2))) & 1)


# ---- the kernels' threads (constants as forward.cu.j2 / backward.cu.j2 derive them) ---------------------------------


def forward_elements(config: KernelConfig):
    """(warp, lane, first_row, step_key, a, n, e, query row, key column) of every score the forward masks."""
    t = config.tile
    rows_per_warp, keys = t.block_m // t.warps, resources.Resources(config).keys_per_step
    for warp in range(t.warps):
        for lane in range(32):
            first_row = warp * rows_per_warp + lane // 4
            for step_key in range(0, t.block_n, keys):
                for a in range(rows_per_warp // 16):
                    for n in range(keys // 8):
                        for e in range(4):
                            yield (lane, first_row, step_key, keys, a, n, e, first_row + 16 * a + 8 * (e // 2),
                                   step_key + 8 * n + 2 * (lane % 4) + e % 2)


def dkdv_elements(config: KernelConfig):
    """(lane, key_row, first_query, span, m, n, e, key, query of the q-tile) of every S^T score dkdv_kernel masks."""
    t = config.tile
    warps = t.block_n // 16
    score_keys = min(t.block_n, 32)
    key_warps = t.block_n // score_keys
    score_queries = STEP_ROWS // (warps // key_warps)
    for part in range(t.block_m // STEP_ROWS):
        for warp in range(warps):
            for lane in range(32):
                key_row = (warp % key_warps) * score_keys + lane // 4
                first_query = part * STEP_ROWS + (warp // key_warps) * score_queries
                for m in range(score_keys // 16):
                    for n in range(score_queries // 8):
                        for e in range(4):
                            yield (lane, key_row, first_query, score_queries, m, n, e, key_row + 16 * m + 8 * (e // 2),
                                   first_query + 8 * n + 2 * (lane % 4) + e % 2)


def dq_elements(config: KernelConfig):
    """(lane, first_row, step_key, n, e, query row, key column) of every score the dQ kernel masks."""
    t = config.tile
    keys = min(t.block_n, 64)
    for warp in range(t.block_m // 16):
        for lane in range(32):
            first_row = warp * 16 + lane // 4
            for step_key in range(0, t.block_n, keys):
                for n in range(keys // 8):
                    for e in range(4):
                        yield lane, first_row, step_key, n, e, first_row + 8 * (e // 2), step_key + 8 * n + 2 * (lane % 4) + e % 2


def _tile(block_m: int, block_n: int, seed: int) -> torch.Tensor:
    return torch.rand(block_m, block_n, generator=torch.Generator().manual_seed(seed)) < 0.5


@pytest.mark.parametrize("tile,head_dim", CASES, ids=[f"{t.label}_d{d}" for t, d in CASES])
def test_each_kernel_reads_every_element_of_a_slot_once(tile, head_dim):
    config = KernelConfig(head_dim, "bf16", "sm_80", tile)
    if resources.Resources(config).problems():
        pytest.skip("not a variant the sm80 templates build")
    bm, bn = tile.block_m, tile.block_n
    blocks = _tile(bm, bn, seed=bm * 1000 + bn)
    forward = pack(blocks[None]).reshape(-1).tolist()
    backward = pack(blocks[None], transposed=True).reshape(-1).tolist()

    seen = torch.zeros(bm, bn, dtype=torch.int32)
    for lane, first_row, step_key, keys, a, n, e, row, column in forward_elements(config):
        assert fragment_kept(forward, bm, keys, first_row, step_key, lane, a, n, e) == bool(blocks[row, column])
        seen[row, column] += 1
    assert bool((seen == 1).all()), "the forward's threads must cover the tile once"

    if resources.Resources(config).backward_problems():
        return
    seen.zero_()
    for lane, key_row, first_query, span, m, n, e, key, query in dkdv_elements(config):
        assert fragment_kept(backward, bn, span, key_row, first_query, lane, m, n, e) == bool(blocks[query, key])
        seen[query, key] += 1
    assert bool((seen == 1).all()), "dkdv_kernel's threads must cover the tile once"
    seen.zero_()
    for lane, first_row, step_key, n, e, row, column in dq_elements(config):
        assert transposed_kept(backward, bn, first_row, step_key, lane, n, e) == bool(blocks[row, column])
        seen[row, column] += 1
    assert bool((seen == 1).all()), "the dQ kernel's threads must cover the tile once"


def test_a_wrong_index_is_caught():
    """The emulation is not vacuous: reading the forward's slot as if it were the transposed one fails."""
    config = KernelConfig(64, "bf16", "sm_80", TileConfig(128, 64, 4, 2))
    blocks = _tile(128, 64, seed=3)
    forward = pack(blocks[None]).reshape(-1).tolist()
    wrong = sum(transposed_kept(forward, 64, first_row, step_key, lane, n, e) != bool(blocks[row, column])
                for lane, first_row, step_key, n, e, row, column in dq_elements(config) if column < 64 and row < 64)
    assert wrong > 0


# ---- which modules render the bits' paths ---------------------------------------------------------------------------


def test_only_modules_of_masks_made_from_data_read_bits():
    """Modules of rules keep their code (kPartialBits false: the bits' paths are not compiled, PARTIAL_BITS False);
    the module of masks made from data reads them (the op no longer refuses such masks on sm80)."""
    config = KernelConfig(64, "bf16", "sm_80", TileConfig(128, 64, 4, 2))
    rules = Rules.load(ROOT / "examples" / "rules" / "transfusion.yaml")
    for which, expected in ((rules, "false"), (RULELESS_RULES, "true")):
        sources = codegen.render(which, config)
        shared = next(text for name, text in sources.items() if name.endswith("_shared.cuh"))
        binding = next(text for name, text in sources.items() if name.endswith("_binding.cpp"))
        assert f"constexpr bool kPartialBits = {expected};" in shared
        assert f"constexpr bool kPartialBits = {expected};" in binding


# ---- with nvcc: the header itself, and a module of masks made from data ---------------------------------------------

HOST_CHECK = r"""
#include <cstdio>
#include "omnigen/sm80/partial_bits.cuh"
// Prints, per case, the element mask each kernel's threads read, in the order the test lists them.
template <int kM, int kN, int kRowsPerWarp, int kKeys, int kScoreKeys, int kScoreQueries, int kDqKeys>
void run(const unsigned* fwd, const unsigned* bwd) {
  using Fwd = omnigen::FragmentBits<kM, kN, kRowsPerWarp / 16, kKeys>;
  for (int warp = 0; warp < kM / kRowsPerWarp; ++warp)
    for (int lane = 0; lane < 32; ++lane)
      for (int step = 0; step < kN; step += kKeys) {
        const int first_row = warp * kRowsPerWarp + lane / 4;
        Fwd bits;
        for (int a = 0; a < kRowsPerWarp / 16; ++a)
          for (int h = 0; h < 2; ++h)
            for (int w = 0; w < Fwd::kWords; ++w) bits.word[a][h][w] = fwd[Fwd::offset(a, h, w, first_row, step, lane)] >> Fwd::shift(step);
        for (int a = 0; a < kRowsPerWarp / 16; ++a)
          for (int n = 0; n < kKeys / 8; ++n)
            for (int e = 0; e < 4; ++e) std::printf("%d", int(bits.kept(a, n, e)));
      }
  std::printf("\n");
  using Dkdv = omnigen::FragmentBits<kN, kM, kScoreKeys / 16, kScoreQueries>;
  constexpr int kWarps = kN / 16, kKeyWarps = kN / kScoreKeys;
  for (int part = 0; part < kM / 64; ++part)
    for (int warp = 0; warp < kWarps; ++warp)
      for (int lane = 0; lane < 32; ++lane) {
        const int key_row = (warp % kKeyWarps) * kScoreKeys + lane / 4;
        const int first_query = part * 64 + (warp / kKeyWarps) * kScoreQueries;
        Dkdv bits;
        for (int m = 0; m < kScoreKeys / 16; ++m)
          for (int h = 0; h < 2; ++h)
            for (int w = 0; w < Dkdv::kWords; ++w) bits.word[m][h][w] = bwd[Dkdv::offset(m, h, w, key_row, first_query, lane)] >> Dkdv::shift(first_query);
        for (int m = 0; m < kScoreKeys / 16; ++m)
          for (int n = 0; n < kScoreQueries / 8; ++n)
            for (int e = 0; e < 4; ++e) std::printf("%d", int(bits.kept(m, n, e)));
      }
  std::printf("\n");
  using Dq = omnigen::TransposedBits<kN, kM, kDqKeys>;
  for (int warp = 0; warp < kM / 16; ++warp)
    for (int lane = 0; lane < 32; ++lane)
      for (int step = 0; step < kN; step += kDqKeys) {
        const int first_row = warp * 16 + lane / 4;
        Dq bits;
        for (int n = 0; n < kDqKeys / 8; ++n)
          for (int c = 0; c < 2; ++c) bits.word[n][c] = bwd[Dq::offset(n, c, first_row, step, lane)] >> Dq::shift(first_row);
        for (int n = 0; n < kDqKeys / 8; ++n)
          for (int e = 0; e < 4; ++e) std::printf("%d", int(bits.kept(n, e)));
      }
  std::printf("\n");
}
"""

# (tile, head dim) cases compiled into the host check.
HOST_CASES = [(TileConfig(128, 64, 4, 2), 64), (TileConfig(128, 128, 8, 2), 128), (TileConfig(64, 64, 4, 2), 128),
              (TileConfig(64, 128, 4, 2), 64)]


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_the_header_reads_what_the_emulation_reads(tmp_path):
    """partial_bits.cuh's own offset / shift / kept, compiled for the host, against the tiles: a wrong index in the
    header (not only in the transcription above) fails here."""
    from omnigen import kernels

    calls, data, expected = [], [], []
    for index, (tile, head_dim) in enumerate(HOST_CASES):
        config = KernelConfig(head_dim, "bf16", "sm_80", tile)
        bm, bn = tile.block_m, tile.block_n
        blocks = _tile(bm, bn, seed=index)
        fwd = pack(blocks[None]).reshape(-1).tolist()
        bwd = pack(blocks[None], transposed=True).reshape(-1).tolist()
        data.append(f"static const unsigned fwd{index}[] = {{{', '.join(str(x & 0xFFFFFFFF) + 'u' for x in fwd)}}};\n"
                    f"static const unsigned bwd{index}[] = {{{', '.join(str(x & 0xFFFFFFFF) + 'u' for x in bwd)}}};\n")
        score_keys = min(bn, 32)
        score_queries = STEP_ROWS // ((bn // 16) // (bn // score_keys))
        keys = resources.Resources(config).keys_per_step
        calls.append(f"  run<{bm}, {bn}, {bm // tile.warps}, {keys}, {score_keys}, {score_queries}, {min(bn, 64)}>"
                     f"(fwd{index}, bwd{index});\n")
        expected.append("".join(str(int(blocks[r, c])) for *_, r, c in forward_elements(config)))
        expected.append("".join(str(int(blocks[q, k])) for *_, k, q in dkdv_elements(config)))
        expected.append("".join(str(int(blocks[r, c])) for *_, r, c in dq_elements(config)))
    source = tmp_path / "check.cu"
    source.write_text(HOST_CHECK + "".join(data) + "int main() {\n" + "".join(calls) + "  return 0;\n}\n")
    includes = [f"-I{d}" for d in kernels.family_of(KernelConfig(64, "bf16", "sm_80", HOST_CASES[0][0])).include_dirs]
    binary = tmp_path / "check"
    subprocess.run(["nvcc", "-std=c++17", "-O1", *includes, "-o", str(binary), str(source)], check=True,
                   capture_output=True, text=True)
    lines = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()
    assert lines == expected


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_the_sm80_module_of_masks_made_from_data_builds_and_reads_bits(tmp_path, monkeypatch):
    """The sm_80 variant with the bits' paths on compiles (forward, dK/dV, dQ), within the family's spill allowances,
    and says PARTIAL_BITS, so the op hands it a mask made from data instead of refusing."""
    from omnigen.jit import cache
    from omnigen.kernels import family_of
    from omnigen.kernels.launch import capabilities

    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path))
    config = KernelConfig(64, "bf16", "sm_80", TileConfig(128, 64, 4, 2))
    [result] = cache.build_variants([cache.variant(RULELESS_RULES, config)])
    assert result.built
    built = result.meta["ptxas"]["kernels"]
    assert sum(name in n for n in built for name in ("forward_kernel", "dkdv_kernel", "dq_kernel")) == 3
    assert not any(family_of(config).excess_spill_bytes(n, k) for n, k in built.items()), built
    module = cache.get_module(RULELESS_RULES, config)
    assert capabilities(module).partial_bits and module.HAS_BACKWARD
