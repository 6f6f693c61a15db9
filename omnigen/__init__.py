"""omnigen: FlashAttention kernels generated for interleaved multimodal masks."""

__version__ = "0.1.0"  # first: the submodules below read it

from .layout import Layout, LayoutBatch, PaddingReport, Segment
from .plan import CAUSAL, EMPTY, FULL, PARTIAL, Plan, plan
from .rules import KernelSpec, Modality, Rules, RulesError, TileConfig
from .ops import Kernel, attention, build


__all__ = [
    "CAUSAL", "EMPTY", "FULL", "PARTIAL",
    "Kernel", "KernelSpec", "attention", "build", "Layout", "LayoutBatch", "Modality", "PaddingReport", "Plan", "Rules", "RulesError",
    "Segment", "TileConfig", "plan",
]
