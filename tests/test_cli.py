"""`omnigen show` and `omnigen plan` on every example rules file, batches, PNGs and a long sequence."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import omnigen
from omnigen import figures
from omnigen.cli import cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "rules"
# A representative layout per example (the one its header comment suggests, or close to it).
LAYOUTS = {
    "transfusion": "text:100 image:256 text:60 image:256 text:40@1 image:256@1 text:56@1",
    "transfusion_no_image_to_image": "text:40 image:256 text:24 image:256",
    "share_question": "question:200 answer:120 answer:90 answer:150",
    "prefix_lm": "prefix:300 text:500",
    "causal_documents": "text:300 text:200@1 text:500@2",
    "sliding_window": "text:600 image:256 text:400",
    "three_modalities": "text:64 image:256 text:32 audio:192 text:48",
}
KINDS = ("empty", "full", "causal", "partial")


def _invoke(*args: str):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _summary_counts(output: str) -> dict[str, int]:
    summary = output.strip().splitlines()[-1]
    assert summary.startswith("S="), summary
    return {kind: int(re.search(rf"\b{kind} (\d+) \(", summary).group(1)) for kind in KINDS}


def test_every_example_has_a_layout():
    assert {p.stem for p in EXAMPLES.glob("*.yaml")} == set(LAYOUTS)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_examples_load_and_round_trip(name: str):
    rules = omnigen.Rules.load(EXAMPLES / f"{name}.yaml")
    assert rules.name == name
    assert omnigen.Rules.from_yaml(rules.to_yaml()) == rules
    assert omnigen.Layout.parse(LAYOUTS[name]).modalities <= set(rules.modality_names)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_show_prints_mask_tiles_and_counts_that_match_plan(name: str):
    path, layout = EXAMPLES / f"{name}.yaml", LAYOUTS[name]
    result = _invoke("show", "--rules", str(path), "--layout", layout, "--block-m", "64", "--block-n", "64",
                     "--width", "100")
    expected = omnigen.plan(omnigen.Rules.load(path), layout, block_m=64, block_n=64)
    assert _summary_counts(result.stdout) == expected.counts()
    assert f"S={expected.seq_len} " in result.stdout
    assert result.stdout.startswith("mask "), "small S draws the dense mask first"
    assert "tiles (one character per 64x64 tile)" in result.stdout
    for segment in omnigen.Layout.parse(layout).segments:
        assert segment.modality in result.stdout  # boundaries are labelled
    framed = [line for line in result.stdout.splitlines() if any(c in line for c in "│┌└")]
    assert framed and all(len(line) <= 100 for line in framed)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_plan_table_matches_plan(name: str):
    path, layout = EXAMPLES / f"{name}.yaml", LAYOUTS[name]
    result = _invoke("plan", "--rules", str(path), "--layout", layout)
    expected = omnigen.plan(omnigen.Rules.load(path), layout)
    for kind, count in expected.counts().items():
        assert re.search(rf"^\s+{kind}\s+{count:,}\s", result.stdout, re.M), (kind, result.stdout)
    assert f"{expected.allowed_pairs:,}" in result.stdout
    assert f"{expected.density:.4f}" in result.stdout
    assert f"{expected.partial_fraction:.4f}" in result.stdout
    assert f"{expected.nbytes():,} bytes" in result.stdout
    assert "planning time" in result.stdout


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_plan_json_is_plan_stats(name: str):
    path, layout = EXAMPLES / f"{name}.yaml", LAYOUTS[name]
    result = _invoke("plan", "--rules", str(path), "--layout", layout, "--block-m", "128", "--block-n", "64",
                     "--json")
    expected = omnigen.plan(omnigen.Rules.load(path), layout, block_m=128, block_n=64).stats()
    assert json.loads(result.stdout) == expected


def test_batch_layouts():
    path = EXAMPLES / "transfusion.yaml"
    layouts = ["text:64 image:256", "image:256 text:64", "text:100 image:220@1"]
    args = [arg for layout in layouts for arg in ("--layout", layout)]
    expected = omnigen.plan(omnigen.Rules.load(path), omnigen.Layout.batch([omnigen.Layout.parse(t) for t in layouts]))

    stats = json.loads(_invoke("plan", "--rules", str(path), *args, "--json").stdout)
    assert stats["batch"] == 3 and stats == expected.stats()

    table = _invoke("plan", "--rules", str(path), *args).stdout
    assert "layout[2]" in table and "text:100 image:220@1" in table

    shown = _invoke("show", "--rules", str(path), *args, "--width", "90").stdout
    assert all(f"batch element {b}: {layouts[b]}" in shown for b in range(3))
    assert _summary_counts(shown) == expected.counts()


def test_ascii_output_is_ascii():
    result = _invoke("show", "--rules", str(EXAMPLES / "three_modalities.yaml"), "--layout",
                     LAYOUTS["three_modalities"], "--ascii", "--width", "80")
    assert result.stdout.isascii()
    assert "'#' full" in result.stdout


def test_small_layout_draws_every_token():
    # 12 tokens: one line per query token, two characters per key token.
    result = _invoke("show", "--rules", str(EXAMPLES / "prefix_lm.yaml"), "--layout", "prefix:4 text:8",
                     "--block-m", "16", "--block-n", "16", "--width", "80", "--ascii")
    # Picture lines: an 18-character label, a space, the left edge ('+' where a segment starts), cells, '|'.
    rows = [m.group(1) for m in re.finditer(r"^.{19}[|+](.*)\|$", result.stdout, re.M)]
    mask_rows = rows[:12]
    assert mask_rows[0] == "#" * 8 + " " * 16  # a prefix token sees the whole prefix, no text
    assert mask_rows[4] == "#" * 10 + " " * 14  # the first text token sees the prefix and itself
    assert mask_rows[11] == "#" * 24


def test_large_sequence_shows_tiles_without_the_dense_mask(monkeypatch: pytest.MonkeyPatch):
    def no_dense(*args, **kwargs):
        raise AssertionError("the dense S x S mask must not be built for a large S")

    monkeypatch.setattr(omnigen.Rules, "dense_mask", no_dense)
    monkeypatch.setattr("omnigen.rules.dense_mask", no_dense)
    layout = " ".join(["text:100 image:924"] * 64)  # 65,536 tokens
    start = time.perf_counter()
    result = _invoke("show", "--rules", str(EXAMPLES / "transfusion.yaml"), "--layout", layout, "--width", "100")
    assert time.perf_counter() - start < 60
    assert "mask picture skipped" in result.stdout
    assert "several kinds" in result.stdout  # 512 x 512 tiles are grouped to fit 100 columns
    framed = [line for line in result.stdout.splitlines() if "│" in line]
    assert 0 < len(framed) <= 64 and all(len(line) <= 100 for line in framed)
    expected = omnigen.plan(omnigen.Rules.load(EXAMPLES / "transfusion.yaml"), layout)
    assert _summary_counts(result.stdout) == expected.counts()


def test_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "mask.png"
    result = _invoke("show", "--rules", str(EXAMPLES / "transfusion.yaml"), "--layout", LAYOUTS["transfusion"],
                     "--block-m", "64", "--block-n", "64", "--png", str(out))
    assert f"wrote {out}" in result.stdout
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_png_batch_and_large(tmp_path: Path):
    pytest.importorskip("matplotlib")
    path = str(EXAMPLES / "transfusion.yaml")
    _invoke("show", "--rules", path, "--layout", "text:64 image:256", "--layout", "image:256 text:64@1",
            "--png", str(tmp_path / "batch.png"))
    _invoke("show", "--rules", path, "--layout", " ".join(["text:100 image:924"] * 9), "--png",
            str(tmp_path / "large.png"))  # S = 9216 > 8192: tile panel only
    for name in ("batch.png", "large.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_png_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    result = CliRunner().invoke(cli, ["show", "--rules", str(EXAMPLES / "transfusion.yaml"), "--layout",
                                      "text:8", "--png", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "pip install matplotlib" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_figures_are_callable_from_python():
    rules = omnigen.Rules.load(EXAMPLES / "share_question.yaml")
    layout = omnigen.Layout.parse(LAYOUTS["share_question"])
    plan = omnigen.plan(rules, layout, block_m=64, block_n=64)
    text = figures.render_terminal(rules, layout, plan, width=90, unicode=False)
    assert text.splitlines()[-1] == figures.summary_line(plan)
    assert "question 0" in text and "answer 200" in text
    assert "partial fraction" in figures.plan_table(rules, layout, plan)
    with pytest.raises(ValueError, match="dense"):
        figures.mask_text(rules, omnigen.Layout.parse("text:9000"))
