"""The sm90 family: Hopper's own machinery (TMA, mbarriers, wgmma, warp specialisation), sm_90a only.

`resources` says which variants fit, `space` which tiles the tuner tries; templates/ holds the forward,
include/omnigen/sm90/ the barrier, TMA and wgmma primitives. Until the Hopper backward exists, a module
carries the sm80 family's backward kernels for the same plan tile (rendered from sm80's template).
"""

from __future__ import annotations

from typing import Any

from ...targets import KernelConfig
from ..family import KernelFamily
from ..sm80 import FAMILY as SM80
from . import resources, space


class Sm90Family(KernelFamily):
    name = "sm90"
    sources = {"kernel": "forward.cu.j2", "backward": "backward.cu.j2"}  # backward.cu.j2: sm80's
    forward_kernel = "forward_kernel"
    backward_kernel = "dkdv_kernel"
    resources = resources
    space = space

    @property
    def template_dirs(self):
        return (self.directory / "templates", SM80.directory / "templates", *super().template_dirs[1:])

    @property
    def include_dirs(self):
        return (*super().include_dirs, SM80.directory / "include")

    def default_backward(self, config: KernelConfig) -> KernelConfig:
        """Until the Hopper backward exists: the sm80 family's own default variant (its backward at its
        tuned-for tile, 128 x 64 with 4 warps), where one exists for the head dim; else this module's."""
        fallback = KernelConfig(config.head_dim, config.dtype, config.arch, SM80.default_tile(config.head_dim),
                                kernel_family=SM80.name)
        return fallback if not (SM80.problems(fallback) or SM80.backward_problems(fallback)) else config

    def render_context(self, config: KernelConfig) -> dict[str, Any]:
        r = resources.Resources(config)
        context = SM80.render_context(r.sm80_backward_config())  # the backward kernels' keys
        context.update({
            "warps": config.tile.warps,
            "stages": config.tile.stages,
            "shared_bytes": r.shared_storage_bytes,
            "wgmma_type": "f16" if config.dtype == "fp16" else "bf16",
            "producer_registers": resources.PRODUCER_REGISTERS,
            "consumer_registers": resources.CONSUMER_REGISTERS,
            "pingpong": resources.PINGPONG,
            "persistent": resources.PERSISTENT,
        })
        return context


FAMILY = Sm90Family()
