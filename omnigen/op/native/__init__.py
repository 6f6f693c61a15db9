"""The native call path: `omnigen::attention` and `omnigen::attention_backward` on CUDA tensors run C++ kernels
(`ops.cpp`, the op shim) that call a generated module's launch directly: no Python between PyTorch's dispatcher
and the kernel launch, eager or compiled.

    from omnigen.op import native
    native.load()        # build once per torch (about 15 s, then cached) and load; False when it cannot be had
    native.problem()     # why not, as a sentence (None when loaded or not tried)

The shim is a host C++ library built against this process's torch by `omnigen.jit.cache.get_host_library`; the
generated modules stay free of torch headers and export their launches as addresses (`omnigen/launch_abi.h`).
The ops keep their Python kernels (op/library.py): they run wherever the shim is not loaded -- no C++ compiler,
a torch without headers, `OMNIGEN_NATIVE=0` (for comparisons and debugging) -- with the same results.

What the shim asks of Python, once per (kernel, sequence length, head dim, dtype, device, pass), through two small
ops defined here: `omnigen::_launch_choice` (which module runs the call: the tuned or default config, loaded or
built on first use) and `omnigen::_dq_ranks` (deterministic mode's order of dQ additions). It keeps the choices;
`forget()` drops them (the tuning database changed, or attention()'s kernels were forgotten).
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from ...jit import cache
from ...kernels import capabilities
from ...kernels.family import COMMON_INCLUDE
from ...plan.masks import PER_SHAPE, SCHEDULE_TENSORS
from ...plan.schedule import dq_ranks
from .. import library

SOURCE = Path(__file__).with_name("ops.cpp")
# ops.cpp indexes each tile shape's schedule tensors in this order (its enum Schedule).
SHIM_SCHEDULE_ORDER = ("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q", "partial_slot", "partial_bits", "partial_slot_bwd",
                       "partial_bits_bwd")
assert SCHEDULE_TENSORS == SHIM_SCHEDULE_ORDER and PER_SHAPE == len(SHIM_SCHEDULE_ORDER)

# ops.cpp's enum Flag: what a module reads besides the arguments every launch takes.
PERSISTENT_FORWARD, PARTIAL_BITS, ORDERED_DQ, GROUP_DKDV, DQ_INTERLEAVED, PERSISTENT_BACKWARD = 1, 2, 4, 8, 16, 32

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_problem: str | None = None

_callbacks = torch.library.Library("omnigen", "FRAGMENT")
_callbacks.define("_launch_choice(str kernel, Tensor q, bool backward) -> Tensor")
_callbacks.define("_dq_ranks(Tensor fwd_ptr, Tensor fwd_kv, Tensor bwd_ptr, Tensor bwd_q, int batch, int q_tiles, "
                  "int kv_tiles) -> Tensor")


def launch_choice(kernel: str, q: torch.Tensor, backward: bool) -> torch.Tensor:
    """What the shim runs for a call: int64 [block_m, block_n, forward, backward, delta launch addresses, flags,
    launch ABI, convert launch address] of the module the kernel key picks for q's sequence length, head dim, dtype
    and device."""
    config, module = library.pass_module(kernel, q, backward)
    caps = capabilities(module)
    if caps.launch_abi is None:
        raise RuntimeError(f"{getattr(module, 'MODULE_NAME', module)} exports no native launches: it was built by an "
                           "older omnigen; clear the kernel cache (omnigen cache clear) to rebuild it")
    launch = caps.backward_launch if backward else caps.forward_launch
    if not launch or (backward and not (caps.delta_launch and caps.convert_launch)):
        raise RuntimeError(f"{getattr(module, 'MODULE_NAME', module)} exports no {'backward' if backward else 'forward'} "
                           "launch for the op shim; clear the kernel cache (omnigen cache clear) to rebuild it")
    flags = (PERSISTENT_FORWARD * caps.persistent_forward | PARTIAL_BITS * caps.partial_bits
             | ORDERED_DQ * caps.ordered_dq | GROUP_DKDV * caps.group_dkdv
             | DQ_INTERLEAVED * caps.dq_interleaved | PERSISTENT_BACKWARD * caps.persistent_backward)
    return torch.tensor([config.tile.block_m, config.tile.block_n, caps.forward_launch, caps.backward_launch,
                         caps.delta_launch, flags, caps.launch_abi, caps.convert_launch], dtype=torch.int64)


_callbacks.impl("_launch_choice", launch_choice, "CompositeExplicitAutograd")
_callbacks.impl("_dq_ranks", dq_ranks, "CompositeExplicitAutograd")


def enabled() -> bool:
    """False when OMNIGEN_NATIVE=0: every call stays in the ops' Python kernels."""
    return os.environ.get("OMNIGEN_NATIVE", "1").strip() != "0"


def load() -> bool:
    """Build (first time) and load the shim into torch's dispatcher, once per process. A failure is not an
    error: it warns once, says why (`problem()`), and calls go through the Python kernels."""
    global _loaded, _problem
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            if not enabled():
                _loaded, _problem = False, "OMNIGEN_NATIVE=0"
            else:
                try:
                    path = cache.get_host_library("omnigen_ops", {SOURCE.name: SOURCE.read_text()}, [COMMON_INCLUDE],
                                                  "op shim (native call path)")
                    torch.ops.load_library(str(path))
                    _loaded = True
                except Exception as exc:  # a missing compiler or torch headers: the Python path still works
                    _loaded, _problem = False, f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"omnigen: the native call path is unavailable ({_problem.splitlines()[0]}); "
                                  "calls go through Python, with more host time per call", RuntimeWarning,
                                  stacklevel=2)
    return bool(_loaded)


def loaded() -> bool:
    return bool(_loaded)


def problem() -> str | None:
    return _problem


def forget() -> None:
    """Drop the shim's kept launch choices: the next call of each shape asks Python again."""
    if _loaded:
        torch.ops.omnigen._forget_launch_choices()
