"""Layout.from_tensors and Layout.from_cu_seqlens against Layout.from_segments (hypothesis), and their errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.layout import Segment

from strategies import layouts, rules

RULES = omnigen.Rules(name="tokens", modalities={"text": "causal", "image": "full", "audio": "full"})


def _merged(layout: omnigen.Layout) -> omnigen.Layout:
    """The layout with neighbouring segments of one modality and document merged: what per-token
    modality and document ids can say (without segment ids)."""
    out: list[Segment] = []
    for seg in layout.segments:
        if out and (out[-1].modality, out[-1].doc) == (seg.modality, seg.doc):
            out[-1] = Segment(seg.modality, out[-1].length + seg.length, seg.doc)
        else:
            out.append(seg)
    return omnigen.Layout.from_segments(out)


def _token_tensors(rule_set, layout):
    ids = torch.tensor([rule_set.modality_id(s.modality) for s in layout.segments for _ in range(s.length)])
    docs = torch.tensor([s.doc for s in layout.segments for _ in range(s.length)])
    segs = torch.tensor([i for i, s in enumerate(layout.segments) for _ in range(s.length)])
    return ids, docs, segs


@settings(max_examples=150)
@given(st.data())
def test_from_tensors_equals_from_segments(data):
    rule_set = data.draw(rules())
    layout = data.draw(layouts(rule_set))
    ids, docs, segs = _token_tensors(rule_set, layout)
    dtype = data.draw(st.sampled_from((torch.int64, torch.int32, torch.int16, torch.uint8)))
    got = omnigen.Layout.from_tensors(ids.to(dtype), docs.to(dtype), rules=rule_set)
    assert isinstance(got, omnigen.Layout) and got == _merged(layout)
    assert got.seq_len == layout.seq_len and got.modalities == layout.modalities
    exact = omnigen.Layout.from_tensors(ids, docs, rules=rule_set, segment_ids=segs)
    assert exact == layout
    # the same mask, and the same tables, as the segments give
    assert torch.equal(rule_set.dense_mask(exact), rule_set.dense_mask(layout))
    if all(s.doc == 0 for s in layout.segments):
        assert omnigen.Layout.from_tensors(ids, rules=rule_set) == _merged(layout)


@settings(max_examples=60)
@given(st.data())
def test_from_tensors_batch_equals_a_batch_of_from_segments(data):
    rule_set = data.draw(rules())
    first = data.draw(layouts(rule_set))
    rows = [first]
    for _ in range(data.draw(st.integers(0, 3))):
        other = data.draw(layouts(rule_set, max_length=20))
        rows.append(other.pad_end(max(other.seq_len, first.seq_len)))
    S = max(r.seq_len for r in rows)
    rows = [r.pad_end(S) for r in rows]
    tensors = [_token_tensors(rule_set, r) for r in rows]
    ids = torch.stack([t[0] for t in tensors])
    docs = torch.stack([t[1] for t in tensors])
    got = omnigen.Layout.from_tensors(ids, docs, rules=rule_set)
    assert isinstance(got, omnigen.LayoutBatch) and got == omnigen.Layout.batch([_merged(r) for r in rows])


@settings(max_examples=100)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(0, 20), st.sampled_from(("text", "image")))
def test_from_cu_seqlens_equals_from_segments(lengths, extra, modality):
    cu = torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32)
    total = sum(lengths)
    got = omnigen.Layout.from_cu_seqlens(cu, rules=RULES, modality=modality, seq_len=total + extra)
    want = [(modality, n, i) for i, n in enumerate(lengths)]
    if extra:
        want.append(("pad", extra, len(lengths) - 1))
    assert got == omnigen.Layout.from_segments(want)
    assert torch.equal(RULES.dense_mask(got), RULES.dense_mask(omnigen.Layout.from_segments(want)))


def test_token_ids_follow_the_rules_ids():
    assert RULES.describe_ids() == "audio=0, image=1, text=2, pad=3"  # canonical order: sorted by name
    assert [RULES.modality_name(i) for i in range(4)] == ["audio", "image", "text", "pad"]
    ids = torch.tensor([RULES.modality_id(n) for n in ["text"] * 3 + ["image"] * 4 + ["pad"] * 2])
    assert str(omnigen.Layout.from_tensors(ids, rules=RULES)) == "text:3 image:4 pad:2"
    with pytest.raises(ValueError, match="modality id must be an integer in \\[0, 3\\]"):
        RULES.modality_name(4)


@pytest.mark.parametrize("ids, docs, error, message", [
    (torch.tensor([2, 2, 4, 2]), None, ValueError,
     r"modality_ids\[2\] = 4 is not a modality id of the rules 'tokens' \(audio=0, image=1, text=2, pad=3\)"),
    (torch.tensor([[2, 2], [2, -1]]), None, ValueError, r"modality_ids\[1, 1\] = -1 is not a modality id"),
    (torch.tensor([2, 2, 2]), torch.tensor([0, 1, 0]), ValueError,
     r"document_ids\[2\] = 0 after 1: document ids must not decrease"),
    (torch.tensor([2, 2]), torch.tensor([0, -3]), ValueError, r"document_ids\[1\] = -3: document ids must be >= 0"),
    (torch.tensor([2.0, 1.0]), None, TypeError, "modality_ids must hold integers, not torch.float32"),
    (torch.tensor([True]), None, TypeError, "must hold integers"),
    ([2, 2], None, TypeError, "modality_ids must be an integer torch.Tensor, not list"),
    (torch.zeros(2, 2, 2, dtype=torch.int64), None, ValueError, r"shape \[S\] or \[B, S\]"),
    (torch.zeros(0, dtype=torch.int64), None, ValueError, r"S >= 1"),
    (torch.tensor([2, 2]), torch.tensor([0, 0, 0]), ValueError, r"document_ids has shape \(3,\), but modality_ids"),
])
def test_from_tensors_errors_name_the_first_offending_position(ids, docs, error, message):
    with pytest.raises(error, match=message):
        omnigen.Layout.from_tensors(ids, docs, rules=RULES)


@pytest.mark.parametrize("cu, kwargs, message", [
    (torch.tensor([1, 4]), {}, r"cu_seqlens\[0\] = 1: it must be 0"),
    (torch.tensor([0, 4, 4, 9]), {}, r"cu_seqlens\[2\] = 4 is not greater than cu_seqlens\[1\] = 4"),
    (torch.tensor([0]), {}, "at least 2 entries"),
    (torch.tensor([0, 4]), {"modality": "video"}, "modality 'video' is not in the rules 'tokens'"),
    (torch.tensor([0, 4]), {"seq_len": 3}, r"seq_len must be an integer >= cu_seqlens\[-1\] = 4"),
])
def test_from_cu_seqlens_errors(cu, kwargs, message):
    with pytest.raises(ValueError, match=message):
        omnigen.Layout.from_cu_seqlens(cu, rules=RULES, **kwargs)


def test_token_layouts_plan_like_segment_layouts():
    layout = omnigen.Layout.parse("text:40 image:64 text:20 audio:30@1 text:10@1")
    ids, docs, _ = _token_tensors(RULES, layout)
    got = omnigen.Layout.from_tensors(ids[None].repeat(2, 1), docs[None].repeat(2, 1), rules=RULES)
    want = omnigen.plan(RULES, omnigen.Layout.batch([layout, layout]), 32, 32)
    assert torch.equal(omnigen.plan(RULES, got, 32, 32).kinds, want.kinds)
