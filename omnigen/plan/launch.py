"""Launching Triton's compiled kernels directly: the planner's calls cost the host more than the GPU.

`kernel[grid](...)` binds, specialises and hashes every argument on every call; after the first
launch of a configuration, `Launcher` calls the compiled kernel that launch returned. Only where
the running Triton is one whose launch signature was read (3.4-3.9) and no profiler hook is set.
"""

from __future__ import annotations

import os

try:  # Triton is optional: without it plan() runs its host path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def direct_launch_supported() -> bool:
    """Whether `CompiledKernel.run` takes (grid x, y, z, stream, function, packed metadata, launch
    metadata, enter hook, exit hook, *arguments): how `JITFunction.run` launches in Triton 3.4-3.9
    (read in the 3.6 and 3.9 sources). Elsewhere, and in the interpreter, every launch goes
    through Triton's own path."""
    if triton is None or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    try:
        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (3, 4) <= version <= (3, 9) and hasattr(triton, "knobs")


def launch_hooks_idle() -> bool:
    """No launch hooks (profilers) registered: a direct launch would bypass them."""
    runtime = triton.knobs.runtime
    # Triton 3.6 keeps hook chains (called even when empty); older versions None or a function.
    return all(hook is None or getattr(hook, "calls", True) == [] for hook in
               (runtime.launch_enter_hook, runtime.launch_exit_hook))


class Launcher:
    """One @triton.jit kernel: the first launch of each configuration through Triton, later ones
    straight through the compiled kernel that launch returned.

    `kernel[grid](...)` binds, specialises and hashes every argument on every call: ~11 us plus
    ~0.5 us a pointer and ~0.25 us an integer on an H200 host, where `CompiledKernel.run` takes
    ~5 us. Reusing the compiled kernel is exact here because what it was compiled for is all in
    the key: pointers are never specialised on alignment and integers never on value (`_jit`),
    each tensor argument's dtype is fixed by the code, and the caller sends integers that do not
    fit int32 (which Triton would type int64) through Triton's path (`direct=False`).
    """

    def __init__(self, kernel, constexpr_names: tuple[str, ...]) -> None:
        self.kernel = kernel
        self.constexpr_names = constexpr_names
        self.compiled: dict = {}

    def __call__(self, grid: tuple[int, int, int], args: tuple, constants: tuple, num_warps: int,
                 direct: bool) -> None:
        if direct:
            driver = triton.runtime.driver.active
            key = (driver.get_current_device(), constants, num_warps)
            entry = self.compiled.get(key)
            if entry is not None:
                run, function, metadata = entry
                stream = driver.get_current_stream(key[0])
                run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args, *constants)
                return
        kernel = self.kernel[grid](*args, **dict(zip(self.constexpr_names, constants)), num_warps=num_warps)
        if direct and hasattr(kernel, "packed_metadata"):
            self.compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)


def unspecialised_jit(fn, ints, pointers):
    """triton.jit without value specialisation of the integer arguments `ints` or alignment specialisation of the
    pointer arguments `pointers`: one compiled kernel per set of constexprs, which `Launcher` relies on (each new
    combination of sizes or alignments would otherwise compile a new kernel)."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    ints = [name for name in names if name in ints]
    pointers = [name for name in names if name in pointers]
    try:
        return triton.jit(fn, do_not_specialize=ints, do_not_specialize_on_alignment=pointers)
    except TypeError:  # pragma: no cover - older Triton
        return triton.jit(fn, do_not_specialize=ints)


DIRECT_LAUNCH = direct_launch_supported()
