"""Kernel families (one folder each) and the registry that picks one per architecture."""

from .family import DTYPE_NAMES, MAX_MODALITIES, TORCH_DTYPES, KernelFamily
from .launch import Capabilities, as_heads_inner, capabilities, heads_inner, kernel_ready
from .registry import FAMILIES, backward_problems, check, default_backward, default_tile, family_of, problems

__all__ = ["DTYPE_NAMES", "FAMILIES", "MAX_MODALITIES", "TORCH_DTYPES", "Capabilities", "KernelFamily",
           "as_heads_inner", "backward_problems", "capabilities", "check", "default_backward", "default_tile", "family_of", "heads_inner", "kernel_ready", "problems"]
