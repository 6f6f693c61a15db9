"""The tuner on a GPU: forward and backward on different tiles, a small tuning job end to end (database,
dispatch, reuse), and a wrong candidate disqualified. Builds three small d64 variants into a private cache.
"""

from __future__ import annotations

import math

import pytest
import torch

import omnigen
from omnigen import tune
from omnigen.jit import cache
from omnigen.kernels import launch as kernel_launch
from omnigen.op import kernel as ops
from omnigen.tune import db as tune_db
from omnigen.targets import KernelConfig
from omnigen.reference import attention_reference, attention_reference_grads
from omnigen.targets import TileConfig

def _tiles() -> list[TileConfig]:
    """Three tiles of the visible GPU's own kernel family, each with a backward (sm90: the Hopper backward takes
    block_n 128 at d64, so its three differ in the forward's stages)."""
    arch = omnigen.jit.toolchain.visible_gpu_arch() if torch.cuda.is_available() else None
    if arch is not None and omnigen.kernels.family_of(arch).name == "sm90":
        return [TileConfig(128, 128, 12, 2), TileConfig(128, 128, 12, 3), TileConfig(128, 128, 12, 4)]
    return [TileConfig(128, 64, 4, 2), TileConfig(64, 64, 4, 2), TileConfig(128, 128, 8, 2)]


TILES = _tiles()
RULES = omnigen.Rules.from_dict({
    "name": "tunegpu", "modalities": {"text": {"self": "causal"}, "image": {"self": "full"}},
    "see": {"text -> image": "all"},
    "kernel": {"head_dims": [64], "tiles": [{"block_m": t.block_m, "block_n": t.block_n, "warps": t.warps,
                                             "stages": t.stages} for t in TILES]},
})


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tune-cache")
    patcher = pytest.MonkeyPatch()
    patcher.setenv("OMNIGEN_CACHE_DIR", str(directory))
    yield directory
    patcher.undo()
    ops.forget_kernels()


def _configs():
    arch = omnigen.jit.toolchain.visible_gpu_arch()
    return [KernelConfig(64, "bf16", arch, t) for t in TILES]


@pytest.mark.gpu
@pytest.mark.parametrize("forward_tile,backward_tile", [(0, 1), (1, 2), (2, 0)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_forward_and_backward_on_different_tiles_match_float64(private_cache, forward_tile, backward_tile,
                                                                 deterministic):
    configs = _configs()
    default = configs[0]
    choice = tune_db.Choice(configs[forward_tile], configs[backward_tile])
    kernel = ops.Kernel(RULES, default, cache.get_module(RULES, default), tuned={1024: choice})
    layout = omnigen.Layout.batch([omnigen.Layout.parse("text:100 image:256 text:77 image:256 text:311"),
                                   omnigen.Layout.parse("image:256 text:500 pad:244")])
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 1000, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    d_out = torch.randn_like(q)
    assert kernel.choice(1000) == choice
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    out = kernel(q_, k_, v_, layout, deterministic=deterministic)
    out.backward(d_out)
    mask = RULES.dense_mask(layout).cuda()
    out_ref, _ = attention_reference(q, k, v, mask)
    assert (out.double() - out_ref).abs().max().item() <= 2e-2 * out_ref.abs().max().item() + 1e-3
    for name, got, ref in zip(("dq", "dk", "dv"), (q_.grad, k_.grad, v_.grad), attention_reference_grads(q, k, v, mask, d_out)):
        assert not torch.isnan(got).any(), name
        assert (got.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-3, name


@pytest.mark.gpu
def test_small_tuning_job_end_to_end(private_cache, monkeypatch):
    arch = omnigen.jit.toolchain.visible_gpu_arch()
    device = tune_db.Device.current()
    job = tune.prepare(RULES, [64], ["bf16"], arch, device, seq_lens=[1024, 4096], tokens=8192)
    assert [c.config.tile for c in job.spaces[0].candidates] == TILES
    tune.compile_candidates(job)
    steps = []
    entries = tune.measure(job, rounds=3, reps=2, on_step=steps.append)
    assert sum(steps) == tune.count_steps(job, 3)
    assert sorted(e["seq_bucket"] for e in entries.values()) == [1024, 4096]
    db = cache.read_tuning_db()
    for key, entry in entries.items():
        assert db[key] == entry and tune_db.staleness(entry) is None
        rows = {row["tile"]: row for row in entry["candidates"]}
        assert set(rows) == {t.label for t in TILES}
        for row in rows.values():
            assert row["status"] == "ok", row
            assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["fwd_tflops"] > 0
        # the winner is never slower than the default in the same run
        assert entry["forward"]["ms"] <= entry["default"]["fwd_ms"]
        assert entry["backward"]["ms"] <= entry["default"]["bwd_ms"]
        assert entry["workload"]["batch"] == 8192 // entry["seq_bucket"]
    # a new kernel -- and attention() -- dispatch to what was tuned
    kernel = omnigen.build(RULES, head_dim=64)
    by_bucket = {e["seq_bucket"]: e for e in entries.values()}
    for bucket, entry in by_bucket.items():
        choice = kernel.choice(bucket)
        assert tune_db.tile_to_dict(choice.forward.tile) == entry["forward"]["tile"]
        assert tune_db.tile_to_dict(choice.backward.tile) == entry["backward"]["tile"]
    q = torch.randn(1, 2, 1024, 64, device="cuda", dtype=torch.bfloat16)
    omnigen.attention(q, q, q, "text:1024", RULES)
    assert next(k for key, k in ops._KERNELS.items() if key[0] == RULES.key).tuned
    # a second tuning request reuses the database instead of timing again
    assert set(tune.reusable(tune.prepare(RULES, [64], ["bf16"], arch, device, seq_lens=[1024, 4096],
                                          tokens=8192))) == set(entries)
    def must_not_measure(*_args, **_kwargs):
        raise AssertionError("the database already holds this job: nothing should be timed again")

    monkeypatch.setattr(tune, "measure", must_not_measure)
    assert tune.tune_kernel(RULES, 64, "bf16", seq_lens=(1024, 4096), tokens=8192).keys() == {1024, 4096}


@pytest.mark.gpu
def test_a_fast_wrong_candidate_is_disqualified(private_cache, monkeypatch):
    arch = omnigen.jit.toolchain.visible_gpu_arch()
    job = tune.prepare(RULES, [64], ["bf16"], arch, tune_db.Device.current(), seq_lens=[1024], tokens=4096)
    tune.compile_candidates(job)
    wrong_tile = TILES[2]
    real_forward = kernel_launch.forward_pass

    def sabotaged(module, p, q, k, v, scale):
        out, lse = real_forward(module, p, q, k, v, scale)
        config = module.CONFIG
        if (config["block_n"], config["warps"], config["stages"]) == (wrong_tile.block_n, wrong_tile.warps, wrong_tile.stages):
            # "fast and wrong": drops half of every row's output
            out[..., : out.shape[-1] // 2] = 0
        return out, lse

    monkeypatch.setattr(kernel_launch, "forward_pass", sabotaged)
    entries = tune.measure(job, rounds=2, reps=1, write=False)
    (entry,) = entries.values()
    row = next(r for r in entry["candidates"] if r["tile"] == wrong_tile.label)
    assert "wrong forward output vs float64" in row["status"] and row["fwd_ms"] is None
    assert "fwd" not in row["winner"] and entry["forward"]["tile"] != tune_db.tile_to_dict(wrong_tile)
    assert math.isfinite(row["bwd_ms"])  # its backward was correct: still timed
