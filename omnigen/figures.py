"""Pictures of a mask and its tile plan: for the terminal (plain text) and as a matplotlib figure.

Pure functions of (rules, layout, plan), used by `omnigen show` / `omnigen plan` and callable
from Python::

    import omnigen
    from omnigen import figures
    rules = omnigen.Rules.load("examples/rules/transfusion.yaml")
    layout = omnigen.Layout.parse("text:40 image:256 text:24@1")
    p = omnigen.plan(rules, layout, block_m=64, block_n=64)
    print(figures.render_terminal(rules, layout, p, width=100))
    figures.save_png(rules, layout, p, "mask.png")

The dense mask (O(S^2)) is only built when S <= DENSE_LIMIT; above that only the tile grid,
which the planner computes without ever materialising S x S, is drawn. Tile grids are drawn from
`plan.kind_cells` (tiles grouped into cells: one per character, or per pixel of the PNG), so a picture
never needs the full [nq, nk] grid either. `plan` is an `omnigen.Plan` or the command line's
`omnigen.plan.PlanSummary`; everything here is numpy (the command line does not import torch).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .layout import AnyLayout, Layout, Segment
from .plan import CAUSAL, EMPTY, FULL, KIND_NAMES, PARTIAL
from .rules import Rules
from .semantics import dense_mask_host

if TYPE_CHECKING:
    from .plan import PlanStatistics as Plan

DENSE_LIMIT = 8192  # largest S for which pictures build the dense S x S mask
MAX_PICTURED = 4  # batch elements drawn; the statistics always cover the whole batch
MAX_LINES = 64  # the mask picture never gets taller than this, however wide the terminal
PNG_PIXELS = 1024  # the PNG's panels are averaged down to at most this many pixels (or tile cells) per side
MAX_BOUNDARY_LINES = 64  # more boundary lines than this would hide the picture

_KIND_ORDER = (EMPTY, FULL, CAUSAL, PARTIAL)
# Characters per tile kind, and for a character cell that covers tiles of several kinds.
_TILE_CHARS = {True: {EMPTY: "·", FULL: "█", CAUSAL: "◣", PARTIAL: "▒", -1: "*"},
               False: {EMPTY: ".", FULL: "#", CAUSAL: "\\", PARTIAL: "%", -1: "*"}}
_MASK_CHARS = {True: ("█", "▒", " "), False: ("#", "+", " ")}  # all allowed, mixed, none
_FRAME = {True: dict(h="─", v="│", tl="┌", tr="┐", bl="└", br="┘", top="┬", left="├"),
          False: dict(h="-", v="|", tl="+", tr="+", bl="+", br="+", top="+", left="+")}
_KIND_COLORS = {EMPTY: "#f2f2f2", FULL: "#1f4e79", CAUSAL: "#5fa8d3", PARTIAL: "#f28e2b", -1: "#b07aa1"}
_SEGMENT_LINE: dict[str, Any] = dict(color="#555555", linewidth=0.6, linestyle=(0, (4, 3)))
_DOC_LINE: dict[str, Any] = dict(color="#c0392b", linewidth=1.4)
_LABEL_WIDTH = 18  # left margin of the terminal pictures: "<modality>@<doc> <position>"


def can_encode_unicode(encoding: str | None) -> bool:
    """Whether a stream with this encoding can print the block and box characters."""
    try:
        "".join(_TILE_CHARS[True].values()).join(_FRAME[True].values()).encode(encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


# --------------------------------------------------------------------------------------------
# terminal


# Per batch element, the dense bool [S, S] mask to draw instead of the rules' (a mask made from data has no rules:
# `omnigen show --mask/--dense/...` passes its mask rebuilt from the plan and bits, plan.ruleless.dense_from_bits).
DenseOf = Callable[[int], Any]


def render_terminal(rules: Rules, layout: AnyLayout, plan: Plan, width: int = 100, unicode: bool = True,
                    dense: DenseOf | None = None) -> str:
    """Everything `omnigen show` prints: mask picture(s) when S is small enough, tile grid(s), summary."""
    parts: list[str] = []
    elements = layout.layouts
    factors = tile_factors(plan.num_kv_tiles, width)
    cells = plan.kind_cells(min(len(elements), MAX_PICTURED), *factors)
    for b, element in enumerate(elements[:MAX_PICTURED]):
        if len(elements) > 1:
            parts.append(f"batch element {b}: {element}")
        if element.seq_len <= DENSE_LIMIT:
            parts.append(mask_text(rules, element, width=width, unicode=unicode,
                                   dense=None if dense is None else dense(b)))
        parts.append(tile_text(cells[b], factors, element, plan.block_m, plan.block_n, width=width, unicode=unicode))
    if len(elements) > MAX_PICTURED:
        parts.append(f"({len(elements) - MAX_PICTURED} more batch elements not drawn; the summary covers all)")
    if plan.seq_len > DENSE_LIMIT:
        parts.append(f"(mask picture skipped: S = {plan.seq_len} > {DENSE_LIMIT} would need the dense S x S mask; "
                     "the tile grid above is exact)")
    parts.append(summary_line(plan))
    return "\n\n".join(parts)


def summary_line(plan: Plan) -> str:
    """One line: S, batch, tile size, tiles per kind, density, partial fraction."""
    counts = plan.counts()
    total = sum(counts.values())
    per_kind = ", ".join(f"{name} {n} ({100.0 * n / total:.1f}%)" for name, n in counts.items())
    return (f"S={plan.seq_len} batch={plan.batch_size} tile={plan.block_m}x{plan.block_n} "
            f"tiles={total}: {per_kind}; density={plan.density:.4f} partial_fraction={plan.partial_fraction:.4f}")


def mask_text(rules: Rules, layout: Layout, width: int = 100, unicode: bool = True, dense: Any = None) -> str:
    """The dense mask of one layout as characters, averaged down to fit `width` columns.

    A character is "all allowed", "mixed" or "none" over the tokens it covers. Segment starts
    are ticked on the frame and labelled with modality (and document, where it changes) and
    position. Needs the dense mask: O(S^2) memory, so only for S <= DENSE_LIMIT. `dense`: that mask (bool
    [S, S]) when it is not the rules' (a mask made from data).
    """
    S = layout.seq_len
    if S > DENSE_LIMIT:
        raise ValueError(f"mask_text builds the dense mask; S = {S} is above {DENSE_LIMIT}, draw tile_text instead")
    avail = max(8, width - _LABEL_WIDTH - 3)
    if 2 * S <= avail:  # small: a token is two characters wide and one line tall, roughly square
        cols, rows, repeat = S, S, 2
    else:  # a line is about twice as tall as a character is wide, so half as many lines
        cols, repeat = min(S, avail, 2 * MAX_LINES), 1
        rows = max(1, math.ceil(cols / 2))
    counts, areas = mask_cells(dense_mask_host(rules, layout) if dense is None else dense, rows, cols)
    full, mixed, none = _MASK_CHARS[unicode]
    chars = [[full if c == a else none if c == 0 else mixed for c, a in zip(cr, ar)]
             for cr, ar in zip(counts.tolist(), areas.tolist())]
    chars = [[ch for ch in line for _ in range(repeat)] for line in chars]
    legend = (f"mask {S}x{S} (query rows, key columns; a character covers about "
              f"{S / rows:.3g} x {S / (cols * repeat):.3g} tokens): "
              f"'{full}' all allowed  '{mixed}' mixed  '{none}' none")
    frame = _framed(chars, layout, S / rows, S / (cols * repeat), unicode, width)
    return textwrap.fill(legend, width) + "\n" + frame


def tile_factors(num_kv_tiles: int, width: int = 100) -> tuple[int, int]:
    """(row_factor, col_factor): tiles per character of the terminal's tile grid, so it fits `width`."""
    avail = max(8, width - _LABEL_WIDTH - 3)
    col_factor = max(1, math.ceil(num_kv_tiles / avail))
    # Once we group anyway, group twice as many rows: a line is about twice as tall as a character is wide.
    return (1 if col_factor == 1 else 2 * col_factor), col_factor


def tile_text(cells: np.ndarray, factors: tuple[int, int], layout: Layout, block_m: int, block_n: int,
              width: int = 100, unicode: bool = True) -> str:
    """The tile-kind grid of one layout: one character per cell of `plan.kind_cells(..., *factors)` -- a tile,
    or a group of tiles when the grid is too wide (`tile_factors`)."""
    row_factor, col_factor = factors
    symbols = _TILE_CHARS[unicode]
    chars = [[symbols[k] for k in row] for row in cells.tolist()]
    if col_factor == 1:
        legend = f"tiles (one character per {block_m}x{block_n} tile): "
    else:
        legend = f"tiles (one character per {row_factor}x{col_factor} tiles of {block_m}x{block_n}): "
    legend += "  ".join(f"'{symbols[k]}' {KIND_NAMES[k]}" for k in _KIND_ORDER)
    if col_factor > 1:
        legend += f"  '{symbols[-1]}' several kinds"
    frame = _framed(chars, layout, block_m * row_factor, block_n * col_factor, unicode, width)
    return textwrap.fill(legend, width) + "\n" + frame


def mask_cells(mask: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(allowed count, area) per cell of a rows x cols grid laid over a bool [S, S] mask (numpy, or anything
    np.asarray reads), int64 [rows, cols] each; rows and cols at most S.

    Cells cover near-equal, contiguous token ranges, so each count is an integer sum over a block:
    np.add.reduceat over columns, then rows, a chunk of rows at a time (memory O(S * cols)).
    """
    mask = np.asarray(mask)
    S = mask.shape[0]
    row_of = np.arange(S) * rows // S
    col_of = np.arange(S) * cols // S
    col_starts = np.searchsorted(col_of, np.arange(cols))
    counts = np.zeros((rows, cols), dtype=np.int64)
    chunk = max(1, (1 << 22) // S)
    for start in range(0, S, chunk):
        part = np.add.reduceat(mask[start:start + chunk], col_starts, axis=1, dtype=np.int64)  # [chunk, cols]
        local = row_of[start:start + chunk]
        first = np.flatnonzero(np.r_[True, local[1:] != local[:-1]])  # each row cell's first row in the chunk
        counts[local[first]] += np.add.reduceat(part, first, axis=0)
    areas = np.bincount(row_of, minlength=rows)[:, None] * np.bincount(col_of, minlength=cols)[None, :]
    return counts, areas


def _segment_label(segments: Sequence[Segment], index: int) -> str:
    """Modality name, with '@doc' on the first segment of a document (layout syntax)."""
    seg = segments[index]
    new_doc = seg.doc != (segments[index - 1].doc if index else 0)
    return seg.modality + (f"@{seg.doc}" if new_doc else "")


def _framed(chars: list[list[str]], layout: Layout, tokens_per_line: float, tokens_per_char: float,
            unicode: bool, width: int) -> str:
    """Put a frame around a character grid, tick segment starts on it and label them."""
    f = _FRAME[unicode]
    n_lines, n_cols = len(chars), len(chars[0]) if chars else 0
    starts = layout.starts()
    segments = layout.segments
    line_labels: dict[int, list[str]] = {}
    tick_cols: set[int] = set()
    top_labels: list[tuple[int, str]] = []
    for index, start in enumerate(starts):
        label = _segment_label(segments, index)
        line = min(n_lines - 1, int(start / tokens_per_line))
        col = min(n_cols - 1, int(start / tokens_per_char))
        line_labels.setdefault(line, []).append(f"{label} {start}")
        if index:
            tick_cols.add(col)
        top_labels.append((col, label))

    # Labels may run past the frame's right edge (small grids) but not past `width`, nor over each other.
    header = [" "] * max(n_cols, width - _LABEL_WIDTH - 2)
    free_from = 0
    for col, label in top_labels:
        if col >= free_from and col + len(label) <= len(header):
            header[col:col + len(label)] = list(label)
            free_from = col + len(label) + 1
    margin = " " * (_LABEL_WIDTH + 1)
    top = [f["top"] if c in tick_cols else f["h"] for c in range(n_cols)]
    out = [margin + " " + "".join(header).rstrip(), margin + f["tl"] + "".join(top) + f["tr"]]
    for line, row in enumerate(chars):
        starting = line_labels.get(line, [])
        # Several segments starting on one line: name the first, count the others.
        label = starting[0] + (f" +{len(starting) - 1}" if len(starting) > 1 else "") if starting else ""
        if len(label) > _LABEL_WIDTH:
            label = label[: _LABEL_WIDTH - 1] + "~"
        edge = f["left"] if line in line_labels and line else f["v"]
        out.append(f"{label:>{_LABEL_WIDTH}} " + edge + "".join(row) + f["v"])
    out.append(margin + f["bl"] + f["h"] * n_cols + f["br"])
    if any(len(starting) > 1 for starting in line_labels.values()):
        out.append(margin + " +N: N more segments start on that line")
    return "\n".join(out)


def plan_table(rules: Rules, layout: AnyLayout, plan: Plan, seconds: float | None = None) -> str:
    """The statistics table `omnigen plan` prints."""
    counts = plan.counts()
    total = sum(counts.values())
    rows: list[tuple[str, str]] = [("rules", f"{rules.name} ({rules.source})")]
    for b, element in enumerate(layout.layouts):
        rows.append(("layout" if len(layout.layouts) == 1 else f"layout[{b}]", str(element)))
    rows += [
        ("sequence length", f"{plan.seq_len:,} tokens"),
        ("batch", str(plan.batch_size)),
        ("tile", f"{plan.block_m} x {plan.block_n}: {plan.num_q_tiles} x {plan.num_kv_tiles} tiles per element, "
                 f"{total:,} in all"),
    ]
    rows += [(f"  {name}", f"{n:>10,}  {100.0 * n / total:5.1f}%") for name, n in counts.items()]
    rows += [
        ("allowed pairs", f"{plan.allowed_pairs:,} of {plan.batch_size * plan.seq_len ** 2:,}"),
        ("density", f"{plan.density:.4f}"),
        ("partial fraction", f"{plan.partial_fraction:.4f} (partial tiles / visited tiles)"),
        ("metadata", f"{plan.nbytes():,} bytes of schedules (+ {plan.tables.nbytes():,} bytes of layout tables)"),
    ]
    if seconds is not None:
        rows.append(("planning time", f"{seconds * 1e3:.1f} ms"))
    key_width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{key_width}}  {value}" for key, value in rows)


# --------------------------------------------------------------------------------------------
# matplotlib


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a PNG needs matplotlib: pip install matplotlib "
                          "(or pip install 'omnigen[plots]')") from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def mask_figure(rules: Rules, layout: AnyLayout, plan: Plan, dense: DenseOf | None = None,
                title: str | None = None) -> Any:
    """A matplotlib Figure: the mask (when S <= DENSE_LIMIT) and the tile kinds, per batch element.

    Segment starts are drawn as lines and labelled with modality (and '@doc' where the
    document changes); document boundaries are drawn thicker. `dense` (per batch element) and `title`: for a mask
    made from data, the mask to draw instead of the rules' and what the title says instead of rules and layout.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    elements = layout.layouts[:MAX_PICTURED]
    show_mask = plan.seq_len <= DENSE_LIMIT
    panels = 2 if show_mask else 1
    S = plan.seq_len
    nq, nk = plan.num_q_tiles, plan.num_kv_tiles
    # The tile panel is downsampled like the mask panel: a pixel per cell of tiles, at most PNG_PIXELS a side
    # (a million tokens in 128 x 128 tiles would otherwise be an 8192 x 8192 image, GBs inside matplotlib).
    row_factor, col_factor = math.ceil(nq / PNG_PIXELS), math.ceil(nk / PNG_PIXELS)
    cells = plan.kind_cells(len(elements), row_factor, col_factor)
    fig, axes = plt.subplots(len(elements), panels, figsize=(6.2 * panels, 6.0 * len(elements)),
                             squeeze=False, layout="constrained")
    kind_cmap = ListedColormap([_KIND_COLORS[k] for k in (-1, *_KIND_ORDER)])
    drawn: set[str] = set()  # which boundary line styles appear, for the legend
    for b, element in enumerate(elements):
        row = axes[b]
        if show_mask:
            size = min(S, PNG_PIXELS)
            counts, areas = mask_cells(dense_mask_host(rules, element) if dense is None else dense(b), size, size)
            row[0].imshow(counts / areas, cmap="Blues", vmin=0, vmax=1.15, extent=(0, S, S, 0),
                          interpolation="nearest")
            row[0].set_title("mask (blue: allowed)", fontsize=10)
        ax = row[-1]
        ax.imshow(cells[b], cmap=kind_cmap, vmin=-1.5, vmax=3.5, interpolation="nearest",
                  extent=(0, cells.shape[2] * col_factor * plan.block_n, cells.shape[1] * row_factor * plan.block_m, 0))
        if nq * nk <= 64 * 64:  # thin tile grid lines while they stay visible
            for x in range(plan.block_n, nk * plan.block_n, plan.block_n):
                ax.axvline(x, color="white", linewidth=0.4)
            for y in range(plan.block_m, nq * plan.block_m, plan.block_m):
                ax.axhline(y, color="white", linewidth=0.4)
        ax.set_title(f"tile kinds ({plan.block_m}x{plan.block_n})", fontsize=10)
        for ax in row:
            drawn |= _draw_segments(ax, element, S, axis_inches=4.8 if show_mask else 3.9)
            ax.set_xlim(0, S)
            ax.set_ylim(S, 0)
        row[0].set_ylabel((f"batch element {b}\n" if len(elements) > 1 else "") + "query", fontsize=9)
    counts = plan.counts()
    handles = [Patch(facecolor=_KIND_COLORS[k], edgecolor="#999999", label=f"{KIND_NAMES[k]} ({counts[KIND_NAMES[k]]})")
               for k in _KIND_ORDER]
    if (cells < 0).any():
        handles.append(Patch(facecolor=_KIND_COLORS[-1], edgecolor="#999999",
                             label=f"several kinds (a pixel: {row_factor}x{col_factor} tiles)"))
    handles += [Line2D([], [], label=f"{what} start", **style)
                for what, style in (("segment", _SEGMENT_LINE), ("document", _DOC_LINE)) if what in drawn]
    axes[0][-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9, frameon=False,
                       title="tile kind", title_fontsize=9)
    layout_text = str(layout.layouts[0]) if len(layout.layouts) == 1 else f"batch of {len(layout.layouts)}"
    heading = title if title is not None else f"rules '{rules.name}'  ·  layout {_wrap(layout_text, 45 * panels)}"
    fig.suptitle(f"{heading}\n"
                 f"S={S}, tile {plan.block_m}x{plan.block_n}, density {plan.density:.3f}, "
                 f"partial fraction {plan.partial_fraction:.3f}", fontsize=11)
    return fig


def _wrap(text: str, width: int, max_lines: int = 3) -> str:
    """Wrap a layout string for a title; very long layouts end in '... (N segments)'."""
    words = text.split()
    lines, line = [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    lines.append(line)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] += f" ... ({len(words)} segments)"
    return "\n".join(lines)


def _draw_segments(ax: Any, layout: Layout, S: int, axis_inches: float) -> set[str]:
    """Segment boundaries as lines, modality names on the top and left axes at segment centres.

    Returns the line kinds drawn ("segment", "document").
    """
    drawn: set[str] = set()
    starts, segments = layout.starts(), layout.segments
    centers, labels = [], []
    doc_starts = sum(a.doc != b.doc for a, b in zip(segments, segments[1:]))
    for index, (start, seg) in enumerate(zip(starts, segments)):
        new_doc = index > 0 and seg.doc != segments[index - 1].doc
        if index and (len(segments) <= MAX_BOUNDARY_LINES or (new_doc and doc_starts <= MAX_BOUNDARY_LINES)):
            style = _DOC_LINE if new_doc else _SEGMENT_LINE
            drawn.add("document" if new_doc else "segment")
            ax.axvline(start, **style)
            ax.axhline(start, **style)
        centers.append(start + seg.length / 2)
        labels.append(_segment_label(segments, index))
    # Keep labels that do not overlap one already kept; documents' first segments go first.
    # An 8pt character is about 0.061in wide and 0.15in tall; axis_inches is the panel's width.
    char, line = 0.061 / axis_inches * S, 0.15 / axis_inches * S
    first = [i for i, label in enumerate(labels) if "@" in label] + [i for i, label in enumerate(labels) if "@" not in label]
    top_keep = _non_overlapping(centers, [char * (len(label) + 2) for label in labels], first)
    left_keep = _non_overlapping(centers, [line] * len(labels), first)
    top = ax.secondary_xaxis("top")
    top.set_xticks([centers[i] for i in top_keep], [labels[i] for i in top_keep], fontsize=8)
    top.tick_params(length=0)
    ax.set_yticks([centers[i] for i in left_keep], [labels[i] for i in left_keep], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("key", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    return drawn


def _non_overlapping(centers: list[float], sizes: list[float], order: list[int]) -> list[int]:
    """Indices of labels kept, tried in `order`, so that no two kept labels overlap (sorted)."""
    kept: list[tuple[float, float, int]] = []
    for index in order:
        lo, hi = centers[index] - sizes[index] / 2, centers[index] + sizes[index] / 2
        if all(hi <= k_lo or lo >= k_hi for k_lo, k_hi, _ in kept):
            kept.append((lo, hi, index))
    return sorted(index for _, _, index in kept)


def save_png(rules: Rules, layout: AnyLayout, plan: Plan, path: str | Path, dpi: int = 120,
             dense: DenseOf | None = None, title: str | None = None) -> Path:
    """Write mask_figure(...) to `path` as a PNG; returns the path."""
    plt = _pyplot()
    fig = mask_figure(rules, layout, plan, dense, title)
    path = Path(path)
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path
