"""The op shim without a GPU (op/native/): it builds against this torch with the real C++ compiler, installs into
the cache once, loads into the dispatcher as the ops' CUDA kernels, and everything around it fails in words.

The shim needs no CUDA headers or libraries (it reaches the current stream through c10's device-generic interface),
so it builds and loads against a CPU-only torch too: what runs it on a GPU is tested in test_native_gpu.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from omnigen.jit import cache, toolchain
from omnigen.kernels.family import COMMON_INCLUDE
from omnigen.op import native

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="needs a C++ compiler")


def _build(cache_root):
    return cache.get_host_library("omnigen_ops", {native.SOURCE.name: native.SOURCE.read_text()}, [COMMON_INCLUDE],
                                  "op shim (native call path)")


@pytest.fixture(scope="module")
def shim_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("omnigen-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNIGEN_CACHE_DIR", str(root))
        yield root


@needs_compiler
@pytest.mark.nvcc
def test_the_shim_builds_once_and_registers_cuda_kernels(shim_cache, monkeypatch):
    monkeypatch.setattr(native, "_loaded", None)
    assert native.load(), native.problem()
    entries = [e for e in cache.entries() if e.path.name.startswith("omnigen_ops-")]
    assert len(entries) == 1 and entries[0].problem is None
    assert entries[0].meta["description"] == "op shim (native call path)"
    assert entries[0].meta["toolchain"]["torch"] == torch.__version__
    for op in ("attention", "attention_backward"):
        dump = torch._C._dispatch_dump(f"omnigen::{op}")
        assert "CUDA: registered at" in dump and "ops.cpp" in dump, dump
        assert "CompositeExplicitAutograd" in dump  # the Python kernel stays for everything else
        # Autograd on CUDA tensors is the shim's C++ (no Python between the dispatcher and the kernel, compiled
        # graphs included); on CPU tensors it stays torch.library's Python formula.
        table = dict(line.split(": ", 1) for line in torch._C._dispatch_dump_table(f"omnigen::{op}").splitlines()
                     if ": " in line)
        assert "ops.cpp" in table["AutogradCUDA"], table["AutogradCUDA"]
        assert "custom_ops.py" in table["AutogradCPU"], table["AutogradCPU"]
    torch.ops.omnigen._forget_launch_choices()
    native.forget()
    # A second build of the same source is the cached entry; a damaged one is rebuilt.
    path = _build(shim_cache)
    assert path == entries[0].path / "omnigen_ops.so"
    stat = path.stat()
    assert _build(shim_cache).stat().st_mtime_ns == stat.st_mtime_ns
    damaged = path.read_bytes()[:100]
    path.unlink()  # a new file: this process has the library mapped, and truncating that one in place kills it
    path.write_bytes(damaged)
    assert cache.entry_problem(entries[0].path) is not None
    rebuilt = _build(shim_cache)
    assert cache.entry_problem(rebuilt.parent) is None and rebuilt.stat().st_size == stat.st_size


def test_launch_choice_names_an_unknown_kernel():
    with pytest.raises(ValueError, match="no kernel 'kernel/v2:nothing#0' in this process"):
        torch.ops.omnigen._launch_choice("kernel/v2:nothing#0", torch.zeros(1, 1, 8, 64), False)


def test_omnigen_native_0_keeps_calls_in_python(monkeypatch):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_problem", None)
    monkeypatch.setenv("OMNIGEN_NATIVE", "0")
    assert native.load() is False
    assert native.problem() == "OMNIGEN_NATIVE=0"


def test_a_shim_that_cannot_build_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_problem", None)

    def no_headers():
        raise toolchain.ToolchainError("torch 0.0 ships no C++ headers")

    monkeypatch.setattr(cache, "find_torch_build", no_headers)
    with pytest.warns(RuntimeWarning, match="native call path is unavailable .*ships no C\\+\\+ headers"):
        assert native.load() is False
    assert native.load() is False  # decided once per process
    assert "ships no C++ headers" in native.problem()


@pytest.mark.nvcc
def test_host_library_flags_follow_torchs_abi():
    build = toolchain.TorchBuild("2.x", ("/inc",), "/lib", cxx11_abi=False)
    assert "-D_GLIBCXX_USE_CXX11_ABI=0" in toolchain.host_library_flags(build)
    text = toolchain.host_library_ninja(Path("/b"), [Path("/b/ops.cpp")], Path("/b/omnigen_ops.so"), [COMMON_INCLUDE],
                                        toolchain.find_toolchain(), build)
    assert "-ltorch_cpu" in text and "-Wl,-rpath,/lib" in text and "-I/inc" in text


@needs_compiler
@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_the_shim_uses_the_processs_libstdcxx_even_under_a_static_wrapper(tmp_path, monkeypatch):
    """A $CXX that links libstdc++ statically (the GPU machine's does) must not give the shim its own copy: the
    shim and libtorch pass strings, streams and exceptions to each other, and a private copy's streams crashed the
    first error message that formatted a number."""
    import subprocess

    real = shutil.which("c++") or shutil.which("g++")
    archive = Path(subprocess.run([real, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip())
    if not archive.is_absolute() or not archive.is_file():
        pytest.skip("this compiler has no libstdc++.a")
    # As on the GPU machine: the compiler's own library directory, searched first, holds only the archive.
    only_static = tmp_path / "lib"
    only_static.mkdir()
    (only_static / "libstdc++.a").symlink_to(archive)
    wrapper = tmp_path / "static-cxx"
    wrapper.write_text(f'#!/bin/sh\nexec {real} -L{only_static} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = _build(tmp_path)
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so.6]" in dynamic
    symbols = subprocess.run(["readelf", "-W", "--dyn-syms", str(path)], capture_output=True, text=True,
                             check=True).stdout
    own = [line for line in symbols.splitlines() if "_ZNSo9_M_insertIlEERSoT_" in line and " UND " not in line]
    assert not own, own  # std::ostream's number insertion comes from the shared libstdc++, not from the shim


def test_the_loaded_libstdcxx_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 13 /opt/lib/libstdc++.so.6.0.33\n"
                    "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert toolchain.loaded_libstdcxx(maps) == "/opt/lib/libstdc++.so.6.0.33"
    assert toolchain.loaded_libstdcxx(tmp_path / "absent") == ""
    build = toolchain.TorchBuild("2.x", ("/inc",), "/lib", cxx11_abi=True, libstdcxx="/opt/lib/libstdc++.so.6.0.33")
    assert toolchain.host_library_link_flags(build)[-1] == "/opt/lib/libstdc++.so.6.0.33"
