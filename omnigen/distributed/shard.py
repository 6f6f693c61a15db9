"""`plan_shards`: which rank holds which chunks of the sequence, and what each rank must receive.

    shard = omnigen.distributed.plan_shards(rules, layout, world_size=8)
    q_local = shard.scatter(q)          # [B, H, S, D] -> this rank's tokens, [B, H, shard.tokens(rank), D]
    out = shard.gather(out_local)       # all ranks' outputs back in sequence order (an all-gather)

A `Shard` is plain data, identical on every rank that makes it from the same arguments (nothing random, nothing
read from the process group), so ranks agree on it without talking; `omnigen.distributed.attention` checks once
per process group that they do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..layout import AnyLayout, as_layout
from ..rules import Rules
from . import balance


@dataclass(eq=False)
class Shard:
    """Chunks of `chunk` tokens dealt to `world_size` ranks (see `plan_shards`).

    `owner[c]`: the rank holding chunk c; `lengths[c]`: its tokens (the last chunk may be shorter);
    `needs[i, j]`: query chunk i has an allowed pair in key chunk j; `chunk_work[c]`: the planned work of chunk c's
    queries (tiles weighted by `balance.TILE_COST`); `method`: "balanced", "even" or "zigzag"."""

    rules: Rules
    layout: AnyLayout
    world_size: int
    chunk: int
    method: str
    owner: np.ndarray
    lengths: np.ndarray
    needs: np.ndarray
    chunk_work: np.ndarray
    _cache: dict = field(default_factory=dict, repr=False)

    # -- what each rank holds ----------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        return int(self.lengths.sum())

    @property
    def batch_size(self) -> int:
        return self.layout.batch_size

    @property
    def num_chunks(self) -> int:
        return len(self.owner)

    def chunks(self, rank: int) -> np.ndarray:
        """The chunks rank `rank` holds, ascending: its local tokens are these chunks' tokens in this order."""
        self._check_rank(rank)
        return np.flatnonzero(self.owner == rank)

    def tokens(self, rank: int) -> int:
        return int(self.lengths[self.chunks(rank)].sum())

    def positions(self, rank: int) -> np.ndarray:
        """int64 [tokens(rank)]: the sequence position of each of the rank's local tokens."""
        key = ("positions", rank)
        if key not in self._cache:
            self._cache[key] = balance.chunk_positions(self.chunks(rank), self.chunk, self.lengths)
        return self._cache[key]

    def local_rows(self, rank: int, chunks: np.ndarray) -> np.ndarray:
        """int64: the rows of rank `rank`'s local tensors that hold `chunks` (chunks it owns), in the given order."""
        mine = self.chunks(rank)
        offsets = np.concatenate([[0], np.cumsum(self.lengths[mine])])
        where = {int(c): i for i, c in enumerate(mine)}
        missing = [int(c) for c in chunks if int(c) not in where]
        if missing:
            raise ValueError(f"rank {rank} does not hold chunks {missing}")
        return np.concatenate([np.arange(offsets[where[int(c)]], offsets[where[int(c)] + 1]) for c in chunks]) \
            if len(chunks) else np.zeros(0, dtype=np.int64)

    def wanted(self, rank: int) -> np.ndarray:
        """bool [chunks]: the chunks whose keys/values rank `rank`'s queries need (its own included)."""
        key = ("wanted", rank)
        if key not in self._cache:
            self._cache[key] = self.needs[self.chunks(rank)].any(axis=0)
        return self._cache[key]

    def needed_from(self, rank: int, source: int) -> np.ndarray:
        """The chunks of rank `source` that rank `rank`'s queries need (ascending)."""
        return np.flatnonzero(self.wanted(rank) & (self.owner == source))

    # -- balance -------------------------------------------------------------------------------------

    @property
    def work(self) -> np.ndarray:
        """float64 [world_size]: each rank's planned work (tiles weighted by cost)."""
        return np.bincount(self.owner, weights=self.chunk_work, minlength=self.world_size)

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' planned work, minus 1 (0 when perfectly even)."""
        work = self.work
        return float(work.max() / work.mean() - 1.0) if work.mean() > 0 else 0.0

    @property
    def received_tokens(self) -> np.ndarray:
        """int64 [world_size]: the tokens of keys/values each rank receives from the others."""
        out = np.zeros(self.world_size, dtype=np.int64)
        for rank in range(self.world_size):
            out[rank] = int(self.lengths[self.wanted(rank) & (self.owner != rank)].sum())
        return out

    def received_bytes(self, heads_kv: int, head_dim: int, element_size: int = 2) -> np.ndarray:
        """int64 [world_size]: bytes of K and V each rank receives for these head counts (bf16: 2 bytes)."""
        return self.received_tokens * (2 * heads_kv * head_dim * element_size)

    def summary(self) -> dict:
        work = self.work
        received = self.received_tokens
        return {"method": self.method, "world_size": self.world_size, "chunk": self.chunk, "seq_len": self.seq_len,
                "work_max_over_mean": float(work.max() / work.mean()) if work.mean() > 0 else 1.0,
                "work": work.tolist(), "received_tokens": received.tolist(),
                "received_max_tokens": int(received.max()), "received_mean_tokens": float(received.mean())}

    def fingerprint(self) -> int:
        """A 62-bit digest of what ranks must agree on (the deal, the lengths, the rules' mask)."""
        digest = hashlib.sha256()
        for part in (self.owner.astype(np.int64), self.lengths.astype(np.int64), np.packbits(self.needs)):
            digest.update(part.tobytes())
        digest.update(f"{self.rules.mask_hash()}:{self.world_size}:{self.chunk}".encode())
        return int.from_bytes(digest.digest()[:8], "little") >> 2

    def __repr__(self) -> str:
        return (f"Shard({self.method}, {self.world_size} ranks, {self.num_chunks} chunks of {self.chunk}, "
                f"S={self.seq_len}, work max/mean {1 + self.imbalance:.3f})")

    # -- moving tensors ------------------------------------------------------------------------------

    def scatter(self, x, rank: int | None = None, group=None):
        """This rank's tokens of a [B, H, S, D] tensor every rank holds whole: [B, H, tokens(rank), D]
        (an index, no communication; differentiable)."""
        import torch

        rank = _rank(rank, group)
        if x.dim() != 4 or x.shape[2] != self.seq_len:
            raise ValueError(f"x must be [B, H, S={self.seq_len}, D], not {list(x.shape)}")
        index = torch.from_numpy(self.positions(rank)).to(x.device)
        return x.index_select(2, index)

    def gather(self, y, group=None):
        """The whole [B, H, S, D] tensor from every rank's [B, H, tokens(rank), D] part, on every rank (an
        all-gather; not differentiable)."""
        import torch
        import torch.distributed as dist

        rank = _rank(None, group)
        if y.dim() != 4 or y.shape[2] != self.tokens(rank):
            raise ValueError(f"y must be [B, H, {self.tokens(rank)} (this rank's tokens), D], not {list(y.shape)}")
        most = max(self.tokens(r) for r in range(self.world_size))
        padded = y.new_zeros(y.shape[0], y.shape[1], most, y.shape[3])
        padded[:, :, : y.shape[2]] = y
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        out = y.new_empty(y.shape[0], y.shape[1], self.seq_len, y.shape[3])
        for r, part in enumerate(parts):
            index = torch.from_numpy(self.positions(r)).to(y.device)
            out.index_copy_(2, index, part[:, :, : len(index)])
        return out

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), not {rank!r}")


def _rank(rank: int | None, group) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("no process group: call torch.distributed.init_process_group first, or pass rank=")
    return dist.get_rank(group)


def plan_shards(
    rules: Rules,
    layout: AnyLayout | str,
    world_size: int,
    chunk: int | None = None,
    *,
    method: str = "balanced",
    tile_cost: Mapping[int, float] | None = None,
) -> Shard:
    """Deal the sequence's chunks to `world_size` ranks so that the planned attention work is balanced.

    `chunk`: tokens per chunk (a multiple of 16; the GPU kernels need a multiple of their tile sizes, 128 covers
    every default), by default 128 x 2^k up to 2048 with at least 8 chunks a rank. `method`: "balanced" (min-max
    of the planned work per rank: full, causal and partial tiles weighted by `tile_cost`, default
    `balance.TILE_COST`), or the usual "even" (consecutive runs) and "zigzag" splits to compare against. Every
    rank gets the same number of chunks (one more for the first `chunks % world_size`)."""
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    layout = as_layout(layout)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    if method not in balance.METHODS:
        raise ValueError(f"method must be one of {', '.join(balance.METHODS)}, not {method!r}")
    S = layout.seq_len
    if chunk is None:
        chunk = balance.default_chunk(S, world_size)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk % 16:
        raise ValueError(f"chunk must be a multiple of 16 tokens, not {chunk!r}")
    lengths = balance.chunk_lengths(S, chunk)
    if S < 16 * world_size:
        raise ValueError(f"a sequence of {S} tokens is too short for {world_size} ranks: each needs at least one "
                         "chunk of 16 tokens")
    if len(lengths) < world_size:
        raise ValueError(f"{len(lengths)} chunks of {chunk} tokens cannot give each of {world_size} ranks one: "
                         f"pass a chunk of at most {max(16, (S // world_size) // 16 * 16)}")
    work, needs = balance.chunk_work(rules, layout, chunk, tile_cost)
    chunk_work = work.sum(axis=1)
    owner = balance.deal(method, chunk_work, world_size)
    return Shard(rules, layout, world_size, chunk, method, owner, lengths, needs, chunk_work)
