"""Layouts: one sequence cut into consecutive segments, and the O(S) tables kernels read.

A `Layout` is one batch element; `Layout.batch([...])` gives a `LayoutBatch` of equal-length
layouts. Neither knows the rules: modality names are checked when tables are made for a
particular `Rules` (`layout.tables(rules)`), which is also where names become integer ids.

The tables are built in numpy and wrapped as torch tensors (`LayoutTables`) only where a tensor is asked
for; `layout.host_tables(rules)` gives the same tables without torch (`HostTables`), which is all the
command line's `show` and `plan` need -- so this module imports torch inside the functions that make or
take tensors, never at import.
"""

from __future__ import annotations

import functools
import itertools
import re
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence, Union

import numpy as np

if TYPE_CHECKING:
    import torch

from .rules import PAD, Rules, closest

_MODALITY_RE = re.compile(r"^[a-z][a-z0-9_]*$")
MAX_SEQ_LEN = 2**31 - 1
_TOKEN_RE = re.compile(r"^([a-z][a-z0-9_]*):(-?\d+)(?:@(-?\d+))?$")


class Segment(NamedTuple):
    """One run of tokens of one modality in one document. A tuple, so layouts build fast."""

    modality: str
    length: int
    doc: int = 0

    def __str__(self) -> str:
        return f"{self.modality}:{self.length}" + (f"@{self.doc}" if self.doc else "")


SegmentLike = Union[Segment, Sequence]


def token_offset(num_segments: int) -> int:
    """Where the token table starts in `LayoutTables.packed`, in int64 words: after the 7 segment
    rows, rounded up to 32 words (256 bytes, as an allocation would be aligned)."""
    return -(-7 * num_segments // 32) * 32


@dataclass(frozen=True)
class LayoutTables:
    """Integer tables for a batch of B layouts of length S, on one device.

    Segments are numbered across the whole batch (element b's segments follow element b-1's);
    positions in the segment tables are *global*: token s of element b is at b * S + s.

    All of them live in one int64 tensor, `packed` (one allocation, one host-to-device copy): 7 rows
    of `num_segments` (seg_start, seg_end, seg_modality, seg_doc, seg_batch, seg_visible_start,
    seg_visible_end), then from word `token_offset(num_segments)` the int32 token table. The named
    tables are views of it, made on first use: the GPU planner reads `packed` itself.
    """

    batch_size: int
    seq_len: int
    num_segments: int
    packed: torch.Tensor

    @functools.cached_property
    def _segment_rows(self) -> tuple[torch.Tensor, ...]:
        n = self.num_segments
        return self.packed[: 7 * n].view(7, n).unbind(0)

    # per segment, int64 [num_segments]
    @property
    def seg_start(self) -> torch.Tensor:  # global position of the first token
        return self._segment_rows[0]

    @property
    def seg_end(self) -> torch.Tensor:  # one past the last token
        return self._segment_rows[1]

    @property
    def seg_modality(self) -> torch.Tensor:  # rules.modality_id (pad = rules.pad_id)
        return self._segment_rows[2]

    @property
    def seg_doc(self) -> torch.Tensor:  # document id as given
        return self._segment_rows[3]

    @property
    def seg_batch(self) -> torch.Tensor:  # batch element
        return self._segment_rows[4]

    @property
    def seg_visible_start(self) -> torch.Tensor:  # first position its queries may see (document or element)
        return self._segment_rows[5]

    @property
    def seg_visible_end(self) -> torch.Tensor:
        return self._segment_rows[6]

    # per token, [B, S]
    @functools.cached_property
    def token_segment(self) -> torch.Tensor:  # int32, global segment index
        import torch

        B, S = self.batch_size, self.seq_len
        return self.packed.view(torch.int32).as_strided((B, S), (S, 1), 2 * token_offset(self.num_segments))

    # Kernels also read these two; the planner reads neither.
    @functools.cached_property
    def token_modality(self) -> torch.Tensor:  # int32 [B, S]
        return self.seg_modality.to(self.token_segment.dtype)[self.token_segment]

    @functools.cached_property
    def token_doc(self) -> torch.Tensor:  # int32 [B, S]
        return self.seg_doc.to(self.token_segment.dtype)[self.token_segment]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """numpy views of `packed` (on the host; copied there first where it is elsewhere): the 7
        segment rows as int64 [7, num_segments] and token_segment as flat int32 [B * S]. Cheaper
        than the tensor views for the host planner, which reads these only."""
        return _split_packed(self.packed.cpu().numpy(), self.num_segments, self.batch_size * self.seq_len)

    def to(self, device: torch.device | str) -> "LayoutTables":
        return LayoutTables(self.batch_size, self.seq_len, self.num_segments, self.packed.to(device))

    def nbytes(self) -> int:
        tensors = (self.packed, self.token_modality, self.token_doc)
        return sum(t.numel() * t.element_size() for t in tensors)


def _split_packed(host: np.ndarray, n_segments: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment rows int64 [7, n_segments], token_segment int32 [n_tokens]): views of a packed buffer."""
    return host[: 7 * n_segments].reshape(7, n_segments), host[token_offset(n_segments) :].view(np.int32)[:n_tokens]


@dataclass(frozen=True)
class HostTables:
    """`LayoutTables` on the host as numpy arrays (the same packed buffer, the same rows), made without
    torch: what the host planner and the command line read. `layout.host_tables(rules)`; a CPU
    `LayoutTables` of the same layout and rules wraps this very buffer."""

    batch_size: int
    seq_len: int
    num_segments: int
    packed: np.ndarray  # int64, the layout of LayoutTables.packed

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """As `LayoutTables.host_arrays`: segment rows int64 [7, num_segments], token_segment int32 [B * S]."""
        return _split_packed(self.packed, self.num_segments, self.batch_size * self.seq_len)

    @property
    def token_segment(self) -> np.ndarray:  # int32 [B, S], global segment index
        return self.host_arrays()[1].reshape(self.batch_size, self.seq_len)

    @property
    def token_modality(self) -> np.ndarray:  # int32 [B, S]
        return self.host_arrays()[0][2].astype(np.int32)[self.token_segment]

    @property
    def token_doc(self) -> np.ndarray:  # int32 [B, S]
        return self.host_arrays()[0][3].astype(np.int32)[self.token_segment]

    def nbytes(self) -> int:
        """What `LayoutTables.nbytes()` says for the same tables (packed + int32 token modality and document),
        counted without making the two per-token tables."""
        return self.packed.nbytes + 2 * 4 * self.batch_size * self.seq_len


# Every Layout and LayoutBatch gets a handle when it is built: a string unique in this process, by which
# `live_layout` finds it while it lives. A torch.compile trace hands the handle on where it may not hand the object,
# and guards on one string instead of every segment (op/traced_layouts.py). A string: Dynamo makes an int that varies
# between traces symbolic.
_LIVE: "weakref.WeakValueDictionary[str, AnyLayout]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _new_handle(layout: "AnyLayout", tracing: bool | None = None) -> str | None:
    """`tracing`: _dynamo_tracing(), where the caller has asked already."""
    if _dynamo_tracing() if tracing is None else tracing:
        return None  # one built inside a trace: the trace has its segments as constants already
    handle = f"layout#{next(_HANDLES)}"
    _LIVE[handle] = layout
    return handle


def live_layout(handle: str) -> "AnyLayout":
    """The living Layout or LayoutBatch of this handle (`layout.handle`); KeyError when it is gone."""
    found = _LIVE.get(handle)
    if found is None:
        raise KeyError(f"no living omnigen layout has the handle {handle!r}")
    return found


class Layout:
    """One sequence of segments: `Layout.from_segments([("text", 40), ("image", 256), ("text", 24, 1)])`."""

    __slots__ = ("segments", "handle", "_tables", "_seq_len", "_modalities", "__weakref__")

    def __init__(self, segments: Iterable[Segment]) -> None:
        self.segments: tuple[Segment, ...] = tuple(segments)
        self._tables: dict = {}
        tracing = _dynamo_tracing()  # asked once a layout
        self._seq_len = _check_segments(self.segments, tracing)
        self._modalities: frozenset[str] | None = None
        self.handle = _new_handle(self, tracing)

    def __reduce__(self) -> tuple:
        # built again, unchecked (it passed the checks when first built), with a handle of this process and no
        # tables: not the slots copied, which would carry the handle over
        return (_unchecked_layout, (self.segments, self._seq_len))

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_segments(cls, items: Iterable[SegmentLike]) -> "Layout":
        segments = []
        new = tuple.__new__  # Segment's own __new__ is Python code: ~3x slower per segment
        for index, item in enumerate(items):
            if type(item) is not Segment:
                if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                    raise ValueError(
                        f"segment {index} is {item!r}; write (modality, length) or (modality, length, document)"
                    )
                item = new(Segment, item if len(item) == 3 else (item[0], item[1], 0))
            segments.append(item)
        return cls(segments)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse "text:40 image:256 text:24@1" (modality:length[@document], space or comma separated)."""
        if not isinstance(text, str):
            raise TypeError(f"layout text must be a string, not {type(text).__name__}")
        words = [w for w in re.split(r"[\s,]+", text.strip()) if w]
        if not words:
            raise ValueError("layout text is empty; write segments like 'text:40 image:256 text:24@1'")
        segments = []
        for word in words:
            match = _TOKEN_RE.match(word)
            if not match:
                raise ValueError(
                    f"cannot read layout segment '{word}' ({_unreadable(word)}); write modality:length or "
                    "modality:length@document, e.g. 'image:256' or 'text:24@1'"
                )
            segments.append(Segment(match.group(1), int(match.group(2)), int(match.group(3) or 0)))
        return cls(segments)

    @classmethod
    def from_tensors(cls, modality_ids: torch.Tensor, document_ids: torch.Tensor | None = None, *, rules: Rules,
                     segment_ids: torch.Tensor | None = None) -> "Layout | LayoutBatch":
        """Layouts from per-token ids: `modality_ids` [S] (a Layout) or [B, S] (a LayoutBatch), integers on
        any device holding `rules.modality_id(name)` (`rules.pad_id` for pad; `rules.describe_ids()` lists
        them). `document_ids` (same shape, >= 0, non-decreasing along each row; default all 0) cut
        documents. A segment is a maximal run of one modality in one document; two images side by side
        need `segment_ids` (same shape, any integers, a new value where a new segment starts).

        Vectorised: a Python loop per batch element, none per token or segment. ValueError/TypeError name
        the first offending position."""
        if not isinstance(rules, Rules):
            raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
        ids = _token_array(modality_ids, "modality_ids")
        shape = ids.shape
        docs = None if document_ids is None else _token_array(document_ids, "document_ids", shape)
        segs = None if segment_ids is None else _token_array(segment_ids, "segment_ids", shape)
        rows = ids.reshape(-1, shape[-1])
        bad = (rows < 0) | (rows > rules.pad_id)
        if bad.any():
            at = _first(bad)
            raise ValueError(f"modality_ids{_where(at, len(shape))} = {rows[at]} is not a modality id of the rules "
                             f"'{rules.name}' ({rules.describe_ids()})")
        doc_rows = None
        if docs is not None:
            doc_rows = docs.reshape(rows.shape)
            if (doc_rows < 0).any():
                at = _first(doc_rows < 0)
                raise ValueError(f"document_ids{_where(at, len(shape))} = {doc_rows[at]}: document ids must be >= 0")
            falling = doc_rows[:, 1:] < doc_rows[:, :-1]
            if falling.any():
                b, s = _first(falling)
                raise ValueError(
                    f"document_ids{_where((b, s + 1), len(shape))} = {doc_rows[b, s + 1]} after {doc_rows[b, s]}: "
                    "document ids must not decrease along the sequence"
                )
        if rows.shape[1] > MAX_SEQ_LEN:
            raise ValueError(f"a layout may have at most {MAX_SEQ_LEN} tokens, these have {rows.shape[1]}")
        cut = rows[:, 1:] != rows[:, :-1]
        if doc_rows is not None:
            cut |= doc_rows[:, 1:] != doc_rows[:, :-1]
        if segs is not None:
            seg_rows = segs.reshape(rows.shape)
            cut |= seg_rows[:, 1:] != seg_rows[:, :-1]
        names = np.array(rules.modality_names + (PAD,), dtype=object)
        made = []
        length = rows.shape[1]
        for b in range(rows.shape[0]):
            starts = np.flatnonzero(cut[b]) + 1
            starts = np.concatenate(([0], starts))
            lengths = np.diff(np.append(starts, length))
            seg_docs = doc_rows[b, starts].tolist() if doc_rows is not None else [0] * len(starts)
            made.append(_trusted_layout(names[rows[b, starts]].tolist(), lengths.tolist(), seg_docs, length))
        return made[0] if len(shape) == 1 else LayoutBatch(made)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, *, rules: Rules, modality: str = "text",
                        seq_len: int | None = None) -> "Layout":
        """One packed sequence of documents, FlashAttention's varlen convention: document i holds tokens
        [cu_seqlens[i], cu_seqlens[i + 1]) (cu_seqlens int [n + 1], from 0, strictly increasing) as one
        `modality` segment with document id i. `seq_len` > cu_seqlens[-1] pads the end."""
        if not isinstance(rules, Rules):
            raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
        rules.modality_id(modality)  # a ValueError naming the rules' modalities
        cu = _token_array(cu_seqlens, "cu_seqlens")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-dimensional with at least 2 entries [0, ..., total], "
                             f"got shape {tuple(cu.shape)}")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens[0] = {cu[0]}: it must be 0 (the first document starts the sequence)")
        lengths = np.diff(cu)
        if (lengths <= 0).any():
            i = int(np.flatnonzero(lengths <= 0)[0]) + 1
            raise ValueError(f"cu_seqlens[{i}] = {cu[i]} is not greater than cu_seqlens[{i - 1}] = {cu[i - 1]}: "
                             "offsets must increase (every document has at least one token)")
        total = int(cu[-1])
        if total > MAX_SEQ_LEN:
            raise ValueError(f"a layout may have at most {MAX_SEQ_LEN} tokens, cu_seqlens holds {total}")
        n = lengths.shape[0]
        names, sizes, docs = [modality] * n, lengths.tolist(), list(range(n))
        if seq_len is not None:
            if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < total:
                raise ValueError(f"seq_len must be an integer >= cu_seqlens[-1] = {total}, not {seq_len!r}")
            if seq_len > total:
                names, sizes, docs = names + [PAD], sizes + [seq_len - total], docs + [n - 1]
        return _trusted_layout(names, sizes, docs, sum(sizes))

    @staticmethod
    def batch(layouts: Iterable["Layout"]) -> "LayoutBatch":
        return LayoutBatch(layouts)

    # -- properties --------------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def batch_size(self) -> int:
        return 1

    @property
    def layouts(self) -> tuple["Layout", ...]:
        return (self,)

    @property
    def modalities(self) -> frozenset[str]:
        if self._modalities is None:
            self._modalities = frozenset(s.modality for s in self.segments)
        return self._modalities

    def starts(self) -> list[int]:
        out, position = [], 0
        for s in self.segments:
            out.append(position)
            position += s.length
        return out

    def __len__(self) -> int:
        return self.seq_len

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.segments == other.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def __str__(self) -> str:
        return " ".join(str(s) for s in self.segments)

    def __repr__(self) -> str:
        return f"Layout.parse({str(self)!r})"

    # -- tables ------------------------------------------------------------------------------

    def tables(self, rules: Rules, device: torch.device | str | None = None) -> LayoutTables:
        return _cached_tables(self, rules, device)

    def host_tables(self, rules: Rules) -> HostTables:
        """The same tables as numpy arrays on the host, made without torch (cached)."""
        return _cached_host_tables(self, rules)

    # -- editing -------------------------------------------------------------------------------

    def pad_to_tiles(self, modalities: Iterable[str], multiple: int, *,
                     rules: Rules | None = None) -> tuple["Layout", "PaddingReport"]:
        """Insert `pad` tokens so every segment of the given modalities starts at a multiple of `multiple`.

        A segment boundary inside a tile makes that tile partial; aligning image starts to the
        tile size keeps their tiles full. Returns the new layout and a report of what moved.
        The mask between real tokens is unchanged, except that a `window` counts positions, so
        pad inserted inside a window's reach narrows what that window covers.

        Every name must be a modality of this layout -- or, with `rules`, of the rules (so one list
        serves every layout of a data set, also those that lack a modality); anything else is a
        ValueError naming the closest valid modality, never a silent "nothing to pad".
        """
        wanted = self._padding_modalities(modalities, rules)
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"multiple must be a positive integer, not {multiple!r}")
        out: list[Segment] = []
        inserted: list[tuple[int, int, int]] = []  # (new position, tokens, original segment index)
        position = 0
        for index, seg in enumerate(self.segments):
            if seg.modality in wanted and position % multiple:
                gap = multiple - position % multiple
                doc = out[-1].doc if out else seg.doc
                if out and out[-1].modality == PAD and out[-1].doc == doc:
                    out[-1] = Segment(PAD, out[-1].length + gap, doc)
                else:
                    out.append(Segment(PAD, gap, doc))
                inserted.append((position, gap, index))
                position += gap
            out.append(seg)
            position += seg.length
        return Layout(out), PaddingReport(self, Layout(out), tuple(inserted), multiple)

    def _padding_modalities(self, modalities: Iterable[str], rules: Rules | None) -> set[str]:
        """`pad_to_tiles`' modality names, checked: each one this layout's (or, with `rules`, the rules')."""
        if isinstance(modalities, str):
            raise TypeError(f"modalities must be a list of modality names, e.g. [{modalities!r}], not a string")
        try:
            names = list(modalities)
        except TypeError:
            raise TypeError(f"modalities must be a list of modality names, e.g. ['image'], "
                            f"not {type(modalities).__name__}") from None
        if rules is not None and not isinstance(rules, Rules):
            raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
        if rules is not None:
            known, where = rules.modality_names, f"the rules '{rules.name}'"
        else:
            known, where = tuple(sorted(self.modalities - {PAD})), "this layout"
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"modalities must be modality names (strings), not {type(name).__name__} {name!r}")
            if name == PAD:
                raise ValueError("'pad' is what pad_to_tiles inserts, not a modality to align: name the modalities "
                                 f"whose segments should start on a tile boundary (those of {where}: "
                                 f"{', '.join(known) or 'none but pad'})")
            if name not in known:
                suggestion = closest(name, known)
                hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
                fix = "" if rules is not None else (
                    "; to name a modality that some layouts lack, pass the rules: "
                    "pad_to_tiles(modalities, multiple, rules=rules)")
                raise ValueError(f"pad_to_tiles: modality '{name}' is not in {where}, whose modalities are "
                                 f"{', '.join(known) or 'none but pad'}{hint}{fix}")
        return set(names)

    def pad_end(self, seq_len: int) -> "Layout":
        """Append `pad` tokens up to `seq_len` (to batch layouts of different lengths)."""
        if seq_len < self.seq_len:
            raise ValueError(f"cannot pad a layout of {self.seq_len} tokens down to {seq_len}")
        if seq_len == self.seq_len:
            return self
        return Layout(self.segments + (Segment(PAD, seq_len - self.seq_len, self.segments[-1].doc),))


@dataclass(frozen=True)
class PaddingReport:
    """What `Layout.pad_to_tiles` changed: where pad runs went and where each old token moved."""

    before: Layout
    after: Layout
    inserted: tuple[tuple[int, int, int], ...]  # (position in the new layout, pad tokens, segment index)
    multiple: int

    @property
    def added_tokens(self) -> int:
        return sum(n for _, n, _ in self.inserted)

    def new_positions(self) -> torch.Tensor:
        """new_positions()[i] is where the original token i lives in the padded sequence."""
        import torch

        shift = torch.zeros(self.before.seq_len + 1, dtype=torch.int64)
        old_starts = self.before.starts()
        for _, tokens, index in self.inserted:
            shift[old_starts[index]] += tokens
        return torch.arange(self.before.seq_len) + torch.cumsum(shift, 0)[:-1]

    def __str__(self) -> str:
        if not self.inserted:
            return f"nothing to pad: every chosen segment already starts at a multiple of {self.multiple}"
        lines = [
            f"inserted {self.added_tokens} pad tokens in {len(self.inserted)} places "
            f"({self.before.seq_len} -> {self.after.seq_len} tokens, +{100.0 * self.added_tokens / self.before.seq_len:.1f}%)"
        ]
        for position, tokens, index in self.inserted:
            seg = self.before.segments[index]
            lines.append(f"  {tokens:5d} pad before segment {index} ({seg}), now starting at {position + tokens}")
        return "\n".join(lines)


class LayoutBatch:
    """B layouts of the same length: one per batch element."""

    __slots__ = ("layouts", "handle", "_tables", "__weakref__")

    def __init__(self, layouts: Iterable[Layout]) -> None:
        items = tuple(layouts)
        if not items:
            raise ValueError("a batch needs at least one layout")
        for index, item in enumerate(items):
            if not isinstance(item, Layout):
                raise TypeError(f"batch element {index} is a {type(item).__name__}, expected omnigen.Layout")
        lengths = [item.seq_len for item in items]
        if len(set(lengths)) > 1:
            longest = max(lengths)
            raise ValueError(
                f"layouts in a batch must have the same length; got {lengths}. "
                f"Pad the shorter ones with layout.pad_end({longest})"
            )
        self.layouts: tuple[Layout, ...] = items
        self._tables: dict = {}
        self.handle = _new_handle(self)

    def __reduce__(self) -> tuple:
        return (LayoutBatch, (self.layouts,))

    @property
    def seq_len(self) -> int:
        return self.layouts[0].seq_len

    @property
    def batch_size(self) -> int:
        return len(self.layouts)

    @property
    def modalities(self) -> set[str]:
        return set().union(*(item.modalities for item in self.layouts))

    def tables(self, rules: Rules, device: torch.device | str | None = None) -> LayoutTables:
        return _cached_tables(self, rules, device)

    def host_tables(self, rules: Rules) -> HostTables:
        """The same tables as numpy arrays on the host, made without torch (cached)."""
        return _cached_host_tables(self, rules)

    def __len__(self) -> int:
        return self.batch_size

    def __getitem__(self, index: int) -> Layout:
        return self.layouts[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayoutBatch) and self.layouts == other.layouts

    def __hash__(self) -> int:
        return hash(self.layouts)

    def __repr__(self) -> str:
        return f"Layout.batch([{', '.join(repr(item) for item in self.layouts)}])"


AnyLayout = Union[Layout, LayoutBatch]


def as_layout(value: object, name: str = "layout") -> AnyLayout:
    """Accept a Layout, a LayoutBatch, a layout string, a list of Layouts, or a mask (its layout)."""
    if isinstance(value, (Layout, LayoutBatch)):
        return value
    inner = getattr(value, "layout", None)  # an omnigen Mask (plan/masks.py) carries the layout it planned
    if isinstance(inner, (Layout, LayoutBatch)) and hasattr(value, "schedules"):
        if getattr(value, "ruleless", False):
            # Its layout is an all-pad stand-in (plan/ruleless.py): planning it with rules would allow nothing.
            raise ValueError(f"{name}: this mask was made from data (mask_from_dense / mask_from_mod / "
                             "mask_from_intervals), so it has no layout or rules to plan from; its exact plan is "
                             "mask.plan(block_m, block_n) for one of mask.tiles, and it runs as "
                             "omnigen.attention(q, k, v, mask)")
        return inner
    if isinstance(value, str):
        return Layout.parse(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Layout) for v in value):
        return LayoutBatch(value)
    raise TypeError(f"{name} must be an omnigen.Layout, a LayoutBatch, an omnigen.mask(...) or a string like "
                    "'text:40 image:256', "
                    f"not {type(value).__name__}")


def _token_array(value: object, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """An integer tensor (any device) as an int64 numpy array: [S] or [B, S], or exactly `shape`."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, not {type(value).__name__}")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name} must hold integers, not {value.dtype}")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, but modality_ids has shape {shape}")
    if value.dim() not in (1, 2) or value.shape[-1] < 1 or (value.dim() == 2 and value.shape[0] < 1):
        raise ValueError(f"{name} must have shape [S] or [B, S] with S >= 1, got {tuple(value.shape)}")
    return value.detach().to("cpu", torch.int64).numpy()


def _first(bad: np.ndarray) -> tuple[int, int]:
    """(row, column) of the first True of a 2-d array, in row-major order."""
    return tuple(int(x) for x in np.unravel_index(int(np.argmax(bad)), bad.shape))  # type: ignore[return-value]


def _where(at: tuple[int, int], dims: int) -> str:
    return f"[{at[1]}]" if dims == 1 else f"[{at[0]}, {at[1]}]"


_NEW_SEGMENT = functools.partial(tuple.__new__, Segment)


def _trusted_layout(names: list[str], lengths: list[int], docs: list[int], seq_len: int) -> "Layout":
    """A Layout from columns already checked (ids in the rules, lengths >= 1, documents non-decreasing):
    Segment tuples made in C (map over zip), no per-segment Python code."""
    return _unchecked_layout(tuple(map(_NEW_SEGMENT, zip(names, lengths, docs))), seq_len, frozenset(names))


def _unchecked_layout(segments: tuple[Segment, ...], seq_len: int,
                      modalities: frozenset[str] | None = None) -> "Layout":
    """A Layout of segments that passed the checks already (made from checked columns, or unpickled)."""
    layout = Layout.__new__(Layout)
    layout.segments = segments
    layout._tables = {}
    layout._seq_len = seq_len
    layout._modalities = modalities
    layout.handle = _new_handle(layout)
    return layout


def _unreadable(word: str) -> str:
    """Why one word of a layout string does not parse, in a few words."""
    if re.search(r"[;|/]", word):
        return "separate segments with spaces or commas"
    name, colon, rest = word.partition(":")
    if not colon:
        return "no ':length'"
    if not name:
        return "no modality name before ':'"
    if not _MODALITY_RE.match(name):
        return f"modality names are lowercase words like 'text', not {name!r}"
    length, at, doc = rest.partition("@")
    if not length:
        return "no length after ':'"
    if not re.fullmatch(r"-?\d+", length):
        return f"the length {length!r} is not a whole number"
    if at and not re.fullmatch(r"-?\d+", doc):
        return f"the document id {doc!r} is not a whole number"
    return "unexpected characters"


_GOOD_MODALITY_NAMES: set[str] = set()  # names already checked against _MODALITY_RE


def _dynamo_tracing() -> bool:
    """Whether TorchDynamo is tracing the caller. Then _GOOD_MODALITY_NAMES is left alone: a layout planned while
    tracing (op/traced_layouts.py) fills it for real, which would fail the guard Dynamo put on it in the same trace;
    and a layout gets no handle. (torch only where it is loaded already: this module does not import it.)"""
    if "torch" not in sys.modules:
        return False
    import torch

    return torch.compiler.is_compiling()


def _check_segments(segments: tuple[Segment, ...], tracing: bool) -> int:
    """Raise ValueError on the first bad segment; return the number of tokens. `tracing` (_dynamo_tracing()): every
    name is checked and the cache of good names left as it is."""
    if not segments:
        raise ValueError("a layout needs at least one segment")
    previous_doc = 0
    total = 0
    known = frozenset() if tracing else _GOOD_MODALITY_NAMES
    for index, (modality, length, doc) in enumerate(segments):
        if modality not in known:
            if not isinstance(modality, str) or not _MODALITY_RE.match(modality):
                raise ValueError(f"segment {index}: modality must be a lowercase name like 'text', not {modality!r}")
            _GOOD_MODALITY_NAMES.add(modality)
        if type(length) is not int or length < 1:  # bool is not int here, on purpose
            raise ValueError(f"segment {index} ({modality}): length must be an integer >= 1, not {length!r}")
        if type(doc) is not int or doc < 0:
            raise ValueError(f"segment {index} ({modality}): document id must be an integer >= 0, not {doc!r}")
        if doc < previous_doc:
            raise ValueError(
                f"segment {index} ({segments[index]}): document ids must not decrease along the sequence "
                f"(document {doc} after document {previous_doc})"
            )
        previous_doc = doc
        total += length
    if total > MAX_SEQ_LEN:  # kernels index tokens with 32-bit integers
        raise ValueError(f"a layout may have at most {MAX_SEQ_LEN} tokens, this one has {total}")
    return total


def _cached_tables(layout: AnyLayout, rules: Rules, device: torch.device | str | None) -> LayoutTables:
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    key = (rules.mask_hash(), rules.modality_names, str(device))
    cached = layout._tables.get(key)
    if cached is None:
        if device.type == "cpu":  # the host tables' own buffer: made once, read by both planners' callers
            host = _cached_host_tables(layout, rules)
            cached = LayoutTables(host.batch_size, host.seq_len, host.num_segments, torch.from_numpy(host.packed))
        else:
            cached = _build_tables(layout.layouts, rules, device)
        layout._tables[key] = cached
    return cached


def _cached_host_tables(layout: AnyLayout, rules: Rules) -> HostTables:
    key = (rules.mask_hash(), rules.modality_names, "numpy")
    cached = layout._tables.get(key)
    if cached is None:
        n_segments, words = _packed_size(layout.layouts)
        host = np.empty(words, dtype=np.int64)
        _fill_tables(layout.layouts, rules, host, n_segments)
        cached = HostTables(layout.batch_size, layout.seq_len, n_segments, host)
        layout._tables[key] = cached
    return cached


def _packed_size(layouts: tuple[Layout, ...]) -> tuple[int, int]:
    """(segments, int64 words) of the packed buffer of these layouts."""
    n_segments = sum(len(layout.segments) for layout in layouts)
    return n_segments, token_offset(n_segments) + (len(layouts) * layouts[0].seq_len + 1) // 2


def _build_tables(layouts: tuple[Layout, ...], rules: Rules, device: torch.device) -> LayoutTables:
    """The tables for a non-CPU device: filled in a (pinned) host buffer, then one copy to `device`."""
    n_segments, words = _packed_size(layouts)
    host, staging = _host_buffer(words, device)
    _fill_tables(layouts, rules, host, n_segments)
    packed = staging.to(device, non_blocking=True)
    return LayoutTables(batch_size=len(layouts), seq_len=layouts[0].seq_len, num_segments=n_segments, packed=packed)


def _fill_tables(layouts: tuple[Layout, ...], rules: Rules, host: np.ndarray, n_segments: int) -> None:
    """Segment tables written straight into one host buffer (one row each, one block of columns per
    batch element), the token table by np.repeat (the layout of LayoutTables.packed)."""
    seq_len = layouts[0].seq_len
    ids = {name: rules.modality_id(name) for name in set().union(*(layout.modalities for layout in layouts))}
    isolated = rules.isolated_documents
    n_tokens = len(layouts) * seq_len
    tokens_at = token_offset(n_segments)
    rows = host[: 7 * n_segments].reshape(7, n_segments)
    start, end, modality, doc, batch, visible_start, visible_end = rows
    lengths = np.empty(n_segments, dtype=np.int64)
    lo = 0
    for b, layout in enumerate(layouts):
        names, sizes, documents = zip(*layout.segments)
        hi = lo + len(sizes)
        element_start = b * seq_len
        lengths[lo:hi] = sizes
        # Element b's segments fill [b * seq_len, (b + 1) * seq_len) exactly.
        ends = np.cumsum(lengths[lo:hi], out=end[lo:hi])
        ends += element_start
        modality[lo:hi] = [ids[name] for name in names]
        doc[lo:hi] = documents
        batch[lo:hi] = b
        # Visible range: the segment's document (isolated) or its whole batch element (shared). Document
        # ids never decrease, so one document per element is first == last: the common case, no loop.
        if not isolated or documents[0] == documents[-1]:
            visible_start[lo:hi] = element_start
            visible_end[lo:hi] = element_start + seq_len
        else:
            docs = doc[lo:hi]
            opens = np.r_[True, docs[1:] != docs[:-1]]  # a segment that opens a document
            first = np.flatnonzero(opens)  # each document's first segment
            group = np.cumsum(opens) - 1  # each segment's document, 0-based
            last = np.r_[first[1:], len(docs)] - 1  # each document's last segment
            visible_start[lo:hi] = np.r_[element_start, ends[:-1]][first][group]
            visible_end[lo:hi] = ends[last][group]
        lo = hi
    np.subtract(end, lengths, out=start)
    host[tokens_at:].view(np.int32)[:n_tokens] = np.repeat(np.arange(n_segments, dtype=np.int32), lengths)


def _host_buffer(words: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """An int64 host buffer of `words` and the tensor it views: pinned for a CUDA device.

    From pinned memory the one copy is asynchronous and skips the driver's staging copy (~6 us
    against ~16 us for a pageable source on an H200 host); torch's pinned-memory cache keeps the
    block until that copy has finished, so dropping the tensor right after is safe.
    """
    import torch

    if device.type != "cuda":
        host = np.empty(words, dtype=np.int64)
        return host, torch.from_numpy(host)
    staging = torch.empty(words, dtype=torch.int64, pin_memory=True)
    return staging.numpy(), staging
