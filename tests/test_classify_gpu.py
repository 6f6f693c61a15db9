"""The Triton path of making a mask from data (omnigen/plan/classify_gpu.py) against the torch path: the same kinds,
schedules, partial tiles' bits and pair counts, bit for bit, for the catalogue's mods and random dense masks, with
several slabs, slot buffers that must grow, tile shapes of any multiple of 16 and every kind of `partial_bits`.

On a CPU the kernels run in Triton's interpreter, in a child process (TRITON_INTERPRET must be set before Triton
compiles anything); on CUDA (`gpu`) compiled, with the path switched on and off in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import omnigen
from omnigen.mask_catalogue import NAMES, catalogue_mask
from omnigen.plan import classify_gpu, ruleless

TESTS = Path(__file__).resolve().parent
TILES = [(128, 64), (64, 128), (112, 48)]  # 112 x 48: blocks that are not powers of two


def _same_masks(fused: omnigen.Mask, torch_made: omnigen.Mask, what: str) -> None:
    assert fused.tiles == torch_made.tiles, what
    for n, (a, b) in enumerate(zip(fused.schedules, torch_made.schedules)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: schedule tensor {n} differs"
    for shape in fused.tiles:
        assert fused.plan(*shape).allowed_pairs == torch_made.plan(*shape).allowed_pairs, what


def _both(make, monkeypatch_supported) -> tuple[omnigen.Mask, omnigen.Mask]:
    """(mask made through classify_gpu, mask made in torch)."""
    original = classify_gpu.supported
    classify_gpu.supported = monkeypatch_supported
    try:
        fused = make()
    finally:
        classify_gpu.supported = original
    classify_gpu.supported = lambda device: False
    try:
        return fused, make()
    finally:
        classify_gpu.supported = original


def compare_paths(device: str, B: int, S: int, names: tuple[str, ...]) -> int:
    """Every comparison of this file on `device` (the interpreter's child calls it too); the cases compared."""
    device = torch.device(device)
    on = (lambda d: True) if device.type == "cpu" else (lambda d: d.type == "cuda")
    slab_budget = ruleless.SLAB_ELEMENTS, ruleless.GPU_SLAB_ELEMENTS
    slot_bytes = classify_gpu.SLOT_BUFFER_BYTES
    cases = 0
    try:
        for name in names:
            mod = catalogue_mask(name, B, S, device).mask_mod
            # one slab, then slabs of a few block-rows with slot buffers of one slot (the host grows them)
            for slab, slots in ((1 << 26, 1 << 26), (S * 256, 1)):
                ruleless.SLAB_ELEMENTS = ruleless.GPU_SLAB_ELEMENTS = slab
                classify_gpu.SLOT_BUFFER_BYTES = slots
                fused, made = _both(lambda: omnigen.mask_from_mod(mod, B, S, device, tiles=TILES), on)
                _same_masks(fused, made, f"{name}, slab {slab}, slot buffer {slots}")
                cases += 1
        gen = torch.Generator().manual_seed(0)
        for density, partial_bits in ((0.02, "exact"), (0.5, "all"), (0.98, B * S)):
            # (half the length: nearly every tile of these is partial, each one slow to pack in the interpreter)
            dense = (torch.rand(B, S // 2, S // 2, generator=gen) < density).to(device)
            fused, made = _both(lambda: omnigen.mask_from_dense(dense, tiles=TILES, partial_bits=partial_bits), on)
            _same_masks(fused, made, f"random {density}, partial_bits={partial_bits}")
            cases += 1
    finally:
        ruleless.SLAB_ELEMENTS, ruleless.GPU_SLAB_ELEMENTS = slab_budget
        classify_gpu.SLOT_BUFFER_BYTES = slot_bytes
    return cases


def test_the_triton_path_matches_torch_in_the_interpreter():
    pytest.importorskip("triton")
    names = ("global_sliding_window", "random_eviction", "medusa_tree")
    # (rows 64 at a time, not ROW_CHUNK's 16: the interpreter's time goes by steps; 128-row tiles still take two.
    # S = 208, a multiple of 16: the mods' slabs take the aligned rows' path, the dense masks (S / 2) the other.)
    child = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_classify_gpu as t; "
             f"t.classify_gpu.ROW_CHUNK = 64; print('cases', t.compare_paths('cpu', 2, 208, {names!r}))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS.parent),
                                                                               os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cases 9" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B,S", [(2, 1000), (4, 2048)])
def test_the_triton_path_matches_torch_on_cuda(B, S):
    assert classify_gpu.supported(torch.device("cuda")) or not classify_gpu.ENABLED
    assert compare_paths("cuda", B, S, NAMES) == 2 * len(NAMES) + 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_triton_path_at_the_benchmarks_size_and_default_tiles():
    for name in ("global_sliding_window", "random_eviction", "medusa_tree"):
        mod = catalogue_mask(name, 4, 8192, "cuda").mask_mod
        fused, made = _both(lambda: omnigen.mask_from_mod(mod, 4, 8192, "cuda", head_dim=128, dtype=torch.bfloat16),
                            lambda d: d.type == "cuda")
        _same_masks(fused, made, name)
