"""The sm90 family's resource model: which Hopper forward tiles fit, and what they need.

A CTA is three warpgroups: one producer (TMA copies; its registers shrink to PRODUCER_REGISTERS) and
two consumers of 64 query rows each (their registers grow to CONSUMER_REGISTERS), so block_m is 128
and warps 12. Shared memory holds Q, `stages` K and V tiles (each in boxes of 64 head-dim columns,
1024-byte aligned) and the mbarriers. The module's backward is the sm80 family's (mma.sync) for the
same block_m x block_n until the Hopper backward exists: its limits come from sm80's model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...targets import ARCH_TABLE, KernelConfig, TileConfig
from ..sm80.resources import Resources as Sm80Resources
from ..sm80.resources import excess_spill_bytes as sm80_excess_spill_bytes

BLOCK_M = 128
WARPS = 12  # producer warpgroup + two consumer warpgroups
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232  # 128 x 40 + 256 x 232 = 64,512 of the SM's 65,536
# Scores (block_n / 2), output (head_dim / 2) and P (block_n / 4) fp32/packed registers per consumer
# thread must leave room for addresses, softmax state and the mask tables under CONSUMER_REGISTERS.
MAX_TILE_REGISTERS = 184
# The Hopper backward (hopper_dkdv_kernel) and the kv-tile (block_n) it takes per head dim. At d64 and d128 each
# of the two consumer warpgroups takes 64 keys and holds their dK and dV (64 x head_dim fp32 each) beside S^T
# and dP^T of a 64-query step, so the producer gives up more registers. At d256 that would be 256 accumulator
# registers a thread, so the CTA takes 64 keys and the warpgroups split the head dims ("split columns"): both
# compute the same S^T and dP^T (a sixth product per step, 7/5 of the tensor work), each keeps dK and dV for
# its 128 head dims, and dQ goes to global memory by vector atomics (shared memory has no room for a TMA
# staging buffer beside K, V and two stages of Q and dO: 192 of 227 KB).
HOPPER_BACKWARD_BLOCK_N = {64: 128, 128: 128, 256: 64}
HOPPER_BACKWARD_HEAD_DIMS = tuple(HOPPER_BACKWARD_BLOCK_N)
# Switches for Hopper backward paths, each one tested with the switch on by the GPU tests (`-k split`,
# `-k ordered`, `-k grouped`), on an H200 first on 2026-11-23 (RESULTS.md, "First GPU run of the switched
# kernels"). The split-columns kernel (d256): on; until then d256 had no backward in either family.
SPLIT_COLUMNS = True
# Deterministic mode on the Hopper backward (kOrderedDq): dQ still leaves each CTA by TMA reduce-add, but one
# thread adds the whole step's rows once the (batch, head, 64 rows) counter says every lower kv-tile visiting
# them has added its own (ranks from Plan.dq_ranks), so the sums come in the same order on every run. The
# ordered grid runs kv-tiles slowest (in sections of heads), so a kv-tile only waits on CTAs launched before it. On:
# 2-7% over atomic order at S = 8K-32K at d128 and 3-8% at d64 with the descending walk (ORDERED_SECTION_PAIRS,
# RESULTS.md 2026-11-24), 1.5-1.9x faster than the carried sm80 backward that deterministic mode runs with it off.
ORDERED_DQ = True
# The ordered grid in sections of this many (query-head block, batch element) pairs, kv-tiles slowest inside a
# section (0: one section of every pair). Fewer pairs per wave read fewer heads' Q and dO (4 MB a head at 8K, d128:
# with every pair in one section, a wave held 64 heads' at 8K, far past L2); but more kv-tiles of one head then run
# side by side, each a step behind the one below it. On the H200 (RESULTS.md, 2026-11-23), deterministic over
# atomic, Transfusion d128 8K / 32K: one section +33% / +8.4%, 32 pairs +16% / +7.7%, 16 pairs +10.9% / +7.6%,
# 8 pairs +14.7% / +10.6%; causal rules 8K / 32K: +16% / +6.0%, +10.6% / +8.0%, +10.0% / +6.7%, +14.5% / +7.7%.
# Not with GQA_IN_KERNEL (its producer's spills doubled: that grid stays one section). The figure is for head dim
# 128; other head dims scale it by 128 / head_dim (`ordered_section_pairs`), so a section reads as many bytes. d64,
# deterministic over atomic (H200, 2026-11-23), Transfusion 8K / 32K: 16 pairs +11.4% / +6.0%, 32 pairs +6.1% /
# +5.0%, 64 pairs +17.7% / +6.9%; causal rules 16 pairs +11.5% / +6.1%, 32 pairs +6.7% / +5.2%.
# With the descending walk (ORDERED_DESCENDING_STEPS, on since 2026-11-24) kv-tiles no longer wait a step per kv-tile
# below them, so small sections pay: H200, d128 backward, deterministic over atomic, Transfusion 8K / 32K, causal rules
# 8K / 32K (RESULTS.md, 2026-11-24): ascending walk, 16 pairs +10.7 / +6.3 / +13.8 / +5.8%; descending, 2 pairs
# +6.9 / +3.1 / +6.6 / +4.6%, 4 pairs +7.2 / +4.5 / +7.5 / +4.0%, 8 pairs +6.0 / +4.9 / +10 / +2.6%, 16 pairs +8.5 /
# +7.1 / +10.4 / +6.1%. At d64 (same day) with the descending walk, 4 / 8 / 16 / 32 pairs: Transfusion 8K / 32K, causal
# 8K / 32K +9.8 / +3.4 / +10 / +5.3%, +6.4 / +4.2 / +8.0 / +4.7%, +8.0 / +8.3 / +8.7 / +10.2%, +9.9 / +7.6 / +12.5 /
# +10%: 8 pairs, 4x d128's (ordered_section_pairs scales by the square of 128 / head dim). The ascending walk's 32
# pairs had given +6.1 / +5.0 / +6.7 / +5.2%.
ORDERED_SECTION_PAIRS = 2
# Atomic order's grid in sections too (0: the 3-D grid, kv-tiles fastest, one (head, batch) pair after another):
# this many pairs at head dim 128 (scaled as ORDERED_SECTION_PAIRS), kv-tiles slowest inside a section, so that the
# section's longest columns (the low kv-tiles, under causal masks) start first and its last CTAs are short ones.
# Before, the last pair's kv-tile 0 (128 steps at 8K: ~6% of the kernel) was among the last CTAs launched. On the
# H200 (RESULTS.md, 2026-11-23), d128 backward against the 3-D grid, Transfusion / causal rules: 2 pairs -1.5% /
# -2.0% at 8K, -1.0% / -0.1% at 16K, within the spread at 32K; 4 and 8 pairs no better.
ATOMIC_SECTION_PAIRS = 2
# The Hopper backward walks each kind's steps of a kv-tile's column last q-tile first (every role alike), in
# deterministic mode / in atomic order. Deterministic mode adds a q-tile's dQ in kv-tile order, lower first; walking
# up from its diagonal, kv-tile j + 1 reaches each q-tile one q-tile before kv-tile j and waits for it, so the kv-tiles
# of a head that start together fall a q-tile behind one another. Walking down, they all reach q-tile m at the same
# step and wait only for each other's writes, once. Alone (sections of 16 pairs) it was within +-2% except
# Transfusion 8K (-4%); with small sections it halves deterministic mode's cost (ORDERED_SECTION_PAIRS). On in
# deterministic mode; in atomic order within the spread (+0.5..2% at 32K): off.
ORDERED_DESCENDING_STEPS = True
ATOMIC_DESCENDING_STEPS = False
# The next step's S^T = K Q^T issued right after this step's dQ product and run while its dQ rows are staged
# (kEarlyScores): a step used to stage dQ with the tensor pipe idle until the next step's products were issued.
# Nsight (causal 8K d128, H200, 2026-11-24): the backward's tensor pipe active 54% of cycles, cuDNN's 62%. Predicted
# -5..-10%; measured (RESULTS.md, 2026-11-24) d128 atomic -2.2..-3.8% in one run and -0.3..-1.7% in another,
# deterministic -1..-3%. (Reading the step's lse before S^T is waited for as well, which took 8.9 points of
# short-scoreboard stalls out of the exponentials' stretch, gained nothing more: not kept.) On.
EARLY_SCORES = True
# Atomic-order dQ through a writer warp (kDqWriter): the consumer warps stage each step's dQ rows and go on; warp
# 1 of the producer warpgroup issues the TMA reduce-adds and waits until they have read the boxes, as in the
# ordered mode minus its counter. Before, every consumer warp's lane 0 issued its own two reductions, and that
# issue loop was 5% of the consumers' stall samples (Nsight, Transfusion 8K d128). On the H200 (RESULTS.md,
# 2026-11-23): backward -3..-4% at d128 (Transfusion 32K 23.46 -> 22.56 ms); the writer warp spills 24 B in the
# producer warpgroup's 24 registers, the consumers none.
DQ_WRITER_WARP = True
# GQA on the Hopper backward (kGroupedHeads): a CTA walks every query head of its kv head and sums their dK and
# dV in registers, written once in the element type, instead of fp32 partials per query head that the caller
# sums (2 x 4 bytes x heads_q x S x D extra at peak: 1 GiB for 32 query heads of d128 at 32K tokens); K and V
# are loaded once per group; the group is walked kind by kind (for_group_steps). Correct on the GPU, but at 16/4
# heads 6-9% slower than partials at d64 and 0-3% at d128 (the group walk itself costs that: an MHA call through
# it is 5% slower at d64): off, a memory saving not yet free of time.
GQA_IN_KERNEL = False
HOPPER_STEP_ROWS = 64
HOPPER_STAGES = 2
# The Q/dO ring's depth per head dim where it differs from HOPPER_STAGES (more fit in shared memory at d64: 150 KB
# with 4 stages; d128 has room for 2). d64's steps are half as long against the same load latency. On the H200
# (RESULTS.md, 2026-11-24), d64 with 4 stages against 2, two rounds: Transfusion 8K -2.3%, 32K -0.4%, causal 8K
# -0.2%, 32K -1.8% (7 of 8 runs faster); 3 stages within the spread. The whole gpu suite passed with {64: 4}
# (H100, 2026-11-25: 526 passed), so it is the default.
HOPPER_STAGES_BY_HEAD_DIM: dict[int, int] = {64: 4}
HOPPER_PRODUCER_REGISTERS = 24
HOPPER_CONSUMER_REGISTERS = 240  # 128 x 24 + 256 x 240 = 64,512
PINGPONG = False  # consumer warpgroups taking turns to issue their GEMMs (kPingPong): no measurable gain yet (RESULTS.md)
# Persistent forward (kPersistent): min(SMs, work tiles) CTAs, each looping over (q-tile, batch, head) tiles in
# TileOrder with one set of barriers, its K/V ring running on across tiles and the next tile's Q and K/V loading
# under the current one's last P V and epilogue. A CTA starts with tile blockIdx.x and takes each further one
# from a per-launch counter (atomicAdd; the launcher zeroes it), so tiles start in TileOrder as SMs free up,
# as the hardware starts a grid's CTAs. The first, static version (a snake over rounds) was 4-15% slower than
# the grid at 16K-32K once tiles ran in L2 sections: its CTAs drifted apart and stopped sharing K/V lines in L2.
# The dynamic one against the grid (H200, RESULTS.md 2026-11-23, d128): Transfusion 8K +1.8% (2.091 -> 2.128 ms),
# 16K -4.1%, 32K -2.7%; causal rules 8K -3.8%, 16K -3.7%, 32K +1.3%; d64 -2.6..0%. On.
# TileConfig has no field for it, so the tuner does not search it: a module-level switch like PINGPONG. Sources
# differ, so the cache keys differ, but module names do not: flip it per process, not within one.
PERSISTENT = True
# A persistent Hopper backward (the same counter and two-slot tile ring; the Q/dO ring, dS^T buffers and dQ writer
# running on across tiles; the next tile's K/V loading while this one's dK/dV are stored) was built, passed the
# float64 and bit-identity tests at d64/d128/d256, and measured slower than the grid everywhere: +0.7..+2.4% at d128,
# +0.2..+1.5% at d64, 8K and 32K (H200, means of two rounds, RESULTS.md 2026-11-24). The grid's boundary costs less
# than predicted, and the loop's state took consumer registers (spills at tile boundaries, one reload per partial
# step). Removed.
# The forward's partial kv-tiles read their key tables from shared memory always (kTablesAlwaysShared): the
# producer copies the rows TMA cannot bring (unaligned, past the end). Before, the mask read a pointer picked
# between shared and global memory, so every read was a generic load. On the H200 (RESULTS.md, 2026-11-23):
# partial/full tile cost 2.26 -> 2.06, Transfusion d128 forward -1.5% (8K) and -0.7% (32K), d64 within noise;
# the d128 forward kernel's spills 4 -> 0 bytes.
TABLES_ALWAYS_SHARED = True
# The forward's O through shared memory and TMA stores (kStoreByTma; grid of tiles only): the 4-byte stores from
# registers fill half of each 32-byte sector (Nsight: 42% of the forward's global sectors are excess). Correct on
# the H200 (`-k store_by_tma`) but not faster there (RESULTS.md 2026-11-23, d128: causal 8K -3%, 32K +5%;
# Transfusion 8K +4%, 16K-32K within 1%): a grid CTA waits for its stores before it exits either way, and the
# persistent grid, on by default, does not use it. Off.
STORE_BY_TMA = False
# GQA packing in the forward (kPackHeads): a work tile is two query heads of one kv head over the same 64 query rows,
# one per consumer warpgroup, sharing the K/V ring. At 128-row tiles it loads the same K/V bytes per (row, head) as
# one head over 128 rows (and as many work tiles), so it is expected to win only where a head has fewer query
# rows than a tile. Needs heads_q / heads_kv even. On the H200 (RESULTS.md, 2026-11-23), GQA 16/4 Transfusion
# forward: within the spread at 8K-32K, 3-10% slower at 1K (d64, d128). Off.
GQA_PACK = False
# Partial kv-tiles (forward) and partial steps (Hopper backward, the tile transposed) read their mask as bits made
# once per layout (omnigen.plan.bits: two words per thread and step) where the mask holds them, instead of
# evaluating the rules on every head (kPartialBits); tiles past the mask's capacity still evaluate the rules. On
# the H200 (RESULTS.md, 2026-11-23): an all-partial layout against an all-full one, d128 8K, forward 1.646 -> 1.161
# (1.155 in the next run), fwd+bwd 1.270 -> 1.058; Transfusion's forward (eager calls: bits for every partial
# tile) -1.3% at 8K and -1.7% at 32K (d128), its backward within run-to-run noise (partial steps are ~4%).
PARTIAL_BITS = True


def default_tile(head_dim: int) -> TileConfig:
    return TileConfig(BLOCK_M, 64 if head_dim > 128 else 128, WARPS, 2)


# The forward's partial path holds each row's segment, document and rule beside S, O and P; at block_n
# 128 ptxas parks one step-invariant 4-byte value on the stack and reloads it once per partial step
# (SASS: one LDL before the step's first wgmma, none on the full and causal paths). More than this
# means a tile has outgrown the consumer's registers.
FORWARD_SPILL_ALLOWANCE = 16


# The Hopper backward's kernels spill in their producer warpgroup only, which runs on 24 registers: the producer
# thread's table copies (odd lengths, last steps) and the dQ writer warp's loop (both instances, since
# DQ_WRITER_WARP), 24/44 B at d128, 82/124 B with GQA groups in the kernel (off); none of it on the consumers'
# path (their SASS has no local memory access past the prologue).
HOPPER_BACKWARD_SPILL_ALLOWANCE = 128


def excess_spill_bytes(kernel_name: str, figures: dict) -> int:
    """Spills of the Hopper kernels beyond their allowances; the carried sm80 backward keeps sm80's."""
    allowance = (FORWARD_SPILL_ALLOWANCE if "forward_kernel" in kernel_name else
                 HOPPER_BACKWARD_SPILL_ALLOWANCE if "hopper_dkdv_kernel" in kernel_name else None)
    if allowance is None:
        return sm80_excess_spill_bytes(kernel_name, figures)
    stores, loads = figures.get("spill_store_bytes", 0), figures.get("spill_load_bytes", 0)
    return 0 if max(stores, loads) <= allowance else stores + loads


@dataclass(frozen=True)
class Resources:
    """What one variant of the sm90 forward needs; `problems()` lists why it cannot be built."""

    config: KernelConfig

    @property
    def boxes(self) -> int:
        return self.config.head_dim // 64

    @property
    def shared_storage_bytes(self) -> int:
        """sizeof(SharedStorage): Q, stages x (K, V) in 128-byte rows, stages x 3 int32 key tables, then the
        barriers (Q full and empty, full + empty for K and V per stage, the persistent grid's two tile slots'
        full + empty) and the two slots' tile numbers, rounded up to the 1024-byte alignment."""
        t = self.config.tile
        q = t.block_m * 128 * self.boxes
        kv = t.block_n * 128 * self.boxes
        tables = t.stages * 3 * t.block_n * 4
        barriers = 8 * (2 + 4 * t.stages + 4)
        slots = 2 * 4
        return -(-(q + 2 * t.stages * kv + tables + barriers + slots) // 1024) * 1024

    @property
    def shared_memory_bytes(self) -> int:
        """What the launch asks for: the storage plus 1 KB to align the dynamic base to 1024 bytes."""
        return self.shared_storage_bytes + 1024

    @property
    def hopper_split_columns(self) -> bool:
        """Whether the Hopper backward's warpgroups share the CTA's 64 keys and split the head dims (d256)."""
        return self.config.tile.block_n == 64

    @property
    def hopper_tma_dq(self) -> bool:
        """Whether the module's Hopper backward adds dQ by TMA reduce-add from staged boxes (not with split
        columns: their dQ goes by per-thread atomics) -- what ordered dQ and the writer warp build on."""
        return not self.hopper_split_columns and not self.hopper_backward_problems()

    @property
    def hopper_ordered_dq(self) -> bool:
        """Whether deterministic mode runs the Hopper backward, its dQ additions ordered by kv-tile (not with split
        columns: their dQ goes by per-thread atomics, which no counter can order)."""
        return ORDERED_DQ and self.hopper_tma_dq

    def _section_pairs(self, pairs_at_d128: int, power: int = 1) -> int:
        """A backward grid section of `pairs_at_d128` (head, batch) pairs at head dim 128, scaled by
        (128 / head_dim) ** power: with power 1 a section's Q and dO take the same bytes at any head dim (0 stays 0:
        no sections)."""
        if pairs_at_d128 <= 0:
            return 0
        return max(1, pairs_at_d128 * 128**power // self.config.head_dim**power)

    @property
    def ordered_section_pairs(self) -> int:
        """The ordered backward grid's section (ORDERED_SECTION_PAIRS, scaled by the square of 128 / head dim: the same
        bytes per section, and at smaller head dims shorter steps against the same latency of each ordered dQ write,
        so fewer kv-tiles of one head per wave)."""
        return self._section_pairs(ORDERED_SECTION_PAIRS, power=2)

    @property
    def atomic_section_pairs(self) -> int:
        """The atomic-order backward grid's section (ATOMIC_SECTION_PAIRS, scaled by head dim)."""
        return self._section_pairs(ATOMIC_SECTION_PAIRS)

    @property
    def hopper_dq_writer(self) -> bool:
        """Whether the atomic-order Hopper backward hands its dQ reductions to a writer warp (not with split
        columns: their dQ goes by per-thread atomics)."""
        return DQ_WRITER_WARP and self.hopper_tma_dq

    @property
    def hopper_grouped_heads(self) -> bool:
        """Whether the Hopper backward sums a GQA group's dK/dV in the kernel (GQA_IN_KERNEL)."""
        return GQA_IN_KERNEL and not self.hopper_backward_problems()

    @property
    def hopper_shared_storage_bytes(self) -> int:
        """sizeof(hopper::SharedStorage): K and V, stages x (Q, dO) of a step, two dS^T buffers, the step's dQ
        (fp32, on its way to TMA; none with split columns, whose dQ goes by atomics), stages x the rows' tables
        (lse, Delta, three token tables), then the barriers; rounded up to 1024 bytes."""
        t = self.config.tile
        kv = t.block_n * 128 * self.boxes
        rows = HOPPER_STEP_ROWS * 128 * self.boxes
        ds = t.block_n * HOPPER_STEP_ROWS * 2
        dq = 0 if self.hopper_split_columns else HOPPER_STEP_ROWS * self.config.head_dim * 4
        stages = self.hopper_stages
        tables = stages * 5 * HOPPER_STEP_ROWS * 4
        barriers = 8 * (1 + 2 * stages)
        return -(-(2 * kv + 2 * stages * rows + 2 * ds + dq + tables + barriers) // 1024) * 1024

    @property
    def hopper_stages(self) -> int:
        """The Hopper backward's Q/dO ring depth (HOPPER_STAGES_BY_HEAD_DIM, else HOPPER_STAGES)."""
        return HOPPER_STAGES_BY_HEAD_DIM.get(self.config.head_dim, HOPPER_STAGES)

    def hopper_backward_problems(self) -> list[str]:
        """Why the module's backward is not the Hopper kernel (it then runs the sm80 one it carries)."""
        c, t = self.config, self.config.tile
        out = []
        block_n = HOPPER_BACKWARD_BLOCK_N.get(c.head_dim)
        if block_n is None:
            out.append(f"the Hopper backward covers head dims {HOPPER_BACKWARD_HEAD_DIMS}, not {c.head_dim}")
        elif t.block_n != block_n:
            shape = ("two warpgroups of 64 keys" if block_n == 128 else
                     "64 keys, the warpgroups splitting the head dims: dK and dV of 128 keys would not fit")
            out.append(f"the Hopper backward takes block_n {block_n} at head_dim {c.head_dim} ({shape}), not {t.block_n}")
        elif block_n == 64 and not SPLIT_COLUMNS:
            out.append(f"the Hopper backward for head_dim {c.head_dim} (split columns) has not yet run on a GPU "
                       "(omnigen.kernels.sm90.resources.SPLIT_COLUMNS is off)")
        if not out and self.hopper_shared_storage_bytes + 1024 > ARCH_TABLE[c.arch].shared_memory:
            out.append(f"the Hopper backward needs {self.hopper_shared_storage_bytes + 1024} bytes of shared memory")
        return out

    def sm80_backward_config(self) -> KernelConfig:
        """The sm80 variant whose backward kernels this module carries (same plan tile)."""
        t = self.config.tile
        c = self.config
        return KernelConfig(c.head_dim, c.dtype, c.arch, TileConfig(t.block_m, t.block_n, 8, 2), kernel_family="sm80")

    def backward_problems(self) -> list[str]:
        """Why the module has no backward at all: neither the Hopper kernel nor the carried sm80 one takes it."""
        if not self.hopper_backward_problems():
            return []
        return Sm80Resources(self.sm80_backward_config()).backward_problems()

    def problems(self) -> list[str]:
        out = self.config.identity_problems()
        if out:
            return out
        c, t = self.config, self.config.tile
        if c.arch != "sm_90a":
            out.append(f"the sm90 family needs wgmma and setmaxnreg: build it for sm_90a, not {c.arch}")
        if t.block_m != BLOCK_M:
            out.append(f"block_m must be {BLOCK_M} (two consumer warpgroups of 64 rows), not {t.block_m}")
        if t.warps != WARPS:
            out.append(f"warps must be {WARPS} (a producer and two consumer warpgroups), not {t.warps}")
        if t.block_n % 16 or not 16 <= t.block_n <= 256:
            out.append(f"block_n must be a multiple of 16 from 16 to 256 (wgmma N, TMA box rows), not {t.block_n}")
        if t.stages < 2:
            out.append("stages must be at least 2 (the producer fills one while the consumers read another)")
        registers = t.block_n // 2 + c.head_dim // 2 + t.block_n // 4
        if registers > MAX_TILE_REGISTERS:
            out.append(f"block_n {t.block_n} with head_dim {c.head_dim} needs {registers} registers per consumer thread "
                       f"for scores, output and P (at most {MAX_TILE_REGISTERS} fit): lower block_n")
        limit = ARCH_TABLE[c.arch].shared_memory
        if not out and self.shared_memory_bytes > limit:
            out.append(f"the tile needs {self.shared_memory_bytes} bytes of shared memory, {c.arch} allows {limit}: "
                       "lower block_n or stages")
        return out
