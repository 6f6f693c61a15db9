"""The toolchain and the build: find nvcc and friends, pick arch flags, write ninja files, run ninja.

The only module that runs subprocesses. It does not decide where things go: cache.py gives it a
build directory and installs what comes out.

Toolchain discovery, in order: $CUDA_HOME (or $CUDA_PATH), `nvcc` on PATH, /usr/local/cuda; every
path is realpath'd, and when nvcc is a wrapper script its real install is read from
`nvcc --dryrun` (the TOP= line). Archs: the visible GPU (torch.cuda), else $OMNIGEN_ARCH_LIST
("sm_80;sm_90a", "8.0 9.0a" and "80,90a" all work), else sm_80 and sm_90a. $MAX_JOBS caps ninja's
parallelism (default: the CPU count). The extension links cudart statically, so it imports on a
machine without a GPU or driver.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

from ..kernels import family_of
from ..targets import ARCH_TABLE, ARCHS, DEFAULT_ARCHS, KernelConfig, arch_for_capability
from .codegen import source_names

FALLBACK_NVCC = (Path("/usr/local/cuda/bin/nvcc"),)
MIN_NVCC = (12, 0)  # sm_90a needs 12.0; cp.async, bf16 mma need 11+


class ToolchainError(RuntimeError):
    """The CUDA toolchain is missing or cannot build what was asked; the message says how to fix it."""


class BuildError(RuntimeError):
    """The compiler failed. `output` is everything ninja and the compilers printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class Toolchain:
    cuda_home: Path
    nvcc: Path
    nvcc_version: str  # e.g. "13.0.88"
    cxx: str
    cxx_version: str
    ninja: str
    python_include: str
    pybind11_include: str
    pybind11_version: str
    ext_suffix: str  # e.g. ".cpython-311-x86_64-linux-gnu.so"

    @property
    def nvcc_version_tuple(self) -> tuple[int, int]:
        major, minor = self.nvcc_version.split(".")[:2]
        return int(major), int(minor)

    def fingerprint(self) -> dict[str, str]:
        """What about the toolchain changes the binary (paths left out: moving a toolkit rebuilds nothing)."""
        return {
            "nvcc": self.nvcc_version,
            "cxx": self.cxx_version,
            "pybind11": self.pybind11_version,
            "python": self.ext_suffix,
        }


# ------------------------------------------------------------------------------------------------
# discovery


def _run(command: list[str], timeout: float = 60) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return result.stdout + result.stderr


def _cuda_home_of_nvcc(nvcc: Path) -> Path:
    """The toolkit an nvcc belongs to, also when `nvcc` is a wrapper script somewhere else."""
    candidate = nvcc.parent.parent
    if (candidate / "include" / "cuda_runtime.h").is_file() or (candidate / "targets").is_dir():
        return candidate
    match = re.search(r"^#\$ TOP=(.+)$", _run([str(nvcc), "--dryrun", "--version"]), re.MULTILINE)
    if match:
        return Path(os.path.realpath(match.group(1).strip()))
    return candidate


def find_nvcc() -> tuple[Path, Path]:
    """(cuda_home, nvcc), both realpath'd. Raises ToolchainError naming what to install or set."""
    looked: list[str] = []
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            nvcc = Path(home) / "bin" / "nvcc"
            looked.append(f"${variable}/bin/nvcc ({nvcc})")
            if nvcc.is_file() and os.access(nvcc, os.X_OK):
                real = Path(os.path.realpath(nvcc))
                return _cuda_home_of_nvcc(real), real
            raise ToolchainError(
                f"${variable} is set to {home}, but {nvcc} is not an executable nvcc. "
                f"Fix: point {variable} at a CUDA toolkit (the folder holding bin/nvcc), or unset it."
            )
    on_path = shutil.which("nvcc")
    looked.append("nvcc on PATH")
    if on_path:
        real = Path(os.path.realpath(on_path))
        return _cuda_home_of_nvcc(real), real
    for fallback in FALLBACK_NVCC:
        looked.append(str(fallback))
        if fallback.is_file():
            real = Path(os.path.realpath(fallback))
            return _cuda_home_of_nvcc(real), real
    raise ToolchainError(
        "nvcc (the CUDA compiler) was not found (looked at: " + ", ".join(looked) + "). "
        "Fix: install the CUDA toolkit 12.0 or newer and set CUDA_HOME to its folder (e.g. "
        "export CUDA_HOME=/usr/local/cuda), or put its bin/ on PATH."
    )


def nvcc_version(nvcc: Path) -> str:
    text = _run([str(nvcc), "--version"])
    match = re.search(r"release [\d.]+, V(\d+\.\d+(?:\.\d+)?)", text) or re.search(r"release (\d+\.\d+)", text)
    if not match:
        raise ToolchainError(f"could not read the version of {nvcc} from `nvcc --version`:\n{text.strip()}")
    return match.group(1)


def _find_ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        raise ToolchainError("ninja was not found. Fix: pip install ninja") from None


@lru_cache(maxsize=1)
def find_toolchain() -> Toolchain:
    """Everything needed to build a variant. Cached for the process."""
    cuda_home, nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < MIN_NVCC:
        raise ToolchainError(
            f"nvcc {version} at {nvcc} is too old: omnigen needs CUDA {MIN_NVCC[0]}.{MIN_NVCC[1]} or newer. "
            "Fix: install a newer CUDA toolkit and point CUDA_HOME at it."
        )
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise ToolchainError("no C++ compiler (c++ or g++) was found. Fix: install g++ (e.g. apt-get install g++) or set CXX.")
    try:
        import pybind11
    except ImportError:
        raise ToolchainError("pybind11 is not installed. Fix: pip install pybind11") from None
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        raise ToolchainError(
            f"Python.h is missing from {python_include}. Fix: install the Python development headers "
            f"(e.g. apt-get install python3-dev)."
        )
    cxx_version = _run([cxx, "--version"]).splitlines()[0].strip() if cxx else ""
    return Toolchain(
        cuda_home=cuda_home,
        nvcc=nvcc,
        nvcc_version=version,
        cxx=cxx,
        cxx_version=cxx_version,
        ninja=_find_ninja(),
        python_include=python_include,
        pybind11_include=pybind11.get_include(),
        pybind11_version=pybind11.__version__,
        ext_suffix=sysconfig.get_config_var("EXT_SUFFIX") or ".so",
    )


# ------------------------------------------------------------------------------------------------
# archs


def normalize_arch(text: str) -> str:
    """'sm_90a', '90a', '9.0a', 'compute_90a' -> 'sm_90a'. Raises ToolchainError for unknown ones."""
    word = text.strip().lower()
    match = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)(a?)", word)
    if not match:
        raise ToolchainError(f"cannot read arch '{text}'; write it like sm_80 or sm_90a")
    arch = f"sm_{match.group(1)}{match.group(2)}{match.group(3)}"
    return arch


def check_arch(arch: str, toolchain: Toolchain | None = None) -> str:
    arch = normalize_arch(arch)
    if arch not in ARCH_TABLE:
        known = "; ".join(f"{a.name} ({a.gpus})" for a in ARCH_TABLE.values())
        raise ToolchainError(
            f"arch {arch} is not supported: omnigen's kernels need sm_80 or newer and are built for {known}. "
            f"Fix: pass --arch with one of {', '.join(ARCHS)}."
        )
    needed = ARCH_TABLE[arch].min_nvcc
    if toolchain is not None and toolchain.nvcc_version_tuple < needed:
        raise ToolchainError(f"{arch} needs nvcc {needed[0]}.{needed[1]} or newer; {toolchain.nvcc} is {toolchain.nvcc_version}")
    return arch


def parse_arch_list(text: str) -> tuple[str, ...]:
    """$OMNIGEN_ARCH_LIST: archs separated by ';', ',' or spaces."""
    words = [w for w in re.split(r"[;,\s]+", text) if w]
    return tuple(dict.fromkeys(check_arch(w) for w in words))


def visible_gpu_arch() -> str | None:
    """The arch of the current CUDA device, or None without one (imports torch only here)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        capability = torch.cuda.get_device_capability()
    except Exception:  # a broken driver means: no usable GPU
        return None
    return arch_for_capability(tuple(capability))


def default_archs() -> tuple[str, ...]:
    """The visible GPU's arch, else $OMNIGEN_ARCH_LIST, else sm_80 and sm_90a."""
    visible = visible_gpu_arch()
    if visible:
        return (visible,)
    listed = os.environ.get("OMNIGEN_ARCH_LIST", "").strip()
    if listed:
        return parse_arch_list(listed)
    return DEFAULT_ARCHS


def gencode_flag(arch: str) -> str:
    """sm_90a -> -gencode=arch=compute_90a,code=sm_90a (machine code only: one arch per module)."""
    number = arch.split("_", 1)[1]
    return f"-gencode=arch=compute_{number},code=sm_{number}"


# ------------------------------------------------------------------------------------------------
# flags and ninja files

NVCC_FLAGS = (
    "-O3", "-std=c++17", "-DNDEBUG",
    "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden",
    # ptxas's report (registers, spills) lands in the build log and in meta.json.
    "-Xptxas=-v,-warn-spills,-warn-lmem-usage",
)
# The binding only forwards arguments: optimising it buys nothing and costs seconds of pybind11.
CXX_FLAGS = ("-O1", "-std=c++17", "-DNDEBUG", "-fPIC", "-fvisibility=hidden")
LINK_FLAGS = ("-shared", "-cudart=static")


def nvcc_flags(config: KernelConfig) -> list[str]:
    return [*NVCC_FLAGS, gencode_flag(config.arch)]


def cxx_flags() -> list[str]:
    return list(CXX_FLAGS)


def flags_fingerprint(config: KernelConfig) -> dict[str, list[str]]:
    """Every flag that shapes the binary (include paths aside), for the cache key."""
    return {"nvcc": nvcc_flags(config), "cxx": cxx_flags(), "link": list(LINK_FLAGS)}


def _ninja_escape(path: str | Path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _quote(args: Iterable[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def module_ninja(build_dir: Path, module: str, rules_name: str, config: KernelConfig, toolchain: Toolchain,
                 stem: str) -> str:
    """build.ninja for one module in `build_dir`: compile the forward and the backward kernel files (one object
    each: one pass per translation unit, sharing the variant's headers) and the binding, link the extension.

    Paths are absolute, so the file works both alone (ninja -C build_dir) and as a subninja.
    Each compile writes its output to <object>.log (ptxas's report included) and prints it only on failure.
    """
    kernel = build_dir / f"{stem}.cu"
    backward = build_dir / f"{stem}_backward.cu"
    binding = build_dir / f"{stem}_binding.cpp"
    kernel_object = build_dir / f"{stem}.cu.o"
    backward_object = build_dir / f"{stem}_backward.cu.o"
    binding_object = build_dir / f"{stem}_binding.o"
    extension = build_dir / f"{module}{toolchain.ext_suffix}"
    includes = ["-I" + str(d) for d in family_of(config).include_dirs] + ["-I" + str(build_dir)]
    host_includes = includes + ["-I" + toolchain.pybind11_include, "-I" + toolchain.python_include,
                                "-I" + str(toolchain.cuda_home / "include")]
    e = _ninja_escape
    lines = [
        f"# {module}: {rules_name}, " + " ".join(f"{k}={v}" for k, v in config.as_dict().items()),
        f"nvcc_{stem} = {_quote([str(toolchain.nvcc)])}",
        f"cxx_{stem} = {_quote([toolchain.cxx])}",
        f"rule nvcc_{stem}",
        f"  command = $nvcc_{stem} {_quote(nvcc_flags(config) + includes)} -c $in -o $out > $out.log 2>&1 || "
        "{ cat $out.log; exit 1; }",
        f"  description = nvcc {config.label}",
        f"rule cxx_{stem}",
        f"  command = $cxx_{stem} {_quote(cxx_flags() + host_includes)} -c $in -o $out > $out.log 2>&1 || "
        "{ cat $out.log; exit 1; }",
        f"  description = c++ {config.label} binding",
        f"rule link_{stem}",
        f"  command = $nvcc_{stem} {_quote(LINK_FLAGS)} $in -o $out",
        f"  description = link {module}",
        f"build {e(kernel_object)}: nvcc_{stem} {e(kernel)}",
        f"build {e(backward_object)}: nvcc_{stem} {e(backward)}",
        f"build {e(binding_object)}: cxx_{stem} {e(binding)}",
        f"build {e(extension)}: link_{stem} {e(kernel_object)} {e(backward_object)} {e(binding_object)}",
        f"build {stem}: phony {e(extension)}",
        "",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class TorchBuild:
    """What a host library that includes torch's C++ headers (the op shim) compiles and links against."""

    version: str
    include_dirs: tuple[str, ...]
    library_dir: str
    cxx11_abi: bool
    libstdcxx: str = ""  # the libstdc++ this process has loaded (a path), "" when none is found

    def fingerprint(self) -> dict[str, str]:
        return {"torch": self.version, "cxx11_abi": str(self.cxx11_abi), "torch_lib": self.library_dir,
                "libstdcxx": self.libstdcxx}


def loaded_libstdcxx(maps: Path = Path("/proc/self/maps")) -> str:
    """The path of the libstdc++ shared library mapped into this process (torch loads it), or "" where the process
    has none or the system has no /proc."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "/libstdc++.so" in path:
            return path.strip()
    return ""


def find_torch_build() -> TorchBuild:
    """This process's torch as a C++ library. Raises ToolchainError when it ships no headers."""
    import torch

    root = Path(torch.__file__).resolve().parent
    include = root / "include"
    if not (include / "torch" / "library.h").is_file():
        raise ToolchainError(f"torch {torch.__version__} at {root} ships no C++ headers (include/torch/library.h); "
                             "install a regular PyTorch wheel to use the native call path")
    return TorchBuild(version=torch.__version__,
                      include_dirs=(str(include), str(include / "torch" / "csrc" / "api" / "include")),
                      library_dir=str(root / "lib"), cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                      libstdcxx=loaded_libstdcxx())


# torch's headers need C++20 from 2.10 on; the shim's own code is C++17.
HOST_LIBRARY_FLAGS = ("-O2", "-std=c++20", "-DNDEBUG", "-fPIC", "-fvisibility=hidden", "-shared")


def host_library_flags(torch_build: TorchBuild) -> list[str]:
    return [*HOST_LIBRARY_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch_build.cxx11_abi)}"]


def host_library_link_flags(torch_build: TorchBuild) -> list[str]:
    """What a host library links against. libstdc++ is named here, as the very shared library this process has
    loaded: the shim hands strings, streams and exceptions to and from libtorch, so both must use one libstdc++.
    The GPU machine's $CXX (/opt/gcc/bin/g++) links a private static copy otherwise -- its own directory holds only
    libstdc++.a, which `-lstdc++` finds first -- and that copy's streams, never set up, crashed the first error
    message that formatted a number (RESULTS.md, twelfth session). Named by path, the shared one resolves every
    reference before any archive is searched."""
    libstdcxx = [torch_build.libstdcxx] if torch_build.libstdcxx else ["-Wl,-Bdynamic", "-lstdc++"]
    return ["-L" + torch_build.library_dir, "-Wl,-rpath," + torch_build.library_dir, "-lc10", "-ltorch_cpu", "-ltorch",
            *libstdcxx]


def host_library_ninja(build_dir: Path, sources: list[Path], library: Path, include_dirs: Iterable[Path],
                       toolchain: Toolchain, torch_build: TorchBuild) -> str:
    """build.ninja for a host C++ library against torch (the op shim): one compile-and-link step, no CUDA."""
    includes = ["-I" + str(d) for d in include_dirs] + ["-I" + d for d in torch_build.include_dirs]
    libraries = host_library_link_flags(torch_build)
    e = _ninja_escape
    return "\n".join([
        "ninja_required_version = 1.3",
        f"cxx = {_quote([toolchain.cxx])}",
        "rule host_library",
        f"  command = $cxx {_quote(host_library_flags(torch_build) + includes)} $in -o $out "
        f"{_quote(libraries)} > $out.log 2>&1 || {{ cat $out.log; exit 1; }}",
        f"  description = c++ {library.name}",
        f"build {e(library)}: host_library {' '.join(e(s) for s in sources)}",
        "",
    ])


def top_ninja(module_files: list[Path]) -> str:
    """The top-level build.ninja: one subninja per module, so one ninja run builds them all in parallel."""
    return "ninja_required_version = 1.3\n" + "".join(f"subninja {_ninja_escape(p)}\n" for p in module_files)


def max_jobs() -> int:
    """ninja's parallelism: $MAX_JOBS, else the CPU count. A $MAX_JOBS that is not a whole number is a
    ToolchainError saying how to set it (checked before anything is built)."""
    value = os.environ.get("MAX_JOBS", "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ToolchainError(
                f"MAX_JOBS={value!r} is not a whole number of parallel compile jobs. Fix: set one "
                f"(e.g. MAX_JOBS=8), or unset MAX_JOBS to use the CPU count ({os.cpu_count() or 1} here)"
            ) from None
    return max(1, os.cpu_count() or 1)


_STATUS = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")


def run_ninja(build_dir: Path, toolchain: Toolchain, jobs: int | None = None,
              on_progress: Callable[[int, int, str], None] | None = None, keep_going: bool = False) -> str:
    """Run ninja in `build_dir`; report [finished/total] edges to on_progress; return the output.

    On failure raise BuildError carrying the whole output (ninja prints each failing command and
    what the compiler said). With `keep_going`, ninja builds everything that does not depend on a
    failed step (`-k 0`) and the output is returned instead: the caller sees per target what exists.
    """
    environment = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    command = [toolchain.ninja, "-C", str(build_dir), "-j", str(jobs or max_jobs())]
    if keep_going:
        command += ["-k", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment, start_new_session=False)
    lines: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        match = _STATUS.match(line.rstrip("\n"))
        if match and on_progress is not None:
            on_progress(int(match.group(1)), int(match.group(2)), match.group(3))
    status = process.wait()
    output = "".join(lines)
    if status != 0 and not keep_going:
        failed = re.findall(r"^FAILED: (.*)$", output, re.MULTILINE)
        raise BuildError(
            f"the build failed in {build_dir} ({len(failed) or 'some'} step(s)). Compiler output:\n\n{output.rstrip()}\n\n"
            "Fix: a compiler error in generated code is an omnigen bug -- please report it with this output. "
            "If the toolchain itself is broken, check `nvcc --version` and CUDA_HOME.",
            output,
        )
    return output


# ------------------------------------------------------------------------------------------------
# what ptxas said

_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SHARED = re.compile(r"(\d+) bytes smem")


def ptxas_report(log_text: str) -> dict:
    """Registers, spills and stack from nvcc's -Xptxas -v output: the worst over every kernel of the
    module (forward, backward, ...) at the top level, and each kernel's own figures under "kernels"."""
    kernels: dict[str, dict[str, int]] = {}
    chunks = _PTXAS_FUNCTION.split(log_text)  # [preamble, name, body, name, body, ...]
    for name, body in zip(chunks[1::2], chunks[2::2]):
        figures: dict[str, int] = {}
        stack = _PTXAS_STACK.search(body)
        if stack:
            figures.update(stack_bytes=int(stack.group(1)), spill_store_bytes=int(stack.group(2)),
                           spill_load_bytes=int(stack.group(3)))
        registers = _PTXAS_REGISTERS.search(body)
        if registers:
            figures["registers"] = int(registers.group(1))
        shared = _PTXAS_SHARED.search(body)
        figures["static_shared_bytes"] = int(shared.group(1)) if shared else 0
        kernels[name] = figures
    report: dict = {}
    for key in ("stack_bytes", "spill_store_bytes", "spill_load_bytes", "registers", "static_shared_bytes"):
        values = [figures[key] for figures in kernels.values() if key in figures]
        if values:
            report[key] = max(values)
    if kernels:
        report["kernels"] = kernels
    return report


def kernel_logs(build_dir: Path, stem: str) -> tuple[Path, Path]:
    """The compile logs (ptxas's report included) of the forward and the backward kernel files."""
    return build_dir / f"{stem}.cu.o.log", build_dir / f"{stem}_backward.cu.o.log"


def kernel_log_text(build_dir: Path, stem: str) -> str:
    """Both kernel files' compile logs, one after the other ("" for any not there)."""
    return "".join(log.read_text() for log in kernel_logs(build_dir, stem) if log.is_file())


def describe_toolchain(toolchain: Toolchain) -> str:
    return (f"nvcc {toolchain.nvcc_version} ({toolchain.nvcc}), {toolchain.cxx_version}, "
            f"pybind11 {toolchain.pybind11_version}, Python {sys.version.split()[0]}")


__all__ = [
    "BuildError", "Toolchain", "ToolchainError", "TorchBuild", "check_arch", "default_archs", "find_toolchain",
    "find_torch_build", "flags_fingerprint", "gencode_flag", "host_library_flags", "host_library_ninja", "kernel_log_text",
    "kernel_logs",
    "max_jobs", "module_ninja", "normalize_arch", "parse_arch_list", "ptxas_report", "run_ninja", "source_names",
    "top_ninja", "visible_gpu_arch",
]
