"""The torch-free host path (issue 28: `omnigen show` / `plan` without torch) gives what the torch API gives.

- `omnigen.plan.summarize` (what the command line prints: tile counts in closed form, no schedules) has the
  same `stats()` as `omnigen.plan(...)`;
- its tile pictures (`kind_cells`, classified band by band) equal the `Plan`'s and an independent grouping of
  `plan.kinds`;
- `host.host_schedules` (numpy) equals the dense reference path `host._classify` + `ruleless.schedules_from_kinds`, and
  `Plan`'s tensors hold exactly those arrays;
- `semantics.dense_mask_host` (numpy) equals `Rules.dense_mask`;

on hypothesis-drawn layouts for every examples/rules file and random rules, with the planner's size
thresholds also forced low, so that bands, own intervals and near chunks are exercised on small layouts.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.plan import host, summarize
from omnigen.plan.ruleless import schedules_from_kinds
from omnigen.semantics import dense_mask_host

from strategies import layouts, rules as random_rules

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {path.stem: omnigen.Rules.load(path) for path in sorted((ROOT / "examples" / "rules").glob("*.yaml"))}
BLOCKS = st.sampled_from((16, 32, 48, 64))
# "small": the planner's own thresholds; "forced": every size threshold low, so a 300-token layout is planned
# in bands, with own intervals, and its near tiles counted in many chunks.
MODES = ("small", "forced")


@contextlib.contextmanager
def _mode(mode: str):
    if mode == "small":
        yield
        return
    with mock.patch.object(host, "CHUNK_COST", 64), mock.patch.object(host, "OWN_FROM", 0), \
            mock.patch.object(host, "NEAR_ENTRIES", 3), mock.patch.object(host, "COUNT_SLICE", 5):
        yield


@st.composite
def batches(draw, rule_set: omnigen.Rules) -> omnigen.Layout | omnigen.LayoutBatch:
    """One layout, or a batch of 2-3 padded to one length."""
    items = [draw(layouts(rule_set)) for _ in range(draw(st.sampled_from((1, 1, 2, 3))))]
    if len(items) == 1:
        return items[0]
    longest = max(item.seq_len for item in items)
    return omnigen.Layout.batch([item.pad_end(longest) for item in items])


def _grouped_reference(kinds: np.ndarray, row_factor: int, col_factor: int) -> np.ndarray:
    """Cells of row_factor x col_factor tiles from a dense [nq, nk] grid, one cell at a time: the kind if its
    tiles share one, else -1."""
    nq, nk = kinds.shape
    out = np.empty((math.ceil(nq / row_factor), math.ceil(nk / col_factor)), dtype=np.int8)
    for r in range(out.shape[0]):
        for c in range(out.shape[1]):
            cell = np.unique(kinds[r * row_factor:(r + 1) * row_factor, c * col_factor:(c + 1) * col_factor])
            out[r, c] = cell[0] if cell.shape[0] == 1 else -1
    return out


def _check(rule_set: omnigen.Rules, layout, block_m: int, block_n: int, factors: tuple[int, int], mode: str) -> None:
    with _mode(mode):
        plan = omnigen.plan(rule_set, layout, block_m=block_m, block_n=block_n)
        summary = summarize(rule_set, layout, block_m=block_m, block_n=block_n)
        assert summary.stats() == plan.stats()
        assert summary.num_tiles == plan.num_tiles
        assert summary.tables.nbytes() == plan.tables.nbytes()

        # the numpy schedules are the tensors' arrays, and those of the dense reference path
        tables = layout.tables(rule_set, "cpu")
        numpy_schedules = host.host_schedules(rule_set, host._CpuTables.of(layout.host_tables(rule_set)),
                                              block_m, block_n)
    grid, allowed = host._classify(rule_set, tables, block_m, block_n)
    reference = schedules_from_kinds(grid.view(plan.batch_size, plan.num_q_tiles, plan.num_kv_tiles))
    for name, mine, theirs, tensor in zip(("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q"), numpy_schedules, reference,
                                          (plan.fwd_ptr, plan.fwd_kv, plan.bwd_ptr, plan.bwd_q)):
        assert np.array_equal(mine, theirs.numpy()), name
        assert np.array_equal(mine, tensor.numpy()), name
    assert allowed == plan.allowed_pairs == summary.allowed_pairs

    # pictures: the summary's band-by-band cells, the plan's from its schedule, a cell-by-cell grouping
    kinds = plan.kinds if plan.batched else plan.kinds[None]
    assert torch.equal(kinds.view(-1), grid.view(-1))
    with _mode(mode):
        from_summary = summary.kind_cells(plan.batch_size, *factors)
    from_plan = plan.kind_cells(plan.batch_size, *factors)
    for b in range(plan.batch_size):
        expected = _grouped_reference(kinds[b].numpy(), *factors)
        assert np.array_equal(from_plan[b], expected), b
        assert np.array_equal(from_summary[b], expected), b

    assert np.array_equal(dense_mask_host(rule_set, layout), rule_set.dense_mask(layout).numpy())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
@settings(max_examples=25)
@given(data=st.data())
def test_host_path_equals_the_torch_path_on_examples(name: str, mode: str, data):
    rule_set = EXAMPLES[name]
    layout = data.draw(batches(rule_set))
    block_m, block_n = data.draw(BLOCKS), data.draw(BLOCKS)
    factors = data.draw(st.sampled_from(((1, 1), (2, 1), (2, 3), (4, 2), (5, 7))))
    _check(rule_set, layout, block_m, block_n, factors, mode)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=60)
@given(data=st.data())
def test_host_path_equals_the_torch_path_on_random_rules(mode: str, data):
    rule_set = data.draw(random_rules())
    layout = data.draw(batches(rule_set))
    factors = data.draw(st.sampled_from(((1, 1), (3, 2))))
    _check(rule_set, layout, data.draw(BLOCKS), data.draw(BLOCKS), factors, mode)


@pytest.mark.parametrize("text", [
    "text:20000",                                                        # one causal segment: own tiles only
    "text:700 image:1024 text:300 image:1024 text:200@1 image:4096@1 text:9000@1",
    "text:6000 image:256 text:3000@1",
])
def test_large_layouts_own_tiles_and_bands(text: str):
    """Grids above OWN_FROM (own intervals in closed form) and plans in several bands, at the planner's own
    thresholds: 16 x 16 tiles over ~20K tokens is ~1.6M tiles."""
    rule_set = EXAMPLES["transfusion"]
    layout = omnigen.Layout.parse(text)
    plan = omnigen.plan(rule_set, layout, block_m=16, block_n=16)
    summary = summarize(rule_set, layout, block_m=16, block_n=16)
    assert summary.stats() == plan.stats()
    factors = (7, 5)
    assert np.array_equal(summary.kind_cells(1, *factors), plan.kind_cells(1, *factors))


def test_summary_checks_its_arguments():
    with pytest.raises(TypeError, match="omnigen.Rules"):
        summarize("rules.yaml", "text:10")
    with pytest.raises(ValueError, match="block_m must be a positive multiple of 16"):
        summarize(EXAMPLES["transfusion"], "text:10", block_m=20)
    with pytest.raises(ValueError, match="video"):
        summarize(EXAMPLES["transfusion"], "video:10")


def test_png_tile_panel_is_downsampled_not_the_plan():
    """`show --png` draws at most PNG_PIXELS cells a side (a million tokens in 128 x 128 tiles would be an
    8192 x 8192 image, GBs inside matplotlib); the counts in its legend are the whole plan's."""
    pytest.importorskip("matplotlib")
    from omnigen import figures

    rule_set = EXAMPLES["transfusion"]
    layout = omnigen.Layout.parse("text:150000 image:50000")  # 1563 x 1563 tiles of 128 x 128
    summary = summarize(rule_set, layout)
    fig = figures.mask_figure(rule_set, layout, summary)
    try:
        (image,) = fig.axes[0].get_images()
        assert image.get_array().shape == (782, 782)  # 2 x 2 tiles a pixel
        labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
        assert f"full ({summary.counts()['full']})" in labels
        assert "several kinds (a pixel: 2x2 tiles)" in labels
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _by_name(struct, args) -> dict:
    """A binding's positional arguments (as a stand-in module receives them) by field name, strides three at a time."""
    values, at = {}, 0
    for key, strides in struct.call_keys:
        values[key] = args[at : at + 3] if strides else args[at]
        at += 3 if strides else 1
    return values


def _stand_in_plan():
    """A plan with empty schedules and tables: what launch.backward_pass reads of one, for stand-in modules."""
    from types import SimpleNamespace

    empty = torch.zeros(0, dtype=torch.int32)
    tables = SimpleNamespace(token_segment=empty, token_modality=empty, token_doc=empty)
    return SimpleNamespace(tables=tables, fwd_ptr=empty, fwd_kv=empty, bwd_ptr=empty, bwd_q=empty,
                           dq_ranks=lambda: empty)


def test_the_backward_adds_gqa_groups_in_the_kernel_only_where_it_can(monkeypatch):
    """launch.backward_pass asks a GROUP_DKDV module to add each group's dK/dV itself (dkdv_group = Hq / Hkv, into
    float32 [B, Hkv, S, D] buffers it zeroes) in atomic mode for groups of a power of two; deterministic mode, other
    groups and modules without the flag get per-query-head partials [B, Hq, S, D] that it sums."""
    from omnigen.kernels import arguments, launch

    monkeypatch.setattr(launch, "_stream", lambda: 0)

    class Module:
        MODULE_NAME = None  # not cached: each case reads its own flags

        def __init__(self, group_dkdv: bool) -> None:
            self.GROUP_DKDV, self.calls = group_dkdv, []

        def backward_delta(self, *args):
            pass

        def backward(self, *args, **keywords):
            values = _by_name(arguments.BACKWARD, args)
            self.calls.append((keywords.get("dkdv_group", 1), values["dk_strides"][0] // (S * D)))  # buffer heads

    S, D = 8, 16
    plan = _stand_in_plan()

    def run(module, Hq, Hkv, deterministic=False):
        q, out, d_out = (torch.randn(1, Hq, S, D) for _ in range(3))
        k, v = torch.randn(1, Hkv, S, D), torch.randn(1, Hkv, S, D)
        lse = torch.randn(1, Hq, S)
        _, dk, dv = launch.backward_pass(module, plan, q, k, v, out, lse, d_out, 1.0, deterministic)
        assert dk.shape == dv.shape == (1, Hkv, S, D)
        return module.calls[-1]

    assert run(Module(True), 8, 2) == (4, 2)  # added by the kernel into [B, Hkv, S, D]
    assert run(Module(True), 8, 2, deterministic=True) == (1, 8)  # per query head, summed here
    assert run(Module(True), 6, 2) == (1, 6)  # a group of 3: summed here
    assert run(Module(False), 8, 2) == (1, 8)
    assert run(Module(True), 4, 4) == (1, 4)  # no GQA: the real dk, [B, H, S, D]


def test_the_backward_zeroes_dq_in_the_delta_pass_and_converts_with_the_modules_own_kernel(monkeypatch):
    """A module with a conversion launch (CONVERT_LAUNCH) is asked to zero the fp32 dQ in its Delta pass and to write
    dQ (and GQA's grouped dK/dV) through its own conversion into the [B, S, H, D]-stored outputs; a module without one
    gets a zeroed dQ and copies."""
    from omnigen.kernels import arguments, launch

    monkeypatch.setattr(launch, "_stream", lambda: 0)
    S, D = 8, 16
    plan = _stand_in_plan()

    class Module:
        MODULE_NAME = None  # not cached: each case reads its own attributes
        GROUP_DKDV = True

        def __init__(self, own_passes: bool) -> None:
            if own_passes:
                self.CONVERT_LAUNCH = 1
            self.zeroed, self.converted, self.dq_accum = [], [], None

        def backward_delta(self, *args, **keywords):
            self.zeroed.append(keywords.get("dq_accum", 0))

        def backward(self, *args, **keywords):
            self.dq_accum = _by_name(arguments.BACKWARD, args)["dq_accum"]

        def backward_convert(self, *args):
            values = _by_name(arguments.CONVERT, args)
            self.converted.append((values["source"], values["destination"], tuple(values["destination_strides"]),
                                   values["heads"]))

    q, out, d_out = (torch.randn(1, 8, S, D) for _ in range(3))
    k, v = torch.randn(1, 2, S, D), torch.randn(1, 2, S, D)
    own = Module(own_passes=True)
    dq, dk, dv = launch.backward_pass(own, plan, q, k, v, out, torch.randn(1, 8, S), d_out, 1.0)
    assert own.zeroed == [own.dq_accum] and own.dq_accum != 0  # the Delta pass zeroes the buffer the kernel adds into
    # grouped dK and dV (2 heads) first, then dQ (8 heads), each into its [B, S, H, D]-stored output
    assert [c[1:] for c in own.converted] == [(dk.data_ptr(), dk.stride()[:3], 2), (dv.data_ptr(), dv.stride()[:3], 2),
                                              (dq.data_ptr(), dq.stride()[:3], 8)]
    assert own.converted[2][0] == own.dq_accum and dq.stride() == (8 * S * D, D, 8 * D, 1)

    plain = Module(own_passes=False)
    dq, _, _ = launch.backward_pass(plain, plan, q, k, v, out, torch.randn(1, 8, S), d_out, 1.0)
    assert plain.zeroed == [0] and plain.converted == []
    assert torch.equal(dq, torch.zeros_like(dq))  # a zeroed dQ, copied out (the stand-in's kernel adds nothing)


def test_the_backwards_counters_are_zeroed_by_the_delta_pass(monkeypatch):
    """The int32 counters a backward takes zeroed (dq_semaphore: the persistent backward's kv-tile counter in atomic
    mode, ORDERED_DQ's semaphores per 64-row block of dQ in deterministic mode) are handed to the Delta pass to zero
    (zero_ints, zero_int_count) instead of a fill launch of their own; launch_backward called without them (after a
    Delta pass of the caller's) makes them and zeroes them itself."""
    import ctypes

    from omnigen.kernels import launch

    monkeypatch.setattr(launch, "_stream", lambda: 0)
    B, H, S, D = 2, 3, 130, 16
    plan = _stand_in_plan()

    class Module:
        MODULE_NAME = None
        CONVERT_LAUNCH = 1

        def __init__(self, **flags: bool) -> None:
            for name, on in flags.items():
                setattr(self, name, on)
            self.delta, self.semaphore, self.count = {}, None, 1

        def backward_delta(self, *args, **keywords):
            self.delta = keywords

        def backward(self, *args, **keywords):
            self.semaphore = keywords.get("dq_semaphore")
            if self.semaphore is not None:
                self.values = [ctypes.c_int32.from_address(self.semaphore + 4 * i).value for i in range(self.count)]

        def backward_convert(self, *args):
            pass

    q, out, d_out = (torch.randn(B, H, S, D) for _ in range(3))
    k, v, lse = torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S)

    def run(module, deterministic=False):
        launch.backward_pass(module, plan, q, k, v, out, lse, d_out, 1.0, deterministic)
        return module

    persistent = run(Module(PERSISTENT_BACKWARD=True))
    assert persistent.delta["zero_int_count"] == 1 and persistent.delta["zero_ints"] == persistent.semaphore != 0
    ordered = run(Module(ORDERED_DQ=True, PERSISTENT_BACKWARD=True), deterministic=True)
    assert ordered.delta["zero_int_count"] == B * H * 3 and ordered.delta["zero_ints"] == ordered.semaphore != 0
    for module, deterministic in ((Module(), False), (Module(ORDERED_DQ=True), False),
                                  (Module(PERSISTENT_BACKWARD=True), True)):
        assert "zero_ints" not in run(module, deterministic).delta and module.semaphore is None

    alone = Module(ORDERED_DQ=True)
    alone.count = B * H * 3  # ceil(130 / 64) blocks a head
    monkeypatch.setattr(launch, "backward_counters",  # poisoned: launch_backward must zero them itself
                        lambda module, q, deterministic: torch.full((alone.count,), -1, dtype=torch.int32))
    delta, dq_accum = torch.empty(B, H, S), torch.zeros(B, H, S, D)
    launch.launch_backward(alone, plan, q, k, v, lse, d_out, delta, dq_accum, k.clone(), v.clone(), 1.0, True)
    assert alone.semaphore is not None and alone.values == [0] * (B * H * 3)
