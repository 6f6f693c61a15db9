"""The tuner's candidate space: which tile configs to compile and time for one (arch, dtype, head dim).

A candidate is one TileConfig -- block_m x block_n (the plan's tile shape), warps and pipeline
stages -- compiled into one module that holds the forward and the backward. The forward and the
backward are tuned separately (one may win with a tile the other loses with), so a candidate can
be usable for the forward only (head dim 256: no backward kernel; a backward that does not fit
the arch's shared memory) and is then timed for the forward alone.

Where the candidates come from: the rules' `kernel.tiles` when given, else the family's
candidate tiles, a
handful of shapes per head dim from the kernel family (`kernels.problems()` and
`kernels.backward_problems()` are the authority) and that compile in seconds. The default config -- what
a kernel runs with no tuning -- is always a candidate, so the tuner's winner is measured against
it in the same run.

Pruning, cheapest first:
  1. before compiling: the templates' own limits (shared memory per arch, fp32 accumulators per
     thread, thread/copy divisibility) -- `prune()`;
  2. after compiling, before timing: ptxas's per-kernel report (meta.json) -- a kernel that spills
     registers to local memory is not timed for that pass -- `prune_by_ptxas()`.

Not in the space: `deterministic=True` (dQ without atomics). It changes what the user gets
(bitwise-reproducible gradients), not only how fast, so it is the caller's choice per call; the
tuner times the default atomic dQ, and a deterministic call uses the backward tile tuned for it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..kernels import backward_problems, family_of, problems
from ..rules import Rules
from ..targets import FP8_DTYPES, KernelConfig, TileConfig

@dataclass(frozen=True)
class Candidate:
    """One config to compile, and for which passes it may be timed (None: usable; else why not)."""

    config: KernelConfig
    forward_problem: str | None = None
    backward_problem: str | None = None

    @property
    def label(self) -> str:
        return self.config.tile.label

    @property
    def forward(self) -> bool:
        return self.forward_problem is None

    @property
    def backward(self) -> bool:
        return self.backward_problem is None

    @property
    def usable(self) -> bool:
        return self.forward or self.backward


def default_config(rules: Rules, head_dim: int, dtype: str, arch: str) -> KernelConfig:
    """What a kernel runs without tuning: the first of the rules' tiles that fits, else the default tile
    (the same choice omnigen.build makes). FP8 variants are forward-only."""
    forward_only = dtype in FP8_DTYPES
    for tile in rules.kernel.tiles if rules.kernel else ():
        config = KernelConfig(head_dim, dtype, arch, tile, forward_only=forward_only)
        if not problems(config):
            return config
    return KernelConfig(head_dim, dtype, arch, family_of(arch).default_tile(head_dim, dtype),
                        forward_only=forward_only)


def candidate_tiles(rules: Rules, head_dim: int, arch: str) -> tuple[TileConfig, ...]:
    """The rules' `kernel.tiles`, else the family's candidate tiles for the head dim (unfiltered)."""
    if rules.kernel is not None and rules.kernel.tiles:
        return rules.kernel.tiles
    return family_of(arch).candidate_tiles(head_dim)


def prune(configs: list[KernelConfig]) -> tuple[list[Candidate], list[tuple[KernelConfig, str]]]:
    """Split configs into candidates worth compiling and (config, why not) for the rest -- before any compile."""
    kept: list[Candidate] = []
    dropped: list[tuple[KernelConfig, str]] = []
    for config in dict.fromkeys(configs):
        found = problems(config)
        if found:
            dropped.append((config, "; ".join(found)))
            continue
        backward = backward_problems(config)
        kept.append(Candidate(config, None, "; ".join(backward) if backward else None))
    return kept, dropped


def candidate_space(rules: Rules, head_dim: int, dtype: str, arch: str
                    ) -> tuple[list[Candidate], list[tuple[KernelConfig, str]]]:
    """The candidates for one (arch, dtype, head dim), the default config first; and what was pruned."""
    default = default_config(rules, head_dim, dtype, arch)
    configs = [default] + [KernelConfig(head_dim, dtype, arch, t) for t in candidate_tiles(rules, head_dim, arch)]
    return prune(configs)


def _spills(config: KernelConfig, report: dict, kernel: str) -> int | None:
    """Spilled bytes beyond the family's allowance of the kernel whose name contains `kernel`; None if absent."""
    for name, figures in (report.get("kernels") or {}).items():
        if kernel in name:
            return family_of(config).excess_spill_bytes(name, figures)
    return None


def prune_by_ptxas(candidate: Candidate, ptxas: dict) -> Candidate:
    """Mark a pass unusable when ptxas says its kernel spills: the tile does not fit the registers, and
    local-memory traffic in the inner loop is never the fast choice. Timing it would only cost time."""
    forward_problem, backward_problem = candidate.forward_problem, candidate.backward_problem
    family = family_of(candidate.config)
    spilled = _spills(candidate.config, ptxas, family.forward_kernel)
    if forward_problem is None and spilled:
        forward_problem = f"forward kernel spills {spilled} B of registers (ptxas)"
    spilled = _spills(candidate.config, ptxas, family.backward_kernel)
    if backward_problem is None and spilled:
        backward_problem = f"dK/dV kernel spills {spilled} B of registers (ptxas)"
    return replace(candidate, forward_problem=forward_problem, backward_problem=backward_problem)


__all__ = ["Candidate", "candidate_space", "candidate_tiles", "default_config", "prune",
           "prune_by_ptxas"]
