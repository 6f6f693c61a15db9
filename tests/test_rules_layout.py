"""Rules: YAML and Python forms, canonical hashing, round trips. Layouts: parsing, tables, padding."""

import pytest
import torch
from hypothesis import given, settings

import omnigen
from omnigen import Layout, Rules, RulesError

from strategies import layouts, rules

TRANSFUSION = """
name: transfusion
modalities:
  text:  {self: causal}
  image: {self: full}
  audio: {self: full, window: 0}
see:
  default: earlier
  image -> image: none
documents: isolated
kernel:
  head_dims: [64, 128]
  dtypes: [bf16, fp16]
  archs: [sm_80, sm_90a]
  tiles:
    - {block_m: 128, block_n: 64, warps: 4, stages: 2}
"""


def test_design_example_loads():
    r = Rules.from_yaml(TRANSFUSION)
    assert r.name == "transfusion"
    assert r.modality_names == ("audio", "image", "text")
    assert r.see_policy("image", "image") == "none" and r.see_policy("text", "image") == "earlier"
    assert r.kernel.head_dims == (64, 128) and r.kernel.tiles[0].block_n == 64
    assert r.pad_id == 3 and r.modality_id("pad") == 3


def test_same_rules_written_differently_hash_the_same():
    a = Rules.from_yaml(TRANSFUSION)
    b = Rules.from_yaml(
        """
kernel:
  tiles: [{stages: 2, warps: 4, block_n: 64, block_m: 128}]
  archs: [sm_80, sm_90a]
  dtypes: [bf16, fp16]
  head_dims: [64, 128]
documents: isolated
see: {image->image: none, text -> text: earlier}
modalities:
  image: full
  audio: {self: full}
  text: {}
name: transfusion
"""
    )
    assert a == b and a.content_hash() == b.content_hash() and a.mask_hash() == b.mask_hash()
    c = Rules(
        name="transfusion",
        modalities={"text": "causal", "image": {"self": "full"}, "audio": "full"},
        see={"image -> image": "none"},
        kernel=a.kernel,
    )
    assert c == a and c.content_hash() == a.content_hash()
    different = Rules.from_yaml(TRANSFUSION.replace("image -> image: none", "image -> image: all"))
    assert different.content_hash() != a.content_hash() and different.mask_hash() != a.mask_hash()


def test_hash_is_stable_across_processes():
    import subprocess
    import sys

    code = "import omnigen; print(omnigen.Rules.from_yaml(open(0).read()).content_hash())"
    outs = {subprocess.run([sys.executable, "-c", code], input=TRANSFUSION, capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed), "PYTHONPATH": "."}).stdout for seed in (1, 2)}
    assert len(outs) == 1 and outs.pop().strip() == Rules.from_yaml(TRANSFUSION).content_hash()


@settings(max_examples=200)
@given(rules())
def test_to_yaml_round_trips(r):
    again = Rules.from_yaml(r.to_yaml())
    assert again == r and again.content_hash() == r.content_hash()


def test_to_yaml_round_trips_kernel_section():
    r = Rules.from_yaml(TRANSFUSION)
    assert Rules.from_yaml(r.to_yaml()) == r
    assert Rules.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    "text, fragment, line, suggestion",
    [
        ("name: x\nmodalities: {text: {self: casual}}\n", "self must be one of", 2, "causal"),
        ("name: x\nmodalites: {text: causal}\n", "unknown top-level key 'modalites'", 2, "modalities"),
        ("name: x\nmodalities:\n  text: causal\nsee:\n  txt -> text: none\n", "unknown modality 'txt'", 5, "text"),
        ("name: x\nmodalities:\n  text: causal\nsee:\n  text->text: none\n  text -> text: all\n", "duplicate see entry", 6, None),
        ("name: X-1\nmodalities: {text: causal}\n", "name must match", 1, None),
    ],
)
def test_rules_errors_name_line_key_and_suggestion(text, fragment, line, suggestion):
    with pytest.raises(RulesError) as info:
        Rules.from_yaml(text, source="bad.yaml")
    err = info.value
    assert fragment in str(err) and err.line == line and f"bad.yaml:{line}" in str(err)
    assert err.suggestion == suggestion
    if suggestion:
        assert f"did you mean '{suggestion}'" in str(err)


def test_python_construction_validates_too():
    with pytest.raises(RulesError, match="did you mean 'full'"):
        Rules(name="x", modalities={"image": "ful"})
    with pytest.raises(RulesError, match="pad"):
        Rules(name="x", modalities={"pad": "full"})


def test_layout_parse_and_tables():
    rules = Rules(name="t", modalities={"text": "causal", "image": "full"})
    layout = Layout.parse("text:4 image:3, text:2@1")
    assert layout == Layout.from_segments([("text", 4), ("image", 3), ("text", 2, 1)])
    assert str(layout) == "text:4 image:3 text:2@1" and layout.seq_len == 9
    t = layout.tables(rules)
    assert t.token_segment.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2]]
    assert t.token_modality.tolist() == [[1, 1, 1, 1, 0, 0, 0, 1, 1]]
    assert t.token_doc.tolist() == [[0] * 7 + [1, 1]]
    assert t.seg_visible_start.tolist() == [0, 0, 7] and t.seg_visible_end.tolist() == [7, 7, 9]
    shared = Rules(name="t", modalities={"text": "causal", "image": "full"}, documents="shared")
    assert layout.tables(shared).seg_visible_end.tolist() == [9, 9, 9]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("text:0", "length must be an integer >= 1"),
        ("text:4@2 image:4@1", "must not decrease"),
        ("text", "cannot read layout segment"),
        ("", "empty"),
        ("Text:4", "cannot read"),
    ],
)
def test_layout_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        Layout.parse(text)


def test_layout_modality_must_be_in_rules():
    rules = Rules(name="t", modalities={"text": "causal", "image": "full"})
    with pytest.raises(ValueError, match="did you mean 'image'"):
        Layout.parse("text:3 imagee:4").tables(rules)


def test_batch_of_unequal_lengths_says_how_to_fix():
    with pytest.raises(ValueError, match=r"pad_end\(7\)"):
        Layout.batch([Layout.parse("text:5"), Layout.parse("text:7")])


def test_pad_to_tiles_aligns_and_reports():
    rules = Rules(name="t", modalities={"text": "causal", "image": "full"})
    layout = Layout.parse("text:40 image:256 text:24 image:256 text:10@1 image:20@1")
    padded, report = layout.pad_to_tiles(["image"], 64)
    starts = [s for s, seg in zip(padded.starts(), padded.segments) if seg.modality == "image"]
    assert all(s % 64 == 0 for s in starts)
    assert report.added_tokens == padded.seq_len - layout.seq_len == 24 + 40 + 54
    moved = report.new_positions()
    assert moved.shape == (layout.seq_len,) and torch.all(moved[1:] > moved[:-1])
    # every original token keeps its modality and document, and the mask between original tokens is unchanged
    old_mask, new_mask = rules.dense_mask(layout), rules.dense_mask(padded)
    assert torch.equal(new_mask[moved][:, moved], old_mask)
    assert "inserted 118 pad tokens in 3 places" in str(report)
    assert Layout.parse("image:64 text:3").pad_to_tiles(["image"], 64)[1].added_tokens == 0


@settings(max_examples=100)
@given(rules().flatmap(lambda r: layouts(r).map(lambda l: (r, l))))
def test_padding_never_changes_the_mask_between_real_tokens(case):
    r, layout = case
    if r.has_windows:  # windows count positions, pad included: padding is meant for window-free modalities
        r = Rules.from_dict({**r.to_dict(), "modalities": {m.name: m.self for m in r.modalities}})
    padded, report = layout.pad_to_tiles(list(r.modality_names), 16, rules=r)  # (names the layout may lack)
    moved = report.new_positions()
    assert torch.equal(r.dense_mask(padded)[moved][:, moved], r.dense_mask(layout))


def test_layouts_have_handles_that_find_them_while_they_live():
    """A layout's handle (op/traced_layouts.py hands it across a torch.compile trace): unique, found again while the
    layout lives, not after; a pickled copy is built again with a handle of its own and no tables."""
    import gc
    import pickle

    from omnigen.layout import live_layout

    one, other = Layout.parse("text:40 image:64"), Layout.parse("text:40 image:64")
    batch = Layout.batch([one, other])
    assert len({one.handle, other.handle, batch.handle}) == 3 and all(isinstance(h, str) for h in (one.handle,))
    assert live_layout(one.handle) is one and live_layout(batch.handle) is batch
    one.tables(Rules.load("examples/rules/transfusion.yaml"))
    copy = pickle.loads(pickle.dumps(batch))
    assert copy == batch and copy.handle != batch.handle and copy[0].handle != one.handle
    assert live_layout(copy[0].handle) is copy[0] and not copy[0]._tables
    gone = other.handle
    del batch, copy, other
    gc.collect()
    with pytest.raises(KeyError, match="no living omnigen layout"):
        live_layout(gone)


def test_rules_canonical_form_builds_equal_rules():
    import json

    rules = Rules.load("examples/rules/transfusion.yaml")
    again = Rules.from_dict(json.loads(rules.canonical))
    assert again == rules and again.key == rules.key and again.canonical == rules.canonical
