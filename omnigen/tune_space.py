"""The tuner's candidate space: which tile configs to compile and time for one (arch, dtype, head dim).

A candidate is one TileConfig -- block_m x block_n (the plan's tile shape), warps and pipeline
stages -- compiled into one module that holds the forward and the backward. The forward and the
backward are tuned separately (one may win with a tile the other loses with), so a candidate can
be usable for the forward only (head dim 256: no backward kernel; a backward that does not fit
the arch's shared memory) and is then timed for the forward alone.

Where the candidates come from: the rules' `kernel.tiles` when given, else DEFAULT_SPACE, a
handful of shapes per head dim that the templates accept (KernelConfig.problems() and
backward_problems() are the authority) and that compile in seconds. The default config -- what
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

from .codegen import KernelConfig, default_tile, excess_spill_bytes
from .rules import Rules, TileConfig

T = TileConfig
# Per head dim: the default tile first, then shapes that trade rows per warp (registers), kv-tile
# width (fewer, longer inner loops; fewer dK/dV CTAs in the backward), warps and pipeline depth.
# Measured earlier on an H200 (RESULTS.md, issue 4): 128x128 / 8 warps is 8% faster for the d128
# backward and 5% slower for its forward -- the kind of split this space is meant to find.
DEFAULT_SPACE: dict[int, tuple[TileConfig, ...]] = {
    64: (T(128, 64, 4, 2), T(128, 128, 8, 2), T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 64, 4, 3), T(64, 128, 4, 2)),
    128: (T(128, 64, 4, 2), T(128, 128, 8, 2), T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 64, 4, 3), T(64, 128, 4, 2)),
    256: (T(64, 32, 4, 2), T(64, 64, 4, 2), T(64, 32, 4, 3), T(128, 64, 8, 2)),
}

# Kernels of a module, by a substring of their (mangled) name in ptxas's report.
FORWARD_KERNEL = "forward_kernel"
BACKWARD_KERNEL = "dkdv_kernel"  # the tuned backward (atomic dQ) is this kernel plus the small Delta one


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
    (the same choice omnigen.build makes)."""
    for tile in rules.kernel.tiles if rules.kernel else ():
        config = KernelConfig(head_dim, dtype, arch, tile)
        if not config.problems():
            return config
    return KernelConfig(head_dim, dtype, arch, default_tile(head_dim))


def candidate_tiles(rules: Rules, head_dim: int) -> tuple[TileConfig, ...]:
    """The rules' `kernel.tiles`, else the default space for the head dim (unfiltered)."""
    if rules.kernel is not None and rules.kernel.tiles:
        return rules.kernel.tiles
    return DEFAULT_SPACE.get(head_dim, (default_tile(head_dim),))


def prune(configs: list[KernelConfig]) -> tuple[list[Candidate], list[tuple[KernelConfig, str]]]:
    """Split configs into candidates worth compiling and (config, why not) for the rest -- before any compile."""
    kept: list[Candidate] = []
    dropped: list[tuple[KernelConfig, str]] = []
    for config in dict.fromkeys(configs):
        problems = config.problems()
        if problems:
            dropped.append((config, "; ".join(problems)))
            continue
        backward = config.backward_problems()
        kept.append(Candidate(config, None, "; ".join(backward) if backward else None))
    return kept, dropped


def candidate_space(rules: Rules, head_dim: int, dtype: str, arch: str
                    ) -> tuple[list[Candidate], list[tuple[KernelConfig, str]]]:
    """The candidates for one (arch, dtype, head dim), the default config first; and what was pruned."""
    default = default_config(rules, head_dim, dtype, arch)
    configs = [default] + [KernelConfig(head_dim, dtype, arch, t) for t in candidate_tiles(rules, head_dim)]
    return prune(configs)


def _spills(report: dict, kernel: str) -> int | None:
    """Spilled bytes beyond the allowance (codegen.excess_spill_bytes) of the kernel whose name contains
    `kernel`; None if absent."""
    for name, figures in (report.get("kernels") or {}).items():
        if kernel in name:
            return excess_spill_bytes(name, figures)
    return None


def prune_by_ptxas(candidate: Candidate, ptxas: dict) -> Candidate:
    """Mark a pass unusable when ptxas says its kernel spills: the tile does not fit the registers, and
    local-memory traffic in the inner loop is never the fast choice. Timing it would only cost time."""
    forward_problem, backward_problem = candidate.forward_problem, candidate.backward_problem
    spilled = _spills(ptxas, FORWARD_KERNEL)
    if forward_problem is None and spilled:
        forward_problem = f"forward kernel spills {spilled} B of registers (ptxas)"
    spilled = _spills(ptxas, BACKWARD_KERNEL)
    if backward_problem is None and spilled:
        backward_problem = f"dK/dV kernel spills {spilled} B of registers (ptxas)"
    return replace(candidate, forward_problem=forward_problem, backward_problem=backward_problem)


__all__ = ["DEFAULT_SPACE", "Candidate", "candidate_space", "candidate_tiles", "default_config", "prune",
           "prune_by_ptxas"]
