"""The sm90 family's resource model: which Hopper forward tiles fit, and what they need.

A CTA is three warpgroups: one producer (TMA copies; its registers shrink to PRODUCER_REGISTERS) and
two consumers of 64 query rows each (their registers grow to CONSUMER_REGISTERS), so block_m is 128
and warps 12. Shared memory holds Q, `stages` K and V tiles (each in boxes of 64 head-dim columns,
1024-byte aligned) and the mbarriers. The module's backward is the Hopper dK/dV kernel, for the tiles
it takes (HOPPER_BACKWARD_BLOCK_N); a variant with another tile has a forward only, and an untuned kernel
trains with another variant's backward (omnigen.kernels.default_backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...targets import ARCH_TABLE, FP8_DTYPES, KernelConfig, TileConfig
from .options import HopperOptions

BLOCK_M = 128
WARPS = 12  # producer warpgroup + two consumer warpgroups
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232  # 128 x 40 + 256 x 232 = 64,512 of the SM's 65,536
# Scores (block_n / 2), output (head_dim / 2) and P (block_n / 4) fp32/packed registers per consumer
# thread must leave room for addresses, softmax state and the mask tables under CONSUMER_REGISTERS.
MAX_TILE_REGISTERS = 184
# The FP8 forward's head dim and kv-tiles: 8-bit rows of 128 bytes; V^T in boxes of 128 keys (128-byte swizzle) or 64
# (64-byte swizzle), so block_n 64, 128 or 192 (256 would need 224 registers a consumer thread for scores, output and
# P; at d256, 208 at block_n 128).
FP8_HEAD_DIM = 128
FP8_BLOCK_N = (64, 128, 192)
# The Hopper backward (hopper_dkdv_kernel) and the kv-tile (block_n) it takes per head dim. At d64 and d128 each
# of the two consumer warpgroups takes 64 keys and holds their dK and dV (64 x head_dim fp32 each) beside S^T
# and dP^T of a 64-query step, so the producer gives up more registers. At d256 that would be 256 accumulator
# registers a thread, so the CTA takes 64 keys and the warpgroups split the head dims ("split columns": the
# option of that name): both compute the same S^T and dP^T (a sixth product per step, 7/5 of the tensor work),
# each keeps dK and dV for its 128 head dims, and dQ goes to global memory by vector atomics (shared memory has
# no room for a TMA staging buffer beside K, V and two stages of Q and dO: 192 of 227 KB). With paired dQ (the
# paired_dq option) kv-tiles 2i and 2i + 1 trade dS^T in a cluster of two and each adds half of dQ's head dims.
HOPPER_BACKWARD_BLOCK_N = {64: 128, 128: 128, 256: 64}
HOPPER_BACKWARD_HEAD_DIMS = tuple(HOPPER_BACKWARD_BLOCK_N)
HOPPER_STEP_ROWS = 64  # query rows per backward step (one 128-byte swizzle period of dS^T)
# The Q/dO ring's depth when the options leave it to the head dim (backward_stages 0): d64's steps are half as long
# against the same load latency, and 4 stages fit in its shared memory (150 KB); d128 has room for 2.
HOPPER_STAGES = 2
BACKWARD_STAGES_BY_HEAD_DIM = {64: 4}
# The forward softmax's chains per row when the options leave it to the head dim (softmax_chains 0): two at d64, whose
# step is as much softmax as products (paired on an H100: forward -1.4..-3.1%); one at d128 (within noise) and d256.
SOFTMAX_CHAINS_BY_HEAD_DIM = {64: 2}
# Head dims whose forward stores O by TMA from a staging buffer when the output_by_tma option leaves it to the head
# dim (1, its default): d128 (FP8's too), where it took 4-6% off the 8K forward, and d256 (two rounds through half the
# boxes: -1.6..-2.4%, H100, paired); at d64 it was 0.2-1.7% slower (its epilogue has half the stores).
OUTPUT_BY_TMA_HEAD_DIMS = (128, 256)
# Head dims whose backward computes dQ in turns (the dq_in_turns option): d64, and d128 since its warpgroup retires dV
# and dK before issuing dQ and stages dQ before the next S^T (kDqRetiresKeyGradients; before that its 64-register
# accumulator beside dK, dV, the in-flight fragments and the next S^T made ptxas serialise every wgmma, C7512). d128
# fwd+bwd -3.0..-3.5% (H200, paired: "dQ in turns at d128, in cuDNN's order").
DQ_IN_TURNS_HEAD_DIMS = (64, 128)
# Head dims whose atomic-order backward runs as a persistent grid under persistent_backward=1: d64, fwd+bwd -0.8..-2.4%
# (H200, paired, "Thirty-second session"); not d128, whose consumers lose the uniform datapath in the loop (+2..+4.7%).
PERSISTENT_BACKWARD_HEAD_DIMS = (64,)
# The Hopper backward's producer warpgroup's registers a thread (setmaxnreg; the backward_producer_registers option
# moves them). The consumers take the rest of the pool, the launch's 168 a thread x 384 threads: 128 x 24 + 256 x 240
# = 64,512 (Resources.hopper_consumer_registers).
HOPPER_PRODUCER_REGISTERS = 24
HOPPER_REGISTER_POOL = 168 * 384


# The FP8 forward's kv-tile when nobody picks one: 192 keys spread each step's fixed costs (barrier waits, the
# row maxima's shuffles, O's rescale) over 1.5x the keys of 128. H100, B.S = 32K, d128: 1-5% faster than 128 at 32K
# in 14 of 14 timings, within 4% either way at 8K (benchmarks/RESULTS.md, twentieth session).
FP8_DEFAULT_BLOCK_N = 192
# One box of O's staging buffer: 64 rows of 128 bytes (64 columns of the 16-bit output).
OUTPUT_BOX_BYTES = 64 * 128


def default_tile(head_dim: int, dtype: str = "bf16") -> TileConfig:
    if dtype in FP8_DTYPES:
        return TileConfig(BLOCK_M, FP8_DEFAULT_BLOCK_N, WARPS, 2)
    return TileConfig(BLOCK_M, 64 if head_dim > 128 else 128, WARPS, 2)


# The forward's partial path holds each row's segment, document and rule beside S, O and P; at block_n
# 128 ptxas parks one step-invariant 4-byte value on the stack and reloads it once per partial step
# (SASS: one LDL before the step's first wgmma, none on the full and causal paths). The FP8 forward's
# 192-key tile (its default) keeps 20 / 28 bytes of set-up values there, stored before the first
# product and read after the last (its step loops have no local memory). More than this means a tile
# has outgrown the consumer's registers.
FORWARD_SPILL_ALLOWANCE = 32


# The Hopper backward's kernels spill in their producer warpgroup only, which runs on 24 registers: the producer
# thread's table copies (odd lengths, last steps) and the dQ writer warp's loop (both instances, with the dq_writer
# option), 24/44 B at d128; with the persistent backward (d64's default) also the producer's and the writer's column
# loops, 140/228 B at d64; none of it on the consumers' path (their SASS has no local memory access past the
# prologue; at d64 every access comes after the producer's setmaxnreg.dealloc).
HOPPER_BACKWARD_SPILL_ALLOWANCE = 256


def excess_spill_bytes(kernel_name: str, figures: dict) -> int:
    """Spills of the Hopper kernels beyond their allowances (Delta's: none)."""
    allowance = (FORWARD_SPILL_ALLOWANCE if "forward_kernel" in kernel_name else
                 HOPPER_BACKWARD_SPILL_ALLOWANCE if "hopper_dkdv_kernel" in kernel_name else 0)
    stores, loads = figures.get("spill_store_bytes", 0), figures.get("spill_load_bytes", 0)
    return 0 if max(stores, loads) <= allowance else stores + loads


@dataclass(frozen=True)
class Resources:
    """What one variant of the sm90 forward needs; `problems()` lists why it cannot be built."""

    config: KernelConfig

    @property
    def options(self) -> HopperOptions:
        return self.config.options if isinstance(self.config.options, HopperOptions) else HopperOptions()

    @property
    def fp8(self) -> bool:
        """An FP8 (e4m3) forward: 8-bit Q, K and V^T, O in bf16."""
        return self.config.dtype in FP8_DTYPES

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of Q, K or V (one head dim's row of keys in FP8's V^T, the same at block_n 128)."""
        return self.config.head_dim * (1 if self.fp8 else 2)

    @property
    def boxes(self) -> int:
        """128-byte boxes per row (the 128-byte swizzle's width)."""
        return self.row_bytes // 128

    def _storage_bytes(self, staged_boxes: int) -> int:
        t = self.config.tile
        q_buffers = 2 if self.fold_tiles else 1
        q = q_buffers * t.block_m * self.row_bytes
        kv = t.block_n * self.row_bytes
        # two consumer warpgroups' staging boxes (folded tiles: in the finished tile's Q, no bytes of their own)
        output = 0 if self.fold_tiles else 2 * staged_boxes * OUTPUT_BOX_BYTES
        tables = t.stages * 3 * t.block_n * 4
        barriers = 8 * (2 * q_buffers + 4 * t.stages + 4)
        slots = 2 * 48  # the persistent grid's two handed tiles (HandedTile: 12 int32)
        return -(-(q + 2 * t.stages * kv + output + tables + barriers + slots) // 1024) * 1024

    @property
    def fold_tiles(self) -> bool:
        """Whether the persistent forward folds each tile boundary into one step (the fold_tiles option): two Q
        buffers, O staged in the finished tile's."""
        return self.options.fold_tiles

    def _fold_problems(self) -> list[str]:
        c = self.config
        if not self.fold_tiles:
            return []
        if self.fp8 or c.head_dim not in (64, 128) or not self.options.persistent:
            return [f"option fold_tiles needs the persistent 16-bit forward at head_dim 64 or 128 (two Q buffers, O "
                    f"staged in one: d256's do not fit, FP8's 1-byte Q cannot hold a bf16 O), not "
                    f"{c.dtype} head_dim {c.head_dim}{'' if self.options.persistent else ' without persistent'}"]
        return []

    @property
    def output_staged_boxes(self) -> int:
        """How many of its O's boxes ([64 rows][64 columns], 16-bit) a consumer warpgroup's staging buffer holds: all
        (head_dim / 64) where they fit beside Q and the K/V ring, else half (d256: O leaves in two rounds), else 0 (the
        stores); 0 too where the output_by_tma option says so (0, or 1 at a head dim not in OUTPUT_BY_TMA_HEAD_DIMS)."""
        mode = self.options.output_by_tma
        if mode == 0 or (mode == 1 and self.config.head_dim not in OUTPUT_BY_TMA_HEAD_DIMS):
            return 0
        boxes = self.config.head_dim // 64
        limit = ARCH_TABLE[self.config.arch].shared_memory if self.config.arch in ARCH_TABLE else 0
        return next((staged for staged in (boxes, boxes // 2)
                     if staged and boxes % staged == 0 and self._storage_bytes(staged) + 1024 <= limit), 0)

    @property
    def output_by_tma(self) -> bool:
        """Whether the forward stores O by TMA from a staging buffer (output_staged_boxes)."""
        return self.output_staged_boxes > 0

    @property
    def shared_storage_bytes(self) -> int:
        """sizeof(SharedStorage): Q, stages x (K, V) in 128-byte rows, O's staging buffer (output_by_tma), stages x 3
        int32 key tables, then the barriers (Q full and empty, full + empty for K and V per stage, the persistent
        grid's two tile slots' full + empty) and the two slots' tile numbers, rounded up to the 1024-byte alignment."""
        return self._storage_bytes(self.output_staged_boxes)

    @property
    def shared_memory_bytes(self) -> int:
        """What the launch asks for: the storage plus 1 KB to align the dynamic base to 1024 bytes."""
        return self.shared_storage_bytes + 1024

    @property
    def softmax_chains(self) -> int:
        """The forward softmax's chains per row: the softmax_chains option, else the head dim's default."""
        return self.options.softmax_chains or SOFTMAX_CHAINS_BY_HEAD_DIM.get(self.config.head_dim, 1)

    @property
    def hopper_split_columns(self) -> bool:
        """Whether the Hopper backward's warpgroups share the CTA's 64 keys and split the head dims (d256)."""
        return self.config.tile.block_n == 64

    @property
    def hopper_split_scores(self) -> bool:
        """Whether the split-columns backward's warpgroups also split S^T and dP^T by query columns (the split_scores
        option), P^T going through shared memory."""
        return self.options.split_scores and self.hopper_split_columns

    @property
    def hopper_score_columns(self) -> int:
        """Query columns of S^T and dP^T per consumer warpgroup and step: half a step with split scores."""
        return HOPPER_STEP_ROWS // 2 if self.hopper_split_scores else HOPPER_STEP_ROWS

    @property
    def hopper_paired_dq(self) -> bool:
        """Whether the split-scores backward runs kv-tiles 2i and 2i + 1 as a cluster of two that trade dS^T and each
        add dQ for half the head dims over both CTAs' keys (the paired_dq option)."""
        return self.options.paired_dq and self.hopper_split_scores

    @property
    def hopper_tma_dq(self) -> bool:
        """Whether the module's Hopper backward adds dQ by TMA reduce-add from staged boxes (not with split
        columns: their dQ goes by per-thread atomics) -- what ordered dQ and the writer warp build on."""
        return not self.hopper_split_columns and not self.backward_problems()

    @property
    def hopper_ordered_dq(self) -> bool:
        """Whether deterministic mode runs the Hopper backward, its dQ additions ordered by kv-tile (not with split
        columns: their dQ goes by per-thread atomics, which no counter can order)."""
        return self.options.ordered_dq and self.hopper_tma_dq

    def _section_pairs(self, pairs_at_d128: int, power: int = 1) -> int:
        """A backward grid section of `pairs_at_d128` (head, batch) pairs at head dim 128, scaled by
        (128 / head_dim) ** power: with power 1 a section's Q and dO take the same bytes at any head dim (0 stays 0:
        no sections)."""
        if pairs_at_d128 <= 0:
            return 0
        return max(1, pairs_at_d128 * 128**power // self.config.head_dim**power)

    @property
    def ordered_section_pairs(self) -> int:
        """The ordered backward grid's section (the ordered_section_pairs option, scaled by the square of 128 / head
        dim: the same bytes per section, and at smaller head dims shorter steps against the same latency of each
        ordered dQ write, so fewer kv-tiles of one head per wave)."""
        return self._section_pairs(self.options.ordered_section_pairs, power=2)

    @property
    def atomic_section_pairs(self) -> int:
        """The atomic-order backward grid's section (the atomic_section_pairs option, scaled by head dim)."""
        return self._section_pairs(self.options.atomic_section_pairs)

    @property
    def hopper_dq_writer(self) -> bool:
        """Whether the atomic-order Hopper backward hands its dQ reductions to a writer warp (not with split
        columns: their dQ goes by per-thread atomics)."""
        return self.options.dq_writer and self.hopper_tma_dq

    @property
    def hopper_persistent_backward(self) -> bool:
        """Whether the atomic-order Hopper backward runs as a persistent grid taking its kv-tiles from a counter (the
        persistent_backward option: 1 at PERSISTENT_BACKWARD_HEAD_DIMS, 2 wherever it builds): with the writer warp and
        a sectioned grid, not with paired dQ (d64, d128)."""
        mode = self.options.persistent_backward
        if mode == 0 or (mode == 1 and self.config.head_dim not in PERSISTENT_BACKWARD_HEAD_DIMS):
            return False
        # (not hopper_dq_writer: its backward_problems() asks for the shared memory, which asks for this)
        return (self.options.dq_writer and not self.hopper_split_columns
                and self.atomic_section_pairs > 0 and not self.hopper_paired_dq)

    @property
    def hopper_dq_in_turns(self) -> bool:
        """Whether each step's dQ is computed by one consumer warpgroup, the two taking turns (the dq_in_turns
        option): at d64 only (DQ_IN_TURNS_HEAD_DIMS), and with the writer warp, which adds what the step's warpgroup
        staged."""
        return self.options.dq_in_turns and self.hopper_dq_writer and self.config.head_dim in DQ_IN_TURNS_HEAD_DIMS

    @property
    def hopper_shared_storage_bytes(self) -> int:
        """sizeof(hopper::SharedStorage): K and V, stages x (Q, dO) of a step (paired dQ: one dO), two dS^T buffers
        (split scores: one dS^T and two P^T; paired dQ: three slots for both), the step's dQ (fp32, on its way to TMA;
        none with split columns, whose dQ goes by atomics), paired dQ's peer tiles, stages x the rows' tables (lse,
        Delta, three token tables, a partial step's bits slot), then the barriers; rounded up to 1024 bytes."""
        t = self.config.tile
        kv = t.block_n * 128 * self.boxes
        rows = HOPPER_STEP_ROWS * 128 * self.boxes
        ds = t.block_n * HOPPER_STEP_ROWS * 2
        # dS^T x 2; split scores: dS^T + P^T x 2, or (paired dQ) a ring of three P^T / dS^T slots
        score_buffers = 3 if self.hopper_split_scores else 2
        dq = 0 if self.hopper_split_columns else HOPPER_STEP_ROWS * self.config.head_dim * 4
        stages = self.hopper_stages
        d_o_stages = 1 if self.hopper_paired_dq else stages
        # paired dQ: the peer's dS^T of two steps, and its K rows for this CTA's half of the head dims
        peer = 2 * ds + kv // 2 if self.hopper_paired_dq else 0
        # + the bits slot, padded to 16 bytes (bits_slot_in_tables)
        tables = stages * (5 * HOPPER_STEP_ROWS * 4 + (16 if self.options.bits_slot_in_tables else 0))
        barriers = 8 * (1 + 2 * stages + (4 if self.hopper_paired_dq else 0))  # paired: dO's full and empty, peer_full x 2
        # persistent: kv_empty, tile_full x 2, tile_empty x 2, and two handed columns of 16 bytes
        handed = 8 * 5 + 2 * 16 if self.hopper_persistent_backward else 0
        total = 2 * kv + (stages + d_o_stages) * rows + score_buffers * ds + dq + peer + tables + barriers + handed
        return -(-total // 1024) * 1024

    @property
    def hopper_producer_registers(self) -> int:
        """The Hopper backward's producer warpgroup's registers a thread (the backward_producer_registers option, 0:
        HOPPER_PRODUCER_REGISTERS)."""
        return self.options.backward_producer_registers or HOPPER_PRODUCER_REGISTERS

    @property
    def hopper_consumer_registers(self) -> int:
        """What is left a consumer thread: the pool less the producer's, over 256 threads, down to a multiple of 8."""
        return min(256, (HOPPER_REGISTER_POOL - 128 * self.hopper_producer_registers) // 256 // 8 * 8)

    @property
    def hopper_stages(self) -> int:
        """The Hopper backward's Q/dO ring depth: the backward_stages option, else the head dim's default."""
        return self.options.backward_stages or BACKWARD_STAGES_BY_HEAD_DIM.get(self.config.head_dim, HOPPER_STAGES)

    def backward_problems(self) -> list[str]:
        """Why the module has no backward: the Hopper kernel does not take its tile (or its options)."""
        c, t = self.config, self.config.tile
        if self.fp8:
            return [f"{c.dtype} variants have a forward only (an FP8 backward is not built)"]
        out = []
        block_n = HOPPER_BACKWARD_BLOCK_N.get(c.head_dim)
        if block_n is None:
            out.append(f"the Hopper backward covers head dims {HOPPER_BACKWARD_HEAD_DIMS}, not {c.head_dim}")
        elif t.block_n != block_n:
            shape = ("two warpgroups of 64 keys" if block_n == 128 else
                     "64 keys, the warpgroups splitting the head dims: dK and dV of 128 keys would not fit")
            out.append(f"the Hopper backward takes block_n {block_n} at head_dim {c.head_dim} ({shape}), not {t.block_n}")
        elif block_n == 64 and not self.options.split_columns:
            out.append(f"the Hopper backward for head_dim {c.head_dim} takes split columns, and this variant's "
                       "options turn them off (split_columns=False)")
        if not out and self.hopper_shared_storage_bytes + 1024 > ARCH_TABLE[c.arch].shared_memory:
            out.append(f"the Hopper backward needs {self.hopper_shared_storage_bytes + 1024} bytes of shared memory")
        return out

    def deterministic_problems(self) -> list[str]:
        """Why the module has no deterministic mode: no backward, or one that adds dQ in no fixed order."""
        if self.backward_problems() or self.hopper_ordered_dq:
            return self.backward_problems()
        if self.hopper_split_columns:
            return [f"the head_dim {self.config.head_dim} Hopper backward (split columns) adds dQ by per-thread atomics, "
                    "in no fixed order"]
        return ["this variant's options turn ordered dQ off (ordered_dq=False): its dQ is added in no fixed order"]

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
        if self.fp8 and (c.head_dim != FP8_HEAD_DIM or t.block_n not in FP8_BLOCK_N):
            out.append(f"the FP8 forward takes head_dim {FP8_HEAD_DIM} and block_n {', '.join(map(str, FP8_BLOCK_N))} "
                       f"(V^T in boxes of 64 or 128 keys, scores, output and P in registers), not head_dim "
                       f"{c.head_dim}, block_n {t.block_n}")
        registers = t.block_n // 2 + c.head_dim // 2 + t.block_n // (8 if self.fp8 else 4)
        if registers > MAX_TILE_REGISTERS:
            out.append(f"block_n {t.block_n} with head_dim {c.head_dim} needs {registers} registers per consumer thread "
                       f"for scores, output and P (at most {MAX_TILE_REGISTERS} fit): lower block_n")
        out += self._fold_problems()
        limit = ARCH_TABLE[c.arch].shared_memory
        if not out and self.shared_memory_bytes > limit:
            out.append(f"the tile needs {self.shared_memory_bytes} bytes of shared memory, {c.arch} allows {limit}: "
                       "lower block_n or stages")
        return out
