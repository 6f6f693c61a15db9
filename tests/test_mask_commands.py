"""The command line of masks no rule says (issue 29 item 5), on the CPU: `omnigen show` draws a catalogue mask, a
user's mask_mod, a saved dense mask and saved FlashMask intervals from what the kernels read; `omnigen bench --mask`
parses its options, refuses clearly without CUDA, and its library half (mask workloads, the table) works; the
catalogue's mask_mods are FlexAttention mask_mods too (create_block_mask accepts them and agrees on the tiles)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import omnigen
from omnigen import bench
from omnigen.cli import cli
from omnigen.mask_catalogue import NAMES, catalogue_mask
from omnigen.plan.ruleless import dense_from_bits, every_tile_as
from omnigen.semantics import CAUSAL, EMPTY, FULL, PARTIAL

MODS = '''
import torch

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

def windowed(B, S, device):
    width = torch.tensor(S // 4, device=device)
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < width)

def two(q, k):
    return q >= k
'''


def _run(*args: str, code: int = 0):
    """The command's output; an error's paragraph (wrapped by the CLI) joined back into one line."""
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == code, result.output
    return result.output if code == 0 else " ".join(result.output.split())


def _summary(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("S="))


def test_show_draws_each_source_of_one_mask_the_same(tmp_path):
    made = catalogue_mask("longformer", 2, 300, seed=4)
    torch.save(made.dense(), tmp_path / "dense.pt")
    torch.save(dict(zip(("lts", "lte", "uts", "ute"), made.intervals)), tmp_path / "intervals.pt")
    outputs = [_run("show", "--mask", "longformer", "--seq-len", "300", "--batch", "2", "--seed", "4",
                    "--block-m", "64", "--block-n", "64", "--ascii", "--width", "90"),
               _run("show", "--dense", str(tmp_path / "dense.pt"), "--block-m", "64", "--block-n", "64", "--ascii",
                    "--width", "90"),
               _run("show", "--intervals", str(tmp_path / "intervals.pt"), "--block-m", "64", "--block-n", "64",
                    "--ascii", "--width", "90")]
    assert outputs[0].startswith("mask made from catalogue mask 'longformer'")
    body = [out.split("\n", 1)[1] for out in outputs]  # the first line names the source
    assert body[0] == body[1] == body[2]
    assert "batch element 1" in body[0] and "mask memory:" in body[0]
    plan = made.mask("dense", tiles=[(64, 64)]).plan(64, 64)
    counts = plan.counts()
    assert _summary(outputs[0]).startswith(f"S=300 batch=2 tile=64x64 tiles={sum(counts.values())}: "
                                           f"empty {counts['empty']} ")


def test_show_a_users_mask_mod_and_png(tmp_path):
    (tmp_path / "my_masks.py").write_text(MODS)
    out = _run("show", "--mask-mod", f"{tmp_path / 'my_masks.py'}:causal", "--seq-len", "100", "--block-m", "32",
               "--block-n", "32", "--ascii")
    assert "mask made from mask_mod" in out and "causal 4" in _summary(out) and "partial 0" in _summary(out)
    pytest.importorskip("matplotlib")
    png = tmp_path / "w.png"
    out = _run("show", "--mask-mod", f"{tmp_path / 'my_masks.py'}:windowed", "--seq-len", "200", "--png", str(png))
    assert png.stat().st_size > 1000 and f"wrote {png}" in out


@pytest.mark.parametrize("args, message", [
    ((), "missing --rules and --layout"),
    (("--mask", "qk_sparse"), "--mask needs --seq-len"),
    (("--mask", "qk", "--seq-len", "64"), "no catalogue mask named 'qk'"),
    (("--mask", "qk_sparse", "--seq-len", "64", "--dense", "x.pt"), "give one mask"),
    (("--mask-mod", "causal", "--seq-len", "64"), "write MODULE:FUNCTION"),
    (("--mask-mod", "no_such_module_here:f", "--seq-len", "64"), "cannot import no_such_module_here"),
    (("--mask-mod", "MY/two", "--seq-len", "64"), "two(q, k) is neither a mask_mod(b, h, q_idx, kv_idx)"),
])
def test_show_errors_name_the_option_and_the_fix(tmp_path, args, message):
    (tmp_path / "my_masks.py").write_text(MODS)
    args = tuple(a.replace("MY/two", f"{tmp_path / 'my_masks.py'}:two") for a in args)
    out = _run("show", *args, code=2)
    assert out.startswith("omnigen: error:") and message in out, out


def test_show_reads_dense_and_interval_files_and_names_bad_ones(tmp_path):
    torch.save(torch.zeros(8, 8), tmp_path / "float.pt")
    assert "must be torch.bool" in _run("show", "--dense", str(tmp_path / "float.pt"), code=2)
    torch.save(torch.zeros(8, dtype=torch.long), tmp_path / "vector.pt")
    assert "expected a dict with keys lts, lte" in _run("show", "--intervals", str(tmp_path / "vector.pt"), code=2)
    torch.save([torch.full((8,), 8), torch.full((8,), 8)], tmp_path / "pair.pt")  # a list: lts, lte
    assert "causal 1" in _summary(_run("show", "--intervals", str(tmp_path / "pair.pt"), "--block-m", "16",
                                       "--block-n", "16"))


def test_dense_from_bits_is_the_mask_whatever_the_input():
    made = catalogue_mask("share_question", 2, 150, seed=2)
    dense = made.dense()
    for source in ("mod", "intervals"):
        mask = made.mask(source, tiles=[(32, 48)])
        for b in range(2):
            assert torch.equal(dense_from_bits(mask, 32, 48, b), dense[b])
    with pytest.raises(ValueError, match="element must be in"):
        dense_from_bits(mask, 32, 48, 2)


# ---- bench ---------------------------------------------------------------------------------------------------


def test_bench_masks_parse_and_refuse_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = _run("bench", "--mask", "all", "--dims", "64,128", "--sizes", "8192,32768", code=2)
    assert out.strip() == "omnigen: error: omnigen bench needs a CUDA GPU to time on, and none is visible here"
    with pytest.raises(bench.NoGPU):
        bench.run_masks(["medusa_tree"])
    assert "not both" in _run("bench", "--mask", "medusa_tree", "--rules", "x.yaml", code=2)
    assert "--mask NAME" in _run("bench", code=2)
    assert "not in the catalogue" in _run("bench", "--mask", "medusa", code=2)
    assert "choose from omnigen, flex" in _run("bench", "--mask", "medusa_tree", "--peers", "sdpa_dense", code=2)
    assert "--layouts is for --rules" in _run("bench", "--mask-mod", "m.py:f", "--layouts", "l.txt", code=2)
    help_text = " ".join(_run("bench", "--help").split())
    for fragment in ("--mask NAME,...", "--mask-mod MODULE:FUNCTION", "medusa_tree", "create_block_mask",
                     "make_ms", "default 8192,32768"):
        assert fragment in help_text, fragment


def test_bench_mask_workloads_and_table():
    work = bench.mask_workloads(["all", "medusa_tree", "my.py:mod"], dims=(64, 128), sizes=(8192, 32768))
    assert len(work) == (len(NAMES) + 1) * 4
    assert {(w.seq_len, w.batch) for w in work} == {(8192, 4), (32768, 1)}  # B * S = 32K tokens
    assert bench.count_mask_steps(["all"], (64, 128), (8192, 32768)) == 4 * len(NAMES) * 4
    result = bench.Result(rows=[
        {"mask": "medusa_tree", "impl": "omnigen", "D": 128, "S": 8192, "B": 4, "fwd_ms": 1.0, "fwd_bwd_ms": 3.0,
         "fwd_tflops": 300.0, "fwd_bwd_tflops": 250.0, "fwd_vs_flex": 1.5, "fwd_bwd_vs_flex": 1.6, "make_ms": 2.5,
         "make_vs_flex": 3.1, "mask_mib": 0.4, "peak_mib": 10},
    ], info={"gpu": "Test GPU", "torch": "2.x", "heads": 16, "tokens": 32768})
    lines = bench.table(result).splitlines()
    assert lines[1].split()[0] == "mask" and "make_ms" in lines[1] and "mask_mib" in lines[1]
    assert lines[2].split()[0] == "medusa_tree" and "3.1" in lines[2]


def test_bench_tile_cost_option_reaches_the_library_and_the_table(monkeypatch):
    """--tile-cost: refused without masks (it times masks from data), passed to run_masks with the progress bar's
    extra step counted, and each mask's figure printed and written to the JSON."""
    assert "--tile-cost times masks no rule says" in _run("bench", "--rules", "x.yaml", "--tile-cost", code=2)
    assert bench.count_mask_steps(["medusa_tree"], (128,), (8192,), tile_cost=True) == 5
    assert bench.count_mask_steps(["medusa_tree"], (128,), (8192,)) == 4
    calls = []
    cost = {"mask": "random_eviction", "D": 128, "S": 8192, "B": 4, "H": 16, "tile": "128x128",
            "visited_tiles": 4160, "partial_tiles": 4100, "partial_over_full_fwd": 1.15,
            "partial_over_full_fwd_bwd": 1.07}

    def fake_run_masks(specs, **kwargs):
        calls.append((specs, kwargs))
        result = bench.Result(info={"gpu": "Test GPU", "torch": "2.x", "heads": 16, "tokens": 32768})
        if kwargs.get("tile_cost"):
            result.tile_costs.append(cost)
        return result

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_masks", fake_run_masks)
    out = _run("bench", "--mask", "random_eviction", "--dims", "128", "--sizes", "8192", "--tile-cost",
               "--json", "-")
    assert calls[-1][0] == ("random_eviction",) and calls[-1][1]["tile_cost"] is True
    assert json.loads(out[out.index("{"):])["tile_costs"] == [cost]  # the progress bar's label comes first (stderr)
    out = _run("bench", "--mask", "random_eviction", "--dims", "128", "--sizes", "8192", "--tile-cost")
    assert ("tile cost, random_eviction D=128 S=8192 B=4 (4160 visited 128x128 tiles, 4100 of them partial): every "
            "visited tile partial / every one full = 1.15 forward, 1.07 forward+backward") in out
    out = _run("bench", "--mask", "random_eviction", "--dims", "128", "--sizes", "8192", "--json", "-")
    assert calls[-1][1]["tile_cost"] is False and "tile_costs" not in json.loads(out[out.index("{"):])


@pytest.mark.parametrize("name", ["qk_sparse", "medusa_tree"])
def test_every_tile_as_keeps_the_visited_tiles_and_the_pairs(name):
    """The tile cost's two masks: the mask's visited tiles, all partial (bits saying the mask's own pairs: the same
    output) or all full; empty tiles stay empty."""
    made = catalogue_mask(name, 2, 200, seed=1)
    mask = made.mask("mod", tiles=[(32, 48), (64, 32)])
    partial, full = every_tile_as(mask, PARTIAL), every_tile_as(mask, FULL)
    for tile in mask.tiles:
        counts = mask.plan(*tile).counts()
        visited = counts["full"] + counts["causal"] + counts["partial"]
        assert partial.plan(*tile).counts() == {"empty": counts["empty"], "full": 0, "causal": 0, "partial": visited}
        assert full.plan(*tile).counts() == {"empty": counts["empty"], "full": visited, "causal": 0, "partial": 0}
        for element in range(2):
            assert torch.equal(dense_from_bits(partial, *tile, element), made.dense()[element])
    q = torch.randn(2, 2, 200, 16, dtype=torch.float64)
    torch.testing.assert_close(omnigen.attention(q, q, q, partial),
                               omnigen.attention(q, q, q, mask), atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="FULL .* or PARTIAL"):
        every_tile_as(mask, CAUSAL)


def _flex_kinds(block_mask, B: int, n: int) -> torch.Tensor:
    """[B, n, n] tile kinds as FlexAttention's block mask sees them: full, partial (anything it must mask), empty."""
    kinds = torch.full((B, n, n), EMPTY, dtype=torch.int8)
    for counts, indices, kind in ((block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
                                  (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)):
        for b in range(B):
            for i in range(n):
                kinds[b, i, indices[b, 0, i, : int(counts[b, 0, i])].long()] = kind
    return kinds


@pytest.mark.parametrize("name", NAMES)
def test_catalogue_mods_are_flex_mask_mods(name):
    """What the bench hands FlexAttention: create_block_mask takes each catalogue mod, and its 128 x 128 blocks
    agree with omnigen's tiles (its partial blocks are omnigen's causal and partial tiles)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, S = 2, 384
    made = catalogue_mask(name, B, S, seed=1)
    block_mask = flex.create_block_mask(made.mask_mod, B, None, S, S, device="cpu")
    kinds = made.mask("mod", tiles=[(128, 128)]).plan(128, 128).kinds.clone()
    kinds[kinds == CAUSAL] = PARTIAL
    assert torch.equal(_flex_kinds(block_mask, B, S // 128), kinds)
