"""The tuner without a GPU: candidate space and pruning, the database (keys, staleness, locking),
layouts for timing, keep-going builds, kernel dispatch, and `omnigen build --tune` on a CPU machine.

Builds here use tests/fake_toolchain.py (shell-script compilers): milliseconds, no nvcc.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import omnigen
from omnigen import kernels
from omnigen.kernels.sm80.resources import default_tile
from omnigen.kernels.sm80.resources import spill_allowance
from omnigen.kernels import launch as kernel_launch
from omnigen.kernels.sm80 import space as sm80_space
from omnigen import tune
from omnigen.jit import cache, codegen
from omnigen.op import kernel as ops
from omnigen.tune import db as tune_db
from omnigen.tune import layouts as tune_layouts
from omnigen.tune import job as tune_job
from omnigen.tune import measurement as tune_measurement
from omnigen.tune import space as tune_space
from omnigen.tune import timing as tune_timing
from omnigen.cli import cli
from omnigen.targets import KernelConfig
from omnigen.targets import TileConfig

from fake_toolchain import fake_toolchain

REPO = Path(__file__).resolve().parent.parent
RULES = omnigen.Rules(name="tunetest", modalities={"text": "causal", "image": "full"})
DEVICE = tune_db.Device("NVIDIA Test GPU", "9.0", "13.0.88")
# The tuner's machinery is family-independent; these tests drive it with the sm80 family on a Hopper-sized
# arch: "sm_90" (portable code, 227 KB of shared memory) is served by sm80, "sm_90a" by sm90.


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ------------------------------------------------------------------------------------------------
# the candidate space


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_space_only_holds_tiles_the_templates_take(head_dim):
    candidates, pruned = tune_space.candidate_space(RULES, head_dim, "bf16", "sm_90")
    assert not pruned, pruned
    assert candidates[0].config == KernelConfig(head_dim, "bf16", "sm_90", default_tile(head_dim))
    assert len(candidates) == len(sm80_space.DEFAULT_SPACE[head_dim]) >= 4
    for c in candidates:
        assert not kernels.problems(c.config)
        assert c.backward == (not kernels.backward_problems(c.config))
    if head_dim == 256:
        assert not any(c.backward for c in candidates)  # no d256 backward kernel: forward-only candidates
    else:
        assert all(c.backward for c in candidates)
        assert TileConfig(128, 128, 8, 2) in {c.config.tile for c in candidates}


def test_space_is_pruned_per_arch_before_compiling():
    candidates, pruned = tune_space.candidate_space(RULES, 128, "bf16", "sm_80")
    labels = {c.label for c in candidates}
    assert "m128n128w8s2" not in labels
    reasons = {config.tile.label: why for config, why in pruned}
    assert "shared memory" in reasons["m128n128w8s2"] and "sm_80" in reasons["m128n128w8s2"]
    # 64x128 fits sm_80's forward but not its backward: a forward-only candidate
    narrow = next(c for c in candidates if c.label == "m64n128w4s2")
    assert narrow.forward and not narrow.backward and "shared memory" in narrow.backward_problem


def test_rules_tiles_replace_the_default_space_and_the_default_stays_first():
    rules = omnigen.Rules.from_dict({**RULES.to_dict(), "kernel": {"tiles": [
        {"block_m": 128, "block_n": 256, "warps": 4, "stages": 4},  # does not fit: pruned
        {"block_m": 64, "block_n": 64, "warps": 4, "stages": 2},
        {"block_m": 128, "block_n": 128, "warps": 8, "stages": 2}]}})
    candidates, pruned = tune_space.candidate_space(rules, 128, "bf16", "sm_90")
    assert [c.label for c in candidates] == ["m64n64w4s2", "m128n128w8s2"]  # the first that fits is the default
    assert [config.tile.label for config, _ in pruned] == ["m128n256w4s4"]
    assert tune_space.default_config(rules, 128, "bf16", "sm_90").tile == TileConfig(64, 64, 4, 2)
    assert ops._variant_config(rules, 128, torch.bfloat16, "sm_90", None).tile == TileConfig(64, 64, 4, 2)


def test_ptxas_spills_prune_only_the_pass_that_spills():
    candidate = tune_space.Candidate(KernelConfig(128, "bf16", "sm_90"))
    report = {"kernels": {
        "_ZN3ns14forward_kernelE11ForwardArgs": {"spill_store_bytes": 0, "spill_load_bytes": 0},
        "_ZN3ns11dkdv_kernelE12BackwardArgs": {"spill_store_bytes": 400, "spill_load_bytes": 408},
        "_ZN3ns9dq_kernelE12BackwardArgs": {"spill_store_bytes": 64, "spill_load_bytes": 64}}}
    pruned = tune_space.prune_by_ptxas(candidate, report)
    assert pruned.forward and not pruned.backward and "808 B" in pruned.backward_problem
    # within the dK/dV kernel's allowance (SPILL_ALLOWANCE_BYTES (kernels/sm80/resources.py)): usable
    report["kernels"]["_ZN3ns11dkdv_kernelE12BackwardArgs"] = {"spill_store_bytes": 136, "spill_load_bytes": 140}
    assert tune_space.prune_by_ptxas(candidate, report) == candidate
    # the deterministic dQ kernel is not what the tuner times: its spills do not prune
    report["kernels"]["_ZN3ns11dkdv_kernelE12BackwardArgs"] = {"spill_store_bytes": 0}
    assert tune_space.prune_by_ptxas(candidate, report) == candidate
    assert tune_space.prune_by_ptxas(candidate, {}) == candidate  # no report: nothing to prune on


def test_forward_spill_allowance():
    """The forward may spill the few per-tile bytes SPILL_ALLOWANCE_BYTES (kernels/sm80/resources.py) allows, not more."""
    candidate = tune_space.Candidate(KernelConfig(128, "bf16", "sm_90"))
    allowance = spill_allowance("_ZN3ns14forward_kernelE11ForwardArgs")
    assert allowance > 0 and spill_allowance("_ZN3ns9dq_kernelE12BackwardArgs") == 0

    def report(stores, loads):
        return {"kernels": {"_ZN3ns14forward_kernelE11ForwardArgs": {"spill_store_bytes": stores, "spill_load_bytes": loads}}}

    assert tune_space.prune_by_ptxas(candidate, report(allowance, allowance)) == candidate
    pruned = tune_space.prune_by_ptxas(candidate, report(allowance + 4, 8))
    assert not pruned.forward and pruned.backward and f"{allowance + 12} B" in pruned.forward_problem


def test_build_table_marks_tolerated_spills():
    from omnigen.cli.build import _ptxas_cells

    def meta(forward, dkdv):
        kernels = {"_ZN3ns14forward_kernelE11ForwardArgs": {"spill_store_bytes": forward, "spill_load_bytes": forward},
                   "_ZN3ns11dkdv_kernelE12BackwardArgs": {"spill_store_bytes": dkdv, "spill_load_bytes": dkdv}}
        return {"ptxas": {"registers": 255, "spill_store_bytes": forward + dkdv, "spill_load_bytes": forward + dkdv,
                          "kernels": kernels}}

    config = KernelConfig(128, "bf16", "sm_90")
    # spill stores/loads, as `omnigen inspect` prints them
    assert _ptxas_cells(config, meta(0, 0)) == ["255", "0/0 B"]
    assert _ptxas_cells(config, meta(8, 0)) == ["255", "8/8 B*"]  # the forward's per-tile spill: tolerated
    assert _ptxas_cells(config, meta(8, 136)) == ["255", "144/144 B*"]  # the dK/dV kernel's per-step addresses: tolerated
    assert _ptxas_cells(config, meta(8, 400)) == ["255", "408/408 B"]   # beyond its allowance: not
    assert _ptxas_cells(config, {}) == ["?", "?"]


# ------------------------------------------------------------------------------------------------
# the database


@pytest.mark.parametrize("length,bucket", [(1, 16), (16, 16), (1000, 1024), (1024, 1024), (1448, 1024), (1449, 2048),
                                           (2800, 2048), (3000, 4096), (32768, 32768), (40000, 32768)])
def test_sequence_buckets(length, bucket):
    assert tune_db.seq_bucket(length) == bucket


def test_keys_name_every_field_and_ignore_the_kernel_section():
    base = tune_db.entry_key(DEVICE, RULES, "bf16", 128, 8192)
    variants = [
        tune_db.entry_key(tune_db.Device("NVIDIA H100", "9.0", "13.0.88"), RULES, "bf16", 128, 8192),
        tune_db.entry_key(tune_db.Device(DEVICE.gpu, "8.0", "13.0.88"), RULES, "bf16", 128, 8192),
        tune_db.entry_key(tune_db.Device(DEVICE.gpu, "9.0", "12.8.93"), RULES, "bf16", 128, 8192),
        tune_db.entry_key(DEVICE, omnigen.Rules(name="tunetest", modalities={"text": "causal"}), "bf16", 128, 8192),
        tune_db.entry_key(DEVICE, RULES, "fp16", 128, 8192),
        tune_db.entry_key(DEVICE, RULES, "bf16", 64, 8192),
        tune_db.entry_key(DEVICE, RULES, "bf16", 128, 16384),
    ]
    assert len({base, *variants}) == len(variants) + 1
    with_kernel = omnigen.Rules.from_dict({**RULES.to_dict(), "kernel": {"head_dims": [128]}})
    assert tune_db.entry_key(DEVICE, with_kernel, "bf16", 128, 8192) == base


def _entry(bucket=8192, forward=TileConfig(128, 64, 4, 2), backward=TileConfig(128, 128, 8, 2), head_dim=128,
           dtype="bf16", space=("m128n64w4s2", "m128n128w8s2")):
    row = {"tile": "m128n64w4s2", "fwd_ms": 1.0, "bwd_ms": 3.0, "status": "ok", "default": True, "winner": "fwd"}
    return tune_db.make_entry(
        DEVICE, RULES, dtype, head_dim, bucket,
        forward={"tile": tune_db.tile_to_dict(forward), "ms": 1.0, "tflops": 300.0},
        backward={"tile": tune_db.tile_to_dict(backward), "ms": 2.7, "tflops": 250.0},
        default={"tile": tune_db.tile_to_dict(TileConfig(128, 64, 4, 2)), "fwd_ms": 1.0, "bwd_ms": 3.0},
        candidates=[row], space=list(space), workload={"layouts": tune_job.SYNTHETIC_WORKLOAD},
    )


def test_staleness():
    entry = _entry()
    assert tune_db.staleness(entry) is None
    assert "templates changed" in tune_db.staleness({**entry, "meta": {**entry["meta"], "templates": "0" * 16}})
    assert "omnigen 0.0.1" in tune_db.staleness({**entry, "meta": {**entry["meta"], "omnigen": "0.0.1"}})
    assert "format" in tune_db.staleness({**entry, "meta": {**entry["meta"], "format": 0}})
    assert tune_db.staleness({k: v for k, v in entry.items() if k != "meta"}) == "no metadata"
    assert "no forward winner" in tune_db.staleness({**entry, "forward": None})
    assert "unreadable" in tune_db.staleness({**entry, "backward": {"tile": {"block_m": "wide"}}})
    assert tune_db.staleness({**entry, "backward": None}) is None  # forward-only (head dim 256)


def test_database_round_trip_lookup_and_stale_entries_ignored(cache_dir):
    fresh = {tune_db.entry_key(DEVICE, RULES, "bf16", 128, b): _entry(b) for b in (4096, 16384)}
    stale_key = tune_db.entry_key(DEVICE, RULES, "bf16", 128, 1024)
    stale = _entry(1024, forward=TileConfig(64, 64, 4, 2))
    stale["meta"]["templates"] = "f" * 16
    other_gpu = tune_db.entry_key(tune_db.Device("Other", "9.0", "13.0.88"), RULES, "bf16", 128, 2048)
    path = cache.update_tuning_db({**fresh, stale_key: stale, other_gpu: _entry(2048)})
    assert path == cache_dir / "tuning.json" and json.loads(path.read_text())["format"] == 1
    found = tune_db.entries_for(DEVICE, RULES, "bf16", 128)
    assert sorted(found) == [4096, 16384]  # the stale entry and the other GPU's are not used
    choices = tune_db.lookup(DEVICE, RULES, "bf16", 128, "sm_90")
    assert choices[4096].forward == KernelConfig(128, "bf16", "sm_90", TileConfig(128, 64, 4, 2))
    assert choices[4096].backward.tile == TileConfig(128, 128, 8, 2)
    assert tune_db.nearest(choices, 1024) is choices[4096]  # below every tuned bucket: the nearest
    assert tune_db.nearest(choices, 10000) is choices[16384]  # 8192 is equally far from 4096 and 16384: up
    assert tune_db.nearest(choices, 5000) is choices[4096]
    assert tune_db.nearest({}, 4096) is None
    assert tune_db.lookup(DEVICE, RULES, "bf16", 64, "sm_90") == {}


def test_choices_skip_winners_that_cannot_be_built():
    entries = {1024: _entry(forward=TileConfig(128, 128, 8, 2)),  # 168 KB of shared memory: too big for sm_80
               2048: _entry(backward=TileConfig(64, 128, 4, 2)),  # sm_80: forward fits, backward does not
               4096: _entry(head_dim=256, forward=TileConfig(64, 32, 4, 2), backward=TileConfig(64, 32, 4, 2))}
    found = tune_db.choices({b: entries[b] for b in (1024, 2048)}, 128, "bf16", "sm_80")
    assert 1024 not in found
    assert found[2048].backward == found[2048].forward  # a backward winner without a backward kernel falls back
    assert tune_db.choices({4096: entries[4096]}, 256, "bf16", "sm_90")[4096].forward.tile == TileConfig(64, 32, 4, 2)


def test_corrupt_database_is_ignored_then_replaced(cache_dir):
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuning.json").write_text("{ not json")
    assert cache.read_tuning_db() == {}
    key = tune_db.entry_key(DEVICE, RULES, "bf16", 128, 4096)
    cache.update_tuning_db({key: _entry(4096)})
    assert list(cache.read_tuning_db()) == [key]
    assert not list(cache_dir.glob("tuning.json.*.tmp"))  # the temp file was moved into place


def test_concurrent_writers_keep_every_entry(cache_dir):
    keys = [tune_db.entry_key(DEVICE, RULES, "bf16", 64, 1 << (10 + i)) for i in range(8)]
    threads = [threading.Thread(target=cache.update_tuning_db, args=({key: _entry()},)) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(cache.read_tuning_db()) == sorted(keys)


def test_reuse_needs_every_bucket_fresh_with_the_same_space_and_layouts(cache_dir):
    job = tune.prepare(RULES, [64], ["bf16"], "sm_90", DEVICE, seq_lens=[2048, 4096], tokens=8192)
    space = job.spaces[0]
    assert sorted(job.layouts) == [2048, 4096] and [c.label for c in space.candidates] == space.labels
    entries = {job.key(space, b): _entry(b, head_dim=64, space=space.labels) for b in (2048, 4096)}
    for entry in entries.values():
        entry["workload"].update(tokens=8192, heads=tune_job.HEADS)
    assert tune.reusable(job, entries) == entries
    assert tune.reusable(job, {k: v for k, v in entries.items() if "S4096" not in k}) == {}
    changed = {k: {**v, "space": space.labels[:2]} for k, v in entries.items()}
    assert tune.reusable(job, changed) == {}  # the rules' tiles changed: tune again
    for change in ({"layouts": "file:abc"}, {"tokens": 32768}):
        other = {k: {**v, "workload": {**v["workload"], **change}} for k, v in entries.items()}
        assert tune.reusable(job, other) == {}


# ------------------------------------------------------------------------------------------------
# layouts


@pytest.mark.parametrize("name", ["transfusion", "three_modalities", "share_question", "causal_documents",
                                  "sliding_window"])
def test_synthetic_layouts_follow_the_rules(name):
    rules = omnigen.Rules.load(REPO / "examples" / "rules" / f"{name}.yaml")
    batch = tune_layouts.synthetic_batch(rules, 4096, tokens=16384)
    assert len(batch) == 4 and all(layout.seq_len == 4096 for layout in batch)
    assert batch == tune_layouts.synthetic_batch(rules, 4096, tokens=16384)  # deterministic
    for layout in batch:
        segments = layout.segments
        assert {s.modality for s in segments} <= set(rules.modality_names)
        for s in segments[:-1]:  # the last one is cut to fit
            modality = rules.modality(s.modality)
            if len(rules.modalities) == 1:
                assert tune_layouts.DOCUMENT_LENGTHS[0] <= s.length <= tune_layouts.DOCUMENT_LENGTHS[1]
            elif modality.causal:
                assert tune_layouts.CAUSAL_LENGTHS[0] <= s.length <= tune_layouts.CAUSAL_LENGTHS[1]
            else:
                assert s.length in tune_layouts.FULL_LENGTHS
    docs = {s.doc for s in batch[0].segments}
    assert (len(docs) > 1) == (len(rules.modalities) == 1)  # single-modality rules: packed documents
    if len(rules.modalities) > 1:  # modalities alternate in declared order
        names = [s.modality for s in batch[0].segments]
        assert names[: len(rules.modalities)] == list(rules.modality_names)


def test_layouts_file(tmp_path):
    path = tmp_path / "layouts.txt"
    path.write_text("# my training mix\n\ntext:40 image:256 text:24@1   # 320 tokens\ntext:300\ntext:1000 image:1024\n")
    layouts = tune_layouts.read_layouts_file(path, RULES)
    assert [layout.seq_len for layout in layouts] == [320, 300, 2024]
    buckets = tune_layouts.bucket_user_layouts(layouts, tokens=4096)
    assert sorted(buckets) == [256, 2048]
    assert len(buckets[256]) == 4096 // 320 and {layout.seq_len for layout in buckets[256]} == {320}  # padded
    assert buckets[256][1].segments[-1] == omnigen.Segment("pad", 20, 0)
    assert len(buckets[2048]) == 2


@pytest.mark.parametrize("text,fragment", [
    ("text:40\ntext:forty\n", ":2: cannot read layout segment 'text:forty'"),
    ("text:40 audio:10\n", ":1: modality 'audio' is not declared by the rules 'tunetest'"),
    ("# nothing\n\n", "no layouts found. Expected one layout per line"),
    ("text:0\n", ":1: segment 0 (text): length must be an integer >= 1"),
])
def test_bad_layouts_file_names_file_line_and_expectation(tmp_path, text, fragment):
    path = tmp_path / "mine.txt"
    path.write_text(text)
    with pytest.raises(tune_layouts.LayoutsFileError) as caught:
        tune_layouts.read_layouts_file(path, RULES)
    assert str(caught.value).startswith(str(path)) and fragment in str(caught.value)


# ------------------------------------------------------------------------------------------------
# timing order and picking


def test_round_robin_rotates_so_nobody_always_runs_first():
    names = ["a", "b", "c"]
    orders = [tune_timing.rotation(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {order[0] for order in orders} == set(names) and {order[-1] for order in orders} == set(names)


class _FakeClockGPU:
    """torch.cuda's events on a fake clock that each candidate's run advances by its duration (no GPU needed)."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def install(self, monkeypatch):
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = gpu.now

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.at - self.at

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(tune_timing, "flush_buffer", lambda device=None: torch.empty(4))

    def candidate(self, name: str, ms: float):
        def run():
            self.calls.append(name)
            self.now += ms
        return run


def test_settling_runs_each_candidate_untimed_before_its_timed_runs(monkeypatch):
    gpu = _FakeClockGPU()
    gpu.install(monkeypatch)
    functions = {"light": gpu.candidate("light", 10.0), "heavy": gpu.candidate("heavy", 40.0)}
    times = tune_timing.time_round_robin(functions, rounds=2, reps=3, warmup=1, settle_ms=100.0)
    assert times == {"light": [10.0] * 6, "heavy": [40.0] * 6}  # only the timed runs are in the result
    # warm-up (1 each), one run each to size the settling (100 ms: 10 light runs, 3 heavy), then per round
    # the settling runs right before the same candidate's timed runs, in the rotated order
    round_0 = ["light"] * (10 + 3) + ["heavy"] * (3 + 3)
    round_1 = ["heavy"] * (3 + 3) + ["light"] * (10 + 3)
    assert gpu.calls == ["light", "heavy", "light", "heavy"] + round_0 + round_1


def test_no_settling_by_default_times_right_after_the_previous_candidate(monkeypatch):
    gpu = _FakeClockGPU()
    gpu.install(monkeypatch)
    functions = {"a": gpu.candidate("a", 5.0), "b": gpu.candidate("b", 7.0)}
    times = tune_timing.time_round_robin(functions, rounds=2, reps=2, warmup=1)
    assert times == {"a": [5.0] * 4, "b": [7.0] * 4}
    assert gpu.calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"]


def test_a_candidate_must_beat_the_default_by_the_margin():
    assert tune_measurement._pick("d", {"d": 10.0, "x": 9.95}) == "d"  # within 1%: noise, keep the default
    assert tune_measurement._pick("d", {"d": 10.0, "x": 9.5}) == "x"
    assert tune_measurement._pick("d", {"d": float("inf"), "x": 12.0}) == "x"  # the default was disqualified
    assert tune_measurement._pick("d", {"x": float("inf")}) is None


# ------------------------------------------------------------------------------------------------
# building candidates: one ninja graph that keeps going


def test_failed_candidate_scores_infinity_and_the_rest_builds(cache_dir, tmp_path, monkeypatch):
    toolchain = fake_toolchain(tmp_path / "tools")
    job = tune.prepare(RULES, [64], ["bf16"], "sm_90", DEVICE, seq_lens=[1024])
    original = cache.variant

    def planting(rules, config, _toolchain=None):
        v = original(rules, config, toolchain)
        kernel = next(name for name in v.sources if name.endswith(".cu") and "backward" not in name)
        if config.tile == TileConfig(64, 64, 4, 2):
            v.sources[kernel] += "\n// PLANTED_FAILURE\n"
        if config.tile == TileConfig(128, 64, 4, 3):
            v.sources[kernel] += "\n// PLANTED_SPILL\n"
        return v

    monkeypatch.setattr(cache, "variant", planting)
    notes = tune.compile_candidates(job, toolchain, jobs=2)
    space = job.spaces[0]
    assert list(space.failed) == [KernelConfig(64, "bf16", "sm_90", TileConfig(64, 64, 4, 2))]
    assert "error: planted failure" in next(iter(space.failed.values()))
    assert len(space.candidates) == len(sm80_space.DEFAULT_SPACE[64]) - 1
    spilled = next(c for c in space.candidates if c.config.tile == TileConfig(128, 64, 4, 3))
    assert not spilled.forward and spilled.backward and notes == [f"{spilled.config.label}: {spilled.forward_problem}"]
    installed = list((cache_dir / "modules").iterdir())
    assert len(installed) == len(sm80_space.DEFAULT_SPACE[64]) - 1


# ------------------------------------------------------------------------------------------------
# dispatch


class _Module:
    def __init__(self, name):
        self.MODULE_NAME = name
        self.HAS_BACKWARD = True


def test_kernel_dispatches_per_bucket_and_plans_per_tile_shape(monkeypatch):
    default = KernelConfig(64, "bf16", "sm_90")
    wide = KernelConfig(64, "bf16", "sm_90", TileConfig(128, 128, 8, 2))
    deep = KernelConfig(64, "bf16", "sm_90", TileConfig(128, 64, 4, 3))
    tuned = {4096: tune_db.Choice(default, wide), 16384: tune_db.Choice(wide, wide)}
    kernel = ops.Kernel(RULES, default, _Module("default"), tuned=tuned)
    assert kernel.choice(4000) == tuned[4096] and kernel.choice(30000) == tuned[16384]
    assert ops.Kernel(RULES, default, _Module("default")).choice(4096) == tune_db.Choice(default, default)
    loaded = []
    monkeypatch.setattr(ops.cache, "get_module", lambda rules, config: loaded.append(config) or _Module(config.label))
    assert kernel.module_for(default).MODULE_NAME == "default" and kernel.module_for(wide).MODULE_NAME == wide.label
    kernel.module_for(wide)
    assert loaded == [wide]  # loaded once, then kept
    layout = omnigen.Layout.parse("text:100 image:256 text:50")
    p_default = kernel.plan(layout, 1, torch.device("cpu"))
    assert (p_default.block_m, p_default.block_n) == (128, 64)
    assert kernel.plan(layout, 1, torch.device("cpu"), deep.tile) is p_default  # same block shape: one plan
    p_wide = kernel.plan(layout, 1, torch.device("cpu"), wide.tile)
    assert (p_wide.block_m, p_wide.block_n) == (128, 128)


def test_build_tune_without_a_gpu_says_why(monkeypatch):
    monkeypatch.setattr(ops.toolchain, "visible_gpu_arch", lambda: None)
    with pytest.raises(RuntimeError, match="tune=True needs a CUDA GPU"):
        omnigen.build(RULES, head_dim=64, tune=True, arch="sm_80")
    with pytest.raises(ValueError, match="tune=True picks the tiles itself"):
        omnigen.build(RULES, head_dim=64, tune=True, arch="sm_80", tile=TileConfig(64, 64, 4, 2))


# ------------------------------------------------------------------------------------------------
# the command line without a GPU


def _no_gpu(monkeypatch, tmp_path):
    import omnigen.cli.build as cli_build

    toolchain = fake_toolchain(tmp_path / "tools")
    monkeypatch.setattr(cli_build, "visible_gpu_arch", lambda: None)
    monkeypatch.setattr(cli_build, "find_toolchain", lambda: toolchain)
    monkeypatch.setattr(cache, "find_toolchain", lambda: toolchain)


def test_cli_tune_without_a_gpu_builds_says_why_and_exits_0(cache_dir, tmp_path, monkeypatch):
    _no_gpu(monkeypatch, tmp_path)
    rules = str(REPO / "examples" / "rules" / "transfusion.yaml")
    result = CliRunner().invoke(cli, ["build", "--rules", rules, "--arch", "sm_80", "--tune"])
    assert result.exit_code == 0, result.output
    assert "2 built" in result.output
    assert "tuning skipped: no CUDA GPU is visible here" in result.output
    assert not (cache_dir / "tuning.json").exists()


def test_cli_bad_layouts_file_exits_2_with_file_and_line(cache_dir, tmp_path, monkeypatch):
    _no_gpu(monkeypatch, tmp_path)
    layouts = tmp_path / "layouts.txt"
    layouts.write_text("text:40 image:256\ntext:40 video:20\n")
    rules = str(REPO / "examples" / "rules" / "transfusion.yaml")
    result = CliRunner().invoke(cli, ["build", "--rules", rules, "--arch", "sm_80", "--tune", "--layouts", str(layouts)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())  # the message is wrapped at 100 columns
    assert f"{layouts}:2: modality 'video' is not declared" in said and "Traceback" not in said
    bad = CliRunner().invoke(cli, ["build", "--rules", rules, "--tune", "--seq-lens", "4k"])
    assert bad.exit_code == 2 and "--seq-lens must be whole numbers" in bad.output


def test_cache_list_shows_tuned_shapes_and_stale_ones(cache_dir):
    stale = _entry(1024)
    stale["meta"]["templates"] = "f" * 16
    cache.update_tuning_db({tune_db.entry_key(DEVICE, RULES, "bf16", 128, 8192): _entry(8192),
                            tune_db.entry_key(DEVICE, RULES, "bf16", 128, 1024): stale})
    runner = CliRunner()
    listed = runner.invoke(cli, ["cache", "list"])
    assert listed.exit_code == 0, listed.output
    assert "tuned shapes:" in listed.output and "NVIDIA Test GPU (sm 9.0)" in listed.output
    line = next(line for line in listed.output.splitlines() if " 8192 " in line)
    assert "m128n64w4s2 1.000 ms" in line and "m128n128w8s2 2.700 ms" in line and "1.00x / 1.11x" in line
    assert "stale: kernel templates changed" in listed.output and "2 tuned shape(s), 1 current, 1 stale" in listed.output
    cleared = runner.invoke(cli, ["cache", "clear"])
    assert cleared.exit_code == 0 and "2 tuned shape(s)" in cleared.output
    assert cache.read_tuning_db() == {}


def test_tuning_table_shows_candidates_winners_and_speedups():
    from omnigen.cli.build import _tuning_table

    entry = _entry(8192)
    entry["workload"].update(batch=4, seq_len=8192, heads=16, density=0.51)
    entry["candidates"] = [
        {"tile": "m128n64w4s2", "fwd_ms": 3.84, "bwd_ms": 13.0, "fwd_tflops": 291.0, "bwd_tflops": 215.0,
         "default": True, "winner": "fwd", "status": "ok"},
        {"tile": "m128n128w8s2", "fwd_ms": 4.03, "bwd_ms": 12.01, "fwd_tflops": 277.0, "bwd_tflops": 233.0,
         "default": False, "winner": "bwd", "status": "ok"},
        {"tile": "m64n64w4s2", "fwd_ms": None, "bwd_ms": None, "fwd_tflops": None, "bwd_tflops": None,
         "default": False, "winner": "", "status": "failed to compile: error: x"},
    ]
    entry["forward"]["ms"], entry["backward"]["ms"] = 3.84, 12.01
    entry["default"].update(fwd_ms=3.84, bwd_ms=13.0)
    text = _tuning_table(entry)
    assert "bf16 d128, S bucket 8192 (B=4 x S=8192, H=16, density 0.51" in text
    assert "m128n64w4s2 (default)" in text and "failed to compile: error: x" in text
    assert "forward m128n64w4s2 (1.00x vs default), backward m128n128w8s2 (1.08x vs default)" in text


# ------------------------------------------------------------------------------------------------
# measure() on the CPU: the orchestration (verify, cross-check, time, pick, write) with stand-ins for
# the kernels (float64 reference attention on the plan's tables) and for the GPU timer.


class _ReferenceModule:
    def __init__(self, config: KernelConfig, wrong: bool = False):
        self.MODULE_NAME = config.label
        self.HAS_BACKWARD = not kernels.backward_problems(config)
        self.BLOCK_M, self.BLOCK_N = config.tile.block_m, config.tile.block_n
        self.wrong = wrong


def _mask_of(p, rules):
    from omnigen.semantics import rule_tensors
    from omnigen.semantics import tile_predicate

    positions = torch.arange(p.seq_len)
    rule_t = rule_tensors(rules, positions.device)
    return torch.stack([tile_predicate(rules, p.tables, b, positions, positions, rule_t) for b in range(p.batch_size)])


def test_measure_verifies_times_picks_and_writes(cache_dir, monkeypatch):
    from omnigen.reference import attention_reference, attention_reference_grads

    rules = omnigen.Rules.from_dict({**RULES.to_dict(), "kernel": {"tiles": [
        {"block_m": 128, "block_n": 64, "warps": 4, "stages": 2}, {"block_m": 128, "block_n": 128, "warps": 8, "stages": 2},
        {"block_m": 64, "block_n": 64, "warps": 4, "stages": 2}, {"block_m": 128, "block_n": 64, "warps": 4, "stages": 3}]}})
    job = tune.prepare(rules, [64], ["bf16"], "sm_90", DEVICE, seq_lens=[256], tokens=512)
    monkeypatch.setattr(tune_measurement, "VERIFY_SEQ_LEN", 150)
    labels = [c.label for c in job.spaces[0].candidates]
    assert labels == ["m128n64w4s2", "m128n128w8s2", "m64n64w4s2", "m128n64w4s3"]
    # m64n64w4s2 is "fast and wrong" in its forward; the rest are exact
    monkeypatch.setattr(cache, "get_module", lambda r, config: _ReferenceModule(config, config.tile.block_m == 64))

    def forward_pass(module, p, q, k, v, scale):
        out, lse = attention_reference(q, k, v, _mask_of(p, rules), scale)
        if module.wrong:
            out = out * 0.5
        return out.to(q.dtype), lse.float()

    def backward_pass(module, p, q, k, v, out, lse, d_out, scale, deterministic=False):
        assert (p.block_m, p.block_n) == (module.BLOCK_M, module.BLOCK_N)  # planned with the module's tile
        return tuple(g.to(q.dtype) for g in attention_reference_grads(q, k, v, _mask_of(p, rules), d_out, scale))

    monkeypatch.setattr(kernel_launch, "forward_pass", forward_pass)
    monkeypatch.setattr(kernel_launch, "backward_pass", backward_pass)
    # Median times per (pass, label): the 128x128 tile wins the forward by 10%, the 3-stage one is within
    # the 1% margin of the default's backward (noise: the default keeps it).
    fake = {"fwd": {"m128n64w4s2": 10.0, "m128n128w8s2": 9.0, "m64n64w4s2": 1.0, "m128n64w4s3": 9.95},
            "bwd": {"m128n64w4s2": 30.0, "m128n128w8s2": 31.0, "m64n64w4s2": 40.0, "m128n64w4s3": 29.9}}
    calls = []

    def timer(functions, rounds, reps, warmup=0, on_round=None):
        kind = "bwd" if len(calls) % 2 else "fwd"
        calls.append(sorted(functions))
        for f in functions.values():
            f()
        for r in range(rounds):
            on_round(r)
        return {label: [fake[kind][label]] * (rounds * reps) for label in functions}

    monkeypatch.setattr(tune_timing, "time_round_robin", timer)
    steps = []
    entries = tune.measure(job, rounds=2, reps=1, on_step=steps.append, device="cpu")
    assert sum(steps) == tune.count_steps(job, 2)
    assert calls[0] == sorted(set(labels) - {"m64n64w4s2"}) and calls[1] == sorted(labels)  # wrong fwd: not timed
    (key, entry), = entries.items()
    assert key == tune_db.entry_key(DEVICE, rules, "bf16", 64, 256)
    assert cache.read_tuning_db() == entries
    assert entry["forward"]["tile"] == tune_db.tile_to_dict(TileConfig(128, 128, 8, 2)) and entry["forward"]["ms"] == 9.0
    assert entry["backward"]["tile"] == tune_db.tile_to_dict(TileConfig(128, 64, 4, 2))  # 29.9 vs 30.0: noise
    assert entry["default"] == {"tile": tune_db.tile_to_dict(TileConfig(128, 64, 4, 2)), "fwd_ms": 10.0, "bwd_ms": 30.0}
    rows = {row["tile"]: row for row in entry["candidates"]}
    assert rows["m64n64w4s2"]["fwd_ms"] is None and "wrong forward output vs float64" in rows["m64n64w4s2"]["status"]
    assert rows["m64n64w4s2"]["bwd_ms"] == 40.0  # its backward was right: timed
    assert rows["m128n128w8s2"]["winner"] == "fwd" and rows["m128n64w4s2"]["winner"] == "bwd"
    assert rows["m128n64w4s2"]["default"] and rows["m128n64w4s2"]["status"] == "ok"
    pairs = entry["workload"]["pairs"]
    assert rows["m128n64w4s2"]["fwd_tflops"] == round(4 * 64 * pairs * tune_job.HEADS / 10.0 / 1e9, 1)
    assert entry["workload"]["batch"] == 2 and entry["space"] == labels
    assert tune.reusable(job) == entries


def test_cli_tune_flow_builds_candidates_prints_tables_and_reuses(cache_dir, tmp_path, monkeypatch):
    """`omnigen build --tune` with a GPU, the GPU parts stood in for: one ninja graph for targets and
    candidates, a table per bucket, the database path; a second run reuses instead of timing."""
    import omnigen.cli.build as cli_build

    _no_gpu(monkeypatch, tmp_path)
    monkeypatch.setattr(cli_build, "visible_gpu_arch", lambda: "sm_90")
    monkeypatch.setattr(omnigen.jit.toolchain, "visible_gpu_arch", lambda: "sm_90")  # default_archs() asks it
    monkeypatch.setattr(tune_db.Device, "current", classmethod(lambda cls, device=None: DEVICE))
    measured = []

    def fake_measure(job, rounds, on_step):
        measured.append(job)
        on_step(tune.count_steps(job, rounds))
        entries = {}
        for space in job.spaces:
            for bucket in job.layouts:
                entry = _entry(bucket, head_dim=space.head_dim, space=space.labels)
                entry["workload"] = dict(job.workload)
                entries[job.key(space, bucket)] = entry
        cache.update_tuning_db(entries)
        return entries

    monkeypatch.setattr(tune, "measure", fake_measure)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.to_yaml() + "kernel:\n  head_dims: [64]\n")
    command = ["build", "--rules", str(rules), "--tune", "--seq-lens", "1000,4096"]
    first = CliRunner().invoke(cli, command)
    assert first.exit_code == 0, first.output
    count = len(sm80_space.DEFAULT_SPACE[64])
    assert f"{count} built" in first.output  # the default target is one of the candidates: built once
    assert len(measured) == 1 and sorted(measured[0].layouts) == [1024, 4096]
    assert first.output.count("bf16 d64, S bucket") == 2 and "m128n64w4s2 (default)" in first.output
    assert f"tuning results: {cache_dir / 'tuning.json'} (2 shape(s)" in first.output
    second = CliRunner().invoke(cli, command)
    assert second.exit_code == 0, second.output
    assert f"0 built, {count} from the cache" in second.output
    assert "tuning: reusing 2 tuned shape(s)" in second.output and len(measured) == 1
    assert second.output.count("bf16 d64, S bucket") == 2
    again = CliRunner().invoke(cli, command + ["--retune"])
    assert again.exit_code == 0 and len(measured) == 2
