"""`omnigen.distributed.attention`: one sequence's attention across the ranks of a process group.

Each rank holds the queries, keys and values of its chunks (`Shard.scatter`). A call:

1. posts, in one batch of point-to-point operations, the keys/values of its chunks that other ranks' queries need
   and the receives of the chunks its own queries need -- only those the plan says have an allowed pair;
2. runs its queries against its own chunks while that traffic moves;
3. runs them against each source rank's chunks and merges the partial results by their log-sum-exp.

The backward runs the same rectangles with the merged output and LSE (each rectangle's gradients are then exact
pieces of the whole's), sends the dK/dV of received chunks back to their owners in one batch while the own
rectangle's backward runs, and adds what comes back into the local dK/dV: a reduce-scatter restricted to the
chunks that were sent. Transport is torch.distributed (NCCL on GPUs, gloo on CPUs); nothing else.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..rules import Rules
from .rectangle import (KernelRectangle, ReferenceRectangle, as_index, batched, chunk_positions, default_scale,
                        merge, rectangle_mask, square_positions)
from .shard import Shard


@dataclass
class Source:
    """The chunks rank `rank` receives from one other rank, and the rectangle its queries run on them."""

    rank: int
    tokens: int
    rectangle: Any


@dataclass
class Sink:
    """The local rows (of this rank's chunks) that another rank's queries need."""

    rank: int
    rows: torch.Tensor


@dataclass
class RankWork:
    """Everything one rank runs in a call: its own rectangle, one per source rank, and what it sends."""

    own: Any
    sources: list[Source]
    sinks: list[Sink]


def _make_rectangle(shard: Shard, layout, q_chunks: np.ndarray, k_chunks: np.ndarray, q: torch.Tensor,
                    scale: float, same_tokens: bool, kernels: bool | None = None):
    """The rectangle of `q_chunks`' queries against `k_chunks`' keys: run by the kernels (CUDA tensors; `kernels`
    forces it, e.g. on the CPU, where the op's own PyTorch path reads the same mask) or by the reference."""
    if not (q.device.type == "cuda" if kernels is None else kernels):
        q_pos = chunk_positions(q_chunks, shard.chunk, shard.lengths)
        k_pos = chunk_positions(k_chunks, shard.chunk, shard.lengths)
        return ReferenceRectangle(shard.rules, layout, q_pos, k_pos, scale)
    importlib.import_module("omnigen.op")  # registers torch.ops.omnigen.* and the kernels' tile shapes

    rows, cols, q_rows, k_rows = square_positions(q_chunks, k_chunks, shard.chunk, shard.lengths, shard.seq_len,
                                                  same_tokens)

    def kinds_of(block_m: int, block_n: int) -> torch.Tensor:
        key = ("kinds", str(q.device), layout.batch_size, block_m, block_n)
        if key not in shard._cache:
            from ..plan import plan

            kinds = plan(shard.rules, layout, block_m, block_n, device=q.device).kinds
            shard._cache[key] = kinds if kinds.dim() == 3 else kinds[None]
        return shard._cache[key]

    mask = rectangle_mask(shard.rules, layout, rows, cols, shard.chunk, q.device, q.shape[-1], q.dtype, kinds_of)
    return KernelRectangle(mask, as_index(q_rows, q.device), as_index(k_rows, q.device), scale)


def rank_work(shard: Shard, rank: int, q: torch.Tensor, scale: float) -> RankWork:
    """The rectangles and messages of rank `rank` for inputs like `q` (cached on the shard per device, dtype, head
    dim, batch and scale: planning the rectangles is done once)."""
    key = ("work", rank, str(q.device), q.dtype, q.shape[0], q.shape[-1], scale)
    found = shard._cache.get(key)
    if found is not None:
        return found
    layout = batched(shard.layout, q.shape[0])
    mine = shard.chunks(rank)
    own = _make_rectangle(shard, layout, mine, mine, q, scale, same_tokens=True)
    sources, sinks = [], []
    for step in range(1, shard.world_size):
        source = (rank - step) % shard.world_size  # the ring order: every rank's sources in a different order
        chunks = shard.needed_from(rank, source)
        if len(chunks):
            sources.append(Source(source, int(shard.lengths[chunks].sum()),
                                  _make_rectangle(shard, layout, mine, chunks, q, scale, same_tokens=False)))
        target = (rank + step) % shard.world_size
        wanted = shard.needed_from(target, rank)
        if len(wanted):
            sinks.append(Sink(target, torch.from_numpy(shard.local_rows(rank, wanted)).to(q.device)))
    found = RankWork(own, sources, sinks)
    shard._cache[key] = found
    return found


def _exchange(sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]], group) -> list:
    """Post every send and receive as one batch of point-to-point operations; returns the requests to wait on."""
    def peer(rank: int) -> int:
        return dist.get_global_rank(group, rank) if group is not None else rank

    ops = [dist.P2POp(dist.isend, tensor, peer(rank), group) for rank, tensor in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer(rank), group) for rank, tensor in receives]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Call:
    """One call's forward and backward (the work of this rank, the process group)."""

    def __init__(self, work: RankWork, group) -> None:
        self.work, self.group = work, group

    def forward(self, q, k, v):
        acc = _accumulator(q.dtype)
        kv = torch.stack((k, v))  # [2, B, Hkv, tokens, D]: one message per peer
        sends = [(sink.rank, kv.index_select(3, sink.rows)) for sink in self.work.sinks]
        received = [kv.new_empty(2, k.shape[0], k.shape[1], source.tokens, k.shape[3]) for source in self.work.sources]
        requests = _exchange(sends, [(s.rank, buf) for s, buf in zip(self.work.sources, received)], self.group)
        out, lse = self.work.own.forward(q, k, v)
        out, lse = out.to(acc), lse.to(acc)
        _wait(requests)
        for source, buf in zip(self.work.sources, received):
            part_out, part_lse = source.rectangle.forward(q, buf[0], buf[1])
            out, lse = merge(out, lse, part_out.to(acc), part_lse.to(acc))
        return out.to(q.dtype), lse, received

    def backward(self, d_out, q, k, v, out, lse, received):
        acc = _accumulator(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        returned = []
        for source, buf in zip(self.work.sources, received):
            part_dq, part_dk, part_dv = source.rectangle.backward(d_out, q, buf[0], buf[1], out, lse)
            dq += part_dq
            returned.append((source.rank, torch.stack((part_dk.to(acc), part_dv.to(acc)))))
        incoming = [(sink.rank, torch.empty(2, k.shape[0], k.shape[1], len(sink.rows), k.shape[3], dtype=acc,
                                            device=k.device)) for sink in self.work.sinks]
        requests = _exchange(returned, incoming, self.group)
        own_dq, own_dk, own_dv = self.work.own.backward(d_out, q, k, v, out, lse)
        dq += own_dq
        dk, dv = own_dk.to(acc), own_dv.to(acc)
        _wait(requests)
        for sink, (_, buf) in zip(self.work.sinks, incoming):
            dk.index_add_(2, sink.rows, buf[0])
            dv.index_add_(2, sink.rows, buf[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse, received = call.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, *received)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse, *received = ctx.saved_tensors
        dq, dk, dv = ctx.call.backward(d_out.contiguous(), q, k, v, out, lse, received)
        return dq, dk, dv, None


def _check_agreement(shard: Shard, group, device: torch.device) -> None:
    """Once per (shard, group): every rank holds the same shard (else each would wait for messages never sent).
    The mark lives on the shard: every rank checks a new shard, whatever its Python id."""
    key = ("agreed", group)
    if shard._cache.get(key):
        return
    mine = shard.fingerprint()
    found = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    if int(found[0]) != mine or -int(found[1]) != mine:
        raise ValueError("the ranks hold different shards: make the shard on every rank with the same "
                         "plan_shards(rules, layout, world_size, chunk, method=...) arguments")
    shard._cache[key] = True


def _check_inputs(q, k, v, shard: Shard, rules: Rules, rank: int) -> None:
    problems = []
    if not isinstance(shard, Shard):
        raise TypeError(f"shard must come from omnigen.distributed.plan_shards, not {type(shard).__name__}")
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    if rules.mask_hash() != shard.rules.mask_hash():
        problems.append("rules: these rules' mask differs from the one the shard was planned for")
    tokens = shard.tokens(rank)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            problems.append(f"{name} must be a 4-D tensor [B, H, tokens, D]")
        elif x.shape[2] != tokens:
            problems.append(f"{name} has {x.shape[2]} tokens, but rank {rank} holds {tokens} "
                            f"(shard.scatter(x) gives a rank its tokens)")
    if not problems:
        if q.shape[0] != k.shape[0] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
            problems.append(f"q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} must agree in batch and "
                            "head dim, k and v in everything")
        elif q.shape[1] % k.shape[1]:
            problems.append(f"q's heads ({q.shape[1]}) must be a multiple of k's ({k.shape[1]})")
        if len({q.device, k.device, v.device}) > 1 or len({q.dtype, k.dtype, v.dtype}) > 1:
            problems.append("q, k and v must share a device and a dtype")
    if problems:
        raise ValueError("omnigen.distributed.attention: " + "; ".join(problems))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shard: Shard,
    rules: Rules,
    group: Any = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sequence, differentiable: q [B, Hq, tokens, D] and k, v
    [B, Hkv, tokens, D] hold this rank's tokens (`shard.scatter`), the output is [B, Hq, tokens, D] in the same
    order (`shard.gather` puts the ranks' outputs back together). Every rank of `group` (default: the world) must
    call it with the same shard. CUDA tensors run the kernels (NCCL), CPU tensors the float64 reference (gloo).
    `return_lse`: also the log-sum-exp [B, Hq, tokens] (float32; float64 for float64 inputs)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("omnigen.distributed.attention needs a process group: torch.distributed."
                           "init_process_group(...) first (one process per rank)")
    world = dist.get_world_size(group)
    if not isinstance(shard, Shard) or shard.world_size != world:
        raise ValueError(f"the shard was planned for {getattr(shard, 'world_size', '?')} ranks, the process group "
                         f"has {world}")
    rank = dist.get_rank(group)
    _check_inputs(q, k, v, shard, rules, rank)
    scale = default_scale(q.shape[-1], scale)
    _check_agreement(shard, group, q.device)
    work = rank_work(shard, rank, q, scale)
    out, lse = _Attention.apply(q, k, v, _Call(work, group))
    return (out, lse) if return_lse else out


class _Rectangle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rectangle):
        out, lse = rectangle.forward(q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rectangle = rectangle
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.rectangle.backward(d_out.contiguous(), q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shard: Shard,
    q_chunks: Any,
    kv_chunks: Any,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectangular attention: the queries of chunks `q_chunks` against the keys/values of chunks `kv_chunks` (chunk
    ids of `shard`, each list in the order its tokens sit in q / in k and v) under the shard's rules and layout,
    at the tokens' sequence positions. Returns (out, lse), differentiable in q, k, v; two rectangles of the same
    queries merge with `omnigen.distributed.merge`. Also chunked prefill: new chunks' queries against a KV cache.
    One process, no communication; CUDA tensors run the kernels, CPU tensors the float64 reference."""
    q_chunks = _chunk_ids(q_chunks, shard, "q_chunks")
    kv_chunks = _chunk_ids(kv_chunks, shard, "kv_chunks")
    for name, x, chunks in (("q", q, q_chunks), ("k", k, kv_chunks), ("v", v, kv_chunks)):
        tokens = int(shard.lengths[chunks].sum())
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[2] != tokens:
            raise ValueError(f"{name} must be [B, H, {tokens}, D] (the tokens of its chunks), not "
                             f"{list(getattr(x, 'shape', []))}")
    scale = default_scale(q.shape[-1], scale)
    same = len(q_chunks) == len(kv_chunks) and bool((q_chunks == kv_chunks).all())
    layout = batched(shard.layout, q.shape[0])
    rectangle = _make_rectangle(shard, layout, q_chunks, kv_chunks, q, scale, same_tokens=same)
    return _Rectangle.apply(q, k, v, rectangle)


def _chunk_ids(chunks: Any, shard: Shard, name: str) -> np.ndarray:
    ids = np.asarray(chunks, dtype=np.int64).reshape(-1)
    if len(ids) == 0 or ids.min() < 0 or ids.max() >= shard.num_chunks or len(set(ids.tolist())) != len(ids):
        raise ValueError(f"{name} must be distinct chunk ids in [0, {shard.num_chunks}), not {chunks!r}")
    return ids
