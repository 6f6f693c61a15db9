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
# Attention sinks: a sink segment at the start that every text chunk sees and that sees every chunk, chunks that do
# not see each other; its kv-tiles' columns and q-tiles' rows run the whole sequence, the others' one chunk (global
# tokens, as Longformer's): the plan's first lines lead the sm90 tile orders (leading_lines).
SINKS = omnigen.Rules(
    name="gpu_sinks",
    modalities={"sink": {"self": "full"}, "text": {"self": "causal"}},
    see={"default": "earlier", "text -> text": "none", "sink -> text": "all"},
)
# Layouts of SINKS whose first two q-tile rows and kv-tile columns lead (tests/test_sm90_grid_order.py checks it)
SINK_LAYOUTS_4096 = ["sink:256" + " text:256" * 15, "sink:200 text:300" + " text:256" * 13 + " text:268"]
SINK_LAYOUTS_8192 = ["sink:256" + " text:256" * 31, "sink:200 text:300" + " text:256" * 29 + " text:268"]

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


def leading_lines(ptr: torch.Tensor, lines: int, most: int) -> int:
    """The kernels' leading_lines (the sm90 shared header) on a plan's CSR pointers, for the tests to know which of
    their cases lead: lines of the first sequence, each with every line before it at least 4x the mean line."""
    ptr = ptr.cpu().long()
    lines_in_all = (ptr.numel() - 1) // 3
    all_tiles, lead = int(ptr[-1]), 0
    for i in range(min(most, lines)):
        tiles = int(ptr[3 * i + 3] - ptr[3 * i])
        if tiles == 0 or tiles * lines_in_all < 4 * all_tiles:
            break
        lead += 1
    return lead
