"""omnigen: FlashAttention kernels generated for interleaved multimodal masks."""

from .layout import Layout, LayoutBatch, PaddingReport, Segment
from .plan import CAUSAL, EMPTY, FULL, PARTIAL, Plan, plan
from .rules import KernelSpec, Modality, Rules, RulesError, TileConfig

__version__ = "0.1.0"

__all__ = [
    "CAUSAL", "EMPTY", "FULL", "PARTIAL",
    "KernelSpec", "Layout", "LayoutBatch", "Modality", "PaddingReport", "Plan", "Rules", "RulesError",
    "Segment", "TileConfig", "plan",
]
