"""`omnigen.distributed.attention`: one sequence's attention across the ranks of a process group.

Each rank holds the queries, keys and values of its chunks (`Shard.scatter`). Keys and values move as *pieces*:
the chunks of rank A that rank B's queries need (only those the plan says have an allowed pair), cut into pieces
of at most `block_tokens` tokens; round t moves piece t of every such stream. A call's forward:

1. posts round 0 (one batch of point-to-point operations), then runs the rank's queries against its own chunks
   while it moves;
2. for each round: waits for it, posts the next, and runs blocks of `block_tokens` queries against each received
   piece -- only the (block, piece) pairs with an allowed pair -- merging each partial result into the output by
   its log-sum-exp, in place.

The backward runs its own chunks' rectangle first while round 0 moves again (pieces are fetched again rather than
kept: the memory of a rank's activations stays that of its own tokens), then each round's blocks with the merged
output and LSE (so each block's gradients are exact pieces of the whole's); the dK/dV of a piece go back to its
owner in the next batch and are added to the owner's dK/dV as they arrive: a reduce-scatter restricted to the chunks
that moved. Every rectangle is a square of at most `block_tokens` tokens on each side, or the rank's own chunks:
no padded copies of a rank's tensors, and the kernels' dQ accumulators stay block-sized. Transport is
torch.distributed (NCCL on GPUs, gloo on CPUs); nothing else. Every rank posts its batches in the same order
(fetch 0, fetch 1, return 0, fetch 2, return 1, ...), and each batch pairs with its peers' batches of the same
place in that order, so no rank waits on a message that is not yet posted.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..rules import Rules
from .balance import chunk_positions
from .lse_merge import merge_into
from .rectangle import (KernelRectangle, ReferenceRectangle, as_index, batched, default_scale, kernel_tile_shapes,
                        rectangle_mask, square_positions, take_rows)
from .shard import Shard

BLOCK_TOKENS = 8192  # tokens per piece of keys/values and per block of queries (rounded to whole chunks)


@dataclass
class Block:
    """A block of this rank's queries (local rows `rows`) against one received piece, and its rectangle."""

    rows: slice
    rectangle: Any


@dataclass
class Piece:
    """Chunks that move from one rank to another in one round. On the receiving side: the source and the blocks of
    queries that read the piece; on the sending side: the destination and the local rows the piece is made of."""

    peer: int
    tokens: int
    rows: slice | torch.Tensor | None = None
    blocks: list[Block] = field(default_factory=list)


@dataclass
class Round:
    receives: list[Piece] = field(default_factory=list)
    sends: list[Piece] = field(default_factory=list)


@dataclass
class RankWork:
    """Everything one rank runs in a call: its own chunks' rectangle and the rounds of pieces."""

    own: Any
    rounds: list[Round]


def _make_rectangle(shard: Shard, layout, q_chunks: np.ndarray, k_chunks: np.ndarray, q: torch.Tensor,
                    scale: float, kernels: bool | None = None):
    """The rectangle of `q_chunks`' queries against `k_chunks`' keys: run by the kernels (CUDA tensors; `kernels`
    forces it, e.g. on the CPU, where the op's own PyTorch path reads the same mask) or by the reference."""
    if not (q.device.type == "cuda" if kernels is None else kernels):
        q_pos = chunk_positions(q_chunks, shard.chunk, shard.lengths)
        k_pos = chunk_positions(k_chunks, shard.chunk, shard.lengths)
        return ReferenceRectangle(shard.rules, layout, q_pos, k_pos, scale)
    importlib.import_module("omnigen.op")  # registers torch.ops.omnigen.* and the kernels' tile shapes

    rows, cols, q_rows, k_rows = square_positions(q_chunks, k_chunks, shard.chunk, shard.lengths, shard.seq_len)

    def kinds_of(block_m: int, block_n: int) -> torch.Tensor:
        key = ("kinds", str(q.device), layout.batch_size, block_m, block_n)
        if key not in shard._cache:
            from ..plan import plan

            kinds = plan(shard.rules, layout, block_m, block_n, device=q.device).kinds
            shard._cache[key] = kinds if kinds.dim() == 3 else kinds[None]
        return shard._cache[key]

    # The shapes depend on L only through the tuning database's bucket: asked once per L, not once per rectangle
    # (each asking reads the database).
    shapes_key = ("tile shapes", len(rows), str(q.device), q.shape[-1], q.dtype)
    if shapes_key not in shard._cache:
        shard._cache[shapes_key] = kernel_tile_shapes(len(rows), q.device, q.shape[-1], q.dtype)
    mask = rectangle_mask(shard.rules, layout, rows, cols, shard.chunk, q.device, shard._cache[shapes_key], kinds_of)
    return KernelRectangle(mask, as_index(q_rows, q.device), as_index(k_rows, q.device), scale)


def _groups(chunks: np.ndarray, per_group: int) -> list[np.ndarray]:
    return [chunks[i:i + per_group] for i in range(0, len(chunks), per_group)]


def rank_work(shard: Shard, rank: int, q: torch.Tensor, scale: float, block_tokens: int = BLOCK_TOKENS) -> RankWork:
    """The rectangles and rounds of rank `rank` for inputs like `q` (cached on the shard per device, dtype, head
    dim, batch, scale and block size: the rectangles are planned once)."""
    key = ("work", rank, str(q.device), q.dtype, q.shape[0], q.shape[-1], scale, block_tokens)
    found = shard._cache.get(key)
    if found is not None:
        return found
    layout = batched(shard.layout, q.shape[0])
    per_group = max(1, block_tokens // shard.chunk)
    mine = shard.chunks(rank)
    offsets = np.concatenate([[0], np.cumsum(shard.lengths[mine])])
    q_blocks = [(slice(int(offsets[i]), int(offsets[i + len(group)])), group)
                for i, group in zip(range(0, len(mine), per_group), _groups(mine, per_group))]
    rounds: list[Round] = []

    def round_(t: int) -> Round:
        while len(rounds) <= t:
            rounds.append(Round())
        return rounds[t]

    for step in range(1, shard.world_size):
        source = (rank - step) % shard.world_size  # ring order: ranks take their sources in different orders
        for t, piece_chunks in enumerate(_groups(shard.needed_from(rank, source), per_group)):
            piece = Piece(source, int(shard.lengths[piece_chunks].sum()))
            for rows, q_chunks in q_blocks:
                if shard.needs[np.ix_(q_chunks, piece_chunks)].any():
                    piece.blocks.append(Block(rows, _make_rectangle(shard, layout, q_chunks, piece_chunks, q, scale)))
            round_(t).receives.append(piece)
        target = (rank + step) % shard.world_size
        for t, piece_chunks in enumerate(_groups(shard.needed_from(target, rank), per_group)):
            rows = shard.local_rows(rank, piece_chunks)
            round_(t).sends.append(Piece(target, len(rows), rows=as_index(rows, q.device)))
    found = RankWork(_make_rectangle(shard, layout, mine, mine, q, scale), rounds)
    shard._cache[key] = found
    return found


def _post(sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]], group) -> list:
    """Post sends and receives as one batch of point-to-point operations; returns the requests to wait on."""
    def peer(rank: int) -> int:
        return dist.get_global_rank(group, rank) if group is not None else rank

    ops = [dist.P2POp(dist.isend, tensor, peer(rank), group) for rank, tensor in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer(rank), group) for rank, tensor in receives]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _take_rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a [B, H, S, D] tensor as a dense message: a strided copy of a slice where the rows are
    consecutive (the usual case: a rank's chunks sit in sequence order), else a gather. Rows of 16-bit values are
    copied as 8-byte words: PyTorch's copy of a strided slice moves one element per lane, so bf16 rows moved at about
    600 GB/s on an H200 (8.4 ms of a 536 ms four-rank step; as words 3.5 ms)."""
    words = x.dtype.itemsize == 2 and (x.shape[-1] * 2) % 8 == 0 and x.stride(-1) == 1
    source = x.view(torch.int64) if words else x
    taken = take_rows(source, rows).contiguous()
    return taken.view(x.dtype) if words else taken


def _add_rows(x: torch.Tensor, rows: slice | torch.Tensor, incoming: torch.Tensor) -> None:
    """x[:, :, rows] += incoming, with x [B, H, S, D] and incoming a dense [B, tokens, H, D] message: for the
    kernels' heads-inner gradients and consecutive rows, one contiguous add."""
    if isinstance(rows, slice):
        x.transpose(1, 2)[:, rows].add_(incoming)
    else:
        x.transpose(1, 2).index_add_(1, rows, incoming)


def _tokens_major(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] as a dense [B, S, H, D] message: no copy when x is already laid out heads-inner (the kernels'
    outputs are)."""
    return x.transpose(1, 2).contiguous()


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device):
    """The CUDA stream fetches are posted from (one per device): the keys/values they send are ready when a call
    starts, so their transfers need not queue behind the call's own kernels, as they would when posted from the
    compute stream (NCCL waits for the stream it is called from)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class _Call:
    """One call's forward and backward (the work of this rank, the process group)."""

    def __init__(self, work: RankWork, group, device: torch.device) -> None:
        self.work, self.group = work, group
        self.side = _side_stream(device) if device.type == "cuda" else None
        self._in_flight: list[tuple[list, list]] = []  # posted fetches: (requests, the tensors they send)

    def _begin(self) -> None:
        if self.side is not None:  # k and v come from the compute stream
            self.side.wait_stream(torch.cuda.current_stream())

    def _retire(self, keep: int) -> None:
        """Let the side stream wait for all but the last `keep` posted fetches, then drop their send buffers (their
        memory is the side stream's to reuse only once the transfers that read it are done)."""
        while len(self._in_flight) > keep:
            requests, _ = self._in_flight.pop(0)
            if self.side is not None:
                with torch.cuda.stream(self.side):
                    _wait(requests)

    def _fetch(self, t: int, k: torch.Tensor, v: torch.Tensor) -> tuple[list, list]:
        """Post round t's keys/values: (requests, [(k piece, v piece)] in the round's receive order)."""
        rnd = self.work.rounds[t]
        if self.side is not None:
            self._retire(keep=1)
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            sends = [(p.peer, _take_rows(x, p.rows)) for p in rnd.sends for x in (k, v)]
            pieces = [(k.new_empty(k.shape[0], k.shape[1], p.tokens, k.shape[3]),
                       v.new_empty(v.shape[0], v.shape[1], p.tokens, v.shape[3])) for p in rnd.receives]
            receives = [(p.peer, x) for p, pair in zip(rnd.receives, pieces) for x in pair]
            requests = _post(sends, receives, self.group)
        if self.side is not None:
            compute = torch.cuda.current_stream()
            for _, x in receives:
                x.record_stream(compute)  # read there: not reused before the compute stream is done with it
            self._in_flight.append((requests, sends))
        return requests, pieces

    def forward(self, q, k, v):
        acc = _accumulator(q.dtype)
        rounds = self.work.rounds
        self._begin()
        pending = self._fetch(0, k, v) if rounds else None
        out, lse = self.work.own.forward(q, k, v)
        out, lse = out.to(acc), lse.to(acc).contiguous()
        for t in range(len(rounds)):
            requests, pieces = pending
            _wait(requests)
            pending = self._fetch(t + 1, k, v) if t + 1 < len(rounds) else None
            for piece, (kp, vp) in zip(rounds[t].receives, pieces):
                for block in piece.blocks:
                    part_out, part_lse = block.rectangle.forward(q[:, :, block.rows], kp, vp)
                    merge_into(out[:, :, block.rows], lse[:, :, block.rows], part_out, part_lse)
        self._retire(keep=0)
        return out.to(q.dtype), lse

    def backward(self, d_out, q, k, v, out, lse):
        acc = _accumulator(q.dtype)
        rounds = self.work.rounds
        self._begin()
        pending = self._fetch(0, k, v) if rounds else None
        own_dq, dk, dv = self.work.own.backward(d_out, q, k, v, out, lse)
        dq = own_dq.to(acc)
        del own_dq
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
        returning = None  # (requests, [(rows, dk piece, dv piece)]) of the previous round's returns
        for t in range(len(rounds)):
            requests, pieces = pending
            _wait(requests)
            pending = self._fetch(t + 1, k, v) if t + 1 < len(rounds) else None
            gradients = []
            for piece, (kp, vp) in zip(rounds[t].receives, pieces):
                # dK/dV of the piece: one block's as it comes, else summed in `acc` in place (in the layout the
                # kernels return, so the sums run as contiguous passes)
                dk_piece = dv_piece = None
                for block in piece.blocks:
                    rows = block.rows
                    part_dq, part_dk, part_dv = block.rectangle.backward(
                        d_out[:, :, rows], q[:, :, rows], kp, vp, out[:, :, rows], lse[:, :, rows])
                    dq[:, :, rows] += part_dq
                    if dk_piece is None:
                        dk_piece, dv_piece = part_dk, part_dv
                    else:
                        if dk_piece.dtype != acc:
                            dk_piece, dv_piece = dk_piece.to(acc), dv_piece.to(acc)
                        dk_piece += part_dk
                        dv_piece += part_dv
                if dk_piece is None:  # (a piece moves only when some block reads it)
                    dk_piece, dv_piece = torch.zeros_like(kp), torch.zeros_like(vp)
                gradients.append((piece.peer, _tokens_major(dk_piece.to(k.dtype)), _tokens_major(dv_piece.to(v.dtype))))
            self._collect(returning, dk, dv)
            returning = self._return(t, gradients, k)
        self._collect(returning, dk, dv)
        self._retire(keep=0)
        return dq.to(q.dtype), dk, dv

    def _return(self, t: int, gradients: list, k: torch.Tensor):
        """Post round t's dK/dV: those of the pieces this rank received go back to their owners; those of the pieces
        it sent come back to it."""
        sends = [(peer, x) for peer, dk_piece, dv_piece in gradients for x in (dk_piece, dv_piece)]
        incoming = [(p.rows, torch.empty(k.shape[0], p.tokens, k.shape[1], k.shape[3], dtype=k.dtype, device=k.device),
                     torch.empty(k.shape[0], p.tokens, k.shape[1], k.shape[3], dtype=k.dtype, device=k.device))
                    for p in self.work.rounds[t].sends]
        receives = [(p.peer, x) for p, (_, dk_in, dv_in) in zip(self.work.rounds[t].sends, incoming)
                    for x in (dk_in, dv_in)]
        return _post(sends, receives, self.group), incoming

    @staticmethod
    def _collect(returning, dk: torch.Tensor, dv: torch.Tensor) -> None:
        if returning is None:
            return
        requests, incoming = returning
        _wait(requests)
        for rows, dk_in, dv_in in incoming:  # [B, tokens, H, D], as they were sent
            _add_rows(dk, rows, dk_in)
            _add_rows(dv, rows, dv_in)


class _Attention(torch.autograd.Function):
    """Autograd around anything with forward(q, k, v) -> (out, lse) and backward(d_out, q, k, v, out, lse) ->
    (dq, dk, dv) that takes the merged out and lse: a call of this module (`_Call`) or one rectangle."""

    @staticmethod
    def forward(ctx, q, k, v, runner):
        out, lse = runner.forward(q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runner = runner
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.runner.backward(d_out.contiguous(), q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


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


def _check_inputs(q, k, v, shard: Shard, rules: Rules, rank: int, scale: Any) -> None:
    """Every problem of a call at once: the tensors as the op checks them (on CUDA: a dtype and a head dim the
    kernels take; on the CPU the reference takes any), then what the shard asks of them."""
    from ..op import checks

    if not isinstance(shard, Shard):
        raise TypeError(f"shard must come from omnigen.distributed.plan_shards, not {type(shard).__name__}")
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    on_gpu = isinstance(q, torch.Tensor) and q.device.type == "cuda"
    problems = checks.tensor_problems(q, k, v, scale, known_head_dims=on_gpu)
    if rules.mask_hash() != shard.rules.mask_hash():
        problems.append("rules: these rules' mask differs from the one the shard was planned for")
    tokens = shard.tokens(rank)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[2] != tokens:
            problems.append(f"{name} has {x.shape[2]} tokens, but rank {rank} holds {tokens} "
                            f"(shard.scatter(x) gives a rank its tokens)")
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
    block_tokens: int = BLOCK_TOKENS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sequence, differentiable: q [B, Hq, tokens, D] and k, v
    [B, Hkv, tokens, D] hold this rank's tokens (`shard.scatter`), the output is [B, Hq, tokens, D] in the same
    order (`shard.gather` puts the ranks' outputs back together). Every rank of `group` (default: the world) must
    call it with the same shard. CUDA tensors run the kernels (NCCL), CPU tensors the float64 reference (gloo).
    `return_lse`: also the log-sum-exp [B, Hq, tokens] (float32; float64 for float64 inputs). `block_tokens`: the
    most tokens of keys/values moved in one piece and of queries run against it in one rectangle (whole chunks, at
    least one): smaller blocks keep less in flight and overlap more, larger ones launch fewer kernels and sum fewer
    partial gradients (four H200s, Transfusion at 256K: 16384 ran 1.05x faster than 8192 for 1.4x the memory)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive int, not {block_tokens!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("omnigen.distributed.attention needs a process group: torch.distributed."
                           "init_process_group(...) first (one process per rank)")
    world = dist.get_world_size(group)
    if not isinstance(shard, Shard) or shard.world_size != world:
        raise ValueError(f"the shard was planned for {getattr(shard, 'world_size', '?')} ranks, the process group "
                         f"has {world}")
    rank = dist.get_rank(group)
    _check_inputs(q, k, v, shard, rules, rank, scale)
    scale = default_scale(q.shape[-1], scale)
    _check_agreement(shard, group, q.device)
    work = rank_work(shard, rank, q, scale, block_tokens)
    out, lse = _Attention.apply(q, k, v, _Call(work, group, q.device))
    return (out, lse) if return_lse else out


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
    layout = batched(shard.layout, q.shape[0])
    rectangle = _make_rectangle(shard, layout, q_chunks, kv_chunks, q, scale)
    return _Attention.apply(q, k, v, rectangle)


def _chunk_ids(chunks: Any, shard: Shard, name: str) -> np.ndarray:
    ids = np.asarray(chunks, dtype=np.int64).reshape(-1)
    if len(ids) == 0 or ids.min() < 0 or ids.max() >= shard.num_chunks or len(set(ids.tolist())) != len(ids):
        raise ValueError(f"{name} must be distinct chunk ids in [0, {shard.num_chunks}), not {chunks!r}")
    return ids
