"""A plain layout given to a call that `torch.compile(fullgraph=True)` traces: planned while Dynamo traces the call,
and read by the graph as a mask made beforehand.

Eagerly, and under `torch.compile` where graph breaks are allowed, a call given a layout (not a mask) plans it on
the host outside any graph: `op/kernel.py` wraps the planning in `torch.compiler.disable`, so Dynamo breaks the graph
there and the compiled code plans each new layout when it runs. A `fullgraph=True` trace (or an export) cannot break.
There the layout is a constant of the trace, which Dynamo guards on, so it is planned at trace time instead:
`traced_mask` calls the planner through `torch._dynamo.assume_constant_result`. Dynamo runs it for real and bakes its
result, the mask's key, into the graph. The graph then reads the mask under that key (an attribute of this module),
and Dynamo lifts its tensors as graph inputs like those of any mask made outside.

What Dynamo hands such a function must be Python constants (torch 2.11 refuses any object; later versions pass
objects by identity): the rules go as their canonical JSON (`Rules.canonical`, made when they were built), a layout
object as its handle (`layout.handle`, a string unique in the process), by which the planner finds the object again.
Dynamo guards on that one string: the segments, also constants, would cost a guard each on every call.

Each new layout is then a new trace, and Dynamo's recompile_limit (8 by default) applies: for layouts that change
every step, make the masks outside the compiled function (`omnigen.mask`) and pass them.
"""

from __future__ import annotations

import itertools
import operator
import sys
import threading
from collections import deque
from typing import Any, Callable, Hashable

import torch

from ..layout import Layout, LayoutBatch, live_layout

# Traced masks, the newest KEPT, each an attribute of this module named by its key (KEYS, oldest first): a graph
# reads its mask through that attribute (a new attribute for each mask: a dict read twice in one trace would be
# Dynamo's copy from the first read, without the masks planned since). A mask evicted before its graph runs again
# fails that graph's guard, which traces anew and plans again.
KEPT = 64
KEYS: deque[str] = deque()
_MODULE = sys.modules[__name__]
_COUNTER = itertools.count()
_LOCK = threading.Lock()
# (owner, layout, batch, seq_len, head_dim, dtype, device) -> Mask: installed by op/kernel.py, which knows how an
# owner (a constant naming attention()'s rules or a Kernel) plans a layout.
_planner: Callable[[Any, Any, int, int, int, torch.dtype, torch.device], Any] | None = None


def set_planner(planner: Callable[[Any, Any, int, int, int, torch.dtype, torch.device], Any]) -> None:
    global _planner
    _planner = planner


def _breaks_are_errors() -> bool:
    """Whether the frame Dynamo is tracing must become one graph (fullgraph=True, export, or graph breaks made
    errors): only then does a layout get planned at trace time. (Dynamo's tracer state, read at trace time; a torch
    without it gets the graph break.)"""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tracer = InstructionTranslator.current_tx()
    except Exception:  # pragma: no cover - another torch's Dynamo
        return False
    return bool(getattr(tracer, "one_graph", False) or getattr(tracer, "error_on_graph_break", False))


def _layout_constant(layout: Any) -> Any:
    """The layout as constants: a layout string itself, a Layout its handle, a LayoutBatch or a list of Layouts one
    constant per layout; None for what is not a layout (the call's checks have said so already)."""
    if isinstance(layout, str):
        return layout
    if isinstance(layout, Layout):
        if layout.handle is None:  # built inside this trace: its segments are constants of the trace
            return ("segments", tuple((name, operator.index(length), operator.index(doc))
                                      for name, length, doc in layout.segments))
        return ("handle", layout.handle)
    if isinstance(layout, LayoutBatch):
        if layout.handle is not None:
            return ("handle", layout.handle)
        layout = layout.layouts
    if isinstance(layout, (list, tuple)) and layout and all(isinstance(item, Layout) for item in layout):
        return ("batch", tuple(_layout_constant(item) for item in layout))
    return None


def _layout_again(constant: Any) -> Any:
    """The layout of `_layout_constant`'s constant (one with a handle is held by the trace's caller: alive)."""
    if isinstance(constant, str):
        return constant
    kind, value = constant
    if kind == "handle":
        return live_layout(value)
    if kind == "segments":
        return Layout.from_segments(value)
    return LayoutBatch(_layout_again(item) for item in value)


def _plan(owner: Any, layout: Any, batch: int, seq_len: int, head_dim: int, dtype: torch.dtype,
          device: str) -> str:
    """The key of the layout's mask, planned now (at trace time)."""
    if _planner is None:  # pragma: no cover - op/kernel.py installs it on import
        raise RuntimeError("omnigen.op.traced_layouts: no planner installed")
    try:
        mask = _planner(owner, _layout_again(layout), batch, seq_len, head_dim, dtype, torch.device(device))
    except (ValueError, TypeError) as error:  # the call's mistake (InputError too): its own message, not Dynamo's
        # "internal error" wrapping of whatever a function it runs at trace time raises
        from torch._dynamo.exc import UserError, UserErrorType

        raise UserError(UserErrorType.INVALID_INPUT, str(error)) from error
    with _LOCK:
        key = f"traced_mask_{next(_COUNTER)}"
        KEYS.append(key)
        setattr(_MODULE, key, mask)
        while len(KEYS) > KEPT:
            delattr(_MODULE, KEYS.popleft())
    return key


# Both run for real while Dynamo traces, their results constants of the trace. Whether the trace may break is asked
# first and alone: a trace that may break must not see the layout as an argument, or Dynamo would guard on it and trace
# anew for every layout, where the graph break plans each one at run time.
_breaks_are_errors_now = torch._dynamo.assume_constant_result(_breaks_are_errors)
_planned = torch._dynamo.assume_constant_result(_plan)


def traced_mask(owner: Hashable, layout: Any, q: torch.Tensor) -> Any:
    """Inside a trace that must be one graph, the mask of `layout` for a call on q, planned while tracing; None
    elsewhere (eager, or a trace that may break): the caller then plans as it always does. `owner` is a constant
    (strings, tuples) that the installed planner knows."""
    if not torch.compiler.is_compiling() or not _breaks_are_errors_now():
        return None
    layout = _layout_constant(layout)
    if q.dim() != 4 or layout is None:
        return None  # the call's own checks say what is wrong
    # The plan is for these sizes: with dynamic shapes, operator.index specialises them (Dynamo guards on each).
    shape = tuple(operator.index(size) for size in q.shape)
    key = _planned(owner, layout, shape[0], shape[2], shape[3], q.dtype, str(q.device))
    return getattr(_MODULE, key)
