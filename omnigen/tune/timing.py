"""Timing candidates fairly on one GPU: CUDA events, warm-up, L2 flush before every run, round-robin.

Every candidate is run `warmup` times first (module load, first-launch costs, clocks up). Then
`rounds` rounds; in each round every candidate runs `reps` times, the candidates in a rotated order
(round r starts with candidate r mod n), so slow drift -- clocks, temperature, another process --
spreads over all of them instead of favouring whoever ran first or last. Before each run a buffer
twice the size of the L2 cache is overwritten, so no candidate finds its inputs cached by the
previous one. Each run is bracketed by CUDA events on the current stream (the flush outside them);
the result per candidate is the list of all its times, and the median is what the tuner compares.

`settle_ms` (the benchmark's peers; the tuner leaves it at 0): before its timed runs in a round, a
candidate runs untimed for about that long, so it is timed at the clocks its own load settles to. A GPU
at its power limit does not hold one clock: on an H200 at 700 W, cuDNN's training step ran its first
~25 ms after a lighter load 12-14% faster than sustained, and omnigen's right after cuDNN's 7% slower
than its own sustained rate (benchmarks/RESULTS.md, 2026-11-24). Without settling, whoever follows the
lightest peer in the rotation is timed in that burst every round.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Mapping

DEFAULT_ROUNDS = 8
DEFAULT_REPS = 3
DEFAULT_WARMUP = 3
BENCH_SETTLE_MS = 250.0


def rotation(names: list[str], round_index: int) -> list[str]:
    """The order of one round: the list rotated by the round number."""
    if not names:
        return []
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def flush_buffer(device=None):
    """A buffer twice the L2 size (at least 64 MiB) whose rewrite evicts everything a run left in L2."""
    import torch

    properties = torch.cuda.get_device_properties(device)
    size = max(2 * int(getattr(properties, "L2_cache_size", 0) or 0), 64 << 20)
    return torch.empty(size, dtype=torch.uint8, device=device or "cuda")


def time_round_robin(
    functions: Mapping[str, Callable[[], object]],
    rounds: int = DEFAULT_ROUNDS,
    reps: int = DEFAULT_REPS,
    warmup: int = DEFAULT_WARMUP,
    on_round: Callable[[int], None] | None = None,
    settle_ms: float = 0.0,
) -> dict[str, list[float]]:
    """Milliseconds of every run of every function, interleaved as described in the module docstring."""
    import torch

    names = list(functions)
    flush = flush_buffer()
    for name in names:
        for _ in range(warmup):
            functions[name]()
    torch.cuda.synchronize()
    settle_runs = {name: _runs_lasting(functions[name], flush, settle_ms) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        pending = []
        for name in rotation(names, round_index):
            for _ in range(settle_runs[name]):  # untimed: the clocks settle to this candidate's load
                flush.zero_()
                functions[name]()
            for _ in range(reps):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                functions[name]()
                end.record()
                pending.append((name, start, end))
        torch.cuda.synchronize()  # once per round: the host never waits between runs of a round
        for name, start, end in pending:
            times[name].append(start.elapsed_time(end))
        if on_round is not None:
            on_round(round_index)
    return times


def _runs_lasting(function: Callable[[], object], flush, milliseconds: float) -> int:
    """How many runs (each after a flush, as timed) take about `milliseconds`: one run is timed to find out."""
    if milliseconds <= 0:
        return 0
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush.zero_()
    start.record()
    function()
    end.record()
    end.synchronize()
    return max(1, math.ceil(milliseconds / max(start.elapsed_time(end), 1e-3)))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def median_ms(function: Callable[[], object], reps: int = 20, warmup: int = DEFAULT_WARMUP) -> float:
    """Median milliseconds of one function (L2 flushed before each run): the quick figure tests print."""
    return median(time_round_robin({"f": function}, rounds=1, reps=reps, warmup=warmup)["f"])


__all__ = ["BENCH_SETTLE_MS", "DEFAULT_REPS", "DEFAULT_ROUNDS", "DEFAULT_WARMUP", "flush_buffer", "median", "median_ms",
           "rotation", "time_round_robin"]
