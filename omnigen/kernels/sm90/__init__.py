"""The sm90 family: Hopper's own machinery (TMA, mbarriers, wgmma, warp specialisation), sm_90a only.

`resources` says which variants fit, `space` which tiles the tuner tries; templates/ holds the forward and
the Hopper backward, include/omnigen/sm90/ the barrier, TMA and wgmma primitives. A module also carries the
sm80 family's backward for the same plan tile (rendered from sm80's template): deterministic mode runs it,
and so do the tiles and head dims the Hopper backward does not cover (resources.hopper_backward_problems).
"""

from __future__ import annotations

from typing import Any

from ...targets import KernelConfig
from ..family import KernelFamily
from ..sm80 import FAMILY as SM80
from . import resources, space
from .options import HopperOptions


class Sm90Family(KernelFamily):
    name = "sm90"
    sources = {"kernel": "forward.cu.j2", "backward": "backward.cu.j2"}
    forward_kernel = "forward_kernel"
    backward_kernel = "hopper_dkdv_kernel"
    resources = resources
    space = space
    options_type = HopperOptions

    @property
    def template_dirs(self):
        return (self.directory / "templates", SM80.directory / "templates", *super().template_dirs[1:])

    @property
    def borrowed_templates(self):
        return {SM80.name: SM80.directory / "templates"}

    @property
    def include_dirs(self):
        return (*super().include_dirs, SM80.directory / "include")

    def default_backward(self, config: KernelConfig) -> KernelConfig:
        """The Hopper backward: this variant's when it covers the tile, else the default tile's when it covers
        the head dim; else the sm80 family's own default variant (its backward at its tuned-for tile, 128 x 64
        with 4 warps), where one exists for the head dim; else this module's."""
        if not resources.Resources(config).hopper_backward_problems():
            return config
        tile = resources.default_tile(config.head_dim)
        default = KernelConfig(config.head_dim, config.dtype, config.arch, tile, kernel_family=config.kernel_family,
                               options=config.options)
        if not (self.problems(default) or resources.Resources(default).hopper_backward_problems()):
            return default
        fallback = KernelConfig(config.head_dim, config.dtype, config.arch, SM80.default_tile(config.head_dim),
                                kernel_family=SM80.name)
        return fallback if not (SM80.problems(fallback) or SM80.backward_problems(fallback)) else config

    def describe_backward(self, config: KernelConfig) -> str:
        r = resources.Resources(config)
        carried = r.sm80_backward_config()
        carried_problems = SM80.backward_problems(carried)
        hopper_problems = r.hopper_backward_problems()
        if hopper_problems:
            why = "; ".join(hopper_problems)
            if not carried_problems:
                return f"the carried sm80 backward ({why}): {SM80.describe_backward(carried)}"
            other = self.default_backward(config)
            if other != config:
                return f"none in this module ({why}); an untuned kernel trains with {other.label}'s"
            return f"none ({why})"
        dq = "vector atomics" if r.hopper_split_columns else "TMA reduce-add"
        if r.hopper_dq_writer:
            dq += " from a writer warp"
        shape = "64 keys, head dims split between the warpgroups" if r.hopper_split_columns else "128 keys"
        if r.hopper_ordered_dq:
            deterministic = "the same kernel, dQ added in kv-tile order"
        elif carried_problems:
            deterministic = "none (the carried sm80 backward has none for this variant)"
        else:
            deterministic = "the carried sm80 backward"
        return f"Hopper dK/dV kernel ({shape}, dQ by {dq}); deterministic: {deterministic}"

    def render_context(self, config: KernelConfig) -> dict[str, Any]:
        r = resources.Resources(config)
        hopper_problems = r.hopper_backward_problems()
        context = SM80.render_context(r.sm80_backward_config())  # the carried backward kernels' keys
        mma_problems = "; ".join(SM80.backward_problems(r.sm80_backward_config())).replace('"', "'")
        if not hopper_problems and mma_problems:
            # The Hopper kernel is the module's backward; the carried sm80 one would serve deterministic mode.
            context["mma_backward_problem"] = (
                f"deterministic=True runs the sm80 family's backward, which has none for {config.label}: {mma_problems}"
                "; call with deterministic=False (the Hopper backward)")
        elif hopper_problems and mma_problems:
            context["backward_problem"] = (
                f"this variant ({config.label}) has no backward kernel: " + "; ".join(hopper_problems).replace('"', "'")
                + f"; and {mma_problems}")
        o = r.options
        context.update({
            "warps": config.tile.warps,
            "stages": config.tile.stages,
            "shared_bytes": r.shared_storage_bytes,
            "wgmma_type": "f16" if config.dtype == "fp16" else "bf16",
            "producer_registers": resources.PRODUCER_REGISTERS,
            "consumer_registers": resources.CONSUMER_REGISTERS,
            "backward_entry": "sm80_backward_launch",
            "backward_supported": context["mma_backward"] or not hopper_problems,
            "hopper_backward": not hopper_problems,
            "hopper_split_columns": r.hopper_split_columns,
            "ordered_dq": r.hopper_ordered_dq,
            "ordered_section_pairs": r.ordered_section_pairs,
            "atomic_section_pairs": r.atomic_section_pairs,
            "ordered_descending_steps": o.ordered_descending_steps,
            "early_scores": o.early_scores,
            "dq_writer": r.hopper_dq_writer,
            "grouped_heads": False,  # the binding's GQA_IN_KERNEL: dK/dV partials per query head, summed by the caller
            "hopper_backward_problem": "; ".join(hopper_problems).replace('"', "'"),
            "hopper_step_rows": resources.HOPPER_STEP_ROWS,
            "hopper_stages": r.hopper_stages,
            "hopper_producer_registers": resources.HOPPER_PRODUCER_REGISTERS,
            "hopper_consumer_registers": resources.HOPPER_CONSUMER_REGISTERS,
            "hopper_shared_bytes": r.hopper_shared_storage_bytes,
            "persistent": o.persistent,
            "partial_bits": o.partial_bits,
            "tables_always_shared": o.tables_always_shared,
        })
        return context


FAMILY = Sm90Family()
