"""The generated forward kernel against the float64 reference, on a GPU (skipped without one).

Every case builds the variant (cached in $OMNIGEN_CACHE_DIR), plans the layout on the GPU, calls the
module's raw-pointer `forward`, and compares out and lse with `attention_reference` in float64. The
error bound is twice what torch's SDPA with the dense boolean mask gets against the same reference
(same bf16/fp16 inputs), plus a small floor. Outputs are poisoned with NaN first, so a row the
kernel forgets to write fails.

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -m gpu tests/test_kernel_forward_gpu.py

The sm90 forward's persistent scheduling (the `persistent` option) has its own tests at the end (Hopper only):

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -s -m gpu tests/test_kernel_forward_gpu.py -k persistent
"""

from __future__ import annotations

import math

import pytest
import torch

import omnigen
from omnigen.jit import cache
from omnigen.kernels.launch import launch_forward
from omnigen.tune.timing import median_ms
from omnigen.jit.toolchain import visible_gpu_arch
from omnigen.kernels import FAMILIES
from omnigen.targets import ARCH_TABLE, KernelConfig, TileConfig
from omnigen.reference import attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from kernel_cases import (DTYPES, MIXED, SINK_LAYOUTS_8192, SINKS, TRANSFUSION, PlanWithBits,  # shared with the
                          with_options)  # other kernel test file

SHORT_SEGMENTS = " ".join(
    [f"{'text' if i % 2 == 0 else 'image'}:{2 + (5 * i) % 6}" for i in range(120)]
    + [f"{'image' if i % 3 == 0 else 'text'}:{9 + (7 * i) % 5}@1" for i in range(40)])

# (name, rules, layouts as strings, heads_q, heads_kv)
CASES = [
    ("one_token", TRANSFUSION, ["text:1"], 2, 2),
    ("s17", TRANSFUSION, ["text:5 image:12"], 2, 1),
    ("pad_and_docs", TRANSFUSION, ["text:30 pad:20 image:50 text:28@1 image:72@1 pad:8@1"], 4, 2),
    ("misaligned_images_1000", TRANSFUSION,
     ["text:37 image:256 text:101 image:256 text:50 image:300", "text:500 image:300@1 text:200@1"], 4, 1),
    ("all_pad_rows", TRANSFUSION, ["pad:150 text:50"], 1, 1),
    ("mixed_windows", MIXED, ["text:300 audio:170 image:130 text:77 image:64 audio:59"], 2, 2),
    # kv-tiles of 20-60 segments (the sm90 forward's pair path: more runs than kMaxRuns) and of 8-16 (its run
    # path at its limit), a document boundary among them
    ("short_segments", TRANSFUSION, [SHORT_SEGMENTS], 2, 2),
    ("short_segments_windows", MIXED, [SHORT_SEGMENTS.replace("image", "audio", 40)], 2, 1),
]


def _families() -> list[str]:
    """Every kernel family that builds for the visible GPU (sm80 everywhere, sm90 on Hopper too)."""
    arch = visible_gpu_arch() if torch.cuda.is_available() else None
    if arch is None:
        return ["sm80"]
    return [ARCH_TABLE[arch].family, *ARCH_TABLE[arch].other_families]


FAMILY_NAMES = _families()


def _config(head_dim: int, dtype: str, family: str) -> KernelConfig:
    arch = visible_gpu_arch()
    assert arch is not None, "this GPU's arch is not one omnigen builds for"
    return KernelConfig(head_dim=head_dim, dtype=dtype, arch=arch, tile=FAMILIES[family].default_tile(head_dim),
                        kernel_family=family)


def _module(rules: omnigen.Rules, head_dim: int, dtype: str, family: str = "sm80"):
    return cache.get_module(rules, _config(head_dim, dtype, family))


def _prebuild(variants: list[tuple[omnigen.Rules, int, str]]) -> None:
    """Compile every variant the tests need, for every family, as one parallel ninja graph."""
    built = [cache.variant(r, _config(d, t, family)) for r, d, t in variants for family in FAMILY_NAMES]
    cache.build_variants(built)


@pytest.fixture(scope="module", autouse=True)
def built_variants():
    needed = {(TRANSFUSION, 64, "bf16"), (TRANSFUSION, 128, "bf16"), (TRANSFUSION, 128, "fp16"),
              (MIXED, 128, "bf16"), (TRANSFUSION, 256, "bf16")}
    _prebuild(sorted(needed, key=lambda x: (x[0].name, x[1], x[2])))


def run_forward(module, rules, layout, q, k, v, scale=None, bits: str | None = None):
    """The forward through the library's own launcher, into NaN-poisoned outputs. `bits`: none (a bare plan: every
    partial tile evaluated in the kernel), "half" (bits for the first half of the partial tiles, as a mask whose
    capacity ran out) or "all"."""
    B, Hq, S, D = q.shape
    plan = omnigen.plan(rules, layout, block_m=module.BLOCK_M, block_n=module.BLOCK_N, device="cuda")
    if bits is not None:
        plan = PlanWithBits(rules, plan, bits)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, S), float("nan"), device=q.device, dtype=torch.float32)
    launch_forward(module, plan, q, k, v, o, lse, 1.0 / math.sqrt(D) if scale is None else scale)
    torch.cuda.synchronize()
    return o, lse


def _inputs(B, Hq, Hkv, S, D, dtype, strided):
    generator = torch.Generator(device="cuda").manual_seed(1234 + S + D)
    def make(H):
        if strided:  # [B, S, H, D] storage seen as [B, H, S, D]: SDPA's usual non-contiguous layout
            return torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=generator).transpose(1, 2)
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=generator)
    return make(Hq), make(Hkv), make(Hkv)


def _sdpa_error(q, k, v, mask, ref_out) -> float:
    """Max abs error of torch's SDPA (same low-precision inputs, dense mask) on rows that have a key."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    dense = (mask if mask.dim() == 3 else mask[None])[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=dense)
    has_key = dense.any(-1, keepdim=True).expand_as(ref_out)
    return float((out.double() - ref_out).abs()[has_key].max()) if has_key.any() else 0.0


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (128, "bf16"), (128, "fp16"), (256, "bf16")])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_reference(case, head_dim, dtype, family):
    name, rules, layout_texts, Hq, Hkv = case
    if rules is MIXED and (head_dim, dtype) != (128, "bf16"):
        pytest.skip("the mixed rules are built for one variant only")
    _check_forward(_module(rules, head_dim, dtype, family), rules, case, head_dim, dtype, family)


def _check_forward(module, rules: omnigen.Rules, case, head_dim: int, dtype: str, label: str,
                   bits: str | None = None) -> None:
    """The module's forward on the case against float64: out within 2x SDPA's error, lse, empty rows."""
    name, _, layout_texts, Hq, Hkv = case
    layouts = [omnigen.Layout.parse(t) for t in layout_texts]
    layout = layouts[0] if len(layouts) == 1 else omnigen.Layout.batch(layouts)
    B, S = len(layouts), layouts[0].seq_len
    q, k, v = _inputs(B, Hq, Hkv, S, head_dim, DTYPES[dtype], strided=(name == "pad_and_docs"))
    out, lse = run_forward(module, rules, layout, q, k, v, bits=bits)

    mask = rules.dense_mask(layout, device="cuda")
    mask3 = mask if mask.dim() == 3 else mask[None]
    ref_out, ref_lse = attention_reference(q, k, v, mask3)
    assert not torch.isnan(out).any(), "the kernel left NaN (unwritten or computed) in out"
    assert not torch.isnan(lse).any(), "the kernel left NaN in lse"

    empty_rows = ~mask3.any(-1)[:, None, :].expand(B, Hq, S)
    assert (out[empty_rows.unsqueeze(-1).expand_as(out)] == 0).all(), "rows with no key must be zeros"
    assert torch.isneginf(lse[empty_rows]).all(), "rows with no key must have lse = -inf"

    error = float((out.double() - ref_out).abs().max())
    sdpa = _sdpa_error(q, k, v, mask3, ref_out)
    floor = 2e-3 if dtype == "bf16" else 5e-4
    print(f"{label} {name} d{head_dim} {dtype}: max |out - ref| = {error:.2e}, SDPA dense-mask = {sdpa:.2e}")
    assert error <= 2 * sdpa + floor, f"out error {error:.3e} > 2 x SDPA's {sdpa:.3e} + {floor}"

    finite = ~empty_rows
    lse_error = float((lse.double() - ref_lse)[finite].abs().max()) if finite.any() else 0.0
    assert lse_error <= 1e-3, f"lse error {lse_error:.3e}"


def _check_sm90_options(case, head_dim: int, dtype: str, label: str, bits: str | None = None, **options) -> None:
    """_check_forward on an sm90 module built with these HopperOptions."""
    if "sm90" not in FAMILY_NAMES:
        pytest.skip("the sm90 family runs on Hopper only")
    name, rules, _, _, _ = case
    if rules is MIXED and (head_dim, dtype) != (128, "bf16"):
        pytest.skip("the mixed rules on one variant only")
    module = cache.get_module(rules, with_options(_config(head_dim, dtype, "sm90"), **options))
    _check_forward(module, rules, case, head_dim, dtype, label, bits=bits)


# ---- the sm90 forward reading partial tiles' masks as bits (omnigen.plan.bits, the partial_bits option): for half of
# the partial tiles (the rest evaluated in the same launch, as when a mask's capacity runs out) and for all.


@pytest.mark.parametrize("bits", ["half", "all"])
@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (128, "bf16"), (128, "fp16"), (256, "bf16")])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sm90_forward_reads_partial_bits(case, head_dim, dtype, bits):
    if "sm90" not in FAMILY_NAMES:
        pytest.skip("the sm90 family runs on Hopper only")
    name, rules, _, _, _ = case
    if rules is MIXED and (head_dim, dtype) != (128, "bf16"):
        pytest.skip("the mixed rules are built for one variant only")
    module = _module(rules, head_dim, dtype, "sm90")
    assert module.PARTIAL_BITS
    _check_forward(module, rules, case, head_dim, dtype, f"sm90 partial bits ({bits})", bits=bits)


# ---- the sm90 forward with the tables_always_shared option off (on by default): partial tiles whose key tables TMA
# can bring read them from shared memory, the others from global memory through a generic pointer. The cases' odd
# lengths, unaligned batch offsets and last kv-tiles take the global-memory branch.


@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (128, "bf16"), (128, "fp16"), (256, "bf16")])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sm90_forward_tables_option_off(case, head_dim, dtype):
    _check_sm90_options(case, head_dim, dtype, "sm90 tables from either memory", tables_always_shared=False)


# ---- the sm90 forward with ping-pong (the pingpong option, off by default): the consumer warpgroups take turns
# issuing their products, on the persistent grid (turns carried across work tiles) and on the grid of tiles; and
# softmax_chains other than the head dim's default (each row's max and sum in independent chains).


@pytest.mark.parametrize("options", [{"pingpong": True}, {"pingpong": True, "persistent": False},
                                     {"softmax_chains": 1}, {"softmax_chains": 4},
                                     {"softmax_chains": 2, "pingpong": True}],
                         ids=["pingpong", "pingpong-grid", "chains1", "chains4", "chains2-pingpong"])
@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (128, "bf16"), (128, "fp16")])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sm90_forward_pingpong_and_softmax_chains(case, head_dim, dtype, options):
    _check_sm90_options(case, head_dim, dtype, f"sm90 {options}", **options)


# ---- the sm90 forward's two ways to store O (the output_by_tma option: 1, the default, by TMA at d128 and at d256 in
# two rounds through half its boxes; 2 wherever a staging buffer fits, d64 too; 0 the stores): against float64 on both grids; then
# bit for bit against the stores with many tiles a CTA (the staging buffer reused), ragged last q-tiles (rows past the
# sequence dropped by the map: in [B, S, H, D] storage they would be the next batch element's).
OUTPUT_STORES = [(128, "bf16", {"output_by_tma": 0}), (128, "bf16", {"output_by_tma": 0, "persistent": False}),
                 (128, "bf16", {"persistent": False}), (128, "fp16", {"output_by_tma": 0}),
                 (128, "fp16", {"persistent": False}), (64, "bf16", {"output_by_tma": 2}),
                 (256, "bf16", {}), (256, "bf16", {"persistent": False}), (256, "bf16", {"output_by_tma": 0})]


@pytest.mark.parametrize("head_dim,dtype,options", OUTPUT_STORES,
                         ids=["d128-stores", "d128-stores-grid", "d128-tma-grid", "d128-fp16-stores",
                              "d128-fp16-tma-grid", "d64-tma", "d256-tma-rounds", "d256-tma-rounds-grid",
                              "d256-stores"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sm90_forward_output_by_tma(case, head_dim, dtype, options):
    _check_sm90_options(case, head_dim, dtype, f"sm90 {options}", **options)


@pytest.mark.parametrize("head_dim,dtype,persistent,mode", [(128, "bf16", True, 1), (128, "bf16", False, 1),
                                                            (128, "fp16", True, 1), (64, "fp16", True, 2),
                                                            (256, "bf16", True, 2), (256, "bf16", False, 2)],
                         ids=["d128-persistent", "d128-grid", "d128-fp16", "d64", "d256-rounds", "d256-rounds-grid"])
def test_sm90_forward_output_by_tma_gives_the_stores_bits(head_dim, dtype, persistent, mode):
    if "sm90" not in FAMILY_NAMES:
        pytest.skip("the sm90 family runs on Hopper only")
    config = _config(head_dim, dtype, "sm90")
    stores = cache.get_module(TRANSFUSION, with_options(config, persistent=persistent, output_by_tma=0))
    by_tma = cache.get_module(TRANSFUSION, with_options(config, persistent=persistent, output_by_tma=mode))
    layout = omnigen.Layout.batch([omnigen.Layout.parse(t) for t in PERSISTENT_LAYOUTS])
    q, k, v = _inputs(2, 16, 4, layout.seq_len, head_dim, DTYPES[dtype], strided=True)
    out, lse = run_forward(by_tma, TRANSFUSION, layout, q, k, v)
    expected, expected_lse = run_forward(stores, TRANSFUSION, layout, q, k, v)
    assert not torch.isnan(out).any(), "the kernel left NaN (unwritten or computed) in out"
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


def test_forward_rejects_bad_arguments():
    module = _module(TRANSFUSION, 128, "bf16")
    q, k, v = _inputs(1, 2, 2, 64, 128, torch.bfloat16, strided=False)
    layout = omnigen.Layout.parse("text:64")
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        plan = omnigen.plan(TRANSFUSION, layout, block_m=module.BLOCK_M, block_n=module.BLOCK_N, device="cuda")
        module.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr(), q.data_ptr(), *([0] * 12), 1, 3, 2, 64,
                       0.1, plan.fwd_ptr.data_ptr(), plan.fwd_kv.data_ptr(), *([plan.fwd_ptr.data_ptr()] * 3), 0)
    with pytest.raises(ValueError, match="aligned"):
        module.forward(q.data_ptr() + 2, k.data_ptr(), v.data_ptr(), q.data_ptr(), q.data_ptr(), *([0] * 12), 1, 2, 2,
                       64, 0.1, *([q.data_ptr()] * 5), 0)
    module.device_check()  # a GPU is here: no error


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_forward_speed_report(family):
    """Not a benchmark (benchmarks/ has those): one rough figure per run, printed."""
    module = _module(TRANSFUSION, 128, "bf16", family)
    segments = []
    while sum(n for _, n in segments) < 8192 - 512:
        segments += [("text", 200), ("image", 256)]
    total = sum(n for _, n in segments)
    segments.append(("text", 8192 - total))
    layout = omnigen.Layout.from_segments(segments)
    B, H, S, D = 4, 16, 8192, 128
    q, k, v = _inputs(B, H, H, S, D, torch.bfloat16, strided=False)
    batch = omnigen.Layout.batch([layout] * B)
    plan = omnigen.plan(TRANSFUSION, batch, block_m=module.BLOCK_M, block_n=module.BLOCK_N, device="cuda")
    o = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
    scale = 1 / math.sqrt(D)

    def timed(fn):
        return median_ms(fn) / 1e3  # seconds
    ours = timed(lambda: launch_forward(module, plan, q, k, v, o, lse, scale))
    causal = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    flops = 4 * D * plan.allowed_pairs * H
    print(f"{family} transfusion S=8192 B=4 H=16 D=128: omnigen {ours * 1e3:.2f} ms ({flops / ours / 1e12:.0f} TFLOP/s effective, "
          f"density {plan.density:.2f}); SDPA causal {causal * 1e3:.2f} ms "
          f"({4 * D * B * H * S * (S + 1) / 2 / causal / 1e12:.0f} TFLOP/s)")


# ---- the sm90 forward's persistent mode (the `persistent` option, on by default): min(SMs, work tiles)
# CTAs, each walking (q-tile, batch, head) tiles with its barrier phases running on across them. Both
# schedulings take the tiles in TileOrder's L2 sections; with a 50 MB L2 these layouts cut them short: at d128
# 16 query heads on 4 kv heads make sections of 28 (batch, head) pairs of 32, at d256 of 12 (12, 12, 8).

# B = 2, S = 8269: 65 q-tiles per sequence (the last one 77 rows), 2 x 16 x 65 = 2080 work tiles, about 16
# per SM. Element 0 starts with pad (its first q-tiles are empty rows at the end of the order), element 1
# ends with 2300 pad tokens (its last 18 q-tiles: empty rows among the first tiles every CTA takes);
# documents and images give full, causal and partial kv-tiles.
PERSISTENT_LAYOUTS = [
    "pad:300 text:2000 image:1024 text:1500 image:256 text:3189",
    "text:3000 image:1024@1 text:1900@1 image:45@1 pad:2300@1",
]


def _sm90_config(head_dim: int, dtype: str, block_n: int | None, persistent: bool) -> KernelConfig:
    """An sm90 variant with the scheduling pinned (the default tile unless block_n is given)."""
    config = _config(head_dim, dtype, "sm90")
    if block_n is not None:
        config = KernelConfig(head_dim, dtype, config.arch, TileConfig(128, block_n, 12, 2), kernel_family="sm90")
    return with_options(config, persistent=persistent)


def _sm90_module(rules: omnigen.Rules, head_dim: int, dtype: str, block_n: int | None, persistent: bool):
    return rules, cache.get_module(rules, _sm90_config(head_dim, dtype, block_n, persistent))


# (rules, head_dim, dtype, block_n or None for the default tile, persistent)
MANY_TILES = [(TRANSFUSION, 128, "bf16", None, True), (TRANSFUSION, 128, "bf16", None, False),
              (TRANSFUSION, 64, "fp16", 176, True), (TRANSFUSION, 256, "bf16", None, True)]


@pytest.fixture(scope="module")
def persistent_variants():
    """The persistent tests' modules, compiled as one parallel ninja graph."""
    if "sm90" not in FAMILY_NAMES:
        return
    needed = [*MANY_TILES, (MIXED, 128, "bf16", None, True)]
    cache.build_variants([cache.variant(rules, _sm90_config(head_dim, dtype, block_n, persistent))
                          for rules, head_dim, dtype, block_n, persistent in needed])


def _check_sliced(rules, layout, q, k, v, out, lse, dtype) -> None:
    """Against the float64 reference one (batch element, head) at a time (a [B, H, S, S] float64 reference
    at S = 8K would not fit), with the bounds of test_forward_matches_reference."""
    assert not torch.isnan(out).any(), "the kernel left NaN (unwritten or computed) in out"
    assert not torch.isnan(lse).any(), "the kernel left NaN in lse"
    mask = rules.dense_mask(layout, device="cuda")
    mask3 = mask if mask.dim() == 3 else mask[None]
    B, Hq = q.shape[:2]
    group = Hq // k.shape[1]
    error = sdpa = lse_error = 0.0
    for b in range(B):
        rows_mask = mask3[b if mask3.shape[0] > 1 else 0][None]
        empty_rows = ~rows_mask[0].any(-1)
        for h in range(Hq):
            hk = h // group
            qs, ks, vs = q[b:b + 1, h:h + 1], k[b:b + 1, hk:hk + 1], v[b:b + 1, hk:hk + 1]
            ref_out, ref_lse = attention_reference(qs, ks, vs, rows_mask)
            o, l = out[b, h], lse[b, h]
            assert (o[empty_rows] == 0).all(), f"rows with no key must be zeros (batch {b}, head {h})"
            assert torch.isneginf(l[empty_rows]).all(), f"rows with no key must have lse = -inf (batch {b}, head {h})"
            error = max(error, float((o.double() - ref_out[0, 0]).abs().max()))
            sdpa = max(sdpa, _sdpa_error(qs, ks, vs, rows_mask, ref_out))
            if (~empty_rows).any():
                lse_error = max(lse_error, float((l.double() - ref_lse[0, 0])[~empty_rows].abs().max()))
    floor = 2e-3 if dtype == "bf16" else 5e-4
    print(f"max |out - ref| = {error:.2e}, SDPA dense-mask = {sdpa:.2e}, lse {lse_error:.2e}")
    assert error <= 2 * sdpa + floor, f"out error {error:.3e} > 2 x SDPA's {sdpa:.3e} + {floor}"
    assert lse_error <= 1e-3, f"lse error {lse_error:.3e}"


needs_sm90 = pytest.mark.skipif("sm90" not in FAMILY_NAMES, reason="needs a Hopper GPU (the sm90 family)")


@needs_sm90
@pytest.mark.parametrize("variant", MANY_TILES, ids=lambda v: f"d{v[1]}-{v[2]}-n{v[3] or 'default'}-{'persistent' if v[4] else 'grid'}")
def test_sm90_persistent_forward_many_tiles_per_sm(variant, persistent_variants):
    """More work tiles than SMs, ragged last q-tile, empty schedule rows, GQA (16 query heads on 4)."""
    assert torch.cuda.get_device_properties(0).multi_processor_count < 2 * 16 * 65
    _, head_dim, dtype, block_n, persistent = variant
    rules, module = _sm90_module(TRANSFUSION, head_dim, dtype, block_n, persistent)
    layout = omnigen.Layout.batch([omnigen.Layout.parse(t) for t in PERSISTENT_LAYOUTS])
    q, k, v = _inputs(2, 16, 4, layout.seq_len, head_dim, DTYPES[dtype], strided=False)
    out, lse = run_forward(module, rules, layout, q, k, v)
    _check_sliced(rules, layout, q, k, v, out, lse, dtype)
    # Again: the same bits (which CTA takes a tile changes from run to run, what the tile computes does not;
    # the counter is fresh per launch).
    again, again_lse = run_forward(module, rules, layout, q, k, v)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


@needs_sm90
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sm90_persistent_forward_fewer_tiles_than_sms(case, persistent_variants):
    """The small cases of test_forward_matches_reference, persistent: a grid of as many CTAs as tiles."""
    name, rules, layout_texts, Hq, Hkv = case
    named, module = _sm90_module(rules, 128, "bf16", None, True)
    layouts = [omnigen.Layout.parse(t) for t in layout_texts]
    layout = layouts[0] if len(layouts) == 1 else omnigen.Layout.batch(layouts)
    q, k, v = _inputs(len(layouts), Hq, Hkv, layouts[0].seq_len, 128, torch.bfloat16, strided=(name == "pad_and_docs"))
    out, lse = run_forward(module, named, layout, q, k, v)
    _check_sliced(named, layout, q, k, v, out, lse, "bf16")


# ---- the tile order's options: every pair's first q-tiles first where the plan's first rows are long
# (leading_q_tiles, at most 2 by default), sections sized so that the last one is not a sliver (balanced_sections, on).
# Which CTA takes a work tile changes, what the tile computes does not, so the output is the default module's bit for
# bit; the many-tile layouts (8K tokens, 2 x 16 heads: more tiles than SMs, several sections), both grids, and
# attention sinks, whose first two rows lead.


@pytest.mark.parametrize("head_dim,persistent,options", [
    (128, True, {"leading_q_tiles": 0}), (128, False, {"leading_q_tiles": 1}), (128, True, {"leading_q_tiles": 3}),
    (64, True, {"leading_q_tiles": 1}), (256, True, {"leading_q_tiles": 0}), (256, False, {"leading_q_tiles": 3}),
    (128, True, {"balanced_sections": False}), (128, False, {"balanced_sections": False}),
    (64, True, {"balanced_sections": False, "leading_q_tiles": 0}),
], ids=["d128-lead0", "d128-grid-lead1", "d128-lead3", "d64-lead1", "d256-lead0", "d256-grid-lead3", "d128-unbalanced",
        "d128-grid-unbalanced", "d64-unbalanced-lead0"])
@pytest.mark.parametrize("rules,layout_texts", [(TRANSFUSION, PERSISTENT_LAYOUTS), (SINKS, SINK_LAYOUTS_8192)],
                         ids=["transfusion", "sinks"])
def test_sm90_forward_tile_order_options_give_the_default_bits(head_dim, persistent, options, rules, layout_texts):
    if "sm90" not in FAMILY_NAMES:
        pytest.skip("the sm90 family runs on Hopper only")
    config = _config(head_dim, "bf16", "sm90")
    default = cache.get_module(rules, with_options(config, persistent=persistent))
    ordered = cache.get_module(rules, with_options(config, persistent=persistent, **options))
    layout = omnigen.Layout.batch([omnigen.Layout.parse(t) for t in layout_texts])
    q, k, v = _inputs(2, 16, 4, layout.seq_len, head_dim, torch.bfloat16, strided=True)
    out, lse = run_forward(ordered, rules, layout, q, k, v)
    expected, expected_lse = run_forward(default, rules, layout, q, k, v)
    assert not torch.isnan(out).any(), "the kernel left NaN (unwritten or computed) in out"
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


# ---- folded tile boundaries (the fold_tiles option): the next tile's first step issued beside this tile's last P V,
# Q in two buffers, O staged in the finished tile's Q rows (with O by TMA). Per tile the arithmetic is the default's, in
# the same order, so the output is the default module's bit for bit: many tiles per SM with empty schedule rows (pad),
# short documents (tiles of one or two kv-steps, where the fold meets the next fold), the small cases (fewer tiles than
# SMs, a tile of all-pad rows), with and without O by TMA.
SHORT_DOCUMENTS = " ".join(f"text:{30 + (37 * i) % 220}@{i}" for i in range(60))
FOLD_LAYOUTS = {
    "many_tiles": PERSISTENT_LAYOUTS,
    "short_documents": [SHORT_DOCUMENTS, SHORT_DOCUMENTS.replace("text:30@0", "pad:30@0")],
    "small": ["text:30 pad:20 image:50 text:28@1 image:72@1 pad:8@1"],
}


@pytest.mark.parametrize("head_dim,options", [
    (128, {}), (128, {"output_by_tma": 0}), (64, {}), (64, {"output_by_tma": 2}), (128, {"pingpong": True}),
], ids=["d128-o-in-q", "d128-o-stored", "d64-o-stored", "d64-o-in-q", "d128-pingpong"])
@pytest.mark.parametrize("layouts", sorted(FOLD_LAYOUTS))
@pytest.mark.parametrize("rules", [TRANSFUSION, MIXED], ids=["transfusion", "mixed"])
def test_sm90_folded_tile_boundaries_give_the_default_bits(head_dim, options, layouts, rules):
    if "sm90" not in FAMILY_NAMES:
        pytest.skip("the sm90 family runs on Hopper only")
    config = _config(head_dim, "bf16", "sm90")
    default = cache.get_module(rules, with_options(config, **options))
    folded = cache.get_module(rules, with_options(config, fold_tiles=True, **options))
    texts = FOLD_LAYOUTS[layouts]
    layout = omnigen.Layout.batch([omnigen.Layout.parse(t) for t in texts]) if len(texts) > 1 else omnigen.Layout.parse(texts[0])
    q, k, v = _inputs(len(texts), 16, 4, layout.seq_len, head_dim, torch.bfloat16, strided=True)
    out, lse = run_forward(folded, rules, layout, q, k, v)
    expected, expected_lse = run_forward(default, rules, layout, q, k, v)
    assert not torch.isnan(out).any(), "the kernel left NaN (unwritten or computed) in out"
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    if layouts == "short_documents" and not options:  # a layout no other test runs: the float64 reference once
        _check_sliced(rules, layout, q, k, v, out, lse, "bf16")
