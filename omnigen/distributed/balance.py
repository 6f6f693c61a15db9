"""What each chunk of queries costs, and how chunks are dealt to ranks.

A sequence is cut into chunks of `chunk` tokens (the last may be shorter). Queries are sharded by chunk; a rank
fetches whatever keys/values its queries need, so the work a chunk of queries brings is the same wherever it
lands: the weighted count of the tiles its rows visit in the exact plan. That makes balancing a number
partition of the chunks' weights into `world_size` ranks of (nearly) equal token counts, which `deal_balanced`
solves by longest-first dealing and then pairwise swaps out of the busiest rank.

Nothing here imports torch.distributed: it is arithmetic on the plan (numpy), the same on every rank.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from ..layout import AnyLayout
from ..rules import Rules
from ..semantics import CAUSAL, EMPTY, FULL, PARTIAL

# A tile's cost relative to a full tile, forward + backward. Partial tiles read their bits (the Hopper kernels):
# 1.25x a full tile at d128, the last tile-cost measurement in benchmarks/RESULTS.md (S=8K, every tile partial
# against every tile full). Causal tiles run the full tile's products plus an index comparison: 1.1 is an estimate
# (no measurement isolates them); per-rank kernel times in the context-parallel benchmark check the whole model.
TILE_COST: dict[int, float] = {EMPTY: 0.0, FULL: 1.0, CAUSAL: 1.1, PARTIAL: 1.25}

METHODS = ("balanced", "even", "zigzag")


def planning_tile(chunk: int) -> int:
    """The square tile the work is counted in: the largest of 128, 64, 32, 16 that divides the chunk."""
    for tile in (128, 64, 32, 16):
        if chunk % tile == 0:
            return tile
    raise ValueError(f"chunk={chunk} must be a multiple of 16")


def chunk_lengths(seq_len: int, chunk: int) -> np.ndarray:
    """Tokens of every chunk: `chunk` each, the last one what is left."""
    count = -(-seq_len // chunk)
    lengths = np.full(count, chunk, dtype=np.int64)
    lengths[-1] = seq_len - chunk * (count - 1)
    return lengths


def chunk_positions(chunks: np.ndarray, chunk: int, lengths: np.ndarray) -> np.ndarray:
    """int64: the sequence positions of the tokens of `chunks`, in that order."""
    if not len(chunks):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(c * chunk, c * chunk + lengths[c]) for c in chunks])


def chunk_work(rules: Rules, layout: AnyLayout, chunk: int,
               tile_cost: Mapping[int, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(work float64 [n, n], needs bool [n, n]) over the n chunks, summed over the batch: work[i, j] is the weighted
    tile count of query chunk i against key chunk j in the exact plan; needs[i, j] whether any of their pairs is
    allowed (chunk i's queries then need chunk j's keys and values). The host planner's tiles are classified a
    band at a time and summed per chunk pair as they come: no schedules, no [nq, nk] grid."""
    from ..plan import host

    cost = dict(TILE_COST)
    cost.update(tile_cost or {})
    lookup = np.array([cost[EMPTY], cost[FULL], cost[CAUSAL], cost[PARTIAL]], dtype=np.float64)
    tile = planning_tile(chunk)
    problem = host._Problem(rules, host._CpuTables.of(layout.host_tables(rules)), tile, tile)
    return host.problem_cell_sums(problem, chunk // tile, chunk // tile, lookup)


def rank_sizes(chunks: int, world_size: int) -> np.ndarray:
    """Chunks per rank: as equal as they go (the first `chunks % world_size` ranks one more)."""
    sizes = np.full(world_size, chunks // world_size, dtype=np.int64)
    sizes[: chunks % world_size] += 1
    return sizes


def deal_even(chunks: int, world_size: int) -> np.ndarray:
    """owner [chunks]: consecutive runs of chunks, rank 0 first (the plain even split of the tokens)."""
    return np.repeat(np.arange(world_size), rank_sizes(chunks, world_size))


def deal_zigzag(chunks: int, world_size: int) -> np.ndarray:
    """owner [chunks]: the sequence cut into 2 x world_size runs, rank r taking run r and run 2P - 1 - r (the
    split Megatron and TransformerEngine use for causal masks)."""
    runs = np.repeat(np.arange(2 * world_size), rank_sizes(chunks, 2 * world_size))
    return np.where(runs < world_size, runs, 2 * world_size - 1 - runs)


def deal_balanced(weights: np.ndarray, world_size: int, max_swaps: int | None = None) -> np.ndarray:
    """owner [chunks] that makes the largest per-rank sum of `weights` small, every rank holding the chunk count
    `rank_sizes` gives it (memory follows tokens): longest-first dealing to the least-loaded rank with room, then
    the best single swap between the busiest rank and any other while it lowers the busiest load."""
    weights = np.asarray(weights, dtype=np.float64)
    n = len(weights)
    room = rank_sizes(n, world_size)
    owner = np.empty(n, dtype=np.int64)
    load = np.zeros(world_size)
    held = np.zeros(world_size, dtype=np.int64)
    for c in np.argsort(-weights, kind="stable"):
        open_ranks = np.flatnonzero(held < room)
        rank = open_ranks[np.argmin(load[open_ranks])]
        owner[c] = rank
        load[rank] += weights[c]
        held[rank] += 1
    limit = max_swaps if max_swaps is not None else 64 * world_size + 64
    for _ in range(limit):
        busiest = int(np.argmax(load))
        mine = np.flatnonzero(owner == busiest)
        best, move = load[busiest], None
        for other in np.argsort(load):
            if other == busiest or load[other] >= best:
                continue
            theirs = np.flatnonzero(owner == other)
            if not len(theirs) or not len(mine):
                continue
            delta = weights[mine][:, None] - weights[theirs][None, :]  # what the busiest rank gives up
            after = np.maximum(load[busiest] - delta, load[other] + delta)
            a, b = np.unravel_index(np.argmin(after), after.shape)
            if after[a, b] < best - 1e-9 * max(1.0, best):
                best, move = after[a, b], (mine[a], theirs[b], other)
        if move is None:
            break
        c_mine, c_theirs, other = move
        shift = weights[c_mine] - weights[c_theirs]
        owner[c_mine], owner[c_theirs] = other, busiest
        load[busiest] -= shift
        load[other] += shift
    return owner


def deal(method: str, weights: np.ndarray, world_size: int) -> np.ndarray:
    if method == "balanced":
        return deal_balanced(weights, world_size)
    if method == "even":
        return deal_even(len(weights), world_size)
    if method == "zigzag":
        return deal_zigzag(len(weights), world_size)
    raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")


def default_chunk(seq_len: int, world_size: int) -> int:
    """Chunks of 128 x 2^k tokens, at most 2048, giving every rank at least 8 of them where the sequence allows
    (finer chunks balance better; coarser ones cost fewer messages and less planning); 16 x 2^k below 128."""
    target = seq_len / (8 * world_size)
    if target >= 128:
        return int(min(2048, 128 * 2 ** math.floor(math.log2(target / 128))))
    return int(max(16, 16 * 2 ** math.floor(math.log2(max(target, 16) / 16))))
