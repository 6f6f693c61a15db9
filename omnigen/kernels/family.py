"""What a kernel family is: everything the layers above need from one folder of templates.

A family (sm80: mma.sync for Ampere and later; sm90: wgmma and TMA for Hopper) owns its
templates and device headers, its resource model (which variants fit), its candidate tiles, the
render context its templates read, and how a built module is launched. The code generator,
build, cache, tuner and op talk to families only through this interface; `registry` picks one
per architecture.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from ..targets import KernelConfig, TileConfig

# Mask headers keep modality sets in 32-bit words, and pad takes an id.
MAX_MODALITIES = 31

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {name: t for t, name in DTYPE_NAMES.items()}

KERNELS_DIR = Path(__file__).resolve().parent
COMMON_TEMPLATES = KERNELS_DIR / "common" / "templates"
COMMON_INCLUDE = KERNELS_DIR / "common" / "include"


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels need a contiguous last dim, 16-byte aligned rows: copy only when that fails."""
    aligned = t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    return t if aligned else t.contiguous()


class KernelFamily(ABC):
    """One kernel family. Subclasses set `name` (the folder under omnigen/kernels/), the rendered
    files (`sources`: role -> template name) and the names of the kernels the tuner times."""

    name: str
    sources: dict[str, str]  # file role ("kernel", "backward") -> template in the family's templates/
    forward_kernel: str  # substrings of the kernels' mangled names in ptxas's report
    backward_kernel: str

    @property
    def directory(self) -> Path:
        return KERNELS_DIR / self.name

    @property
    def template_dirs(self) -> tuple[Path, ...]:
        """Where Jinja looks: the family's own templates first, then the shared ones."""
        return (self.directory / "templates", COMMON_TEMPLATES)

    @property
    def include_dirs(self) -> tuple[Path, ...]:
        return (COMMON_INCLUDE, self.directory / "include")

    # ---- what fits

    @abstractmethod
    def problems(self, config: KernelConfig) -> list[str]:
        """Why this variant cannot be built (empty when it can)."""

    @abstractmethod
    def backward_problems(self, config: KernelConfig) -> list[str]:
        """Why this variant's module has no backward (empty when it has one); the forward is unaffected."""

    @abstractmethod
    def excess_spill_bytes(self, kernel_name: str, figures: dict) -> int:
        """Spilled bytes of one kernel's ptxas figures beyond what the family tolerates (0: fine)."""

    @abstractmethod
    def describe_resources(self, config: KernelConfig) -> str:
        """One line for `omnigen build`'s table: shared memory and threads of the variant's kernels."""

    # ---- the candidate space

    @abstractmethod
    def default_tile(self, head_dim: int) -> TileConfig:
        """The tile a variant gets when nobody picked one."""

    @abstractmethod
    def candidate_tiles(self, head_dim: int) -> tuple[TileConfig, ...]:
        """The tiles the tuner compiles and times for a head dim (the default tile among them)."""

    # ---- code generation

    @abstractmethod
    def render_context(self, config: KernelConfig) -> dict[str, Any]:
        """The template variables that depend on the variant (the rules' part is common)."""

    # ---- launching a built module (inputs already checked by the op)

    @abstractmethod
    def forward(self, module: Any, plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward: (out [B, Hq, S, D], lse [B, Hq, S] float32)."""

    @abstractmethod
    def backward(self, module: Any, plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor, scale: float,
                 deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One backward: (dq, dk, dv) in the inputs' dtype. `plan` has this module's tile shape."""
