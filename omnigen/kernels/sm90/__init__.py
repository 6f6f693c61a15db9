"""The sm90 family: Hopper's own machinery (TMA, mbarriers, wgmma, warp specialisation), sm_90a only.

`resources` says which variants fit, `space` which tiles the tuner tries, `options` which code paths a variant
renders (HopperOptions, part of its KernelConfig); templates/ holds the forward and the Hopper backward,
include/omnigen/sm90/ the barrier, TMA and wgmma primitives. A module holds this family's kernels only: a
variant whose tile the Hopper backward does not take has a forward alone, and an untuned kernel trains with
the variant the registry picks (omnigen.kernels.default_backward: this family's default tile, else another
family's variant for the arch, built as a module of its own).
"""

from __future__ import annotations

from typing import Any

from ...targets import ELEMENT_TYPES, KernelConfig
from ..family import KernelFamily
from . import resources, space
from .options import HopperOptions


class Sm90Family(KernelFamily):
    name = "sm90"
    sources = {"kernel": "forward.cu.j2", "backward": "backward.cu.j2", "shared": "shared.cuh.j2"}
    forward_kernel = "forward_kernel"
    backward_kernel = "hopper_dkdv_kernel"
    resources = resources
    space = space
    options_type = HopperOptions

    def default_backward(self, config: KernelConfig) -> KernelConfig | None:
        """This variant when the Hopper backward takes it, else the default tile's (same options) when it covers
        the head dim; else None (the registry looks in the arch's other families)."""
        if not self.backward_problems(config):
            return config
        tile = resources.default_tile(config.head_dim, config.dtype)
        default = KernelConfig(config.head_dim, config.dtype, config.arch, tile, kernel_family=config.kernel_family,
                               options=config.options)
        return default if not (self.problems(default) or self.backward_problems(default)) else None

    def describe_backward(self, config: KernelConfig) -> str:
        r = resources.Resources(config)
        problems = r.backward_problems()
        if problems:
            return "none in this module: " + "; ".join(problems)
        dq = "vector atomics" if r.hopper_split_columns else "TMA reduce-add"
        if r.hopper_dq_writer:
            dq += " from a writer warp"
        if r.hopper_dq_in_turns:
            dq += ", the warpgroups taking turns by step"
        shape = "64 keys, head dims split between the warpgroups" if r.hopper_split_columns else "128 keys"
        if r.hopper_split_scores:
            shape += ", scores split by query columns"
        if r.hopper_paired_dq:
            dq += " over kv-tile pairs (clusters of two trading dS^T) where their rows agree"
        deterministic = r.deterministic_problems()
        mode = "the same kernel, dQ added in kv-tile order" if not deterministic else "none (" + "; ".join(deterministic) + ")"
        return f"Hopper dK/dV kernel ({shape}, dQ by {dq}); deterministic: {mode}"

    def render_context(self, config: KernelConfig) -> dict[str, Any]:
        r = resources.Resources(config)
        o = r.options
        problems = r.backward_problems()

        def sentence(found: list[str]) -> str:  # a C string literal's contents
            return "; ".join(found).replace('"', "'")

        deterministic = r.deterministic_problems()
        backward_problem = f"this variant ({config.label}) has no backward kernel: {sentence(problems)}" if problems else ""
        deterministic_problem = backward_problem
        if deterministic and not problems:
            deterministic_problem = (
                f"deterministic=True: this variant ({config.label}) has no deterministic backward: {sentence(deterministic)}; "
                "call with deterministic=False, or use the sm80 family's variant (family='sm80') for deterministic "
                "gradients")
        return {
            "warps": config.tile.warps,
            "stages": config.tile.stages,
            "shared_bytes": r.shared_storage_bytes,
            "wgmma_type": {"fp16": "f16"}.get(config.dtype, config.dtype),  # PTX's type names: f16, bf16, e4m3
            "fp8": r.fp8,
            "output_type": "__nv_bfloat16" if r.fp8 else ELEMENT_TYPES[config.dtype],
            "producer_registers": resources.PRODUCER_REGISTERS,
            "consumer_registers": resources.CONSUMER_REGISTERS,
            "persistent": o.persistent,
            "partial_bits": o.partial_bits,
            "tables_always_shared": o.tables_always_shared,
            "softmax_chains": r.softmax_chains,
            "pingpong": o.pingpong,
            "output_staged_boxes": r.output_staged_boxes,
            "fold_tiles": r.fold_tiles,
            # the backward
            "hopper_backward": not problems,
            "backward_supported": not problems,
            "backward_problem": backward_problem,
            "deterministic_problem": deterministic_problem,
            "hopper_split_columns": r.hopper_split_columns,
            "hopper_split_scores": r.hopper_split_scores,
            "hopper_paired_dq": r.hopper_paired_dq,
            "hopper_score_columns": r.hopper_score_columns,  # S^T / dP^T query columns per warpgroup
            "hopper_slice_columns": config.head_dim // 2 if r.hopper_split_columns else config.head_dim,  # dK/dV per warpgroup
            "ordered_dq": r.hopper_ordered_dq,
            "ordered_section_pairs": r.ordered_section_pairs,
            "atomic_section_pairs": r.atomic_section_pairs,
            "ordered_descending_steps": o.ordered_descending_steps,
            "early_scores": o.early_scores,
            "dq_writer": r.hopper_dq_writer,
            "dq_in_turns": r.hopper_dq_in_turns,
            "bits_slot_in_tables": o.bits_slot_in_tables,
            "persistent_backward": r.hopper_persistent_backward,
            "leading_kv_tiles": o.leading_kv_tiles,
            "leading_q_tiles": o.leading_q_tiles,
            "balanced_sections": o.balanced_sections,
            # GQA in atomic mode: each query head adds its dK/dV into its group's fp32 rows (the binding's GROUP_DKDV)
            "group_dkdv": not problems,
            # dQ staged by stmatrix, its fp32 columns interleaved in groups of 8 (split columns add it by atomics)
            "dq_interleaved": r.hopper_tma_dq,
            "hopper_step_rows": resources.HOPPER_STEP_ROWS,
            "hopper_stages": r.hopper_stages,
            "hopper_producer_registers": r.hopper_producer_registers,
            "hopper_consumer_registers": r.hopper_consumer_registers,
            "hopper_shared_bytes": r.hopper_shared_storage_bytes,
            # the binding's BACKWARD_CONFIG: the Hopper dK/dV kernel (no dQ kernel of its own)
            "bwd_threads": 384,
            "step_rows": resources.HOPPER_STEP_ROWS,
            "bwd_shared_bytes": r.hopper_shared_storage_bytes + 1024 if not problems else 0,
            "dq_threads": 0,
            "dq_shared_bytes": 0,
        }


FAMILY = Sm90Family()
