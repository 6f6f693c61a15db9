"""Code generation: golden sources, canonical naming and hashing, readable output, invalid variants. No compiler."""

from __future__ import annotations

import dataclasses
import keyword
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jinja2
import pytest

import omnigen
from omnigen import kernels
from omnigen.kernels.sm80.resources import Resources, default_tile
from omnigen.targets import DEFAULT_ARCHS
from omnigen.kernels import family_of
from omnigen.kernels.family import KERNELS_DIR
from omnigen.jit import cache, codegen, regenerate
from omnigen.targets import KernelConfig, TileConfig

REPO = Path(__file__).resolve().parent.parent
CONFIG = KernelConfig(head_dim=128, dtype="bf16", arch="sm_80")

TRANSFUSION_A = """
name: transfusion
modalities:
  text:  {self: causal}
  image: {self: full}
see:
  default: earlier
documents: isolated
"""
# The same rules written differently: other order, shorthand, defaults spelled out, a see entry equal to the default.
TRANSFUSION_B = """
documents: isolated
see: {image -> text: earlier}
modalities:
  image: {self: full, window: 0}
  text: causal
name: transfusion
"""


def test_generated_sources_are_current():
    """generated/ is exactly what the templates render now. Fix: python -m omnigen.jit.regenerate --regenerate"""
    expected = regenerate.generated_tree()
    assert expected, "examples/rules/ produced nothing"
    on_disk = {p.relative_to(regenerate.GENERATED_DIR).as_posix(): p.read_text()
               for p in regenerate.GENERATED_DIR.rglob("*") if p.is_file()}
    stale = sorted(set(on_disk) - set(expected))
    missing = sorted(set(expected) - set(on_disk))
    changed = sorted(name for name in set(expected) & set(on_disk) if expected[name] != on_disk[name])
    assert not (stale or missing or changed), (
        f"generated/ is out of date (changed: {changed[:5]}, missing: {missing[:5]}, stale: {stale[:5]}); "
        "run: python -m omnigen.jit.regenerate --regenerate"
    )


def test_check_command_passes():
    result = subprocess.run([sys.executable, "-m", "omnigen.jit.regenerate", "--check"], cwd=REPO, capture_output=True,
                            text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr


def test_same_rules_written_differently_render_the_same():
    a = omnigen.Rules.from_yaml(TRANSFUSION_A)
    b = omnigen.Rules.from_yaml(TRANSFUSION_B)
    assert codegen.module_name(a, CONFIG) == codegen.module_name(b, CONFIG)
    assert codegen.render(a, CONFIG) == codegen.render(b, CONFIG)
    python_built = omnigen.Rules(name="transfusion", modalities={"image": "full", "text": "causal"})
    assert codegen.render(python_built, CONFIG) == codegen.render(a, CONFIG)


def test_module_name_is_readable_and_an_identifier():
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    name = codegen.module_name(rules, CONFIG)
    assert re.fullmatch(r"transfusion_bf16_d128_m128n64w4s2_sm_80_[0-9a-f]{8}", name)
    digits = omnigen.Rules(name="3d", modalities={"text": "causal"})
    name = codegen.module_name(digits, CONFIG)
    assert name.isidentifier() and not keyword.iskeyword(name)


def test_everything_that_shapes_the_binary_changes_the_module_or_the_key(monkeypatch):
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    base_name = codegen.module_name(rules, CONFIG)
    sources = codegen.render(rules, CONFIG)
    headers = codegen.header_files(CONFIG)
    flags = {"nvcc": ["-O3"], "cxx": ["-O1"], "link": []}
    toolchain = {"nvcc": "13.0.88"}
    key = cache.cache_key(sources, headers, flags, toolchain, "sm_80")
    assert cache.cache_key(sources, headers, flags, toolchain, "sm_80") == key

    changed_headers = dict(headers, **{"omnigen/sm80/mma.cuh": headers["omnigen/sm80/mma.cuh"] + "\n// edit"})
    assert cache.cache_key(sources, changed_headers, flags, toolchain, "sm_80") != key
    assert cache.cache_key(sources, headers, {**flags, "nvcc": ["-O2"]}, toolchain, "sm_80") != key
    assert cache.cache_key(sources, headers, flags, {"nvcc": "13.1.0"}, "sm_80") != key
    assert cache.cache_key(sources, headers, flags, toolchain, "sm_90a") != key
    edited = dict(sources)
    first = next(iter(edited))
    edited[first] += "\n"
    assert cache.cache_key(edited, headers, flags, toolchain, "sm_80") != key

    # A template edit renames the module (so its sources and key change too).
    original = codegen.template_files()
    edited_templates = tuple((n, d + b"\n// edit" if n == "sm80/templates/forward.cu.j2" else d) for n, d in original)
    monkeypatch.setattr(codegen, "template_files", lambda: edited_templates)
    assert codegen.module_name(rules, CONFIG) != base_name
    monkeypatch.undo()
    assert codegen.module_name(rules, CONFIG) == base_name

    other_arch = KernelConfig(head_dim=128, dtype="bf16", arch="sm_90a")
    assert codegen.module_name(rules, other_arch) != base_name
    assert "code=sm_90a" in " ".join(__import__("omnigen.jit.toolchain", fromlist=["x"]).nvcc_flags(other_arch))


def test_emitted_code_reads_like_the_rules():
    rules = omnigen.Rules(
        name="demo",
        modalities={"text": {"self": "causal", "window": 128}, "image": "full", "image_patch": "full"},
        see={"default": "earlier", "image -> image": "none", "text -> image_patch": "all"},
    )
    files = codegen.render(rules, CONFIG)
    mask = files["demo_mask.cuh"]
    for word in ("kText = 2", "kImage = 0", "kImagePatch = 1", "kPad = 3", "constexpr See kSee", "kWindow",
                 "SelfPolicy::kCausal,  // text", "constexpr bool kIsolatedDocuments = true",
                 "sliding window of the query's modality"):
        assert word in mask, word
    assert "/* image       -> */ { See::kNone" in mask
    kernel = files["demo_bf16_d128_m128n64w4s2_sm_80.cu"]
    # the code paths named at the top (their walk: omnigen/sm80/partial_bits.cuh's for_each_path, the partial tiles
    # from bits where the variant reads them, else the rules' predicate), tensor-core products as named tile steps
    for comment in ("//   full    -- every pair allowed: no mask work", "//   causal  -- the tile's mask is k <= q",
                    "//   partial -- anything else: the tile's mask as bits", "else the rules'\n//              predicate",
                    "for_each_path<kPartialBits>(", "omnigen::mma_abt"):
        assert comment in kernel, comment
    assert "#define" not in kernel and "#define" not in mask  # no macro soup
    no_window = codegen.render(omnigen.Rules(name="plain", modalities={"text": "causal"}, documents="shared"), CONFIG)
    assert "sliding window of the query" not in no_window["plain_mask.cuh"]
    assert "documents: shared" in no_window["plain_mask.cuh"]


def test_header_names_the_rules_and_config():
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    for name, text in codegen.render(rules, CONFIG).items():
        head = text[:2000]
        assert "Generated by omnigen" in head and rules.without_kernel().content_hash() in head, name
        assert "//     text: {self: causal}" in head, name
        if not name.endswith("_mask.cuh"):
            assert "config: head_dim=128 dtype=bf16 arch=sm_80 block_m=128 block_n=64 warps=4 stages=2" in head


def test_binding_carries_metadata():
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    binding = codegen.render(rules, CONFIG)["transfusion_bf16_d128_m128n64w4s2_sm_80_binding.cpp"]
    for attribute in ("MODULE_NAME", "RULES_NAME", "RULES_HASH", "MASK_HASH", "RULES_YAML", "CONFIG", "OMNIGEN_VERSION",
                      "HEAD_DIM", "BLOCK_M", "BLOCK_N", "MODALITIES", "PAD_ID"):
        assert f'm.attr("{attribute}")' in binding
    assert rules.without_kernel().content_hash() in binding and rules.mask_hash() in binding
    includes = re.findall(r"#include [<\"](.+)[>\"]", binding)
    assert not [i for i in includes if i.startswith(("torch", "ATen", "c10", "cuda"))], includes


def test_strict_undefined():
    env = codegen._environment(family_of(CONFIG))
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("binding.cpp.j2").render({})


def test_targets_follow_the_kernel_section():
    rules = omnigen.Rules.load(REPO / "examples" / "rules" / "transfusion.yaml")
    configs = codegen.targets(rules)
    assert {c.arch for c in configs} == set(DEFAULT_ARCHS)
    assert codegen.targets(rules, ["sm_90a"])[0].arch == "sm_90a"
    plain = omnigen.Rules(name="plain", modalities={"text": "causal"})
    assert [c.label for c in codegen.targets(plain, ["sm_80"])] == ["bf16_d64_m128n64w4s2_sm_80", "bf16_d128_m128n64w4s2_sm_80"]


@pytest.mark.parametrize("config,message", [
    (KernelConfig(256, "bf16", "sm_80", TileConfig(128, 64, 4, 2)), "fp32 output"),
    (KernelConfig(128, "bf16", "sm_80", TileConfig(128, 128, 8, 2)), "shared memory"),
    (KernelConfig(128, "bf16", "sm_80", TileConfig(48, 64, 4, 2)), "multiple of 16 x warps"),
    (KernelConfig(96, "bf16", "sm_80"), "head_dim"),
    (KernelConfig(64, "fp8", "sm_80"), "dtype"),
])
def test_unbuildable_variants_say_why(config, message):
    with pytest.raises(ValueError, match=message):
        codegen.render(omnigen.Rules(name="x", modalities={"text": "causal"}), config)


def test_default_tiles_fit():
    for head_dim in (64, 128, 256):
        for arch in ("sm_80", "sm_86", "sm_90a"):
            config = KernelConfig(head_dim, "bf16", arch, family_of(arch).default_tile(head_dim))
            assert not kernels.problems(config), (config.label, kernels.problems(config))
        # sm_90a's fallback family: the sm80 kernels build there too
        assert not kernels.problems(KernelConfig(head_dim, "bf16", "sm_90a", default_tile(head_dim), kernel_family="sm80"))


def test_templates_found_from_the_package():
    assert (family_of(CONFIG).template_dirs[0] / "forward.cu.j2").is_file()
    assert KERNELS_DIR.parent == Path(omnigen.__file__).resolve().parent
    assert set(codegen.header_files(CONFIG)) >= {"omnigen/sm80/mma.cuh", "omnigen/sm80/ldmatrix.cuh", "omnigen/sm80/cp_async.cuh",
                                           "omnigen/forward_args.h"}


@pytest.mark.slow
def test_wheel_ships_the_templates(tmp_path):
    # Build from a copy: setuptools writes build/ and *.egg-info next to pyproject.toml.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "omnigen", source / "omnigen", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                             "-w", str(tmp_path / "dist"), "-q"], capture_output=True, text=True, cwd=tmp_path)
    if result.returncode != 0:
        pytest.skip(f"pip wheel did not run here: {result.stderr[-300:]}")
    wheel = next((tmp_path / "dist").glob("omnigen-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in codegen.template_files():
        assert f"omnigen/kernels/{template[0]}" in names


def test_kernel_section_does_not_rename_or_change_variants():
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    with_kernel = omnigen.Rules.from_dict({**rules.to_dict(), "kernel": {"head_dims": [128], "tiles": [{"block_m": 64}]}})
    assert with_kernel.content_hash() != rules.content_hash()
    assert codegen.module_name(with_kernel, CONFIG) == codegen.module_name(rules, CONFIG)
    assert codegen.render(with_kernel, CONFIG) == codegen.render(rules.without_kernel(), CONFIG)


def test_backward_is_rendered_next_to_the_forward():
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    files = codegen.render(rules, CONFIG)
    names = codegen.source_names(rules, CONFIG)
    assert names["backward"] == "transfusion_bf16_d128_m128n64w4s2_sm_80_backward.cu" and names["backward"] in files
    backward = files[names["backward"]]
    # One translation unit per pass: neither kernel file includes the other; both include the variant's shared header.
    assert f'#include "{names["backward"]}"' not in files[names["kernel"]]
    for role in ("kernel", "backward"):
        assert f'#include "{names["shared"]}"' in files[names[role]], role
    for text in ("__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel", "dq_kernel", "delta_kernel",
                 "// Full path: no mask work.", "// Causal path: one compare per score.",
                 "// Partial path: the generated predicate.", "mask_key_rows<kind>(", "mask_query_rows<kind>(", "Mma::run",
                 "omnigen::atomic_add_pair", f"static_assert(kDkdvSharedBytes == {Resources(CONFIG).backward_shared_bytes}",
                 f"static_assert(kDqSharedBytes == {Resources(CONFIG).dq_shared_bytes}"):
        assert text in backward, text
    # The masks of both layouts (rows queries, rows keys) are rendered once, into the shared header.
    for text in ("void mask_query_rows(", "void mask_key_rows(", "allowed(rule", "row_rule("):
        assert text in files[names["shared"]], text
    assert "#pragma once" in files[names["shared"]]
    assert "#define" not in backward
    binding = files[names["binding"]]
    for text in ('m.def("backward"', 'm.def("backward_delta"', 'm.attr("HAS_BACKWARD")', 'm.attr("BACKWARD_CONFIG")',
                 "constexpr bool kHasBackward = true;"):
        assert text in binding, text


def test_variants_without_a_backward_say_why():
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    # d256 on the sm80 family (the sm90 family's split-columns Hopper backward covers d256 on Hopper)
    wide = KernelConfig(256, "bf16", "sm_80", family_of("sm_80").default_tile(256))
    assert not kernels.problems(wide) and kernels.backward_problems(wide)
    files = codegen.render(rules, wide)
    backward = files[codegen.source_names(rules, wide)["backward"]]
    # Delta still works; no dK/dV or dQ kernel is compiled.
    assert "dkdv_kernel(const" not in backward and "dq_kernel(const" not in backward
    assert "launch_delta<" in backward  # omnigen/delta.cuh's kernel
    assert "has no backward kernel: the backward holds dK and dV" in backward
    assert "constexpr bool kHasBackward = false;" in files[codegen.source_names(rules, wide)["binding"]]
    assert not kernels.backward_problems(KernelConfig(128, "bf16", "sm_80"))
    assert "multiple of 64" in " ".join(kernels.backward_problems(KernelConfig(64, "bf16", "sm_80", TileConfig(32, 32, 2, 2))))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_forward_only_variant_renders_no_backward_kernel(arch):
    """KernelConfig.forward_only (inference): another module, whose backward file holds the launchers alone (they
    say there is no backward); an untuned kernel would train with the full variant's choice."""
    rules = omnigen.Rules.from_yaml(TRANSFUSION_A)
    full = KernelConfig(128, "bf16", arch, kernels.default_tile(arch, 128))
    forward = dataclasses.replace(full, forward_only=True)
    assert forward.label == full.label + "_fwd" and forward.as_dict()["forward_only"] is True
    assert codegen.module_name(rules, forward) != codegen.module_name(rules, full)
    assert not kernels.problems(forward) and "built forward-only" in " ".join(kernels.backward_problems(forward))
    assert kernels.default_backward(forward) == kernels.default_backward(full)
    files, names = codegen.render(rules, forward), codegen.source_names(rules, forward)
    backward = files[names["backward"]]
    assert "__global__" not in backward and "int backward_launch(" in backward and "int backward_delta_launch(" in backward
    assert "constexpr bool kHasBackward = false;" in files[names["binding"]]
    assert "forward_kernel" in files[names["kernel"]]
