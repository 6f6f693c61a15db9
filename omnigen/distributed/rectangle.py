"""Rectangular attention: some chunks of queries against some chunks of keys/values, returning O and LSE.

This is one rank's share of context-parallel attention (its queries against its own chunks, or against the
chunks another rank sent) and also chunked prefill against a KV cache. Two ways to run one rectangle:

- `KernelRectangle` (CUDA): the rectangle is planned exactly, tile by tile, from the layout's own plan, and run by
  the kernels as a mask made from data (`plan.ruleless`): a square problem of L tokens whose row i is the i-th
  query and whose column j is the j-th key (`square_positions`; the shorter side padded with zeros, tiles the
  schedules never visit). A local tile maps to one tile of the whole sequence's plan, because chunks are
  multiples of every tile dimension: its kind is that tile's kind (a causal tile keeps its diagonal only where
  queries and keys sit as far apart locally as in the sequence, else it is partial), and a partial tile's bits are
  the rules evaluated at the tokens' sequence positions (windows and causality included).
- `ReferenceRectangle` (CPU): the same arithmetic in float64 (the rules' predicate at sequence positions, a dense
  softmax), for tests; its backward is the kernels' formula (P from the final LSE, delta from the final O), so
  the distributed code around it is the code the GPU runs.

Both take and return [B, H, rows, D] tensors: `forward(q, k, v) -> (out, lse)` and
`backward(d_out, q, k, v, out, lse) -> (dq, dk, dv)` where out/lse are the *merged* results of every rectangle of
the queries (so that the pieces' gradients add up to the whole's).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..layout import AnyLayout, Layout, LayoutBatch
from ..rules import Rules
from ..reference import _expand_kv
from ..semantics import CAUSAL, FULL, PARTIAL, pair_predicate


def batched(layout: AnyLayout, batch: int) -> LayoutBatch:
    """The layout as a batch of `batch` (one layout repeated, or a batch of that size)."""
    if isinstance(layout, Layout):
        return LayoutBatch([layout] * batch)
    if layout.batch_size != batch:
        raise ValueError(f"the shard's layout has a batch of {layout.batch_size}, q has {batch}")
    return layout


def _fold(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """Gradients of the expanded heads summed back onto each key/value head."""
    B, H, S, D = x.shape
    return x.view(B, heads_kv, H // heads_kv, S, D).sum(2) if H != heads_kv else x


class ReferenceRectangle:
    """Queries at sequence positions `q_pos` against keys at `k_pos`, in float64 (the CPU path)."""

    def __init__(self, rules: Rules, layout: LayoutBatch, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
                 device: torch.device | str = "cpu") -> None:
        tables = layout.tables(rules, device)
        b = torch.arange(layout.batch_size, device=device)[:, None, None]
        qp = torch.as_tensor(q_pos, device=device)[None, :, None]
        kp = torch.as_tensor(k_pos, device=device)[None, None, :]
        self.allowed = pair_predicate(rules, tables, b, qp, kp)[:, None]  # [B, 1, Sq, Sk]
        self.scale = scale

    def _scores(self, q, k):
        scores = torch.matmul(q.double(), _expand_kv(k.double(), q.shape[1]).transpose(-1, -2)) * self.scale
        return scores.masked_fill(~self.allowed, float("-inf"))

    def _probabilities(self, scores, lse):
        """exp(scores - lse) on allowed pairs, 0 elsewhere (rows without keys: lse -inf, all 0)."""
        finite = torch.where(torch.isfinite(lse), lse.double(), torch.zeros_like(lse, dtype=torch.float64))
        return torch.where(self.allowed, torch.exp(scores - finite[..., None]), torch.zeros_like(scores))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self._scores(q, k)
        lse = torch.logsumexp(scores, dim=-1)  # -inf for a row without keys
        return torch.matmul(self._probabilities(scores, lse), _expand_kv(v.double(), q.shape[1])), lse

    def backward(self, d_out, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self._probabilities(self._scores(q, k), lse)
        d_out, out = d_out.double(), out.double()
        v64 = _expand_kv(v.double(), q.shape[1])
        dv = torch.matmul(p.transpose(-1, -2), d_out)
        dp = torch.matmul(d_out, v64.transpose(-1, -2))
        delta = (d_out * out).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, _expand_kv(k.double(), q.shape[1])) * self.scale
        dk = torch.matmul(ds.transpose(-1, -2), q.double()) * self.scale
        return dq, _fold(dk, k.shape[1]), _fold(dv, k.shape[1])


class KernelRectangle:
    """A rectangle run by the CUDA kernels through a mask made from data (see the module docstring).

    `q_index`, `k_index`: where the rectangle's queries and keys sit among the L rows of the square (a slice where
    they are contiguous, else an int64 tensor); every other row is padding: zeros in, ignored out."""

    def __init__(self, mask: Any, q_index: slice | torch.Tensor, k_index: slice | torch.Tensor, scale: float) -> None:
        from ..op import library
        from ..plan.ruleless import RULELESS_KEY

        self.mask, self.q_index, self.k_index, self.scale = mask, q_index, k_index, scale
        self.length = mask.seq_len
        self.kernel_key = library.RULES_PREFIX + RULELESS_KEY
        self._inputs = (mask.schedules, list(mask.tile_shapes), mask.token_segment, mask.token_modality,
                        mask.token_doc, self.kernel_key, float(scale), False)

    def _place(self, x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
        """x at rows `index` of an L-row tensor of zeros (x itself when it fills the square)."""
        if isinstance(index, slice) and index.start == 0 and index.stop == self.length == x.shape[2]:
            return x
        shape = list(x.shape)
        shape[2] = self.length
        out = x.new_zeros(shape)
        if isinstance(index, slice):
            out[:, :, index] = x
        else:
            out.index_copy_(2, index, x)
        return out

    def forward(self, q, k, v):
        out, lse = torch.ops.omnigen.attention(self._place(q, self.q_index), self._place(k, self.k_index),
                                               self._place(v, self.k_index), *self._inputs)
        return take_rows(out, self.q_index), take_rows(lse.unsqueeze(-1), self.q_index).squeeze(-1)

    def backward(self, d_out, q, k, v, out, lse):
        # Padding rows: q = dO = O = 0 and lse 0, so every product they take part in is exactly 0.
        dq, dk, dv = torch.ops.omnigen.attention_backward(
            self._place(d_out, self.q_index), self._place(q, self.q_index), self._place(k, self.k_index),
            self._place(v, self.k_index), self._place(out, self.q_index),
            self._place(lse.unsqueeze(-1), self.q_index).squeeze(-1), *self._inputs)
        return take_rows(dq, self.q_index), take_rows(dk, self.k_index), take_rows(dv, self.k_index)


# ---- the rectangle's mask ------------------------------------------------------------------------------------


def _padded(chunks: np.ndarray, chunk: int, lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Positions of `chunks`, each chunk filling `chunk` rows (a short chunk's rest: `seq_len`, no token)."""
    positions = np.full(len(chunks) * chunk, seq_len, dtype=np.int64)
    for i, c in enumerate(chunks):
        positions[i * chunk: i * chunk + lengths[c]] = np.arange(c * chunk, c * chunk + lengths[c])
    return positions


def square_positions(q_chunks: np.ndarray, k_chunks: np.ndarray, chunk: int, lengths: np.ndarray,
                     seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(row positions [L], column positions [L], query rows, key rows) of the L-token square a rectangle runs as.

    Row i is a query and column j a key; they need not be the same token, since a mask made from data says which
    pairs are allowed (a causal tile keeps its diagonal only where row and column offsets match the sequence's).
    So queries and keys share the square's indices, each chunk at a chunk boundary, and L is the longer of the two:
    a rectangle of equal sides needs no padding and no copy. A row or column at `seq_len` is padding; the last
    chunk of the longer side is not padded."""
    rows = _padded(q_chunks, chunk, lengths, seq_len)
    cols = _padded(k_chunks, chunk, lengths, seq_len)
    length = max(len(rows) - (chunk - lengths[q_chunks[-1]]), len(cols) - (chunk - lengths[k_chunks[-1]]))
    rows = np.concatenate([rows, np.full(max(0, length - len(rows)), seq_len, dtype=np.int64)])[:length]
    cols = np.concatenate([cols, np.full(max(0, length - len(cols)), seq_len, dtype=np.int64)])[:length]
    return rows, cols, np.flatnonzero(rows < seq_len), np.flatnonzero(cols < seq_len)


def as_index(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """A slice where `rows` are consecutive, else an int64 tensor on `device`."""
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1:
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return torch.as_tensor(rows, device=device)


def take_rows(x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """Rows `index` (an `as_index`: a slice, a view, or an int64 tensor, a gather) of a [B, H, S, ...] tensor."""
    return x[:, :, index] if isinstance(index, slice) else x.index_select(2, index)


def _global_tiles(positions: torch.Tensor, block: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each local tile of `block` tokens: (the sequence tile its first token lies in, whether it has one)."""
    firsts = positions[::block]
    return (firsts.clamp(max=seq_len - 1) // block), firsts < seq_len


def kernel_tile_shapes(L: int, device: torch.device, head_dim: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """The tile shapes the bits-only kernels may run for an L-token square (the families' defaults and this GPU's
    tuning database, as `omnigen.mask_from_*` pick them)."""
    from ..plan import ruleless

    kernel_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None  # (the CPU path takes any float)
    return ruleless.tile_shapes(L, device, None, head_dim, kernel_dtype)


def rectangle_mask(rules: Rules, layout: LayoutBatch, rows: np.ndarray, cols: np.ndarray, chunk: int,
                   device: torch.device, shapes: list[tuple[int, int]], kinds_of: Any) -> Any:
    """The Mask (made from data) of the square whose rows/columns are the tokens at sequence positions `rows` and
    `cols` (`seq_len` for none), for the tile `shapes` (`kernel_tile_shapes`). `kinds_of(block_m, block_n)` gives
    the whole sequence's tile kinds, int8 [B, nq, nk] on `device`. Every tile dimension must divide `chunk`."""
    from ..plan import ruleless

    S, B, L = layout.seq_len, layout.batch_size, len(rows)
    bad = [f"{m}x{n}" for m, n in shapes if chunk % m or chunk % n]
    if bad:
        raise ValueError(f"chunk={chunk} is not a multiple of the kernels' tile sizes ({', '.join(bad)}): plan the "
                         "shards with chunk a multiple of 128")
    tables = layout.tables(rules, device)
    row_pos = torch.as_tensor(rows, device=device)
    col_pos = torch.as_tensor(cols, device=device)
    made = []
    for block_m, block_n in shapes:
        whole = kinds_of(block_m, block_n)
        gq, q_ok = _global_tiles(row_pos, block_m, S)
        gk, k_ok = _global_tiles(col_pos, block_n, S)
        kinds = whole[:, gq][:, :, gk]
        kinds = torch.where(q_ok[None, :, None] & k_ok[None, None, :], kinds, torch.zeros_like(kinds))
        # A causal tile keeps its diagonal (the kernels compare local indices) only where its rows and columns sit
        # as far apart locally as in the sequence; elsewhere it becomes partial, with bits.
        local = (torch.arange(len(gq), device=device) * block_m)[:, None] - (torch.arange(len(gk), device=device)
                                                                             * block_n)[None, :]
        moved = (kinds == CAUSAL) & (local != row_pos[::block_m][:, None] - col_pos[::block_n][None, :])[None]
        # A full or causal tile with padding among its rows or columns is partial here: bits leave the padding out
        # (padding keys would otherwise take part in the softmax).
        padded = _has_padding(row_pos, block_m, S)[:, None] | _has_padding(col_pos, block_n, S)[None, :]
        moved |= ((kinds == FULL) | (kinds == CAUSAL)) & padded[None]
        kinds = torch.where(moved, torch.full_like(kinds, PARTIAL), kinds).contiguous()
        made.append(_shape_plan(rules, tables, kinds, row_pos, col_pos, block_m, block_n, S))
    return ruleless.ruleless_mask(made, B, L, True, device, "exact", made_by="omnigen.distributed")


def _has_padding(positions: torch.Tensor, block: int, seq_len: int) -> torch.Tensor:
    """bool per local tile of `block` tokens: some of its rows are padding (inside the square)."""
    tiles = -(-len(positions) // block)
    padded = torch.full((tiles * block,), False, device=positions.device)
    padded[: len(positions)] = positions >= seq_len
    return padded.view(tiles, block).any(1)


def _tile_positions(positions: torch.Tensor, index: torch.Tensor, block: int, seq_len: int) -> torch.Tensor:
    """[n, block]: the sequence positions of tiles `index` (seq_len past the square's end)."""
    offsets = index[:, None] * block + torch.arange(block, device=positions.device)[None, :]
    inside = offsets < len(positions)
    return torch.where(inside, positions[offsets.clamp(max=len(positions) - 1)], seq_len)


def _real_per_tile(positions: torch.Tensor, block: int, seq_len: int) -> torch.Tensor:
    """int64 per local tile of `block` tokens: how many of its rows are tokens (not padding, not past the end)."""
    tiles = -(-len(positions) // block)
    padded = torch.full((tiles * block,), seq_len, dtype=positions.dtype, device=positions.device)
    padded[: len(positions)] = positions
    return (padded.view(tiles, block) < seq_len).sum(1)


def _shape_plan(rules, tables, kinds, row_pos, col_pos, block_m, block_n, S):
    from ..plan.ruleless import ShapePlan

    b, i, j = (kinds == PARTIAL).nonzero(as_tuple=True)
    partials = []
    pairs = torch.zeros((), dtype=torch.int64, device=kinds.device)
    step = max(1, (1 << 24) // (block_m * block_n))
    for start in range(0, len(b), step):
        bb, ii, jj = b[start:start + step], i[start:start + step], j[start:start + step]
        blocks = pair_predicate(rules, tables, bb[:, None, None], _tile_positions(row_pos, ii, block_m, S)[:, :, None],
                                _tile_positions(col_pos, jj, block_n, S)[:, None, :])
        partials.append((bb, ii, jj, blocks))
        pairs += blocks.sum()
    # Full and causal tiles are counted from their real rows and columns, never tile by tile: a full tile has
    # rows x columns pairs; a causal tile's tokens are consecutive from its first row and column (one chunk), so its
    # row r sees the columns c <= q0 + r - k0.
    rows_real, cols_real = _real_per_tile(row_pos, block_m, S), _real_per_tile(col_pos, block_n, S)
    _, ii, jj = (kinds == FULL).nonzero(as_tuple=True)
    pairs += (rows_real[ii] * cols_real[jj]).sum()
    _, ii, jj = (kinds == CAUSAL).nonzero(as_tuple=True)
    if len(ii):
        r = torch.arange(block_m, device=kinds.device)[None, :]
        reach = row_pos[ii * block_m][:, None] + r - col_pos[jj * block_n][:, None] + 1
        seen = torch.minimum(reach.clamp(min=0), cols_real[jj][:, None])
        pairs += torch.where(r < rows_real[ii][:, None], seen, 0).sum()
    return ShapePlan(block_m, block_n, kinds, int(pairs), partials, partial_count=len(b))


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


__all__ = ["KernelRectangle", "ReferenceRectangle", "as_index", "batched", "kernel_tile_shapes", "rectangle_mask",
           "square_positions", "take_rows"]
