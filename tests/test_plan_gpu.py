"""The fused Triton planner (omnigen/plan/gpu.py) against the CPU path, array for array.

Every case plans the same rules and layout with `omnigen.plan(..., device="cuda")` (which must go
through plan_gpu) and with the CPU path (`_classify` + `ruleless.schedules_from_kinds`), and compares fwd_ptr,
fwd_kv, bwd_ptr, bwd_q (values and dtypes) and allowed_pairs exactly.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.plan import gpu as plan_gpu
from omnigen.plan.ruleless import schedules_from_kinds

from strategies import layouts, rules

plan_module = importlib.import_module("omnigen.plan.host")
planners = importlib.import_module("omnigen.plan.planners")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

SCHEDULE = ("fwd_ptr", "fwd_kv", "bwd_ptr", "bwd_q")
TILE_SIZES = st.sampled_from((16, 32, 48, 64, 80, 128))


def fit(layout: omnigen.Layout, seq_len: int) -> omnigen.Layout:
    """The layout cut or padded (with pad at the end) to exactly seq_len tokens."""
    segments, used = [], 0
    for seg in layout.segments:
        take = min(seg.length, seq_len - used)
        if take <= 0:
            break
        segments.append((seg.modality, take, seg.doc))
        used += take
    return omnigen.Layout.from_segments(segments).pad_end(seq_len)


@st.composite
def planning_cases(draw):
    rule_set = draw(rules())
    size = draw(st.sampled_from(("free", "free", 1, 17, 1000, 2000)))  # 2000: more than 64 tiles a side
    long = size in (1000, 2000)
    count = draw(st.integers(1, 3))
    items = [
        draw(layouts(rule_set, max_segments=40 if long else 8, max_length=80 if long else 40)) for _ in range(count)
    ]
    seq_len = max(item.seq_len for item in items) if size == "free" else size
    items = [fit(item, seq_len) for item in items]
    layout = items[0] if count == 1 and draw(st.booleans()) else omnigen.Layout.batch(items)
    return rule_set, layout


def cpu_schedules(rule_set, layout, block_m, block_n):
    tables = layout.tables(rule_set, "cpu")
    B, S = tables.batch_size, tables.seq_len
    grid, allowed = plan_module._classify(rule_set, tables, block_m, block_n)
    schedules = schedules_from_kinds(grid.view(B, -(-S // block_m), -(-S // block_n)))
    return dict(zip(SCHEDULE, schedules)), allowed


def assert_same_plan(rule_set, layout, block_m, block_n):
    expected, allowed = cpu_schedules(rule_set, layout, block_m, block_n)
    gpu = omnigen.plan(rule_set, layout, block_m, block_n, device="cuda")
    for name in SCHEDULE:
        got = getattr(gpu, name)
        assert got.is_cuda and got.dtype == torch.int32, name
        assert torch.equal(got.cpu(), expected[name]), f"{name} differs for {layout!r} at {block_m}x{block_n}"
    assert isinstance(gpu.allowed_pairs, int) and gpu.allowed_pairs == allowed
    return gpu


def transfusion(seq_len, seed=0):
    from bench_plan import RULES, transfusion_segments

    return RULES, omnigen.Layout.from_segments(transfusion_segments(seq_len, seed))


def test_available_needs_triton_and_cuda():
    assert plan_gpu.available() == (plan_gpu.triton is not None and torch.cuda.is_available())


@pytest.mark.gpu
def test_plan_uses_the_fused_planner():
    assert planners._gpu_planner() is plan_gpu


@pytest.mark.gpu
@settings(max_examples=400)
@given(planning_cases(), TILE_SIZES, TILE_SIZES)
def test_gpu_plan_equals_cpu_plan(case, block_m, block_n):
    rule_set, layout = case
    assert_same_plan(rule_set, layout, block_m, block_n)


@pytest.mark.gpu
def test_gpu_plan_by_hand():
    rule_set = omnigen.Rules(name="w", modalities={"text": {"self": "causal", "window": 20}, "image": "full"})
    for text in ("text:1", "pad:17", "text:50 image:17 text:30@1 pad:3@1", "image:5 pad:2 text:10"):
        for bm, bn in ((16, 16), (16, 128), (128, 16), (48, 80)):
            assert_same_plan(rule_set, omnigen.Layout.parse(text), bm, bn)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [32768, 131072])
def test_gpu_plan_equals_cpu_on_long_transfusion_layouts(seq_len):
    rule_set, layout = transfusion(seq_len)
    for bm, bn in ((128, 128), (128, 64), (64, 128)):
        gpu = assert_same_plan(rule_set, layout, bm, bn)
        assert gpu.num_tiles > 0


@pytest.mark.gpu
def test_gpu_plan_long_windows_documents_and_batches():
    rule_set = omnigen.Rules(
        name="mixed",
        modalities={"text": {"self": "causal", "window": 3000}, "image": "full", "audio": {"self": "full", "window": 700}},
        see={"default": "earlier", "image -> text": "all", "audio -> image": "none"},
    )
    rng = torch.Generator().manual_seed(0)
    layouts_ = []
    for _ in range(3):
        segments, used, doc = [], 0, 0
        while used < 32768:
            modality = ("text", "image", "audio", "pad")[int(torch.randint(0, 4, (1,), generator=rng))]
            length = int(torch.randint(1, 600, (1,), generator=rng))
            doc += int(torch.randint(0, 12, (1,), generator=rng)) == 0
            segments.append((modality, length, doc))
            used += length
        layouts_.append(fit(omnigen.Layout.from_segments(segments), 32768))
    shared = omnigen.Rules.from_dict({**rule_set.to_dict(), "documents": "shared"})
    for rules_ in (rule_set, shared):
        assert_same_plan(rules_, omnigen.Layout.batch(layouts_), 128, 128)
        assert_same_plan(rules_, layouts_[0], 64, 32)


@pytest.mark.gpu
def test_gpu_plan_sized_after_a_sync(monkeypatch):
    # above INLINE_TILE_LIMIT the schedules are allocated exactly after one sync
    monkeypatch.setattr(plan_gpu, "INLINE_TILE_LIMIT", 0)
    rule_set, layout = transfusion(32768, seed=1)
    assert_same_plan(rule_set, layout, 128, 128)
    assert_same_plan(rule_set, omnigen.Layout.parse("pad:40"), 16, 16)
    assert_same_plan(omnigen.Rules(name="t", modalities={"text": "causal"}), omnigen.Layout.parse("text:1"), 16, 32)
