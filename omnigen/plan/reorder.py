"""`reorder`: a permutation of token positions that makes a fragmented mask compact, kept only when the plan says
it pays (Binary Block Masking's RCM step, judged by omnigen's exact tile plan).

Attention with one permutation `p` applied to queries and keys alike is the same attention: with q' = q[p], k' = k[p],
v' = v[p] and the permuted mask M'[i, j] = M[p[i], p[j]], out = scatter(attention(q', k', v', M')). When the
allowed pairs of M are scattered in token order (a MEDUSA tree, interleaved audio/video frames with windows,
shuffled documents) M' can cover far fewer tiles, so the kernels visit less; the price is a gather of q, k, v
and a scatter of out (and, in the backward, a gather of dOut and scatters of dQ, dK, dV).

What this module does (pure planning: tensors in, a permutation and a Mask out; the op layer applies it):

1. Reads the mask once at a coarse grain: `granularity` consecutive tokens are one *atom* (a power of two <= 16,
   so atoms never straddle a tile), and for every pair of atoms whether any pair is allowed and whether all are
   (O((S / g)^2) booleans; the mask is evaluated in bounded slabs, never S x S at once).
2. Proposes permutations of atoms: connected components of the atom graph (symmetrised), each kept in token
   order; Reverse Cuthill-McKee (our own, below) over the graph; both again after putting the "hub" atoms (those
   that touch most others, e.g. a MEDUSA prefix or global tokens) first; and atoms sorted by the keys they see
   (`keyset_order`: a depth-first order of a tree mask, which the symmetric graph of RCM cannot see). For a mask
   made from rules it also proposes moving whole segments next to others of their modality where the rules make
   that exact (see `segment_order`); that candidate stays a rules mask, which every kernel family and the CPU path
   runs.
3. Scores each by the tiles it visits, weighted by kind (`ReorderCosts`: full, causal, partial), per tile shape
   the mask holds, plus the gathers' memory traffic in the same unit; the original is scored from its exact plan.
4. Builds the winner exactly (its plan, its partial tiles' bits), scores it again exactly, and returns it only
   if it beats token order on every tile shape by `min_gain`; otherwise a `Reordering` that says why it declined.

Two ways to run a reordered mask:

- **Per call** (`Reordering.mask`, which carries the permutation): `omnigen.attention(q, k, v, found.mask)` takes
  q, k, v in token order, gathers them into the mask's order, and gathers out / lse / the gradients back. Nothing
  else changes, so it suits a caller who does not control the model's input. The price is eight gathers per
  forward + backward (q, k, v, out; dOut, dQ, dK, dV): on an H100 at 8K they took a third of the call
  (benchmarks/RESULTS.md), more than the kernels gain on most masks.
- **Once per batch, for the whole model** (`Reordering.token_order()`, a `TokenOrder`): a transformer is
  token-wise everywhere but attention (embeddings, MLPs, norms, the loss), and attention with one permutation `p`
  applied to queries and keys alike is the same attention under the permuted mask. So the data (token ids,
  position ids, labels, loss masks, per-token modality ids) is permuted once with `order.permute(x)`, every layer
  calls `omnigen.attention(q, k, v, order.mask)` with no gathers at all, and the loss, a sum or mean over tokens,
  is the same number. Per-token outputs wanted in token order (logits for sampling, metrics) come back with
  `order.unpermute(y)`. What must travel with the tokens is whatever says where a token sits: RoPE / ALiBi
  positions (`order.positions()` for the default 0..S-1, else `order.permute(position_ids)`), labels shifted for
  next-token prediction *before* permuting (the shift is a token-order operation), loss masks, modality ids,
  document ids. A layer that mixes neighbouring tokens (a causal convolution, token shifting) is not token-wise
  and must unpermute around itself.

Why `TokenOrder` is its own object with its own mask rather than a flag on `attention`: the permuted-order mask
(`PermutedMask`) holds the same plan as `found.mask` but no permutation, so `attention` cannot gather with it, and
its repr says that its tensors must be in the permuted order; the per-call mask keeps gathering, so neither object
can be used silently in the other's way. A declined `Reordering` gives an identity `TokenOrder` (the original
mask, `permute` returns its input): a model may call `reorder(...).token_order()` on every batch with one code
path. `permute` moves whole rows (the backward of a float tensor's permute is the gather by the inverse, one pass
and no atomics); it cannot know whether a tensor is already permuted, so permute each input exactly once, where
the batch is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from ..errors import InputError, type_name
from ..layout import Layout, LayoutBatch
from ..semantics import CAUSAL, FULL, PARTIAL, SEE_CODES, SEE_EARLIER, SEE_NONE, pair_predicate, rule_tensors
from .masks import Mask, _reads_bits, make_mask
from . import row_gather
from .planners import _check_device
from .ruleless import classify_shapes, ruleless_mask
from .bits import slot_words
from .tile_bits import unpack

# The atom graph is kept as a dense boolean matrix per batch element: at most this many atoms unless the caller
# picks a finer granularity (8192^2 booleans = 64 MiB). Atoms of single tokens matter for trees: an atom of two
# nodes sees both their ancestor paths, and a depth-first order of such pairs is no longer one of the tree.
MAX_ATOMS = 8192
GRANULARITIES = (1, 2, 4, 8, 16)
# Mask elements evaluated at once while reading the mask (bounded temporaries).
SLAB_ELEMENTS = 1 << 24
# An atom that touches at least this fraction of the others is a hub (placed first in the "hubs" candidates).
HUB_FRACTION = 0.9
METHODS = ("auto", "rcm", "components", "keysets", "segments")
# Gathers and scatters a forward + backward with a reordered mask runs: q, k, v, out; dOut, dQ, dK, dV.
GATHERS_PER_STEP = 8
# Gathers a model that permutes its tokens once per step runs (TokenOrder): one activation of about q's size
# forward and its gradient backward, shared by all its attention layers (ids, positions, labels are integers).
GATHERS_PER_MODEL_STEP = 2


@dataclass(frozen=True)
class ReorderCosts:
    """The cost model `reorder` judges by. Unit: one full tile's forward + backward (3.5x the forward's FLOPs).

    The constants are estimates to be replaced by measurements on the GPU (scripts/bench_reorder.py times the
    calls with and without reordering, and the gathers alone): `partial` 1.2 is the acceptance bound of issue 29
    (a partial tile costs <= 1.2x a full one); `causal` 1.0 (one integer compare per element); `flop_per_byte`
    converts the gathers' bytes into tile work (an H100 runs attention at ~500 TFLOP/s and copies at ~2 TB/s);
    `launch_us` is one gather or scatter's fixed cost (an eager launch); `min_gain` is the margin a permutation
    must win by, so that the model's error never makes a call slower than not reordering."""

    full: float = 1.0
    causal: float = 1.0
    partial: float = 1.2
    flop_per_byte: float = 250.0
    tflops: float = 500.0
    launch_us: float = 5.0
    min_gain: float = 1.1

    def tiles(self, counts: dict[str, int]) -> float:
        """Weighted visited tiles of a plan's kind counts."""
        return self.full * counts["full"] + self.causal * counts["causal"] + self.partial * counts["partial"]

    def gathers(self, B: int, S: int, block_m: int, block_n: int, heads: int, kv_heads: int, head_dim: int,
                element_size: int, layers: int | None = None) -> float:
        """The gathers and scatters of one forward + backward in full tiles of one head. Per call (`layers` None):
        every token's q, out, dOut, dQ (heads) and k, v, dK, dV (kv heads) read and written once, plus the launches.
        Permuted once per step for a model of `layers` attention layers: one q-sized activation and its gradient,
        divided over the layers."""
        tile_flops = 3.5 * 4 * block_m * block_n * head_dim
        if layers is None:
            tensors, launched = 4 + 4 * kv_heads / heads, GATHERS_PER_STEP
        else:
            tensors = launched = GATHERS_PER_MODEL_STEP / layers
        per_head_bytes = B * S * head_dim * element_size * 2 * tensors
        traffic = per_head_bytes * self.flop_per_byte / tile_flops
        launches = launched * self.launch_us * 1e-6 * self.tflops * 1e12 / (tile_flops * heads)
        return traffic + launches


@dataclass
class Reordering:
    """What `reorder` found. True (`bool(result)`) when it proposes a permutation.

    `permutation`: int64 [S] (every batch element the same) or [B, S]: position i of the reordered sequence holds
    the original token `permutation[..., i]`; `inverse` undoes it. `mask`: the permuted mask, carrying both, to
    pass to `omnigen.attention(q, k, v, result.mask)` with q, k, v in the ORIGINAL order (the call gathers and
    scatters); `token_order()`: the same plan for a model that permutes its inputs once per batch (no gathers in
    the calls; see the module docstring). `costs`: per tile shape, (original, reordered, gathers) in full-tile units (`ReorderCosts`);
    `candidates`: each proposal's estimated visited-tile cost on the first tile shape."""

    accepted: bool
    reason: str
    method: str | None = None
    permutation: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    mask: Mask | None = None
    costs: dict[tuple[int, int], tuple[float, float, float]] = field(default_factory=dict)
    candidates: dict[str, float] = field(default_factory=dict)
    # The mask in token order that was judged (made from the mod or dense tensor when one was given): what a
    # declined reordering's `token_order()` runs.
    original: Mask | None = field(default=None, repr=False)

    def __bool__(self) -> bool:
        return self.accepted

    def token_order(self) -> "TokenOrder":
        """The permutation to apply once per batch to the whole model's inputs, with the mask in that order (no
        gathers in any attention call); an identity `TokenOrder` over the original mask when reorder declined.
        See the module docstring for what a model must permute alongside the tokens."""
        if not self.accepted:
            if self.original is None:  # pragma: no cover - reorder always records it
                raise InputError(["this Reordering holds no mask to run: call omnigen.reorder(mask) again"])
            return TokenOrder(None, None, self.original)
        return TokenOrder(self.permutation, self.inverse, PermutedMask.of(self.mask))

    @property
    def gain(self) -> float | None:
        """The estimated speed-up of the reordered call (its worst tile shape), gathers included."""
        gains = [original / (mine + gathers) for original, mine, gathers in self.costs.values() if mine is not None]
        return min(gains) if gains else None

    def __repr__(self) -> str:
        verdict = f"accepted ({self.method})" if self.accepted else "declined"
        return f"omnigen.Reordering({verdict}: {self.reason})"


# ---- reading the mask ---------------------------------------------------------------------------------------

Evaluator = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]


def _dense_evaluator(dense: torch.Tensor) -> Evaluator:
    return lambda b0, b1, rows, cols: dense[b0:b1][:, rows][:, :, cols]


def _mod_evaluator(mod: Callable, device: torch.device, compiled: bool | None = None) -> Evaluator:
    """`compiled`: None, where mask_from_mod compiles the mod (the same evaluator, already built for the mask)."""
    from .from_mod import _Mod, compiles_by_default

    call = _Mod(mod, device, compiles_by_default(device) if compiled is None else compiled)
    return lambda b0, b1, rows, cols: call(torch.arange(b0, b1, device=device)[:, None, None], rows[None, :, None],
                                           cols[None, None, :])


def _rules_evaluator(mask: Mask) -> Evaluator:
    rules, tables = mask.rules, mask.tables
    rule_t = rule_tensors(rules, mask.device)
    return lambda b0, b1, rows, cols: pair_predicate(rules, tables, torch.arange(b0, b1, device=rows.device)[:, None, None],
                                                     rows[None, :, None], cols[None, None, :], rule_t)


def _bits_evaluator(mask: Mask) -> Evaluator:
    """A mask made from data, read back from its first tile shape: kinds from the plan, partial tiles from their bits
    (slots in row-major order of the partial tiles, as plan.ruleless lays them out)."""
    block_m, block_n = mask.tiles[0]
    plan = mask.plan(block_m, block_n)
    nq, nk = plan.num_q_tiles, plan.num_kv_tiles
    kinds = plan.kinds.reshape(-1)  # flat over (b, q-tile, kv-tile): one gather per element below
    partial = kinds == PARTIAL
    slot = (partial.long().cumsum(0) - 1).clamp(min=0)
    count = int(partial.sum())
    words = mask.schedules[5]  # SCHEDULE_TENSORS: the forward's partial_bits of the first tile shape
    per_slot = slot_words(block_m, block_n, False)
    blocks = unpack(words[: count * per_slot], block_m, block_n).reshape(-1) if count else None

    def evaluate(b0: int, b1: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        batch = torch.arange(b0, b1, device=rows.device)[:, None, None]
        tile = (batch * nq + (rows // block_m)[None, :, None]) * nk + (cols // block_n)[None, None, :]
        kind = kinds[tile]
        out = (kind == FULL) | ((kind == CAUSAL) & (cols[None, None, :] <= rows[None, :, None]))
        if blocks is not None:
            offset = slot[tile] * (block_m * block_n) + ((rows % block_m) * block_n)[None, :, None] + \
                (cols % block_n)[None, None, :]
            out |= (kind == PARTIAL) & blocks[offset]
        return out

    return evaluate


@dataclass
class _Source:
    """The mask being reordered: its Mask (token order), how to evaluate any pairs of it, and where it lives."""

    mask: Mask
    evaluate: Evaluator
    device: torch.device

    @property
    def B(self) -> int:
        return self.mask.batch_size

    @property
    def S(self) -> int:
        return self.mask.seq_len


def _atoms(source: _Source, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all): bool [B, n, n] per pair of atoms (query atom x key atom), n = ceil(S / g). Positions past S
    count as allowed for `all` (they do not exist) and as not allowed for `any`."""
    B, S, device = source.B, source.S, source.device
    n = -(-S // g)
    any_ = torch.zeros(B, n, n, dtype=torch.bool, device=device)
    all_ = torch.zeros(B, n, n, dtype=torch.bool, device=device)
    cols = torch.arange(S, device=device)
    per = max(1, SLAB_ELEMENTS // (g * n * g))  # query atoms per slab
    for b in range(B):
        for a0 in range(0, n, per):
            a1 = min(n, a0 + per)
            rows = torch.arange(a0 * g, min(S, a1 * g), device=device)
            block = source.evaluate(b, b + 1, rows, cols)[0]
            padded_any = torch.zeros(( a1 - a0) * g, n * g, dtype=torch.bool, device=device)
            padded_all = torch.ones_like(padded_any)
            padded_any[: rows.numel(), :S] = block
            padded_all[: rows.numel(), :S] = block
            any_[b, a0:a1] = padded_any.view(a1 - a0, g, n, g).any(3).any(1)
            all_[b, a0:a1] = padded_all.view(a1 - a0, g, n, g).all(3).all(1)
    return any_, all_


# ---- permutations of atoms ----------------------------------------------------------------------------------


def _bfs_levels(adjacency: np.ndarray, start: int, allowed: np.ndarray) -> list[np.ndarray]:
    """Breadth-first levels from `start` over the nodes where `allowed` is True."""
    seen = ~allowed.copy()
    seen[start] = True
    levels = [np.array([start])]
    while True:
        reached = adjacency[levels[-1]].any(0) & ~seen
        if not reached.any():
            return levels
        seen |= reached
        levels.append(np.flatnonzero(reached))


def _peripheral(adjacency: np.ndarray, degree: np.ndarray, component: np.ndarray) -> int:
    """A pseudo-peripheral node of a component (George and Liu): start at a node of least degree, go to a node of
    least degree in the last BFS level while that makes the BFS deeper."""
    nodes = np.flatnonzero(component)
    start = int(nodes[np.argmin(degree[nodes])])
    depth = len(_bfs_levels(adjacency, start, component))
    for _ in range(8):  # converges in a couple of steps in practice
        last = _bfs_levels(adjacency, start, component)[-1]
        candidate = int(last[np.argmin(degree[last])])
        deeper = len(_bfs_levels(adjacency, candidate, component))
        if deeper <= depth:
            break
        start, depth = candidate, deeper
    return start


def components(adjacency: np.ndarray, nodes: np.ndarray) -> list[np.ndarray]:
    """The connected components among `nodes` (a bool mask), each as ascending node numbers, ordered by their first
    node."""
    left = nodes.copy()
    found = []
    while left.any():
        start = int(np.argmax(left))
        members = np.concatenate(_bfs_levels(adjacency, start, left))
        left[members] = False
        found.append(np.sort(members))
    return found


def reverse_cuthill_mckee(adjacency: np.ndarray, nodes: np.ndarray | None = None) -> np.ndarray:
    """The Reverse Cuthill-McKee order of a symmetric graph (dense bool adjacency, no self loops), restricted to
    `nodes` (bool mask; default all). Each component from a pseudo-peripheral node; a node's unvisited neighbours are
    appended by increasing degree (ties: by number, so the result is deterministic); the whole order reversed."""
    n = adjacency.shape[0]
    nodes = np.ones(n, dtype=bool) if nodes is None else nodes
    degree = (adjacency & nodes[None, :]).sum(1)
    order: list[int] = []
    left = nodes.copy()
    while left.any():
        component = np.zeros(n, dtype=bool)
        component[np.concatenate(_bfs_levels(adjacency, int(np.argmax(left)), left))] = True
        start = _peripheral(adjacency, degree, component)
        left[start] = False
        queue = [start]
        head = 0
        while head < len(queue):
            node = queue[head]
            head += 1
            fresh = np.flatnonzero(adjacency[node] & left)
            if fresh.size:
                fresh = fresh[np.argsort(degree[fresh], kind="stable")]
                left[fresh] = False
                queue.extend(fresh.tolist())
        order.extend(queue)
    return np.array(order[::-1], dtype=np.int64)


def _hubs(graph: np.ndarray) -> np.ndarray:
    """Atoms connected to nearly every other (a MEDUSA prefix, global tokens): peeled in rounds, each round among the
    atoms left, so that a second tier (a tree's root among its tree) is found once the first is gone."""
    hubs = np.zeros(graph.shape[0], dtype=bool)
    for _ in range(4):
        left = ~hubs
        degree = (graph & left[None, :]).sum(1)
        found = left & (degree >= HUB_FRACTION * max(1, int(left.sum()) - 1))
        if not found.any() or found.sum() == left.sum():
            break
        hubs |= found
    return hubs


def keyset_order(allowed: np.ndarray) -> np.ndarray:
    """Rows sorted by their allowed-key sets, read as binary numbers whose most significant digits are the keys
    most rows see (ties by position, so a mask whose rows are already in this order keeps it).

    Why: rows with the same keys become neighbours, so a tile of them shares its kv-tiles; and when the key sets are
    nested, as in a tree mask (each node sees its parent's keys and itself), popular keys first is a depth-first
    (pre-order) walk: a node's key set is a prefix of its descendants', so every subtree is one contiguous run, a
    node directly before its subtree, and all of a tree's nodes together (a shared context seen by every row is the
    most significant digit and changes nothing). Neither Reverse Cuthill-McKee nor components finds that order on a
    tree that shares a prompt: the prompt connects everything, and RCM's symmetric graph forgets which way each edge
    points. O(n^2 / 8) bytes for n atoms."""
    if allowed.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    popular_first = torch.from_numpy(np.argsort(-allowed.sum(0), kind="stable"))
    # (torch's column gather: numpy's fancy index along the columns of a large bool matrix is several times slower)
    columns = torch.from_numpy(np.ascontiguousarray(allowed)).index_select(1, popular_first).numpy()
    digits = np.packbits(columns, axis=1)  # first column = most significant bit
    keys = np.ascontiguousarray(digits).view(np.dtype((np.void, digits.shape[1]))).ravel()
    return np.argsort(keys, kind="stable").astype(np.int64)  # void values compare as bytes: lexicographic


def _distinct_elements(any_: torch.Tensor, all_: torch.Tensor) -> list[int]:
    """For each batch element, the first element with the same atom matrices (itself when none before it has them).
    A mask_mod that ignores `b`, as most do, gives B equal elements: their candidates and estimates are made once."""
    distinct: list[int] = []
    twin: list[int] = []
    for b in range(any_.shape[0]):
        same = next((a for a in distinct if torch.equal(any_[a], any_[b]) and torch.equal(all_[a], all_[b])), None)
        if same is None:
            distinct.append(b)
        twin.append(b if same is None else same)
    return twin


def _atom_candidates(any_b: np.ndarray, movable: int) -> dict[str, np.ndarray]:
    """Permutations of the first `movable` atoms of one batch element (the rest stay last, in order)."""
    n = any_b.shape[0]
    graph = any_b[:movable, :movable] | any_b[:movable, :movable].T
    np.fill_diagonal(graph, False)
    everything = np.ones(movable, dtype=bool)
    out = {"components": np.concatenate(components(graph, everything)) if movable else np.zeros(0, np.int64),
           "rcm": reverse_cuthill_mckee(graph, everything),
           "keysets": keyset_order(any_b[:movable, :movable])}
    hubs = _hubs(graph)
    if hubs.any() and not hubs.all():
        first = np.flatnonzero(hubs)
        out["hubs+components"] = np.concatenate([first, *components(graph, ~hubs)])
        out["hubs+rcm"] = np.concatenate([first, reverse_cuthill_mckee(graph, ~hubs)])
    tail = np.arange(movable, n)
    return {name: np.concatenate([p, tail]).astype(np.int64) for name, p in out.items()}


def _tokens(atom_perm: torch.Tensor, g: int, S: int) -> torch.Tensor:
    """The token permutation [S] of an atom permutation (a short last atom is last: dropping the positions past S
    keeps the order)."""
    tokens = (atom_perm[:, None] * g + torch.arange(g, device=atom_perm.device)).reshape(-1)
    return tokens[tokens < S]


def _estimated_tiles(any_b: torch.Tensor, all_b: torch.Tensor, p: torch.Tensor, g: int, S: int, block_m: int,
                     block_n: int, costs: ReorderCosts) -> float:
    """Weighted tiles of the mask permuted by atoms `p` (one batch element): a tile with no allowed atom pair is
    empty, one whose atom pairs are all full is full, the rest count as partial (a causal tile is counted as partial:
    the estimate errs against reordering; the winner is scored exactly)."""
    n = p.numel()
    rm, rn = block_m // g, block_n // g
    nq, nk = -(-n // rm), -(-n // rn)
    # Rows first: gather whole rows in the new order and reduce each q-tile's rows to one [n] row, then permute and
    # reduce the columns of that small [nq, n] matrix (gathering columns of the n x n matrix costs far more).
    rows_any = torch.zeros(nq * rm, n, dtype=torch.bool, device=any_b.device)
    rows_all = torch.ones(nq * rm, n, dtype=torch.bool, device=any_b.device)  # rows past n do not exist
    rows_any[:n], rows_all[:n] = any_b.index_select(0, p), all_b.index_select(0, p)
    tile_any = torch.zeros(nq, nk * rn, dtype=torch.bool, device=any_b.device)
    tile_all = torch.ones(nq, nk * rn, dtype=torch.bool, device=any_b.device)
    tile_any[:, :n] = rows_any.view(nq, rm, n).any(1)[:, p]
    tile_all[:, :n] = rows_all.view(nq, rm, n).all(1)[:, p]
    visited = tile_any.view(nq, nk, rn).any(2)
    full = tile_all.view(nq, nk, rn).all(2) & visited
    return costs.full * float(full.sum()) + costs.partial * float((visited & ~full).sum())


# ---- segments of a rules layout -----------------------------------------------------------------------------


def segment_order(rules, layout: Layout) -> list[int] | None:
    """A new order of `layout`'s segments that groups segments of one modality, or None when the rules allow no
    move (or the best order is the original). Exact by construction: the permuted layout under the same rules gives
    exactly the permuted mask, because

    - a segment stays contiguous and in its own order (its `self` policy and its window inside it are unchanged);
    - documents stay where they are (ids must not decrease); segments move only inside their document;
    - two segments A before B that can see each other keep that order when their pair depends on it: a `see` of
      `earlier` in either direction (`none` and `all` do not depend on the order);
    - where a windowed modality may see another segment (inside its document, or anywhere with
      `documents: shared`), nothing that can change its distances moves: its document keeps its order (shared: the
      whole layout), unless the window is at least that span's length (it never cuts).
    Pad segments see nothing and are seen by nothing: they move freely (grouped like a modality)."""
    n_mod = len(rules.modalities)
    see = np.array([[SEE_CODES[p] for p in row] for row in rules.see_matrix()], dtype=np.int64).reshape(n_mod, n_mod)
    window = np.array([m.window for m in rules.modalities], dtype=np.int64)
    segments = list(layout.segments)
    ids = np.array([rules.modality_id(s[0]) for s in segments], dtype=np.int64)
    groups: list[list[int]] = []
    for index, segment in enumerate(segments):
        if groups and segments[groups[-1][-1]][2] == segment[2]:
            groups[-1].append(index)
        else:
            groups.append([index])
    if not rules.isolated_documents and _window_pins(rules, ids, see, window, layout.seq_len):
        return None
    order: list[int] = []
    for group in groups:
        members = ids[group]
        if rules.isolated_documents and _window_pins(rules, members, see, window, sum(segments[i][1] for i in group)):
            order.extend(group)
        else:
            order.extend(group[i] for i in _grouped(rules, members, see))
    return None if order == list(range(len(segments))) else order


def _window_pins(rules, ids: np.ndarray, see: np.ndarray, window: np.ndarray, span: int) -> bool:
    """Whether a segment of a windowed modality (window shorter than `span`) may see another segment of `ids`."""
    real = ids != rules.pad_id
    safe = np.where(real, ids, 0)
    windowed = real & (window[safe] > 0) & (window[safe] < span)
    sees = (see[safe[:, None], safe[None, :]] != SEE_NONE) & real[:, None] & real[None, :]
    np.fill_diagonal(sees, False)
    return bool((windowed[:, None] & sees).any())


def _grouped(rules, ids: np.ndarray, see: np.ndarray) -> list[int]:
    """Positions 0..k-1 of one document's segments in a grouped order: greedily the next segment of the last one's
    modality whose bound predecessors are placed, else the first placeable one."""
    k = len(ids)
    if k < 3:
        return list(range(k))
    real = ids != rules.pad_id
    safe = np.where(real, ids, 0)
    forward = see[safe[:, None], safe[None, :]]  # [query segment, key segment]
    # A before B (A < B) stays so when either direction's policy is `earlier`.
    bound = np.triu(real[:, None] & real[None, :] & ((forward == SEE_EARLIER) | (forward.T == SEE_EARLIER)), 1)
    waiting = bound.sum(0).astype(np.int64)  # bound predecessors not placed yet
    placed = np.zeros(k, dtype=bool)
    out: list[int] = []
    last = -1
    for _ in range(k):
        ready = np.flatnonzero(~placed & (waiting == 0))
        same = ready[ids[ready] == last]
        pick = int(same[0] if same.size else ready[0])
        placed[pick] = True
        waiting -= bound[pick]
        last = int(ids[pick])
        out.append(pick)
    return out


def _segment_candidate(mask: Mask) -> tuple[torch.Tensor, Mask] | None:
    """(token permutation [B, S], the regrouped rules mask) or None."""
    layout = mask.layout
    layouts = list(layout.layouts) if isinstance(layout, LayoutBatch) else [layout]
    if len(layouts) != mask.batch_size:  # pragma: no cover - make_mask repeats a Layout into a LayoutBatch
        layouts = layouts * mask.batch_size
    new_layouts, perms, moved = [], [], False
    for item in layouts:
        order = segment_order(mask.rules, item)
        starts = np.concatenate([[0], np.cumsum([s[1] for s in item.segments])])
        order = order if order is not None else list(range(len(item.segments)))
        moved |= order != list(range(len(item.segments)))
        perms.append(np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order]))
        new_layouts.append(Layout([item.segments[i] for i in order]))
    if not moved:
        return None
    new_layout = LayoutBatch(new_layouts) if isinstance(layout, LayoutBatch) else new_layouts[0]
    regrouped = make_mask(mask.rules, new_layout, mask.tiles, mask.device)
    return torch.from_numpy(np.stack(perms)).to(mask.device), regrouped


# ---- the entry point ----------------------------------------------------------------------------------------


def _source(mask_or_mod, B, S, device, tiles, head_dim, dtype) -> _Source:
    if isinstance(mask_or_mod, Mask):
        if B is not None or S is not None:
            raise InputError(["B and S come from the mask: pass omnigen.reorder(mask) alone (B and S are for a "
                              "mask_mod)"])
        if getattr(mask_or_mod, "permutation", None) is not None or isinstance(mask_or_mod, PermutedMask):
            raise InputError(["this mask is already reordered (it carries a permutation, or it is a TokenOrder's mask "
                              "in permuted order): reorder the original mask"])
        evaluate = _bits_evaluator(mask_or_mod) if mask_or_mod.ruleless else _rules_evaluator(mask_or_mod)
        return _Source(mask_or_mod, evaluate, mask_or_mod.device)
    if isinstance(mask_or_mod, torch.Tensor):
        from .from_dense import mask_from_dense

        made = mask_from_dense(mask_or_mod, device=device, tiles=tiles, head_dim=head_dim, dtype=dtype)
        dense = mask_or_mod.to(made.device)
        dense = dense[None] if dense.dim() == 2 else dense
        return _Source(made, _dense_evaluator(dense), made.device)
    if callable(mask_or_mod):
        if B is None or S is None:
            raise InputError(["a mask_mod needs the batch size and sequence length: omnigen.reorder(mask_mod, B, S)"])
        from .from_mod import mask_from_mod

        device = _check_device(device if device is not None else "cuda")
        made = mask_from_mod(mask_or_mod, B, S, device, tiles=tiles, head_dim=head_dim, dtype=dtype)
        return _Source(made, _mod_evaluator(mask_or_mod, made.device), made.device)
    raise InputError([f"reorder takes an omnigen Mask, a mask_mod(b, h, q_idx, kv_idx) with B and S, or a dense "
                      f"boolean [B, S, S] / [S, S] tensor, not {type_name(mask_or_mod)}"])


def _granularity(granularity: int | None, S: int, shapes: Iterable[tuple[int, int]]) -> int:
    smallest = min(min(m, n) for m, n in shapes)
    if granularity is None:
        for g in GRANULARITIES:
            if -(-S // g) <= MAX_ATOMS or g * 2 > smallest:
                return g
        return GRANULARITIES[-1]
    if isinstance(granularity, bool) or granularity not in GRANULARITIES or smallest % granularity:
        raise InputError([f"granularity must be one of {', '.join(map(str, GRANULARITIES))} dividing every tile side "
                          f"(smallest {smallest}), not {granularity!r}"])
    return granularity


def _exact_costs(mask: Mask, costs: ReorderCosts) -> dict[tuple[int, int], float]:
    return {shape: costs.tiles(mask.plan(*shape).counts()) for shape in mask.tiles}


def _permuted_mask(source: _Source, perm: torch.Tensor, partial_bits) -> Mask:
    """The mask made from data of `source` permuted by the token permutation `perm` [B, S] (exact)."""
    B, S, device = source.B, source.S, source.device

    def slab(b0: int, b1: int, r0: int, r1: int) -> torch.Tensor:
        return torch.cat([source.evaluate(b, b + 1, perm[b, r0:r1], perm[b]) for b in range(b0, b1)])

    plans = classify_shapes(slab, B, S, list(source.mask.tiles), device)  # the mask read once for every shape
    return ruleless_mask(plans, B, S, source.mask.batched, device, partial_bits)


def _attach(mask: Mask, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Give `mask` its permutation ([S] when every batch element has the same one) and its inverse."""
    if perm.shape[0] == 1 or bool((perm == perm[:1]).all()):
        perm = perm[0]
    perm = perm.contiguous()
    inverse = torch.empty_like(perm)
    inverse.scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device).expand_as(perm).contiguous())
    mask.permutation, mask.inverse_permutation = perm, inverse
    mask.__class__ = ReorderedMask  # (a Mask subclass that only names its order in its repr)
    return perm, inverse


def reorder(
    mask_or_mod: Mask | Callable | torch.Tensor,
    B: int | None = None,
    S: int | None = None,
    *,
    method: str = "auto",
    granularity: int | None = None,
    costs: ReorderCosts | None = None,
    heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    tiles: Iterable[tuple[int, int]] | None = None,
    partial_bits: int | str = "exact",
    rules_only: bool | None = None,
    layers: int | None = None,
) -> Reordering:
    """Propose a permutation of token positions that makes the mask visit fewer (weighted) tiles, and keep it only
    when it wins, the gathers counted. Returns a `Reordering`: truthy with `.mask` (pass it to `omnigen.attention`
    with q, k, v in the original order) and `.permutation`, or falsy with `.reason`.

    `mask_or_mod`: an omnigen Mask (from rules or from data), a dense bool [B, S, S] / [S, S] tensor, or a
    FlexAttention-style mask_mod with `B` and `S` (then `device`, `tiles`, `head_dim`, `dtype` as for
    `omnigen.mask_from_mod`). `method`: "auto" (every proposal, the best wins), "rcm" (Reverse Cuthill-McKee),
    "components" (connected components, each in token order), "keysets" (rows sorted by their allowed-key sets,
    most-seen keys most significant: a depth-first order of a tree mask), "segments" (rules masks: whole segments
    grouped by modality where the rules make that exact; the result stays a rules mask). `granularity`: tokens per
    atom of the graph (a power of two <= 16; default the finest with at most MAX_ATOMS atoms). `heads`, `kv_heads`,
    `head_dim`, `dtype`: the calls' shapes, for the gathers' cost. `costs`: the cost model (`ReorderCosts`).
    `partial_bits`: the reordered mask's bit slots (as for `omnigen.mask_from_dense`). `rules_only`: for a rules
    mask, propose only regrouped segments (a rules mask, which every kernel family runs), not permutations of tokens
    (a mask made from data, which only kernels that read partial tiles' bits run: Hopper's and the CPU path); default
    True on a CUDA device whose kernels do not read bits, else False. `layers`: how the permutation will be applied,
    which sets the gathers' price: None (default), around every call (`.mask`: eight gathers per forward + backward);
    L, once per step by a model of L attention layers (`.token_order()`: one activation's permutation per step, an
    L-th of it per call), which lets smaller gains win."""
    problems = []
    if method not in METHODS:
        problems.append(f"method must be one of {', '.join(repr(m) for m in METHODS)}, not {method!r}")
    if costs is not None and not isinstance(costs, ReorderCosts):
        problems.append(f"costs must be omnigen.plan.reorder.ReorderCosts, not {type_name(costs)}")
    for name, value in (("heads", heads), ("head_dim", head_dim)) + ((("kv_heads", kv_heads),) if kv_heads else ()):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, not {value!r}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        problems.append(f"layers must be None (gathers around every call) or the model's number of attention layers "
                        f"(a positive integer), not {layers!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        problems.append(f"dtype must be a floating torch.dtype (the calls' q/k/v dtype), not {dtype!r}")
    if problems:
        raise InputError(problems)
    costs = costs or ReorderCosts()
    kv_heads = kv_heads or heads
    source = _source(mask_or_mod, B, S, device, tiles, head_dim if not isinstance(mask_or_mod, Mask) else None,
                     dtype if dtype in (torch.bfloat16, torch.float16) else None)
    mask = source.mask
    if method == "segments" and mask.ruleless:
        raise InputError(["method='segments' regroups a rules layout's segments; this mask was made from data (use "
                          "'rcm', 'components' or 'auto')"])
    if rules_only is None:
        rules_only = mask.device.type == "cuda" and not _reads_bits(mask.device)
    B, S, shapes = source.B, source.S, list(mask.tiles)
    element = torch.empty((), dtype=dtype).element_size()
    gathers = {s: costs.gathers(B, S, s[0], s[1], heads, kv_heads, head_dim, element, layers) for s in shapes}
    original = _exact_costs(mask, costs)
    first = shapes[0]

    proposals: dict[str, tuple[torch.Tensor, Mask | None, dict[tuple[int, int], float] | None]] = {}
    estimates: dict[str, float] = {}
    if method in ("auto", "segments") and not mask.ruleless:
        found = _segment_candidate(mask)
        if found is not None:
            perm, regrouped = found
            exact = _exact_costs(regrouped, costs)
            proposals["segments"], estimates["segments"] = (perm, regrouped, exact), exact[first]
    if method in ("auto", "rcm", "components", "keysets") and not (rules_only and not mask.ruleless):
        g = _granularity(granularity, S, shapes)
        any_, all_ = _atoms(source, g)
        n = any_.shape[1]
        movable = n if S % g == 0 else n - 1  # a short last atom stays last (tiles stay aligned)
        twin = _distinct_elements(any_, all_)
        made_for = {a: _atom_candidates(any_[a].cpu().numpy(), movable) for a in dict.fromkeys(twin)}
        weight = {a: twin.count(a) for a in made_for}  # batch elements each distinct one stands for
        names = [name for name in made_for[0]  # (element 0 is always planned)
                 if method == "auto" or name == method or name.endswith("+" + method)]
        names = [name for name in names if all(name in c for c in made_for.values())]
        identity = np.arange(n)
        for name in names:
            if all(np.array_equal(c[name], identity) for c in made_for.values()):
                continue
            moved = {a: torch.from_numpy(c[name]).to(source.device) for a, c in made_for.items()}  # once each
            estimate = {s: sum(weight[a] * _estimated_tiles(any_[a], all_[a], p, g, S, s[0], s[1], costs)
                               for a, p in moved.items()) for s in shapes}
            orders = {a: _tokens(p, g, S) for a, p in moved.items()}
            tokens = torch.stack([orders[a] for a in twin])
            proposals[name], estimates[name] = (tokens, None, estimate), estimate[first]

    result = Reordering(False, "", candidates=dict(estimates), original=mask)
    if not proposals:
        result.reason = ("no permutation to propose: the mask's graph keeps token order (one component, and Reverse "
                         "Cuthill-McKee finds token order)" if method != "segments" else
                         "the rules allow no segment to move (or the order is already grouped)")
        result.costs = {s: (original[s], None, gathers[s]) for s in shapes}
        return result

    def worst_gain(scores: dict[tuple[int, int], float]) -> float:
        return min(original[s] / max(scores[s] + gathers[s], 1e-9) for s in shapes)

    # Rules masks run everywhere: the regrouped layout wins ties with a mask made from data.
    ranked = sorted(proposals, key=lambda name: (-worst_gain(proposals[name][2]), name != "segments"))
    best = ranked[0]
    perm, made, scores = proposals[best]
    if worst_gain(scores) < costs.min_gain:
        result.reason = (f"not worth it: the best proposal ({best}) would visit {scores[first]:.0f} weighted "
                         f"{first[0]}x{first[1]} tiles against {original[first]:.0f} in token order, plus gathers "
                         f"worth {gathers[first]:.0f} tiles: {worst_gain(scores):.2f}x, below the {costs.min_gain}x "
                         "a reordering must win by")
        result.costs = {s: (original[s], scores[s], gathers[s]) for s in shapes}
        return result
    if made is None:
        made = _permuted_mask(source, perm, partial_bits)
        scores = _exact_costs(made, costs)  # the estimate counted causal tiles as partial; now exact
    result.costs = {s: (original[s], scores[s], gathers[s]) for s in shapes}
    if worst_gain(scores) < costs.min_gain:  # pragma: no cover - the estimate errs against reordering
        result.reason = f"the exact plan of {best} wins only {worst_gain(scores):.2f}x"
        return result
    result.permutation, result.inverse = _attach(made, perm)
    result.accepted, result.method, result.mask = True, best, made
    result.reason = (f"{best}: {scores[first]:.0f} weighted {first[0]}x{first[1]} tiles instead of "
                     f"{original[first]:.0f}, gathers {gathers[first]:.0f}: {worst_gain(scores):.2f}x")
    return result


# ---- running a model in the mask's order ---------------------------------------------------------------------


def take_tokens(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x with its sequence dimension `dim` reordered: position i of the result is x's position index[i]. `index` [S]
    applies to every batch element; [B, S] per batch element (dim 0 of x is the batch, `dim` >= 1).

    The sequence is moved next to the batch before the gather so that each token's trailing dims are one contiguous
    row to copy, and the result keeps the batch outermost: for q [B, H, S, D] (dim 2) this is the [B, S, H, D]
    layout transposed, the heads-inner layout the kernels and the op's outputs use."""
    if index.device != x.device:
        index = index.to(x.device)
    if dim == 0:
        return x.index_select(0, index)
    return _take_rows(x.movedim(dim, 1), index).movedim(1, dim)


def _take_rows(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """y [B, S, ...] gathered along dim 1 by index [S] or [B, S]: a new tensor, never a view.

    On a GPU a Triton program per token row (plan/row_gather.py says why). Elsewhere, and for what it does not take,
    index_select over dim 1 for a shared index, advanced indexing on the batch and sequence for per-batch ones (whole
    rows; 2x faster than torch.gather over an expanded index on a CPU)."""
    if row_gather.supported(y, index):
        return row_gather.gather_rows(y, index)
    if index.dim() == 1:
        return y.index_select(1, index)
    batch = torch.arange(y.shape[0], device=y.device)[:, None]
    return y[batch, index]


class _Permute(torch.autograd.Function):
    """A gather by a permutation along dim 1 whose backward is the gather by its inverse: autograd's own backward of
    a gather is a zero-filled tensor plus an atomic add of every row (right for any index, repeats included), a third
    pass over memory and atomics on bf16; for a permutation the inverse's gather gives the same rows in one pass.
    Its output is a new tensor; the caller's movedim around it stays outside, so the result it hands on is a plain
    view that in-place operations may modify (not one "created inside a custom Function", which autograd forbids)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index, inverse)
        return _take_rows(y, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, inverse = ctx.saved_tensors
        # Through _Permute again, so that a double backward is a gather as well.
        return _Permute.apply(grad, inverse, index), None, None


def permute_tokens(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, dim: int) -> torch.Tensor:
    """`take_tokens` by a permutation `index` whose inverse is `inverse`; differentiable, its backward a gather."""
    if not x.requires_grad:
        return take_tokens(x, index, dim)
    if index.device != x.device:
        index, inverse = index.to(x.device), inverse.to(x.device)
    if dim == 0:  # a sequence without a batch: index [S]
        return _Permute.apply(x.unsqueeze(0), index, inverse).squeeze(0)
    return _Permute.apply(x.movedim(dim, 1), index, inverse).movedim(1, dim)


class ReorderedMask(Mask):
    """The per-call reordered mask (`Reordering.mask`): it carries its permutation, and `omnigen.attention` gathers
    q, k, v (given in token order) into the mask's order around every call. Only its repr differs from a Mask's."""

    def __repr__(self) -> str:
        return (super().__repr__()[:-1] + ", order=token order: omnigen.reorder's permutation applied around every "
                "call by gathers; Reordering.token_order() avoids them)")


class PermutedMask(Mask):
    """A reordered mask in its own (permuted) token order, without the permutation: `omnigen.attention(q, k, v,
    mask)` runs it as it is, with no gathers, so q, k, v must already be in the permuted order -- which they are
    when the model's inputs were permuted by the `TokenOrder` this mask came from. The same plan, schedules and
    bits as the per-call `Reordering.mask` (shared tensors, not copies); its repr says which order it wants."""

    in_permuted_order = True

    @classmethod
    def of(cls, reordered: Mask) -> "PermutedMask":
        """The permuted-order view of a mask that carries a permutation (`Reordering.mask`)."""
        if reordered.permutation is None:
            raise InputError(["PermutedMask.of takes a mask that carries a permutation (Reordering.mask)"])
        made = cls.__new__(cls)
        made.__dict__.update(reordered.__dict__)
        made.permutation = None  # (instance attributes: _attach set them on `reordered`)
        made.inverse_permutation = None
        return made

    def __repr__(self) -> str:
        return (super().__repr__()[:-1] + ", order=permuted by omnigen.reorder: q, k, v, positions and labels must "
                "be in this order (TokenOrder.permute); attention does no gathers)")


def _check_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError([f"{name} must be an int (the sequence dimension), not {type_name(value)}"])
    return value


@dataclass(frozen=True, eq=False)
class TokenOrder:
    """A batch's token order for a whole model (`Reordering.token_order()`; see the module docstring).

    `permutation` int64 [S] (every batch element) or [B, S] (one each): position i of the permuted sequence holds
    original token `permutation[..., i]`; `inverse` undoes it; both None for the identity (reorder declined).
    `mask`: the mask in the permuted order, carrying no permutation (a `PermutedMask`; for the identity, the
    original mask): pass it to every layer's `omnigen.attention(q, k, v, order.mask)` with q, k, v computed from
    permuted inputs. `permute(x, dim)` / `unpermute(y, dim)` move a tensor's sequence dimension into / out of that
    order; `positions()` are the permuted tokens' default position ids."""

    permutation: torch.Tensor | None
    inverse: torch.Tensor | None
    mask: Mask

    @property
    def identity(self) -> bool:
        """True when tokens keep their order (reorder declined): `permute` and `unpermute` return their input."""
        return self.permutation is None

    @property
    def batch_size(self) -> int:
        return self.mask.batch_size

    @property
    def seq_len(self) -> int:
        return self.mask.seq_len

    def permute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """x (token order) with dimension `dim` (its sequence, length S) in the permuted order: token ids, position
        ids, labels, loss masks, modality ids [B, S] (dim 1), activations [B, S, d] (dim 1), or [S] ones (dim 0, when
        every batch element has one permutation). Differentiable (backward: the inverse gather). Apply it to each
        input exactly once: a tensor permuted twice is not detectable and is silently wrong."""
        return self._apply(x, dim, self.permutation, self.inverse, "permute")

    def unpermute(self, y: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """y (permuted order, e.g. a model's logits [B, S, V]) back in token order along `dim`."""
        return self._apply(y, dim, self.inverse, self.permutation, "unpermute")

    def positions(self) -> torch.Tensor:
        """Position ids of the permuted tokens when the model's positions are 0..S-1 (RoPE, learned positions): the
        permutation itself ([S] or [B, S]; arange(S) for the identity). Positions travel with the tokens, so a
        token's rotary phase is what it was in token order. Models with other position ids (restarting per packed
        document, say) permute theirs: `order.permute(position_ids)`."""
        if self.permutation is None:
            return torch.arange(self.seq_len, device=self.mask.device)
        return self.permutation

    def _apply(self, x: torch.Tensor, dim: int, index: torch.Tensor | None, inverse: torch.Tensor | None,
               verb: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise InputError([f"TokenOrder.{verb} takes a tensor with a sequence dimension, not {type_name(x)}"])
        dim = _check_int(dim, "dim")
        if x.dim() == 0 or not -x.dim() <= dim < x.dim():
            raise InputError([f"dim={dim} is not a dimension of the tensor of shape {tuple(x.shape)}: pass the "
                              f"sequence dimension (dim=1 for [B, S, ...], dim=0 for [S])"])
        dim %= x.dim()
        S = self.seq_len
        if x.shape[dim] != S:
            raise InputError([f"TokenOrder.{verb}: dimension {dim} of the tensor of shape {tuple(x.shape)} has "
                              f"{x.shape[dim]} entries, but this order is over S={S} tokens: pass the sequence "
                              f"dimension as dim"])
        if index is None:
            return x
        if index.dim() == 2:
            B = index.shape[0]
            if dim == 0 or x.shape[0] != B:
                raise InputError([f"TokenOrder.{verb}: this order has one permutation per batch element ([{B}, {S}]), "
                                  f"so the tensor needs its batch of {B} in dim 0 and its sequence in dim >= 1; got "
                                  f"shape {tuple(x.shape)} with dim={dim} (expand a shared [S] tensor to [{B}, {S}] "
                                  "first)"])
        return permute_tokens(x, index, inverse, dim)


__all__ = ["PermutedMask", "ReorderedMask", "Reordering", "ReorderCosts", "TokenOrder", "components",
           "keyset_order", "permute_tokens", "reorder", "reverse_cuthill_mckee", "segment_order", "take_tokens"]
