"""A plan's statistics, and the same statistics made on the host without torch and without schedules.

`PlanStatistics` is what `Plan` and `PlanSummary` derive alike from their tiles per kind, allowed pairs and
schedule size (density, partial fraction, `stats()`): one definition, so `omnigen plan --json` prints exactly
`omnigen.plan(...).stats()`.

`summarize(rules, layout, block_m, block_n)` is what `omnigen show` and `omnigen plan` read. It runs the host
planner's core (`host._Problem`) but keeps no schedules: tiles per kind come in closed form
(`host.tile_counts`: O(segments + tile rows + near tiles), so 4M tokens take well under a second), and
pictures of the tile kinds are classified one band of q-tile rows at a time and downsampled as they go
(`host.problem_kind_cells`), so a picture of a million tokens never holds the plan. Only numpy: the command
line does not import torch (tests/test_cli_startup.py checks it). The Python API's `omnigen.plan` returns a
`Plan` of tensors from the same core (tests/test_host_path.py compares the two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..layout import AnyLayout, LayoutBatch, as_layout
from ..rules import Rules
from . import host

if TYPE_CHECKING:
    from ..layout import HostTables


class PlanStatistics:
    """Statistics of a plan from its `counts()`, `allowed_pairs` and `nbytes()` (which a subclass provides,
    with `block_m`, `block_n`, `batch_size`, `seq_len` and `batched`)."""

    block_m: int
    block_n: int
    batch_size: int
    seq_len: int
    batched: bool

    def counts(self) -> dict[str, int]:
        raise NotImplementedError

    @property
    def allowed_pairs(self) -> int:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def kind_cells(self, elements: int, row_factor: int, col_factor: int) -> np.ndarray:
        """Tile kinds of the first `elements` batch elements in cells of row_factor x col_factor tiles, int8
        [elements, ceil(nq / row_factor), ceil(nk / col_factor)]: a cell's kind where its tiles share one, -1
        where they do not (for pictures: no [nq, nk] grid is made)."""
        raise NotImplementedError

    @property
    def num_q_tiles(self) -> int:
        return -(-self.seq_len // self.block_m)

    @property
    def num_kv_tiles(self) -> int:
        return -(-self.seq_len // self.block_n)

    @property
    def density(self) -> float:
        return self.allowed_pairs / float(self.batch_size * self.seq_len * self.seq_len)

    @property
    def partial_fraction(self) -> float:
        """Share of visited tiles that need the rules' predicate."""
        counts = self.counts()
        visited = counts["full"] + counts["causal"] + counts["partial"]
        return counts["partial"] / visited if visited else 0.0

    def stats(self) -> dict[str, Any]:
        counts = self.counts()
        return {
            "seq_len": self.seq_len,
            "batch": self.batch_size,
            "block_m": self.block_m,
            "block_n": self.block_n,
            "tiles": counts,
            "allowed_pairs": self.allowed_pairs,
            "density": self.density,
            "partial_fraction": self.partial_fraction,
            "metadata_bytes": self.nbytes(),
        }


class PlanSummary(PlanStatistics):
    """A plan's statistics and pictures without its schedules (see the module's docstring); `summarize` makes
    one. Its numbers are the `Plan`'s of the same rules, layout and tiles."""

    def __init__(self, rules: Rules, layout: AnyLayout, block_m: int, block_n: int) -> None:
        n_segments = sum(len(element.segments) for element in layout.layouts)
        host.check_summary_memory(layout.batch_size, layout.seq_len, n_segments, len(rules.modalities), block_m,
                                  block_n)
        self.tables: HostTables = layout.host_tables(rules)  # unknown modalities raise here, naming the rules
        self.block_m, self.block_n = block_m, block_n
        self.batch_size, self.seq_len = self.tables.batch_size, self.tables.seq_len
        self.batched = isinstance(layout, LayoutBatch)
        self.rules_hash = rules.mask_hash()
        self._rules = rules
        self._host = host._CpuTables.of(self.tables)
        self._problem = host._Problem(rules, self._host, block_m, block_n)
        self._counts: dict[str, int] | None = None
        self._pairs: int | None = None

    def counts(self) -> dict[str, int]:
        if self._counts is None:
            self._counts = host.tile_counts(self._problem)
        return dict(self._counts)

    @property
    def allowed_pairs(self) -> int:
        if self._pairs is None:
            self._pairs = host._allowed_pairs_host(self._rules, self._host)
        return self._pairs

    @property
    def num_tiles(self) -> int:
        """Tiles a kernel visits (every non-empty tile)."""
        return sum(n for kind, n in self.counts().items() if kind != "empty")

    def nbytes(self) -> int:
        """What `Plan.nbytes()` says: int32 schedules, 3 pointers per tile row and column (+1 each), and each
        visited tile once forward, once backward."""
        rows, columns = self.batch_size * self.num_q_tiles, self.batch_size * self.num_kv_tiles
        return 4 * ((3 * rows + 1) + (3 * columns + 1) + 2 * self.num_tiles)

    def kind_cells(self, elements: int, row_factor: int, col_factor: int) -> np.ndarray:
        return host.problem_kind_cells(self._problem, elements, row_factor, col_factor)


def summarize(rules: Rules, layout: AnyLayout | str, block_m: int = 128, block_n: int = 128) -> PlanSummary:
    """The statistics `omnigen.plan(rules, layout, block_m, block_n)` would give, made on the host with numpy
    only and without the schedules (see the module's docstring). Arguments are checked as `plan` checks them."""
    from .planners import _check_block

    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    layout = as_layout(layout)
    return PlanSummary(rules, layout, _check_block(block_m, "block_m"), _check_block(block_n, "block_n"))
