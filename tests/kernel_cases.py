"""Rule sets shared by the forward and backward GPU tests, so both files use the same built modules, and the
helper that gives a variant sm90 options."""

import dataclasses

import torch

import omnigen
from omnigen.kernels.sm90.options import HopperOptions
from omnigen.targets import KernelConfig

TRANSFUSION = omnigen.Rules(
    name="gpu_transfusion",
    modalities={"text": {"self": "causal"}, "image": {"self": "full"}},
    see={"default": "earlier"},
)
# Windows, a see override in each direction, shared documents: the other branches of the predicate.
MIXED = omnigen.Rules(
    name="gpu_mixed",
    modalities={"text": {"self": "causal", "window": 96}, "image": {"self": "full"}, "audio": {"self": "full", "window": 40}},
    see={"default": "earlier", "image -> image": "none", "text -> audio": "all"},
    documents="shared",
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def with_options(config: KernelConfig, **options: bool | int) -> KernelConfig:
    """The sm90 variant `config` with these HopperOptions (the others at their defaults): another module, named
    after the options it changes."""
    return dataclasses.replace(config, options=HopperOptions(**options))


class PlanWithBits:
    """A plan with its partial tiles' masks as bits for both schedules (omnigen.plan.bits), as a Mask's schedules
    hand them to the launchers: for every partial tile ("all") or the first half of them ("half": the rest are
    evaluated in the same launch, as when a mask's capacity runs out)."""

    def __init__(self, rules: omnigen.Rules, plan, bits: str) -> None:
        from omnigen.plan.bits import partial_bits

        self._plan = plan
        partial = plan.counts()["partial"]
        capacity = partial if bits == "all" else partial // 2
        m, n = plan.block_m, plan.block_n
        self.partial_slot, self.partial_bits = partial_bits(rules, plan.tables, plan.fwd_ptr, plan.fwd_kv, m, n, capacity)
        self.partial_slot_bwd, self.partial_bits_bwd = partial_bits(rules, plan.tables, plan.bwd_ptr, plan.bwd_q, m, n,
                                                                    capacity, transposed=True)

    def __getattr__(self, name: str):
        return getattr(self._plan, name)
