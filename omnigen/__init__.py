"""omnigen: FlashAttention kernels generated for interleaved multimodal masks.

The public names below are imported on first use (PEP 562), so that `import omnigen` -- and with it
the command line, whose `omnigen --help` needs none of them -- does not import torch and its compiler
stack. `omnigen.attention`, `from omnigen import Layout`, `dir(omnigen)` work as they always did; the
only difference is when the submodules are imported (the custom ops `torch.ops.omnigen.*` are
registered on first use of `omnigen.attention` / `mask` / `build` / `Kernel`, or by `import omnigen.op`).
"""

import importlib as _importlib
import sys as _sys
import types as _types
import typing as _typing

from .version import __version__

if _typing.TYPE_CHECKING:  # what the names are, for type checkers and editors
    from .errors import InputError
    from .layout import Layout, LayoutBatch, PaddingReport, Segment
    from .op import Kernel, attention, build, mask
    from .plan import CAUSAL, EMPTY, FULL, PARTIAL, Mask, Plan, PlanMemoryError, plan
    from .plan.from_dense import mask_from_dense
    from .plan.from_intervals import mask_from_intervals
    from .plan.from_mod import mask_from_mod
    from .plan.reorder import Reordering, TokenOrder, reorder
    from .rules import Modality, Rules, RulesError
    from .targets import KernelConfig, KernelSpec, TileConfig


# public name -> the submodule that defines it
_LAZY = {
    **dict.fromkeys(("Layout", "LayoutBatch", "PaddingReport", "Segment"), "layout"),
    **dict.fromkeys(("CAUSAL", "EMPTY", "FULL", "PARTIAL", "Mask", "Plan", "PlanMemoryError", "plan"), "plan"),
    "InputError": "errors",
    **dict.fromkeys(("Modality", "Rules", "RulesError"), "rules"),
    **dict.fromkeys(("KernelConfig", "KernelSpec", "TileConfig"), "targets"),
    **dict.fromkeys(("Kernel", "attention", "build", "mask"), "op"),  # `mask` the function, not a submodule
    # masks no rule says (omnigen.plan.ruleless): the same Mask, partial tiles from bits only
    **dict.fromkeys(("mask_from_dense", "mask_from_intervals", "mask_from_mod", "reorder"), "op"),  # op: the kernels' tiles
    **dict.fromkeys(("Reordering", "TokenOrder"), "plan.reorder"),  # what reorder returns; a model's batch order
}


def __getattr__(name: str) -> object:
    source = _LAZY.get(name)
    if source is not None:
        value = getattr(_importlib.import_module(f"{__name__}.{source}"), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # a submodule as an attribute (omnigen.jit, omnigen.reference, ...)
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    import pkgutil

    submodules = {info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")}
    names = {name for name in globals() if not name.startswith("_") or name.startswith("__")}
    return sorted(names | set(_LAZY) | submodules)


class _Package(_types.ModuleType):
    """`omnigen.plan` is the function, although a subpackage has that name too: importing the
    subpackage sets the attribute to the subpackage, which this puts back to its `plan` function (what
    the eager `from .plan import plan` left there)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "plan" and isinstance(value, _types.ModuleType) and value.__name__ == f"{__name__}.plan":
            value = value.plan
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


__all__ = [
    "__version__",
    "CAUSAL", "EMPTY", "FULL", "PARTIAL",
    "InputError", "Kernel", "KernelConfig", "KernelSpec", "attention", "build", "Layout", "LayoutBatch", "Mask",
    "Modality", "PaddingReport", "Plan", "PlanMemoryError", "Rules", "RulesError", "mask",
    "mask_from_dense", "mask_from_intervals", "mask_from_mod", "reorder", "Reordering", "TokenOrder",
    "Segment", "TileConfig", "plan",
]
