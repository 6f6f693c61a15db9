"""The dense mask against its definition (docs/semantics.md) read literally, and the planner against the dense mask."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.plan import CAUSAL, EMPTY, FULL, PARTIAL
from omnigen.plan.schedule import dq_ranks
from omnigen.reference import allowed_pair, tile_kinds_from_mask

from strategies import block_sizes, layouts, rules


@st.composite
def rules_and_layout(draw, max_segments=8, max_length=40):
    rule_set = draw(rules())
    return rule_set, draw(layouts(rule_set, max_segments, max_length))


@settings(max_examples=500)
@given(rules_and_layout(max_segments=6, max_length=12))
def test_dense_mask_is_the_definition(case):
    rule_set, layout = case
    mask = rule_set.dense_mask(layout)
    S = layout.seq_len
    assert mask.shape == (S, S) and mask.dtype == torch.bool
    expected = torch.tensor([[allowed_pair(rule_set, layout, q, k) for k in range(S)] for q in range(S)])
    assert torch.equal(mask, expected)


def _schedule_sets(ptr, index, rows):
    ptr = ptr.tolist()
    out = {}
    for r in range(rows):
        for g, kind in enumerate((FULL, CAUSAL, PARTIAL)):
            for x in index[ptr[3 * r + g] : ptr[3 * r + g + 1]].tolist():
                out[(r, x)] = kind
    return out


def _check_plan(rule_set, layout, block_m, block_n, mask):
    p = omnigen.plan(rule_set, layout, block_m, block_n)
    expected = tile_kinds_from_mask(mask, block_m, block_n)
    assert torch.equal(p.kinds, expected), f"\nplan:\n{p.kinds}\nexpected:\n{expected}"
    assert p.allowed_pairs == int(mask.sum())
    # forward and backward schedules list the same tiles with the same kinds, sorted inside a kind
    fwd = _schedule_sets(p.fwd_ptr, p.fwd_kv, p.num_q_tiles)
    bwd = {(i, j): kind for (j, i), kind in _schedule_sets(p.bwd_ptr, p.bwd_q, p.num_kv_tiles).items()}
    nonempty = {(i, j): int(expected[i, j]) for i, j in zip(*torch.nonzero(expected, as_tuple=True)) for i, j in [(int(i), int(j))]}
    assert fwd == nonempty and bwd == nonempty
    for r in range(p.num_q_tiles):
        for kind, tiles in p.forward_tiles(r).items():
            assert tiles == sorted(tiles)
    counts = p.counts()
    assert sum(counts.values()) == p.num_q_tiles * p.num_kv_tiles
    assert counts["empty"] == int((expected == EMPTY).sum())
    return p


@settings(max_examples=1000)
@given(rules_and_layout(), block_sizes, block_sizes, st.booleans())
def test_plan_is_exact(case, block_m, block_n, own_tiles):
    """`own_tiles`: also the closed form for tiles inside a whole-row segment, which the planner
    uses only on grids over host.OWN_FROM tiles (long sequences)."""
    from omnigen.plan import host

    rule_set, layout = case
    saved = host.OWN_FROM
    try:
        host.OWN_FROM = 0 if own_tiles else saved
        _check_plan(rule_set, layout, block_m, block_n, rule_set.dense_mask(layout))
    finally:
        host.OWN_FROM = saved


@settings(max_examples=150)
@given(st.data(), block_sizes, block_sizes)
def test_batched_plan_is_each_layout_planned_alone(data, block_m, block_n):
    rule_set = data.draw(rules())
    first = data.draw(layouts(rule_set))
    others = [data.draw(layouts(rule_set)) for _ in range(data.draw(st.integers(1, 3)))]
    S = max([first.seq_len] + [o.seq_len for o in others])
    batch = omnigen.Layout.batch([first.pad_end(S)] + [o.pad_end(S) for o in others])
    p = omnigen.plan(rule_set, batch, block_m, block_n)
    assert p.kinds.shape == (batch.batch_size, p.num_q_tiles, p.num_kv_tiles)
    masks = rule_set.dense_mask(batch)
    for b, item in enumerate(batch.layouts):
        single = omnigen.plan(rule_set, item, block_m, block_n)
        assert torch.equal(p.kinds[b], single.kinds)
        assert torch.equal(masks[b], rule_set.dense_mask(item))
        assert p.forward_tiles(0, batch=b) == single.forward_tiles(0)
    assert p.allowed_pairs == int(masks.sum())


def _padded_batch(data, rule_set: omnigen.Rules, most: int) -> omnigen.LayoutBatch:
    """1 to `most` random layouts of the rules, padded at the end to the longest."""
    items = [data.draw(layouts(rule_set)) for _ in range(data.draw(st.integers(1, most)))]
    S = max(item.seq_len for item in items)
    return omnigen.Layout.batch([item.pad_end(S) for item in items])


@settings(max_examples=150)
@given(st.data(), block_sizes, block_sizes)
def test_dq_ranks_count_the_lower_kv_tiles_of_each_q_tile(data, block_m, block_n):
    """Plan.dq_ranks (the order of deterministic mode's dQ additions on Hopper): for each backward-schedule entry
    (kv-tile j, q-tile i), the kv-tiles below j that q-tile i visits -- from the dense tile kinds."""
    rule_set = data.draw(rules())
    p = omnigen.plan(rule_set, _padded_batch(data, rule_set, 3), block_m, block_n)
    visited = (p.kinds != EMPTY).int()  # [B, nq, nk]
    below = visited.cumsum(-1) - visited  # visited kv-tiles before each one, per q-tile row
    expected = []
    for b in range(p.batch_size):
        for j in range(p.num_kv_tiles):
            column = p.backward_tiles(j, batch=b)
            expected += [int(below[b, i, j]) for kind in ("full", "causal", "partial") for i in column[kind]]
    ranks = p.dq_ranks()
    assert ranks.dtype == torch.int32 and ranks.tolist() == expected
    # A precomputed mask's schedule buffers may run past the plan (capacity for other layouts): the ranks are
    # computed without reading the tile count on the host, so the extra entries' garbage must not matter.
    extra = data.draw(st.integers(1, 9))
    garbage = torch.randint(-2**31, 2**31 - 1, (2, extra), dtype=torch.int32)
    padded = dq_ranks(p.fwd_ptr, torch.cat([p.fwd_kv, garbage[0]]), p.bwd_ptr, torch.cat([p.bwd_q, garbage[1]]),
                      p.batch_size, p.num_q_tiles, p.num_kv_tiles)
    assert padded.tolist() == expected + [0] * extra


def _ordered_dq_work(p) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per (batch element, kv-tile) CTA, its steps in the kernels' order (full, causal, partial q-tiles) as
    (q-tile row across the batch, rank from Plan.dq_ranks)."""
    ranks, work, entry = p.dq_ranks().tolist(), {}, 0
    for b in range(p.batch_size):
        for j in range(p.num_kv_tiles):
            column = p.backward_tiles(j, batch=b)
            q_tiles = column["full"] + column["causal"] + column["partial"]
            work[b, j] = [(b * p.num_q_tiles + i, ranks[entry + n]) for n, i in enumerate(q_tiles)]
            entry += len(q_tiles)
    return work


@settings(max_examples=100)
@given(st.data(), block_sizes, block_sizes, st.integers(1, 4), st.integers(0, 3))
def test_ordered_dq_protocol_finishes_and_adds_in_kv_order(data, block_m, block_n, resident, section):
    """Deterministic mode's dQ protocol, simulated: CTAs (one per kv-tile and batch element, launched in the
    ordered kernel's grid order: sections of `section` batch elements (0: one section of all), kv-tiles slowest
    inside a section; at most `resident` CTAs at a time) walk their backward schedules
    in the kernels' order (full, causal, partial q-tiles); at each q-tile a CTA waits until the q-tile's counter
    equals its rank (Plan.dq_ranks), adds, and bumps the counter. Every CTA finishes, and each q-tile's
    additions come in kv-tile order."""
    rule_set = data.draw(rules())
    p = omnigen.plan(rule_set, _padded_batch(data, rule_set, 3), block_m, block_n)
    per_column = _ordered_dq_work(p)
    width = section or p.batch_size
    launch = [(b, j) for first in range(0, p.batch_size, width) for j in range(p.num_kv_tiles)
              for b in range(first, min(first + width, p.batch_size))]  # kv-tiles slowest inside a section
    work = [per_column[cta] for cta in launch]
    counters, added = {}, {}
    waiting, running, progress = list(range(len(work))), [], [0] * len(work)
    while waiting or running:
        while waiting and len(running) < resident:
            running.append(waiting.pop(0))
        moved = False
        for cta in list(running):
            if progress[cta] == len(work[cta]):
                running.remove(cta)
                moved = True
                continue
            row, rank = work[cta][progress[cta]]
            if counters.get(row, 0) == rank:
                counters[row] = rank + 1
                added.setdefault(row, []).append(launch[cta][1])
                progress[cta] += 1
                moved = True
        assert moved, "the ordered dQ deadlocks"
    for row, kv_tiles in added.items():  # each q-tile's visited kv-tiles, every one once, in index order
        visited = p.forward_tiles(row % p.num_q_tiles, batch=row // p.num_q_tiles)
        assert kv_tiles == sorted(visited["full"] + visited["causal"] + visited["partial"]), (row, kv_tiles)


def test_transfusion_tile_kinds_by_hand():
    rules = omnigen.Rules(name="t", modalities={"text": "causal", "image": "full"})
    layout = omnigen.Layout.parse("text:32 image:32 text:32")
    p = omnigen.plan(rules, layout, 16, 16)
    K = {0: ".", 1: "F", 2: "C", 3: "P"}
    grid = ["".join(K[int(x)] for x in row) for row in p.kinds]
    assert grid == [
        "C.....",
        "FC....",
        "FFFF..",
        "FFFF..",
        "FFFFC.",
        "FFFFFC",
    ]
    assert p.counts() == {"empty": 14, "full": 18, "causal": 4, "partial": 0}


def test_window_and_documents_and_tails():
    rules = omnigen.Rules(name="w", modalities={"text": {"self": "causal", "window": 20}, "image": "full"})
    layout = omnigen.Layout.parse("text:50 image:17 text:30@1 pad:3@1")
    for bm, bn in ((16, 16), (32, 48), (128, 128)):
        _check_plan(rules, layout, bm, bn, rules.dense_mask(layout))


def test_all_pad_layout_plans_nothing():
    rules = omnigen.Rules(name="p", modalities={"text": "causal"})
    p = omnigen.plan(rules, omnigen.Layout.parse("pad:40"), 16, 16)
    assert p.num_tiles == 0 and p.allowed_pairs == 0 and p.counts()["empty"] == 9


def test_plan_rejects_bad_blocks():
    rules = omnigen.Rules(name="p", modalities={"text": "causal"})
    for bad in (0, 8, 24, 100, -16, 16.0, True):
        with pytest.raises(ValueError, match="multiple of 16"):
            omnigen.plan(rules, "text:40", block_m=bad)
    with pytest.raises(ValueError, match="not in the rules"):
        omnigen.plan(rules, "text:40 image:3", 16, 16)


def test_plan_metadata_is_compact():
    rules = omnigen.Rules(name="t", modalities={"text": "causal", "image": "full"})
    segments = []
    while sum(n for _, n in segments) < 32768:
        segments += [("text", 100), ("image", 256)]
    layout = omnigen.Layout.from_segments(segments)
    p = omnigen.plan(rules, layout, 128, 128)
    # two int32 index lists over visited tiles plus O(tiles per side) pointers
    assert p.nbytes() <= 8 * p.num_tiles + 4 * 3 * (p.num_q_tiles + p.num_kv_tiles) + 8


@pytest.mark.gpu
@settings(max_examples=100)
@given(rules_and_layout(), block_sizes, block_sizes)
def test_plan_on_gpu_matches_cpu(case, block_m, block_n):
    rule_set, layout = case
    cpu = omnigen.plan(rule_set, layout, block_m, block_n)
    gpu = omnigen.plan(rule_set, layout, block_m, block_n, device="cuda")
    assert gpu.fwd_kv.is_cuda
    for name in ("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
    assert cpu.allowed_pairs == gpu.allowed_pairs


@settings(max_examples=300)
@given(st.data(), block_sizes, block_sizes, st.integers(1, 40), st.booleans())
def test_banded_planner_matches_one_band(data, block_m, block_n, chunk_cost, own_tiles):
    """Long layouts are planned a band of q-tile rows at a time (bounded memory); with a tiny band
    budget every small case runs that path, and must give the one-band plan exactly."""
    from omnigen.plan import host

    rule_set = data.draw(rules())
    first = data.draw(layouts(rule_set, max_length=60))
    others = [data.draw(layouts(rule_set, max_length=60)) for _ in range(data.draw(st.integers(0, 2)))]
    S = max([first.seq_len] + [o.seq_len for o in others])
    layout = first if not others else omnigen.Layout.batch([first.pad_end(S)] + [o.pad_end(S) for o in others])
    tables = host._CpuTables.of(layout.tables(rule_set, "cpu"))
    saved = host.CHUNK_COST, host.OWN_FROM
    try:
        host.OWN_FROM = 0 if own_tiles else saved[1]
        problem = host._Problem(rule_set, tables, block_m, block_n)
        grid, _ = problem.classify(0, problem.n_rows, narrow=False)
        expected = host._schedules_host(grid.reshape(problem.B, problem.nq, problem.nk))
        host.CHUNK_COST = chunk_cost
        bands = problem.bands()
        got = host._schedules_banded(problem, bands)
    finally:
        host.CHUNK_COST, host.OWN_FROM = saved
    masks = rule_set.dense_mask(layout)
    masks = masks if masks.dim() == 3 else masks[None]
    kinds = torch.stack([tile_kinds_from_mask(m, block_m, block_n) for m in masks])
    assert grid.reshape(kinds.shape).tolist() == kinds.tolist()
    assert bands[0][0] == 0 and bands[-1][1] == problem.n_rows
    assert all(a < b for a, b in bands) and all(x[1] == y[0] for x, y in zip(bands, bands[1:]))
    for name, want, have in zip(("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q"), expected, got):
        assert want.dtype == have.dtype and want.tolist() == have.tolist(), name


def _ordered_dq_ticks(p, heads: int, resident: int, kv_tiles_slowest: bool) -> tuple[int, float]:
    """Step-synchronous model of the ordered dQ: every running CTA does one step per tick if its q-tile's
    counter has reached its rank. Returns (ticks to finish, the ideal: all steps / resident CTAs)."""
    work = _ordered_dq_work(p)  # one sequence; every head walks the same columns
    columns = [work[0, j] for j in range(p.num_kv_tiles)]
    if kv_tiles_slowest:
        launch = [(h, j) for j in range(p.num_kv_tiles) for h in range(heads)]
    else:
        launch = [(h, j) for h in range(heads) for j in range(p.num_kv_tiles)]
    counters, progress, running, waiting, ticks = {}, dict.fromkeys(launch, 0), [], list(launch), 0
    while waiting or running:
        while waiting and len(running) < resident:
            running.append(waiting.pop(0))
        ticks += 1
        ready = []
        for cta in running:
            head, j = cta
            if progress[cta] < len(columns[j]):
                row, rank = columns[j][progress[cta]]
                if counters.get((head, row), 0) == rank:
                    ready.append((cta, head, row, rank))
        for cta, head, row, rank in ready:
            counters[head, row] = rank + 1
            progress[cta] += 1
        running = [cta for cta in running if progress[cta] < len(columns[cta[1]])]
    return ticks, sum(len(columns[j]) for _, j in launch) / resident


def test_ordered_dq_grid_runs_kv_tiles_slowest_so_that_nobody_waits_long():
    """Why the ordered kernel's grid is (heads, batch, kv-tiles): launched kv-tiles fastest, each kv-tile waits
    for its neighbour launched beside it and the lag grows along the column (about 2x the ideal finish on a
    causal mask, as measured on the H200); kv-tiles slowest, lower kv-tiles are a wave ahead."""
    rules = omnigen.Rules(name="causal", modalities={"text": "causal"})
    p = omnigen.plan(rules, omnigen.Layout.parse("text:4096"), 128, 128)
    slowest, ideal = _ordered_dq_ticks(p, heads=16, resident=32, kv_tiles_slowest=True)
    fastest, _ = _ordered_dq_ticks(p, heads=16, resident=32, kv_tiles_slowest=False)
    assert slowest <= 1.15 * ideal, (slowest, ideal)
    assert fastest >= 1.4 * ideal, (fastest, ideal)


@settings(max_examples=150)
@given(st.data(), st.integers(1, 48))
def test_a_rows_keys_in_one_segment_are_one_interval(data, block_n):
    """What the Hopper forward's run path relies on (forward.cu.j2 `run_mask`, mask_rules.cuh
    `sees_other_segment`): within one kv-tile cut into runs of one segment, a row's allowed keys are, per run,
    the whole run when the row sees that other segment, the run up to q + self_reach when it is the row's own
    segment, nothing else; then cut by the row's window (k > q - W). Checked against the dense mask on every
    kv-tile of random rules and layouts (pads, windows, shared documents, 1-token segments)."""
    from omnigen.semantics import SEE_ALL, SEE_EARLIER, rule_tensors

    rule_set = data.draw(rules())
    layout = data.draw(layouts(rule_set))
    dense = rule_set.dense_mask(layout)
    tables = layout.tables(rule_set)
    segment, modality, document = (t[0].long() for t in (tables.token_segment, tables.token_modality, tables.token_doc))
    rule_t = rule_tensors(rule_set, "cpu")
    pad, unlimited = rule_set.pad_id, 1 << 30
    S = layout.seq_len
    for key_start in range(0, S, block_n):
        columns = range(key_start, min(S, key_start + block_n))
        runs = [k for k in columns if k == key_start or segment[k] != segment[k - 1]]  # each run's first key
        ends = runs[1:] + [columns[-1] + 1]
        for q in range(S):
            mq = int(modality[q])
            reach = -unlimited if mq == pad else (0 if rule_t["causal"][mq] else unlimited)
            window = int(rule_t["window"][mq]) if mq != pad else 0
            expected = torch.zeros(S, dtype=torch.bool)
            for first, end in zip(runs, ends):
                if segment[first] == segment[q]:
                    expected[first:max(first, min(end, q + reach + 1))] = True
                    continue
                code = int(rule_t["see"][mq, modality[first]])
                sees = code >= SEE_EARLIER if segment[first] < segment[q] else code == SEE_ALL
                if rule_set.isolated_documents:
                    sees &= bool(document[first] == document[q])
                expected[first:end] = sees
            if window:
                expected[: max(0, q - window + 1)] = False
            assert torch.equal(expected[key_start:columns[-1] + 1], dense[q, key_start:columns[-1] + 1]), (q, key_start)
