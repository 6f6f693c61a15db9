"""The sm90 (Hopper) kernel family without a GPU: its resource model, candidate space, rendered source and
the registry that gives it sm_90a. Compiling it for sm_90a with the real nvcc is in test_toolchain.py."""

from __future__ import annotations

import pytest

import omnigen
from omnigen import kernels
from omnigen.kernels import registry
from omnigen.jit import codegen
from omnigen.kernels.sm90 import resources, space
from omnigen.kernels.sm90.options import HopperOptions
from omnigen.targets import ARCH_TABLE, KernelConfig, TileConfig
from omnigen.tune import space as tune_space

RULES = omnigen.Rules(name="hopper", modalities={"text": "causal", "image": "full"})


def hopper(head_dim: int, tile: TileConfig | None = None, **options) -> KernelConfig:
    """An sm_90a variant (the default tile unless given) with these HopperOptions."""
    return KernelConfig(head_dim, "bf16", "sm_90a", tile or resources.default_tile(head_dim),
                        options=HopperOptions(**options))


def test_options_are_part_of_the_variant():
    """Options equal to the defaults are no options (one spelling, one module); others rename the module and say
    so in the label and the config dict; another family's options, or values out of range, are problems."""
    assert hopper(128).options is None and hopper(128, persistent=True) == hopper(128)
    assert codegen.module_name(RULES, hopper(128, persistent=True)) == codegen.module_name(RULES, hopper(128))
    changed = hopper(128, persistent=False, ordered_section_pairs=16)
    assert changed.label == "bf16_d128_m128n128w12s2_sm_90a_persistent0_ordered_section_pairs16"
    assert changed.as_dict()["options"] == {"persistent": False, "ordered_section_pairs": 16}
    assert codegen.module_name(RULES, changed) != codegen.module_name(RULES, hopper(128))
    assert len({hopper(128, persistent=False), hopper(128, persistent=False), hopper(128)}) == 2  # hashable
    sm80 = KernelConfig(128, "bf16", "sm_80", options=HopperOptions(persistent=False))
    assert any("takes KernelOptions, not HopperOptions" in p for p in kernels.problems(sm80))
    assert any("atomic_section_pairs must be an integer >= 0" in p
               for p in kernels.problems(hopper(128, atomic_section_pairs=-1)))
    assert any("backward_stages" in p for p in kernels.backward_problems(hopper(128, backward_stages=1)))
    assert any("leading_q_tiles must be an integer >= 0" in p for p in kernels.problems(hopper(128, leading_q_tiles=-1)))
    assert any("leading_kv_tiles must be an integer >= 0" in p for p in kernels.problems(hopper(128, leading_kv_tiles=1.5)))
    assert not kernels.problems(hopper(128, leading_kv_tiles=0, leading_q_tiles=1, balanced_sections=False,
                                       bits_slot_in_tables=True))
    assert not kernels.problems(hopper(64, atomic_section_pairs=0, ordered_section_pairs=0))  # leading: no effect there


def test_sm_90a_is_served_by_sm90_with_sm80_as_fallback():
    assert ARCH_TABLE["sm_90a"].family == "sm90" and "sm80" in ARCH_TABLE["sm_90a"].other_families
    assert kernels.family_of("sm_90a").name == "sm90"
    assert kernels.family_of(KernelConfig(128, "bf16", "sm_90a", TileConfig(128, 64, 4, 2), kernel_family="sm80")).name == "sm80"
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):
        assert kernels.family_of(arch).name == "sm80"


def test_a_family_that_does_not_build_for_the_arch_is_refused():
    config = KernelConfig(128, "bf16", "sm_80", TileConfig(128, 128, 12, 2), kernel_family="sm90")
    assert any("does not build for sm_80" in p for p in kernels.problems(config))
    with pytest.raises(ValueError, match="cannot be built"):
        kernels.check(config)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_candidate_fits_and_the_default_comes_first(head_dim):
    candidates, pruned = tune_space.candidate_space(RULES, head_dim, "bf16", "sm_90a")
    assert not pruned, pruned
    assert candidates[0].config.tile == resources.default_tile(head_dim)
    assert {c.config.tile for c in candidates} == set(space.DEFAULT_SPACE[head_dim])
    for candidate in candidates:
        assert candidate.config.family == "sm90"
        assert resources.Resources(candidate.config).shared_memory_bytes <= ARCH_TABLE["sm_90a"].shared_memory


@pytest.mark.parametrize("tile,words", [
    (TileConfig(64, 128, 12, 2), "block_m must be 128"),
    (TileConfig(128, 128, 8, 2), "warps must be 12"),
    (TileConfig(128, 120, 12, 2), "multiple of 16"),
    (TileConfig(128, 128, 12, 1), "stages must be at least 2"),
    (TileConfig(128, 256, 12, 2), "registers per consumer thread"),
    (TileConfig(128, 160, 12, 3), "shared memory"),
])
def test_tiles_the_hopper_forward_cannot_take_say_why(tile, words):
    problems = kernels.problems(KernelConfig(128, "bf16", "sm_90a", tile))
    assert any(words in p for p in problems), problems


def test_a_module_holds_its_own_familys_kernels_only():
    """No sm80 code in an sm90 module: a tile the Hopper backward does not take is a forward-only variant (the
    registry gives an untuned kernel another variant's backward, a module of its own), and nothing in the family
    reaches into the sm80 family's folder."""
    config = KernelConfig(128, "bf16", "sm_90a", TileConfig(128, 128, 12, 2))
    assert not kernels.backward_problems(config)
    wide = KernelConfig(128, "bf16", "sm_90a", TileConfig(128, 160, 12, 2))
    assert any("takes block_n 128" in p for p in kernels.backward_problems(wide))  # a forward-only candidate
    # d256: the Hopper backward (split columns) at block_n 64
    assert not kernels.backward_problems(KernelConfig(256, "bf16", "sm_90a", resources.default_tile(256)))
    family = kernels.FAMILIES["sm90"]
    assert all("sm80" not in str(d) for d in (*family.template_dirs, *family.include_dirs))
    sources = codegen.render(RULES, wide)
    for text in sources.values():
        assert "omnigen/sm80/" not in text and "dkdv_kernel(const" not in text and "dq_kernel(const" not in text


@pytest.mark.parametrize("head_dim,block_n,dtype", [(64, 176, "bf16"), (128, 128, "fp16"), (256, 64, "bf16")])
def test_rendered_forward_reads_like_the_plan(head_dim, block_n, dtype):
    config = KernelConfig(head_dim, dtype, "sm_90a", TileConfig(128, block_n, 12, 2))
    files = codegen.render(RULES, config)
    forward = files[codegen.source_names(RULES, config)["kernel"]]
    wgmma = "f16" if dtype == "fp16" else "bf16"
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.{wgmma}.{wgmma}" in forward  # S = Q K^T
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.{wgmma}.{wgmma}" in forward  # O += P V
    for text in ("sm90::load_box", "sm90::grow_registers", "TileKind::kFull", "TileKind::kCausal", "TileKind::kPartial",
                 f"static_assert(sizeof(SharedStorage) == {resources.Resources(config).shared_storage_bytes}",
                 "#include \"" + codegen.source_names(RULES, config)["shared"] + "\""):
        assert text in forward, text
    assert "#define" not in forward
    binding = files[codegen.source_names(RULES, config)["binding"]]
    assert 'm.attr("THREADS") = 384;' in binding


def test_an_sm90_edit_renames_no_sm80_module(monkeypatch):
    sm80 = KernelConfig(128, "bf16", "sm_80")
    sm90 = KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128))
    before = codegen.module_name(RULES, sm80), codegen.module_name(RULES, sm90)
    original = codegen.template_files()
    edited = tuple((n, d + b"\n// edit" if n == "sm90/templates/forward.cu.j2" else d) for n, d in original)
    monkeypatch.setattr(codegen, "template_files", lambda: edited)
    assert codegen.module_name(RULES, sm80) == before[0]
    assert codegen.module_name(RULES, sm90) != before[1]


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_scheduling_is_an_option(persistent):
    """The persistent option renders kPersistent (min(SMs, tiles) CTAs taking work tiles from a counter) and the
    binding's PERSISTENT_FORWARD (the caller must pass the zeroed counter); the shared memory holds the Q-empty
    barrier and the tile slots either way, so the resource model does not depend on it."""
    config = hopper(128, persistent=persistent)
    sources, names = codegen.render(RULES, config), codegen.source_names(RULES, config)
    forward, binding = sources[names["kernel"]], sources[names["binding"]]
    assert f"constexpr bool kPersistent = {'true' if persistent else 'false'};" in forward
    assert f"constexpr bool kPersistentForward = {'true' if persistent else 'false'};" in binding
    for text in ("uint64_t q_empty[kQBuffers];", "HandedTile next_tile[2];", "atomicAdd(args.tile_counter, 1)",
                 "cudaDevAttrMultiProcessorCount", "cudaDevAttrL2CacheSize",
                 f"static_assert(sizeof(SharedStorage) == {resources.Resources(config).shared_storage_bytes}"):
        assert text in forward, text


@pytest.mark.parametrize("head_dim,block_n,hopper",
                         [(128, 128, True), (64, 128, True), (128, 96, False), (256, 64, True)])
def test_the_hopper_backward_takes_128_keys_at_d64_d128_and_64_at_d256(head_dim, block_n, hopper):
    config = KernelConfig(head_dim, "bf16", "sm_90a", TileConfig(128, block_n, 12, 2))
    problems = resources.Resources(config).backward_problems()
    assert (not problems) == hopper
    if not hopper:
        assert any(word in " ".join(problems) for word in ("head dims", "block_n", "split_columns"))
    sources = codegen.render(RULES, config)
    backward = sources[codegen.source_names(RULES, config)["backward"]]
    assert ("hopper_dkdv_kernel" in backward) == hopper
    # Delta and the launch entry points either way; without the kernel, backward_launch says why.
    assert "int backward_launch(" in backward and "launch_delta<__nv_bfloat16" in backward
    binding = sources[codegen.source_names(RULES, config)["binding"]]
    assert f"constexpr bool kHasBackward = {'true' if hopper else 'false'};" in binding
    if hopper:  # its shared memory figure is the resource model's, and fits the GPU
        assert f"sizeof(SharedStorage) == {resources.Resources(config).hopper_shared_storage_bytes}" in backward
        assert resources.Resources(config).hopper_shared_storage_bytes + 1024 <= ARCH_TABLE["sm_90a"].shared_memory


@pytest.mark.parametrize("split", [False, True])
def test_d256_trains_on_the_hopper_backward_with_split_columns(split):
    """d256: the CTA's 64 keys in both warpgroups, each holding dK/dV for half the head dims, dQ by atomics.
    On by default; with the split_columns option off the module has no d256 backward and says why."""
    config = hopper(256, split_columns=split)
    r = resources.Resources(config)
    assert r.hopper_split_columns
    assert (not r.backward_problems()) == split
    assert kernels.backward_problems(config) == r.backward_problems()
    sources = codegen.render(RULES, config)
    names = codegen.source_names(RULES, config)
    backward, binding = sources[names["backward"]], sources[names["binding"]]
    assert f"constexpr bool kHasBackward = {'true' if split else 'false'};" in binding
    if not split:
        assert "hopper_dkdv_kernel" not in backward and "split_columns=False" in binding
        return
    assert kernels.default_backward(config) == config
    assert r.hopper_shared_storage_bytes + 1024 <= ARCH_TABLE["sm_90a"].shared_memory
    assert f"sizeof(SharedStorage) == {r.hopper_shared_storage_bytes}" in backward
    # dK and dV of 128 head dims per warpgroup: 64 accumulator registers a thread, as at d128.
    for text in ("constexpr bool kSplitColumns = true;", "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                 "void wgmma_key_gradient(float (&d)[64]", "wgmma_key_gradient(gradient", "omnigen::atomic_add_pair(",
                 "CUtensorMap q, k, v, d_o;"):
        assert text in backward, text
    # No TMA staging of dQ (no room beside K, V and two stages of Q and dO), so no ordered dQ either: deterministic
    # mode says so instead of running anything. (The staging's code is there, behind kDqByTma; no sm80 kernel.)
    for text in ("constexpr bool kDqByTma = !kSplitColumns;", "constexpr bool kOrderedDq = false;",
                 "constexpr bool kDqWriter = false;"):
        assert text in backward, text
    assert "dkdv_kernel(const BackwardArgs" not in backward
    assert "has no deterministic backward: the head_dim 256 Hopper backward (split columns) adds dQ by" in backward


def test_split_columns_leave_the_128_key_kernel_alone():
    config = hopper(128, split_columns=True)
    backward = codegen.render(RULES, config)[codegen.source_names(RULES, config)["backward"]]
    assert "constexpr bool kSplitColumns = false;" in backward and "void wgmma_key_gradient(float (&d)[64]" in backward


@pytest.mark.parametrize("ordered", [False, True])
def test_ordered_dq_is_deterministic_modes_own_kernel_instance(ordered):
    """The ordered_dq option: deterministic mode runs hopper_dkdv_kernel<true> (a writer warp adds dQ in kv-tile
    order); off, the module has no deterministic mode and says so. The atomic-order instance is the same code either
    way."""
    config = hopper(128, ordered_dq=ordered)
    assert resources.Resources(config).hopper_ordered_dq == ordered
    sources = codegen.render(RULES, config)
    names = codegen.source_names(RULES, config)
    backward, binding = sources[names["backward"]], sources[names["binding"]]
    assert f"constexpr bool kOrderedDq = {'true' if ordered else 'false'};" in binding
    assert f"constexpr bool kOrderedDq = {'true' if ordered else 'false'};" in backward
    # (the ordered instance is built only where kOrderedDq is true: its launch and limit are behind if constexpr)
    assert "if constexpr (kOrderedDq)" in backward and "launch_instance<true>(" in backward
    assert ("ordered dQ off (ordered_dq=False)" in backward) == (not ordered)
    # The writer warp: deterministic mode's (kOrdered), or atomic order's with the dq_writer option.
    assert "constexpr bool kDqWriter = true;" in backward and "if constexpr (kOrdered || kDqWriter)" in backward
    # Not with split columns: their dQ goes by per-thread atomics, which no counter orders.
    assert not resources.Resources(hopper(256)).hopper_ordered_dq


def test_gqa_dk_dv_are_added_per_group_or_written_per_query_head():
    """GQA in the Hopper backward: one CTA per query head (a CTA walking its group's heads measured slower: RESULTS.md,
    "Kernel options removed (issue 27)"). In atomic mode each head's dK/dV are added into its group's fp32 rows
    (dkdv_group, GROUP_DKDV), by a shift (groups of a power of two: a division spilled at d128); else fp32 partials
    per query head that the caller sums."""
    config = hopper(128)
    sources = codegen.render(RULES, config)
    names = codegen.source_names(RULES, config)
    backward, binding = sources[names["backward"]], sources[names["binding"]]
    assert "const bool partials = args.heads_q != args.heads_kv;" in backward
    assert "head >> (31 - __clz(group))" in backward and "omnigen::atomic_add_pair(static_cast<float*>(args.dk)" in backward
    assert "constexpr bool kGroupDkdv = true;" in binding and 'm.attr("GROUP_DKDV") = kGroupDkdv;' in binding
    assert "(dkdv_group & (dkdv_group - 1)) == 0" in binding  # powers of two only, atomic mode only
    sm80 = KernelConfig(128, "bf16", "sm_80", TileConfig(128, 64, 4, 2))
    sm80_binding = codegen.render(RULES, sm80)[codegen.source_names(RULES, sm80)["binding"]]
    assert "constexpr bool kGroupDkdv = false;" in sm80_binding


def test_an_untuned_kernel_trains_with_the_hopper_backward_where_it_can():
    default = KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128))
    assert kernels.default_backward(default) == default
    wide = KernelConfig(64, "bf16", "sm_90a", TileConfig(128, 176, 12, 2))
    assert kernels.default_backward(wide) == KernelConfig(64, "bf16", "sm_90a", TileConfig(128, 128, 12, 2))
    d256 = KernelConfig(256, "bf16", "sm_90a", resources.default_tile(256))
    assert kernels.default_backward(d256) == d256  # split columns
    # With the Hopper backward off at d256, the registry looks in the arch's other families: sm80's default
    # variant for the head dim where it has a backward, else none.
    off = hopper(256, split_columns=False)
    chosen = kernels.default_backward(off)
    assert chosen == off or (chosen.family == "sm80" and not kernels.backward_problems(chosen))
    assert "none in this module" in registry.describe_backward(off)


def test_the_hopper_backward_spill_allowance_names_its_kernel():
    figures = {"spill_store_bytes": 52, "spill_load_bytes": 56}
    assert resources.excess_spill_bytes("_ZN4x6hopper18hopper_dkdv_kernelE", figures) == 0
    assert resources.excess_spill_bytes("_ZN4x6hopper18hopper_dkdv_kernelE", {"spill_store_bytes": 300}) == 300


@pytest.mark.parametrize("on", [False, True])
def test_forward_tables_always_shared_option(on):
    """The tables_always_shared option: the producer copies the key tables TMA cannot bring into the K slot, and the
    mask reads shared memory only (no pointer picked between shared and global: those reads were generic loads)."""
    config = hopper(128, tables_always_shared=on)
    forward = codegen.render(RULES, config)[codegen.source_names(RULES, config)["kernel"]]
    assert f"constexpr bool kTablesAlwaysShared = {'true' if on else 'false'};" in forward
    assert "sm90::copy_rows(shared.key_tables[stage][0]" in forward  # in the source either way; dropped when off


@pytest.mark.parametrize("head_dim, pairs", [(64, 64), (128, 16), (256, 4)])
def test_ordered_sections_scale_with_the_square_of_the_head_dim(head_dim, pairs):
    """The ordered_section_pairs option is the figure at head dim 128, scaled by (128 / head_dim) ** 2 (the same
    bytes of Q and dO per section); 0 stays one section."""
    config = hopper(head_dim, ordered_section_pairs=16)
    assert resources.Resources(config).ordered_section_pairs == pairs
    if head_dim != 256:  # d256 runs the split-columns backward, which has no ordered instance
        backward = codegen.render(RULES, config)[codegen.source_names(RULES, config)["backward"]]
        assert f"constexpr int kOrderedSectionPairs = {pairs};" in backward
    assert resources.Resources(hopper(head_dim, ordered_section_pairs=0)).ordered_section_pairs == 0


@pytest.mark.parametrize("head_dim, stages", [(64, 4), (128, 2), (256, 2)])
def test_a_deeper_backward_ring_per_head_dim(head_dim, stages):
    """The Q/dO ring is 4 deep at d64 by default (timed faster, and the gpu suite passed), 2 elsewhere; the
    backward_stages option overrides it; the shared memory figure follows and still fits beside K, V, dS^T and dQ."""
    assert resources.Resources(hopper(64, backward_stages=2)).hopper_stages == 2
    config = hopper(head_dim)
    r = resources.Resources(config)
    assert r.hopper_stages == stages
    assert not r.backward_problems()
    backward = codegen.render(RULES, config)[codegen.source_names(RULES, config)["backward"]]
    assert f"constexpr int kStages = {stages};" in backward
    assert f"static_assert(sizeof(SharedStorage) == {r.hopper_shared_storage_bytes}," in backward


def test_softmax_chains_render_independent_chains_and_default_by_head_dim():
    """The softmax_chains option: the forward's softmax state takes it as its chain count, by default the head dim's
    (two at d64, one elsewhere); a power of two up to 8, else a problem that names the option."""
    def forward(config):
        return codegen.render(RULES, config)[codegen.source_names(RULES, config)["kernel"]]

    assert "omnigen::RowPairSoftmax<kBlockN / 2, 1>;" in forward(hopper(128))
    assert "omnigen::RowPairSoftmax<kBlockN / 2, 2>;" in forward(hopper(64))
    assert "omnigen::RowPairSoftmax<kBlockN / 2, 1>;" in forward(hopper(64, softmax_chains=1))
    assert "omnigen::RowPairSoftmax<kBlockN / 2, 4>;" in forward(hopper(64, softmax_chains=4))
    assert not kernels.problems(hopper(64, softmax_chains=4))
    for wrong in (3, -1, 16):
        assert any("softmax_chains must be 1, 2, 4 or 8" in p for p in kernels.problems(hopper(128, softmax_chains=wrong)))


def test_pingpong_renders_turns_around_every_issue_and_is_off_by_default():
    """The pingpong option: the consumer warpgroups wait for their turn before issuing a step's products and hand it
    on after, in the first step, every later step and the last P V; off by default (the same module as before)."""
    def forward(config):
        return codegen.render(RULES, config)[codegen.source_names(RULES, config)["kernel"]]

    assert "constexpr bool kPingPong = false;" in forward(hopper(64))
    source = forward(hopper(64, pingpong=True))
    assert "constexpr bool kPingPong = true;" in source
    # the first step, every later step, a folded tile boundary (fold_into, rendered always) and the last P V
    assert source.count("wait_turn();") == 4 and source.count("pass_turn();") == 4
    assert source.count("begin_turns();") == 2 and source.count("end_turns();") == 2  # persistent and grid paths


@pytest.mark.parametrize("head_dim", (64, 128))
def test_fold_tiles_takes_two_q_buffers_and_stages_o_in_them(head_dim):
    """The fold_tiles option: off by default; on, two Q buffers and their barriers, the folded loops, and with O by
    TMA no staging buffer of its own (O goes out through the finished tile's Q rows), so shared memory grows by one Q
    tile less the staging buffer it drops; refused where it cannot be built (d256, FP8, the grid of tiles)."""
    def forward(config):
        return codegen.render(RULES, config)[codegen.source_names(RULES, config)["kernel"]]

    assert "constexpr bool kFoldTiles = false;" in forward(hopper(head_dim))
    for output_by_tma in (0, 2):
        default, folded = hopper(head_dim, output_by_tma=output_by_tma), hopper(head_dim, output_by_tma=output_by_tma,
                                                                                 fold_tiles=True)
        assert not kernels.problems(folded)
        source = forward(folded)
        assert "constexpr bool kFoldTiles = true;" in source and "constexpr int kQBuffers = kFoldTiles ? 2 : 1;" in source
        assert "consume_tiles_folded(shared, maps, args, order);" in source
        r, base = resources.Resources(folded), resources.Resources(default)
        q_tile = 128 * head_dim * 2
        staged = 2 * (head_dim // 64) * resources.OUTPUT_BOX_BYTES if output_by_tma else 0
        assert r.output_staged_boxes == base.output_staged_boxes
        assert abs(r.shared_storage_bytes - (base.shared_storage_bytes + q_tile - staged)) <= 1024
        assert f"static_assert(sizeof(SharedStorage) == {r.shared_storage_bytes}" in source
    for config in (hopper(256, fold_tiles=True), hopper(head_dim, fold_tiles=True, persistent=False),
                   KernelConfig(128, "e4m3", "sm_90a", TileConfig(128, 192, 12, 2), kernel_family="sm90",
                                options=HopperOptions(fold_tiles=True), forward_only=True)):
        assert any("fold_tiles" in p for p in kernels.problems(config)), config


@pytest.mark.parametrize("head_dim", (64, 128))
def test_dq_in_turns_renders_a_whole_width_dq_product_at_d64_and_d128(head_dim):
    """The dq_in_turns option (on by default): at d64 and d128 each step's dQ, every head dim, by one consumer
    warpgroup (m64n{D} instead of m64n{D/2} in each), the writer warp's barriers counting one warpgroup; d128 retires
    dV and dK first (kDqRetiresKeyGradients); off, or without the writer warp, both warpgroups every step; no effect
    at d256 (split columns: dQ by atomics)."""
    config = hopper(head_dim)
    assert resources.Resources(config).hopper_dq_in_turns and not kernels.backward_problems(config)
    assert "taking turns" in kernels.FAMILIES["sm90"].describe_backward(config)
    backward = codegen.render(RULES, config)[codegen.source_names(RULES, config)["backward"]]
    assert "constexpr bool kDqInTurns = true;" in backward
    assert f"void wgmma_query_gradient(float (&d)[{head_dim // 2}]" in backward and f"m64n{head_dim}k16" in backward
    assert "constexpr bool kDqRetiresKeyGradients = kDqInTurns && kHeadDim > 64;" in backward
    for off in (hopper(head_dim, dq_in_turns=False), hopper(head_dim, dq_writer=False)):
        assert not resources.Resources(off).hopper_dq_in_turns
        source = codegen.render(RULES, off)[codegen.source_names(RULES, off)["backward"]]
        assert "constexpr bool kDqInTurns = false;" in source
        assert f"void wgmma_query_gradient(float (&d)[{head_dim // 4}]" in source
    assert not resources.Resources(hopper(256)).hopper_dq_in_turns
    assert not kernels.backward_problems(hopper(256))
