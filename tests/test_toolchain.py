"""Toolchain discovery, arch flags, error messages, and (with nvcc) real builds for sm_80 and sm_90a.

Tests marked `nvcc` compile; CI has nvcc, so they run there. This file compiles five variants once
(one sm_80, one sm_90a, the sm_90a one with the sm90 forward's options that are on by default turned off, the
d256 split-columns Hopper backward, and a d64 Hopper backward with its step and grid options off; in one
parallel ninja run) into a private cache, the sm_80 one forward-only, and the sm90 FP8 forward at two kv-tiles.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import omnigen
from omnigen.kernels import family_of
from omnigen.jit import cache
from omnigen.jit.codegen import source_names
from omnigen.jit import toolchain as tools
from omnigen.cli import cli
from omnigen.targets import KernelConfig, TileConfig

from kernel_cases import with_options  # the GPU tests' helper for sm90 options

REPO = Path(__file__).resolve().parent.parent
HAS_NVCC = shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc") or bool(os.environ.get("CUDA_HOME"))

RULES = omnigen.Rules(name="buildtest", modalities={"text": "causal", "image": "full"})
# A small tile: the fastest compile that still exercises every code path.
SMALL_TILE = TileConfig(block_m=64, block_n=64, warps=4, stages=2)
SM80 = KernelConfig(head_dim=64, dtype="bf16", arch="sm_80", tile=SMALL_TILE)
SM90A = KernelConfig(head_dim=64, dtype="bf16", arch="sm_90a", tile=TileConfig(128, 64, 12, 2))  # the sm90 family


# SM90A with the forward's options that are on by default off (a grid of tiles, key tables from either memory,
# partial tiles evaluated), so that those paths compile too. (O by TMA, on by default at d128: the FP8 variants.)
OTHER_SCHEDULING = with_options(SM90A, persistent=False, tables_always_shared=False, partial_bits=False)
# The d256 Hopper backward (split columns: both warpgroups over 64 keys, dQ by atomics; its walk without early
# scores).
SPLIT = KernelConfig(head_dim=256, dtype="bf16", arch="sm_90a", tile=TileConfig(128, 64, 12, 2))
# The d64 Hopper backward, both dQ orders, with the step and grid options that are on by default off: the walk
# without early scores (ascending and descending), dQ reductions from each consumer warp in atomic order, the
# 3-D grids.
# The sm_80 variant built forward-only (for inference): its backward file holds the launchers alone.
SM80_FORWARD = dataclasses.replace(SM80, forward_only=True)
# The sm90 family's FP8 forward (e4m3 inputs, bf16 out; forward-only, d128): 128-key tiles (V^T in one 128-byte
# swizzled box), and 192-key ones (V^T in three 64-byte swizzled boxes).
FP8 = KernelConfig(head_dim=128, dtype="e4m3", arch="sm_90a", tile=TileConfig(128, 128, 12, 2), forward_only=True)
FP8_WIDE = dataclasses.replace(FP8, tile=TileConfig(128, 192, 12, 2))
ORDERED = with_options(KernelConfig(head_dim=64, dtype="bf16", arch="sm_90a", tile=TileConfig(128, 128, 12, 2)),
                       early_scores=False, dq_writer=False, ordered_section_pairs=0, atomic_section_pairs=0)
# The default d64 variant: its atomic-order backward is the persistent one (the producer's and writer's column loops).
DEFAULT_D64 = KernelConfig(head_dim=64, dtype="bf16", arch="sm_90a", tile=TileConfig(128, 128, 12, 2))


# ------------------------------------------------------------------------------------------------
# no compiler needed


@pytest.mark.parametrize("text,arch", [("sm_80", "sm_80"), ("90a", "sm_90a"), ("9.0a", "sm_90a"),
                                       ("compute_86", "sm_86"), ("SM_89", "sm_89")])
def test_arch_spellings(text, arch):
    assert tools.check_arch(text) == arch


def test_unsupported_arch_names_the_fix():
    with pytest.raises(tools.ToolchainError, match="sm_80 or newer.*--arch"):
        tools.check_arch("sm_70")
    with pytest.raises(tools.ToolchainError, match="write it like sm_80"):
        tools.check_arch("hopper")


def test_gencode_flags():
    assert tools.gencode_flag("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"
    assert tools.gencode_flag("sm_80") == "-gencode=arch=compute_80,code=sm_80"


def test_default_archs(monkeypatch):
    monkeypatch.setattr(tools, "visible_gpu_arch", lambda: None)
    monkeypatch.delenv("OMNIGEN_ARCH_LIST", raising=False)
    assert tools.default_archs() == ("sm_80", "sm_90a")
    monkeypatch.setenv("OMNIGEN_ARCH_LIST", "8.0;9.0a, sm_86")
    assert tools.default_archs() == ("sm_80", "sm_90a", "sm_86")
    monkeypatch.setattr(tools, "visible_gpu_arch", lambda: "sm_90a")
    assert tools.default_archs() == ("sm_90a",)


def test_missing_nvcc_names_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(tools.shutil, "which", lambda name: None)
    monkeypatch.setattr(tools, "FALLBACK_NVCC", (Path("/nonexistent/bin/nvcc"),))
    with pytest.raises(tools.ToolchainError, match="CUDA_HOME"):
        tools.find_nvcc()


def test_bad_cuda_home_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(tools.ToolchainError, match=r"CUDA_HOME is set to .* not an executable nvcc"):
        tools.find_nvcc()


def test_cli_build_without_nvcc(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path / "cache"))
    tools.find_toolchain.cache_clear()
    try:
        result = CliRunner().invoke(cli, ["build", "--rules", str(REPO / "examples/rules/transfusion.yaml"), "--arch", "sm_80"])
    finally:
        tools.find_toolchain.cache_clear()
    assert result.exit_code == 2
    assert "CUDA_HOME" in result.output and "Traceback" not in result.output


def test_cli_build_unsupported_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(cli, ["build", "--rules", str(REPO / "examples/rules/transfusion.yaml"), "--arch", "sm_75"])
    assert result.exit_code == 2 and "sm_75 is not supported" in result.output


def test_ninja_files(tmp_path):
    toolchain = tools.Toolchain(
        cuda_home=Path("/cuda"), nvcc=Path("/cuda/bin/nvcc"), nvcc_version="13.0.88", cxx="c++", cxx_version="g++ 12",
        ninja="ninja", python_include="/py/include", pybind11_include="/pb/include", pybind11_version="3.0",
        ext_suffix=".so",
    )
    text = tools.module_ninja(tmp_path, "mod_abc", "rules", SM90A, toolchain, "stem")
    assert "-gencode=arch=compute_90a,code=sm_90a" in text
    assert "-cudart=static" in text and "-Xptxas=-v" in text
    assert "torch" not in text
    top = tools.top_ninja([tmp_path / "a" / "build.ninja", tmp_path / "b" / "build.ninja"])
    assert top.count("subninja ") == 2


def test_ptxas_report():
    log = """ptxas info    : Function properties for _ZN3foo
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 232 registers, used 1 barriers"""
    assert tools.ptxas_report(log) == {"stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0,
                                       "registers": 232, "static_shared_bytes": 0,
                                       "kernels": {"_ZN3foo": {"stack_bytes": 0, "spill_store_bytes": 0,
                                                               "spill_load_bytes": 0, "registers": 232,
                                                               "static_shared_bytes": 0}}}
    two = log + """
ptxas info    : Function properties for _ZN3bar
    8 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 30 registers, used 1 barriers, 64 bytes smem"""
    report = tools.ptxas_report(two)  # the worst kernel decides: a spill anywhere shows
    assert (report["registers"], report["spill_store_bytes"], report["stack_bytes"]) == (232, 16, 8)
    assert set(report["kernels"]) == {"_ZN3foo", "_ZN3bar"}


def test_max_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert tools.max_jobs() == 3
    monkeypatch.setenv("MAX_JOBS", "lots")
    with pytest.raises(tools.ToolchainError, match="MAX_JOBS"):
        tools.max_jobs()


# ------------------------------------------------------------------------------------------------
# with nvcc


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One sm_80 and one sm_90a variant, the sm_90a one's other scheduling and the two Hopper backwards above,
    compiled together; yields the cache dir and the build results."""
    directory = tmp_path_factory.mktemp("omnigen-cache")
    previous = os.environ.get("OMNIGEN_CACHE_DIR")
    os.environ["OMNIGEN_CACHE_DIR"] = str(directory)
    try:
        variants = [cache.variant(RULES, config)
                    for config in (SM80, SM90A, OTHER_SCHEDULING, SPLIT, ORDERED, SM80_FORWARD, FP8, FP8_WIDE,
                                   DEFAULT_D64)]
        results = cache.build_variants(variants)
        yield directory, results
    finally:
        if previous is None:
            os.environ.pop("OMNIGEN_CACHE_DIR", None)
        else:
            os.environ["OMNIGEN_CACHE_DIR"] = previous


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_build_sm80_and_sm90a_and_read_metadata(built):
    directory, results = built
    assert [r.built for r in results] == [True] * 9
    # The sm90 forward's other options, the split-columns (d256) Hopper backward, the d64 one with its step and grid
    # options off and the default d64 one (persistent): compiled, within the spill allowances.
    for result in results[2:5] + results[8:]:
        kernels_built = result.meta["ptxas"]["kernels"]
        assert not any(family_of(SM90A).excess_spill_bytes(n, k) for n, k in kernels_built.items()), kernels_built
    assert sum("hopper_dkdv_kernel" in name for name in results[3].meta["ptxas"]["kernels"]) == 1
    assert sum("hopper_dkdv_kernel" in name for name in results[4].meta["ptxas"]["kernels"]) == 2  # both orders
    assert cache.get_module(RULES, DEFAULT_D64).PERSISTENT_BACKWARD
    for result, config in zip(results, (SM80, SM90A)):
        kernels_built = result.meta["ptxas"]["kernels"]
        assert not any(family_of(config).excess_spill_bytes(n, k) for n, k in kernels_built.items()), kernels_built
        module = cache.get_module(RULES, config)
        assert module.MODULE_NAME == result.variant.module
        assert module.RULES_NAME == "buildtest"
        assert module.RULES_HASH == RULES.without_kernel().content_hash()
        assert module.MASK_HASH == RULES.mask_hash()
        assert omnigen.Rules.from_yaml(module.RULES_YAML) == RULES
        assert module.CONFIG == config.as_dict()
        assert (module.HEAD_DIM, module.BLOCK_M, module.BLOCK_N, module.DTYPE) == (64, config.tile.block_m, 64, "bf16")
        assert module.MODALITIES == ("image", "text", "pad") and module.PAD_ID == 2
        assert module.OMNIGEN_VERSION == omnigen.__version__


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_a_forward_only_build_has_the_forward_kernel_alone(built):
    directory, results = built
    result = results[5]
    assert "_fwd_" in result.variant.module and result.variant.module != results[0].variant.module
    assert [name for name in result.meta["ptxas"]["kernels"]] == [
        name for name in results[0].meta["ptxas"]["kernels"] if "forward_kernel" in name]
    module = cache.get_module(RULES, SM80_FORWARD)
    assert module.HAS_BACKWARD is False and "built forward-only" in module.BACKWARD_PROBLEM


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_the_fp8_forward_compiles_to_8_bit_products_without_spills(built):
    directory, results = built
    for result, config in zip(results[6:8], (FP8, FP8_WIDE)):
        kernels_built = result.meta["ptxas"]["kernels"]
        assert [name for name in kernels_built] == [name for name in kernels_built if "forward_kernel" in name]
        module = cache.get_module(RULES, config)
        assert module.DTYPE == "e4m3" and module.HAS_BACKWARD is False and "forward" in module.BACKWARD_PROBLEM
        assert "k16.f32" not in result.variant.sources[source_names(RULES, config)["kernel"]]
    # The 128-key tile spills nothing. The 192-key one (FP8's default) is at the consumers' register limit: ptxas keeps
    # a few values of the tile's set-up on the stack (20 / 28 bytes stored / loaded, seen in CI; its SASS has no local
    # memory between the first and the last product), which the forward's allowance covers (no unmarked spill cell in
    # `omnigen build`'s table).
    assert all(k.get("spill_store_bytes", 0) == 0 for k in results[6].meta["ptxas"]["kernels"].values())
    assert all(family_of(FP8_WIDE).excess_spill_bytes(name, k) == 0
               for name, k in results[7].meta["ptxas"]["kernels"].items()), results[7].meta["ptxas"]
    source = results[6].variant.sources[source_names(RULES, FP8)["kernel"]]
    assert source.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 2  # S = Q K^T and O += P V
    wide = results[7].variant.sources[source_names(RULES, FP8_WIDE)["kernel"]]
    assert "m64n192k32.f32.e4m3.e4m3" in wide and "m64n128k32.f32.e4m3.e4m3" in wide  # S is 64 x 192, O 64 x 128


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_calling_without_a_gpu_raises_clearly(built):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    module = cache.get_module(RULES, SM80)
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        module.device_check()
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        module.forward(*([16] * 5), *([8] * 12), 1, 2, 1, 100, 0.125, *([16] * 5), 0)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        module.forward(*([16] * 5), *([8] * 12), 1, 3, 2, 100, 0.125, *([16] * 5), 0)
    with pytest.raises(ValueError, match="null pointer"):
        module.forward(0, *([16] * 4), *([8] * 12), 1, 2, 1, 100, 0.125, *([16] * 5), 0)
    # The backward's passes: Delta (zeroing dq_accum when given) and the fp32 gradients' conversion check their
    # arguments before asking for the GPU.
    delta = (16, 16, 16, *([8] * 6), 1, 2, 100, 0)  # o, d_o, delta, strides, batch, heads_q, seq_len, stream
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        module.backward_delta(*delta, dq_accum=16)
    with pytest.raises(ValueError, match="dq_accum.*aligned"):
        module.backward_delta(*delta, dq_accum=24)
    convert = (16, 16, 8, 8, 8, 1, 2, 100, 0)  # source, destination, strides, batch, heads, seq_len, stream
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        module.backward_convert(*convert)
    with pytest.raises(ValueError, match="source.*aligned"):
        module.backward_convert(20, *convert[1:])
    with pytest.raises(ValueError, match="multiples of 8"):
        module.backward_convert(16, 16, 8, 12, 8, *convert[5:])


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_compiler_error_shows_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path))
    broken = cache.variant(RULES, SM80)
    kernel = next(name for name in broken.sources if name.endswith(".cu"))
    broken.sources[kernel] = broken.sources[kernel].replace("namespace omnigen_rules", "#error planted_failure\nnamespace omnigen_rules", 1)
    with pytest.raises(tools.BuildError) as caught:
        cache.build_variants([broken])
    assert "planted_failure" in str(caught.value) and "Fix:" in str(caught.value)
    assert not list((tmp_path / "modules").glob("*")) if (tmp_path / "modules").exists() else True


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_cli_on_a_built_cache(built, tmp_path):
    directory, results = built
    rules_file = tmp_path / "buildtest.yaml"
    rules_file.write_text(RULES.to_yaml() + "kernel:\n  head_dims: [64]\n  tiles: [{block_m: 64, block_n: 64, warps: 4, stages: 2}]\n")
    runner = CliRunner()
    env = {"OMNIGEN_CACHE_DIR": str(directory)}
    # The kernel: section only picks variants: the one it names is the module already built.
    result = runner.invoke(cli, ["inspect", "--rules", str(rules_file), "--arch", "sm_80"], env=env)
    assert result.exit_code == 0, result.output
    assert "buildtest_bf16_d64_m64n64w4s2_sm_80_" in result.output and "not in the cache" not in result.output
    assert "built at" in result.output
    listed = runner.invoke(cli, ["cache", "list"], env=env)
    assert listed.exit_code == 0 and "buildtest" in listed.output and f"{len(results)} module(s)" in listed.output


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_cli_build_cached_tune_and_clear(built, tmp_path):
    directory, results = built
    rules_file = tmp_path / "buildtest.yaml"
    rules_file.write_text(RULES.to_yaml())
    runner = CliRunner()
    env = {"OMNIGEN_CACHE_DIR": str(directory)}
    # Same rules, no kernel: section, --arch sm_80: the default tile, which is not built yet -> skip
    # the compile by pointing the CLI only at what exists: inspect shows the built module path.
    out = tmp_path / "out"
    import omnigen.cli.build as cli_build

    original = cli_build.codegen.targets
    try:
        cli_build.codegen.targets = lambda rules, archs=None: [SM80]
        result = runner.invoke(cli, ["build", "--rules", str(rules_file), "--arch", "sm_80", "--tune", "--out", str(out)], env=env)
        inspected = runner.invoke(cli, ["inspect", "--rules", str(rules_file), "--arch", "sm_80"], env=env)
    finally:
        cli_build.codegen.targets = original
    assert result.exit_code == 0, result.output
    assert "cached" in result.output and "0 built, 1 from the cache" in result.output
    assert "tuning skipped" in result.output and f"omnigen build --rules {rules_file} --tune" in result.output
    assert "_backward.cu" in inspected.output.split("sources:")[1].splitlines()[0]
    assert (out / "buildtest" / "buildtest_mask.cuh").is_file()
    assert inspected.exit_code == 0 and "built:" in inspected.output and "spills st/ld 0/0 B" in inspected.output
    cleared = runner.invoke(cli, ["cache", "clear"], env=env)
    assert cleared.exit_code == 0 and f"removed {len(results)} module(s)" in cleared.output
    assert runner.invoke(cli, ["cache", "list"], env=env).output.strip().endswith("empty")
