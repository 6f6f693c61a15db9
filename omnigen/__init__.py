"""omnigen: FlashAttention kernels generated for interleaved multimodal masks."""


from .version import __version__
from .layout import Layout, LayoutBatch, PaddingReport, Segment
from .plan import CAUSAL, EMPTY, FULL, PARTIAL, Plan, PlanMemoryError, plan
from .errors import InputError
from .rules import Modality, Rules, RulesError
from .targets import KernelConfig, KernelSpec, TileConfig
from .plan import Mask
from .op import Kernel, attention, build, mask  # `mask` the function shadows the submodule name on purpose


__all__ = [
    "__version__",
    "CAUSAL", "EMPTY", "FULL", "PARTIAL",
    "InputError", "Kernel", "KernelConfig", "KernelSpec", "attention", "build", "Layout", "LayoutBatch", "Mask",
    "Modality", "PaddingReport", "Plan", "PlanMemoryError", "Rules", "RulesError", "mask",
    "Segment", "TileConfig", "plan",
]
