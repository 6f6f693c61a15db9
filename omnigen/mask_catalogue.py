"""The masks issue 29 is judged on, each as a FlexAttention `mask_mod`, a dense mask and FlashMask intervals.

One definition per mask, shared by the CPU tests (tests/test_mask_makers.py: the three inputs give one plan and
one output, equal to a float64 reference) and by `omnigen bench --mask NAME` (the same `mask_mod` timed through
omnigen and FlexAttention), so what is measured is what is tested.

Every mask is built for a batch of B sequences of S tokens on a device, from a seeded generator: its parameters
(document lengths, window widths, how many globals) scale with S, so S = 200 in a test and S = 32K in a benchmark
are the same kind of mask. Batch elements differ where the mask has random structure (documents, evictions).
The `mask_mod`s use tensor operations only (omnigen evaluates them on blocks, FlexAttention vmaps them over
scalars) and index tensors that live on the mask's device. `intervals` is None where FlashMask's two column
intervals cannot say the mask (a tree in breadth-first order: a node's descendants are one range per depth).

    from omnigen.mask_catalogue import catalogue_mask
    made = catalogue_mask("medusa_tree", B=4, S=8192, device="cuda")
    mask = omnigen.mask_from_mod(made.mask_mod, made.batch, made.seq_len)   # or made.mask("mod")
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Intervals = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]

# Pairs the dense evaluation of a mask_mod holds at once (its temporaries are a few int64 tensors of this size).
DENSE_CHUNK = 1 << 22


@dataclass
class CatalogueMask:
    """One mask of the catalogue for B sequences of S tokens: its mask_mod and, where FlashMask can say it, its
    column intervals (lts, lte, uts, ute) as [B, S] int64 tensors (uts, ute None: FlashMask's causal mode)."""

    name: str
    description: str
    batch: int
    seq_len: int
    device: torch.device
    mask_mod: MaskMod
    intervals: Intervals | None

    def dense(self) -> torch.Tensor:
        """bool [B, S, S] on the mask's device, the mod evaluated on every pair (O(B S^2): for tests and pictures)."""
        B, S = self.batch, self.seq_len
        out = torch.empty(B, S, S, dtype=torch.bool, device=self.device)
        keys = torch.arange(S, device=self.device)[None, None, :]
        h = torch.zeros((), dtype=torch.int64, device=self.device)
        rows = max(1, DENSE_CHUNK // max(1, B * S))
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            b = torch.arange(B, device=self.device)[:, None, None]
            q = torch.arange(r0, r1, device=self.device)[None, :, None]
            out[:, r0:r1] = torch.broadcast_to(self.mask_mod(b, h, q, keys), (B, r1 - r0, S))
        return out

    def mask(self, source: str = "mod", **kwargs: Any) -> Any:
        """The omnigen Mask made from `source`: "mod" (mask_from_mod), "dense" (mask_from_dense) or "intervals"
        (mask_from_intervals); `kwargs` go to the maker (tiles, head_dim, dtype, partial_bits)."""
        import omnigen

        if source == "mod":
            return omnigen.mask_from_mod(self.mask_mod, self.batch, self.seq_len, self.device, **kwargs)
        if source == "dense":
            return omnigen.mask_from_dense(self.dense(), **kwargs)
        if source == "intervals":
            if self.intervals is None:
                raise ValueError(f"the catalogue mask {self.name!r} has no FlashMask intervals (two column intervals "
                                 "cannot say it): make it from its mask_mod or its dense mask")
            return omnigen.mask_from_intervals(*self.intervals, **kwargs)
        raise ValueError(f"source must be 'mod', 'dense' or 'intervals', not {source!r}")


# ---- building blocks ---------------------------------------------------------------------------------------------


def _lengths(total: int, low: int, high: int, gen: torch.Generator) -> list[int]:
    """Random lengths in [low, high] that sum to `total`, except that the last one takes what would otherwise be
    left shorter than `low` (so it may reach high + low - 1)."""
    low, high = max(1, min(low, total)), max(1, min(high, total))
    out: list[int] = []
    left = total
    while left > 0:
        n = min(left, int(torch.randint(low, max(low, high) + 1, (1,), generator=gen)))
        if 0 < left - n < low:
            n = left  # never leave a stub shorter than `low`
        out.append(n)
        left -= n
    return out


def _segments(lengths_per_batch: list[list[int]], S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(id, start, end) int64 [B, S] of consecutive segments with the given lengths (ids count up from 0 within
    each batch element); positions past the segments get id -1 and start = end = S."""
    B = len(lengths_per_batch)
    ids, starts, ends = (torch.full((B, S), fill, dtype=torch.int64) for fill in (-1, S, S))
    for b, lengths in enumerate(lengths_per_batch):
        at = 0
        for index, n in enumerate(lengths):
            ids[b, at : at + n], starts[b, at : at + n], ends[b, at : at + n] = index, at, at + n
            at += n
    return ids, starts, ends


def _full(B: int, S: int, value: int) -> torch.Tensor:
    return torch.full((B, S), value, dtype=torch.int64)


def _positions(B: int, S: int) -> torch.Tensor:
    return torch.arange(S).expand(B, S)


# ---- the masks -----------------------------------------------------------------------------------------------
# Each builder: (B, S, generator) -> (mask_mod factory taking the device's tensors, intervals on the CPU or None,
# the CPU tensors the mod reads). The tensors are moved to the device once, in `catalogue_mask`.


def _causal_documents(B: int, S: int, gen: torch.Generator):
    docs = [_lengths(S, max(8, S // 16), max(16, S // 3), gen) for _ in range(B)]
    doc, _, end = _segments(docs, S)

    def make(doc, end):
        def causal_documents(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)
        return causal_documents

    return make, (end, _full(B, S, S), None, None), (doc, end)


def _share_question(B: int, S: int, gen: torch.Generator):
    """Documents of one question and 2-4 answers: an answer sees the question and itself (causally), never the
    other answers (FlashMask's share-question mask)."""
    docs = [_lengths(S, max(16, S // 16), max(32, S // 3), gen) for _ in range(B)]
    doc, _, doc_end = _segments(docs, S)
    parts = []
    for lengths in docs:
        row = []
        for n in lengths:
            question = max(1, n // 3)
            answers = int(torch.randint(2, 5, (1,), generator=gen))
            rest = n - question
            cuts = sorted(torch.randint(1, max(2, rest), (answers - 1,), generator=gen).tolist()) if rest > 1 else []
            bounds = [0] + [c for c in dict.fromkeys(cuts) if 0 < c < rest] + [rest]
            row += [question] + [b1 - b0 for b0, b1 in zip(bounds, bounds[1:]) if b1 > b0]
        parts.append(row)
    segment, _, segment_end = _segments(parts, S)
    # the first segment of each document is its question
    first = torch.ones(B, S, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    question_id = torch.where(first, segment, -1).cummax(1).values  # the segment id of each token's question
    question = segment == question_id

    def make(doc, segment, question):
        def share_question(b, h, q_idx, kv_idx):
            same = (segment[b, q_idx] == segment[b, kv_idx]) | question[b, kv_idx]
            return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx) & same
        return share_question

    lts = torch.where(question, doc_end, segment_end)
    return make, (lts, _full(B, S, S), None, None), (doc, segment, question)


def _global_sliding_window(B: int, S: int, gen: torch.Generator):
    """Causal sliding window of W tokens, and G global tokens at the start that every later token sees."""
    W, G = max(16, S // 16), max(4, S // 128)

    def make():
        def global_sliding_window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & ((q_idx - kv_idx < W) | (kv_idx < G))
        return global_sliding_window

    j = _positions(B, S)
    lts = torch.where(j < G, S, (j + W).clamp(max=S))
    return make, (lts, _full(B, S, S), None, None), ()


def _prefix_lm_documents(B: int, S: int, gen: torch.Generator):
    """Documents whose first 1/4-1/2 is a prefix every token of the document sees; the rest is causal."""
    docs = [_lengths(S, max(8, S // 16), max(16, S // 3), gen) for _ in range(B)]
    doc, start, end = _segments(docs, S)
    share = 0.25 + 0.25 * torch.rand(B, 1, generator=gen)  # one fraction per batch element
    prefix_end = start + ((end - start) * share).long().clamp(min=1)

    def make(doc, prefix_end):
        def prefix_lm_documents(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & ((kv_idx <= q_idx) | (kv_idx < prefix_end[b, q_idx]))
        return prefix_lm_documents

    j = _positions(B, S)
    upper_end = torch.where(j < prefix_end, start, j)  # a prefix column is hidden above its document only
    return make, (end, _full(B, S, S), _full(B, S, 0), upper_end), (doc, prefix_end)


def _qk_sparse(B: int, S: int, gen: torch.Generator):
    """Causal attention after dropping tokens: one block of queries sees nothing (its rows are zeros) and a few
    blocks of keys are seen by nobody."""
    q_drop = torch.zeros(B, S, dtype=torch.bool)
    k_drop = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        n = max(1, S // 8)
        a = int(torch.randint(0, S - n + 1, (1,), generator=gen))
        q_drop[b, a : a + n] = True
        for _ in range(3):
            m = max(1, S // 16)
            c = int(torch.randint(0, S - m + 1, (1,), generator=gen))
            k_drop[b, c : c + m] = True

    def make(q_drop, k_drop):
        def qk_sparse(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & ~q_drop[b, q_idx] & ~k_drop[b, kv_idx]
        return qk_sparse

    j = _positions(B, S)
    rows = torch.arange(S)
    first = torch.where(q_drop, rows, S).amin(1, keepdim=True)  # the dropped query block [first, last)
    last = torch.where(q_drop, rows + 1, 0).amax(1, keepdim=True)
    # Upper interval: the causal part [0, j). Lower: every row from j for a dropped key, else the dropped block.
    lts = torch.where(k_drop, j, torch.maximum(first, j))
    lte = torch.where(k_drop, S, torch.maximum(last, j))
    return make, (lts, lte, _full(B, S, 0), j.clone()), (q_drop, k_drop)


def _random_eviction(B: int, S: int, gen: torch.Generator):
    """Causal attention where key j leaves the cache at a random later query (FlashMask's random eviction)."""
    j = _positions(B, S)
    evict = (j + 1 + torch.randint(0, S, (B, S), generator=gen)).clamp(max=S)

    def make(evict):
        def random_eviction(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < evict[b, kv_idx])
        return random_eviction

    return make, (evict, _full(B, S, S), None, None), (evict,)


def _medusa_tree(B: int, S: int, gen: torch.Generator):
    """A causal prompt (the first half), then a tree of candidate tokens in breadth-first order, as MEDUSA's heads
    propose them: each node sees the prompt, itself and its ancestors. The tree is complete with 4 children per
    node, so a node's parent is (n - 1) // 4 (tree positions n from 0): ancestors are found arithmetically."""
    P = S // 2
    width = 4
    depth = max(1, math.ceil(math.log(max(2, S - P) * (width - 1) + 1, width)))

    def make():
        def medusa_tree(b, h, q_idx, kv_idx):
            node, target = q_idx - P, kv_idx - P
            seen = node == target
            for _ in range(depth):
                node = torch.where(node > 0, torch.div(node - 1, width, rounding_mode="floor"), -1)
                seen = seen | (node == target)
            in_tree = torch.where(kv_idx < P, True, seen & (kv_idx >= P))
            return torch.where(q_idx < P, kv_idx <= q_idx, in_tree)
        return medusa_tree

    return make, None, ()


def _packed_alpaca(B: int, S: int, gen: torch.Generator):
    """Short instruction-tuning samples packed into each sequence, each causal, with padding at the end that sees
    nothing and that nothing sees (rows of zeros)."""
    pad = int(torch.randint(1, max(2, S // 16), (1,), generator=gen))
    docs = [_lengths(S - pad, max(4, S // 64), max(8, S // 16), gen) for _ in range(B)]
    doc, _, end = _segments(docs, S)  # padding: id -1

    def make(doc):
        def packed_alpaca(b, h, q_idx, kv_idx):
            same = (doc[b, q_idx] == doc[b, kv_idx]) & (doc[b, kv_idx] >= 0)
            return same & (kv_idx <= q_idx)
        return packed_alpaca

    j = _positions(B, S)
    lts = torch.where(doc >= 0, end, j)  # a padding column: hidden from every row (its upper rows are causal)
    return make, (lts, _full(B, S, S), None, None), (doc,)


def _longformer(B: int, S: int, gen: torch.Generator):
    """Longformer: a bidirectional window (|q - k| < W) and G global tokens at the start that see and are seen by
    every token."""
    W, G = max(8, S // 32), max(2, S // 256)

    def make():
        def longformer(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx).abs() < W) | (kv_idx < G) | (q_idx < G)
        return longformer

    j = _positions(B, S)
    glob = j < G
    lts = torch.where(glob, S, (j + W).clamp(max=S))
    uts = torch.where(glob, S, G)
    ute = torch.where(glob, S, (j - W + 1).clamp(min=G))
    return make, (lts, _full(B, S, S), uts, ute), ()


_BUILDERS: dict[str, tuple[Callable, str]] = {
    "causal_documents": (_causal_documents, "documents of random length, causal inside, isolated"),
    "share_question": (_share_question, "a question and 2-4 answers per document; answers do not see each other"),
    "global_sliding_window": (_global_sliding_window, "causal window of S/16 tokens plus S/128 global tokens"),
    "prefix_lm_documents": (_prefix_lm_documents, "documents with a bidirectional prefix, then causal"),
    "qk_sparse": (_qk_sparse, "causal with a block of queries and 3 blocks of keys dropped"),
    "random_eviction": (_random_eviction, "causal; each key evicted at a random later query"),
    "medusa_tree": (_medusa_tree, "causal prompt, then a 4-ary candidate tree in breadth-first order"),
    "packed_alpaca": (_packed_alpaca, "short causal samples packed per sequence, padding at the end"),
    "longformer": (_longformer, "bidirectional window of S/32 plus S/256 global tokens"),
}
NAMES: tuple[str, ...] = tuple(_BUILDERS)


def describe(name: str) -> str:
    """One line saying what the catalogue mask `name` is."""
    return _BUILDERS[_check_name(name)][1]


def _check_name(name: str) -> str:
    if name not in _BUILDERS:
        raise ValueError(f"no catalogue mask named {name!r}; the names are {', '.join(NAMES)}")
    return name


def catalogue_mask(name: str, B: int, S: int, device: torch.device | str = "cpu", seed: int = 0) -> CatalogueMask:
    """The catalogue mask `name` for B sequences of S tokens on `device` (its mod's tensors live there), made
    from a generator seeded with `seed` (the same arguments give the same mask)."""
    builder, description = _BUILDERS[_check_name(name)]
    for label, value in (("B", B), ("S", S)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, not {value!r}")
    device = torch.device(device)
    make, intervals, tensors = builder(B, S, torch.Generator().manual_seed(seed))
    mod = make(*(t.to(device) for t in tensors))
    if intervals is not None:
        intervals = tuple(None if v is None else v.to(device) for v in intervals)
    return CatalogueMask(name, description, B, S, device, mod, intervals)


# ---- masks the command line names: a user's mask_mod, a saved dense mask, saved intervals ------------------------


def load_mask_mod(spec: str, B: int, S: int, device: torch.device | str = "cpu") -> MaskMod:
    """The mask_mod that `spec`, "MODULE:FUNCTION", names: MODULE is an importable module (my_pkg.masks) or a Python
    file (path/to/masks.py). FUNCTION is a mask_mod(b, h, q_idx, kv_idx), or a factory FUNCTION(B, S, device) that
    returns one (for a mod that reads tensors made for the sequence: document ids, a tree's ancestors)."""
    import importlib
    import importlib.util
    import inspect
    from pathlib import Path

    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"--mask-mod {spec!r}: write MODULE:FUNCTION, e.g. my_pkg.masks:causal or masks.py:causal")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"--mask-mod {spec!r}: no file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--mask-mod {spec!r}: cannot import {module_name} ({exc}); give an importable module "
                         "(run from its directory or set PYTHONPATH) or a path to a .py file") from None
    found = getattr(module, attribute, None)
    if not callable(found):
        raise ValueError(f"--mask-mod {spec!r}: {module_name} has no function {attribute!r}")
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        return found
    for arity, is_mod in ((4, True), (3, False)):
        try:
            signature.bind(*range(arity))
        except TypeError:
            continue
        return found if is_mod else found(B, S, torch.device(device))
    raise ValueError(f"--mask-mod {spec!r}: {attribute}{signature} is neither a mask_mod(b, h, q_idx, kv_idx) nor a "
                     "factory (B, S, device) that returns one")


def read_dense(path: str) -> torch.Tensor:
    """A dense mask saved with torch.save: a bool tensor [S, S] or [B, S, S] (mask_from_dense checks it)."""
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded, dict) and len(loaded) == 1:
        loaded = next(iter(loaded.values()))
    return loaded


def read_intervals(path: str) -> dict[str, torch.Tensor]:
    """FlashMask vectors saved with torch.save: a dict with lts, lte (and optionally uts, ute), [B, S] or [S] each,
    or a list of 2 or 4 tensors in that order."""
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded, (list, tuple)) and len(loaded) in (2, 4):
        loaded = dict(zip(("lts", "lte", "uts", "ute"), loaded))
    if not isinstance(loaded, dict) or not {"lts", "lte"} <= set(loaded) or set(loaded) - {"lts", "lte", "uts", "ute"}:
        keys = sorted(loaded) if isinstance(loaded, dict) else type(loaded).__name__
        raise ValueError(f"--intervals {path}: expected a dict with keys lts, lte (and optionally uts, ute), saved "
                         f"with torch.save({{'lts': lts, 'lte': lte}}, path); found {keys}")
    return loaded


__all__ = ["CatalogueMask", "NAMES", "catalogue_mask", "describe", "load_mask_mod", "read_dense", "read_intervals"]
