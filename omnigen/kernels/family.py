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
from types import ModuleType
from typing import Any

import torch

from ..targets import KernelConfig, KernelOptions, TileConfig
from . import launch

# Mask headers keep modality sets in 32-bit words, and pad takes an id.
MAX_MODALITIES = 31

# Torch dtypes of the kernels' inputs: the training dtypes, and e4m3 for the sm90 family's FP8 forward (forward-only).
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "e4m3"}
TORCH_DTYPES = {name: t for t, name in DTYPE_NAMES.items()}

KERNELS_DIR = Path(__file__).resolve().parent
COMMON_TEMPLATES = KERNELS_DIR / "common" / "templates"
COMMON_INCLUDE = KERNELS_DIR / "common" / "include"


class KernelFamily(ABC):
    """One kernel family. A subclass names its folder under omnigen/kernels/ (`name`), the files it
    renders (`sources`: role -> template), the kernels the tuner times, its `resources` module (a
    `Resources(config)` class with `problems()`, `backward_problems()` and `shared_memory_bytes`, plus
    `default_tile(head_dim, dtype)` and `excess_spill_bytes(kernel_name, figures)`), its `space` module
    (`DEFAULT_SPACE`: candidate tiles per head dim) and the type of its options (`options_type`, a
    KernelOptions dataclass: the base one, without fields, for a family without choices); and it writes
    `render_context`."""

    name: str
    sources: dict[str, str]  # file role ("kernel", "backward", "shared") -> template in the family's templates/
    forward_kernel: str  # substrings of the kernels' mangled names in ptxas's report
    backward_kernel: str
    resources: ModuleType
    space: ModuleType
    options_type: type[KernelOptions] = KernelOptions

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

    def options(self, config: KernelConfig) -> KernelOptions:
        """The variant's options: its own, or the family's defaults."""
        return config.options if config.options is not None else self.options_type()

    def option_problems(self, config: KernelConfig) -> list[str]:
        """What is wrong with the variant's options (another family's type, values out of range)."""
        if config.options is None:
            return []
        if type(config.options) is not self.options_type:
            return [f"the {self.name} family takes {self.options_type.__name__}, not {type(config.options).__name__}"]
        check = getattr(config.options, "problems", None)
        return check() if check is not None else []

    def problems(self, config: KernelConfig) -> list[str]:
        """Why this variant cannot be built (empty when it can)."""
        return self.option_problems(config) or self.resources.Resources(config).problems()

    def backward_problems(self, config: KernelConfig) -> list[str]:
        """Why this variant's module has no backward (empty when it has one); the forward is unaffected."""
        if config.forward_only:
            return [f"the variant {config.label} is built forward-only (KernelConfig.forward_only)"]
        return self.option_problems(config) or self.resources.Resources(config).backward_problems()

    def excess_spill_bytes(self, kernel_name: str, figures: dict) -> int:
        """Spilled bytes of one kernel's ptxas figures beyond what the family tolerates (0: fine)."""
        return self.resources.excess_spill_bytes(kernel_name, figures)

    def describe_backward(self, config: KernelConfig) -> str:
        """One line for `omnigen inspect`: which kernels run this variant's backward, in both dQ modes."""
        problems = self.backward_problems(config)
        if problems:
            return "none: " + "; ".join(problems)
        return "dK/dV kernel with atomic dQ; deterministic: a dQ kernel per q-tile (no atomics)"

    def describe_resources(self, config: KernelConfig) -> str:
        """One line for `omnigen build`'s table: shared memory and threads of the variant's forward."""
        return f"{self.resources.Resources(config).shared_memory_bytes // 1024} KB smem, {config.threads} threads"

    # ---- the candidate space

    def default_tile(self, head_dim: int, dtype: str = "bf16") -> TileConfig:
        """The tile a variant of `dtype` (a name of targets.DTYPES or FP8_DTYPES) gets when nobody picked one."""
        return self.resources.default_tile(head_dim, dtype)

    def candidate_tiles(self, head_dim: int) -> tuple[TileConfig, ...]:
        """The tiles the tuner compiles and times for a head dim (the default tile among them)."""
        return self.space.DEFAULT_SPACE.get(head_dim, (self.default_tile(head_dim),))

    def default_backward(self, config: KernelConfig) -> KernelConfig | None:
        """The variant of this family an untuned kernel runs its backward with when `config` runs its forward
        (the same one, unless the family's own backward is not the best it has); None when the family has no
        backward for it (the registry then looks in the arch's other families)."""
        return None if self.backward_problems(config) else config

    # ---- code generation

    @abstractmethod
    def render_context(self, config: KernelConfig) -> dict[str, Any]:
        """The template variables that depend on the variant (the rules' part is common)."""

    def rules_context(self, rules: Any, config: KernelConfig) -> dict[str, Any]:
        """Template variables of this family that depend on the rules too (they update render_context's)."""
        return {}

    def traits(self, rules: Any, config: KernelConfig) -> launch.VariantTraits:
        """What the variant's module will do besides the common launches: the one statement of it, which the
        binding exports (codegen renders its flags from this record) and `launch.capabilities` reads back."""
        return self.traits_of({**self.render_context(config), **self.rules_context(rules, config)}, config)

    def traits_of(self, context: dict[str, Any], config: KernelConfig) -> launch.VariantTraits:
        """`traits` from the variant's merged render and rules context (what codegen has already made)."""
        if config.forward_only:
            problem = "; ".join(self.backward_problems(config)).replace('"', "'")
            has_backward, backward_problem = False, f"this module has no backward kernel: {problem}"
        else:
            has_backward, backward_problem = bool(context["backward_supported"]), context["backward_problem"] or None
        return launch.VariantTraits(has_backward=has_backward, backward_problem=backward_problem,
                                    persistent_forward=bool(context["persistent"]),
                                    partial_bits=bool(context["partial_bits"]), ordered_dq=bool(context["ordered_dq"]),
                                    group_dkdv=bool(context["group_dkdv"]),
                                    dq_interleaved=has_backward and bool(context["dq_interleaved"]),
                                    persistent_backward=has_backward and bool(context.get("persistent_backward")))

    # ---- launching a built module (inputs already checked by the op): the shared binding's arguments

    def forward(self, module: Any, plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward: (out [B, Hq, S, D], lse [B, Hq, S] float32)."""
        return launch.forward_pass(module, plan, q, k, v, scale)

    def backward(self, module: Any, plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor, scale: float,
                 deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One backward: (dq, dk, dv) in the inputs' dtype. `plan` has this module's tile shape."""
        return launch.backward_pass(module, plan, q, k, v, out, lse, d_out, scale, deterministic)
