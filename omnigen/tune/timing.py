"""Timing candidates fairly on one GPU: CUDA events, warm-up, L2 flush before every run, round-robin.

Every candidate is run `warmup` times first (module load, first-launch costs, clocks up). Then
`rounds` rounds; in each round every candidate runs `reps` times, the candidates in a rotated order
(round r starts with candidate r mod n), so slow drift -- clocks, temperature, another process --
spreads over all of them instead of favouring whoever ran first or last. Before each run a buffer
twice the size of the L2 cache is overwritten, so no candidate finds its inputs cached by the
previous one. Each run is bracketed by CUDA events on the current stream (the flush outside them);
the result per candidate is the list of all its times, and the median is what the tuner compares.
"""

from __future__ import annotations

import statistics
from typing import Callable, Mapping

DEFAULT_ROUNDS = 8
DEFAULT_REPS = 3
DEFAULT_WARMUP = 3


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
) -> dict[str, list[float]]:
    """Milliseconds of every run of every function, interleaved as described in the module docstring."""
    import torch

    names = list(functions)
    flush = flush_buffer()
    for name in names:
        for _ in range(warmup):
            functions[name]()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        pending = []
        for name in rotation(names, round_index):
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


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def median_ms(function: Callable[[], object], reps: int = 20, warmup: int = DEFAULT_WARMUP) -> float:
    """Median milliseconds of one function (L2 flushed before each run): the quick figure tests print."""
    return median(time_round_robin({"f": function}, rounds=1, reps=reps, warmup=warmup)["f"])


__all__ = ["DEFAULT_REPS", "DEFAULT_ROUNDS", "DEFAULT_WARMUP", "flush_buffer", "median", "median_ms", "rotation", "time_round_robin"]
