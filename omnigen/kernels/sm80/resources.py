"""The sm80 family's resource model: what one variant needs, and which variants its templates accept.

Shared memory per CTA, fp32 accumulators per thread, thread/copy divisibility, the backward's own
limits: checked here before anything compiles, so a config that cannot work is refused with a
sentence saying why (and the tuner never spends a compile on it). ptxas has the last word on
registers (`SPILL_ALLOWANCE_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...targets import ARCH_TABLE, DEFAULT_TILE, FP8_DTYPES, KernelConfig, TileConfig

# head_dim 256 needs half the rows per warp to keep the fp32 output accumulators in registers.
DEFAULT_TILE_D256 = TileConfig(block_m=64, block_n=32, warps=4, stages=2)

# fp32 output accumulators one thread may hold (rows per warp / 16 * head_dim / 2) before the
# scores, fragments and addresses no longer fit beside them in 255 registers.
MAX_OUTPUT_ACCUMULATORS = 128
# Bytes of spill stores (and, separately, loads) ptxas may report for a kernel before it counts as not
# fitting its registers. The forward's partial path keeps every key column's tables in registers across
# the rows (3x fewer shared loads; partial tiles 2.2x -> 1.4x a full tile at d128), which moves one or
# two per-kv-tile values to the stack, outside the step loops (SASS in benchmarks/RESULTS.md). A spill
# inside the step loops is larger: 64-key steps at d128 spilled 36-92 bytes there.
# The dK/dV kernel's 2-D warp layouts hold 128 fp32 dK/dV accumulators per thread at d128 beside 32
# scores, so ptxas parks step-invariant addresses and bounds on the stack: none on the full path, a few
# loads per step (not per mma) on the causal and partial paths (76-136 bytes; up to 340 with one P^T/dS^T
# buffer on sm_90a). Measured against the spill-free one-warp-per-16-keys layout it replaced: 5-11%
# faster on every tile (RESULTS.md). Beyond these figures a config has outgrown its registers.
SPILL_ALLOWANCE_BYTES = {"forward_kernel": 16, "dkdv_kernel": 384}


def spill_allowance(kernel_name: str) -> int:
    """The spill bytes (stores or loads) tolerated in the kernel whose (mangled) name is given."""
    return next((limit for kernel, limit in SPILL_ALLOWANCE_BYTES.items() if kernel in kernel_name), 0)


def excess_spill_bytes(kernel_name: str, figures: dict) -> int:
    """Spilled bytes (stores + loads) of one kernel's ptxas figures, or 0 when within its allowance."""
    stores, loads = figures.get("spill_store_bytes", 0), figures.get("spill_load_bytes", 0)
    return 0 if max(stores, loads) <= spill_allowance(kernel_name) else stores + loads


def default_tile(head_dim: int, dtype: str = "bf16") -> TileConfig:  # the same tile for bf16 and fp16
    return DEFAULT_TILE_D256 if head_dim > 128 else DEFAULT_TILE


@dataclass(frozen=True)
class Resources:
    """What one variant of the sm80 templates needs; `problems()` lists why it cannot be built."""

    config: KernelConfig

    @property
    def shared_memory_bytes(self) -> int:
        """sizeof(SharedStorage) in the kernel: Q tile, stages x (K tile, V tile, 3 int32 key tables),
        3 int32 query tables."""
        element = 2
        t = self.config.tile
        stage = 2 * t.block_n * self.config.head_dim * element + 12 * t.block_n
        return t.block_m * self.config.head_dim * element + t.stages * stage + 12 * t.block_m

    @property
    def keys_per_step(self) -> int:
        """Keys the kernel scores per online-softmax step: the whole kv-tile, unless its fp32 scores
        would not fit in registers beside the output accumulators (then 32 at a time)."""
        row_blocks = max(self.config.tile.block_m // self.config.tile.warps // 16, 1)
        if row_blocks * self.config.head_dim >= 256 and self.config.tile.block_n > 32 and self.config.tile.block_n % 32 == 0:
            return 32
        return self.config.tile.block_n

    # ---- the backward (sm80/templates/backward.cu.j2). It plans with the forward's tile (one Plan serves
    # both passes); its thread counts follow from the tile: a warp per 16 keys in the dK/dV kernel,
    # 16 query rows per warp in the deterministic dQ kernel.

    BACKWARD_STEP_ROWS = 64  # query rows per pipeline step of the dK/dV kernel

    @property
    def backward_step_tiles(self) -> int:
        """Buffers for a step's P^T and dS^T in the dK/dV kernel: 2 (side by side), or 1 (dS^T over P^T
        once every warp has used it: two more barriers per step). Tiles of up to 64 keys take one, so that
        two CTAs share an SM (their registers allow it; at d128 two buffers would not fit twice)."""
        return 1 if self.config.tile.block_n <= 64 else 2

    @property
    def backward_warps(self) -> int:
        return self.config.tile.block_n // 16

    @property
    def dq_warps(self) -> int:
        return self.config.tile.block_m // 16

    @property
    def backward_shared_bytes(self) -> int:
        """sizeof(DkdvShared): K and V tiles, P^T and dS^T [block_n][64] (backward_step_tiles buffers), 2
        stages of (64 rows of Q and dO, their lse, Delta and 3 int32 token tables), 3 int32 key tables."""
        n, d, rows = self.config.tile.block_n, self.config.head_dim, self.BACKWARD_STEP_ROWS
        stage = 2 * rows * d * 2 + 2 * 4 * rows + 12 * rows
        return 2 * n * d * 2 + self.backward_step_tiles * n * rows * 2 + 2 * stage + 12 * n

    @property
    def dq_shared_bytes(self) -> int:
        """sizeof(DqShared): Q and dO tiles, 2 stages of (K, V tiles and 3 int32 key tables), 3 int32 query tables."""
        m, n, d = self.config.tile.block_m, self.config.tile.block_n, self.config.head_dim
        return 2 * m * d * 2 + 2 * (2 * n * d * 2 + 12 * n) + 12 * m

    def backward_problems(self) -> list[str]:
        """Why this variant's module has no backward (empty when it has one). The forward is unaffected."""
        t = self.config.tile
        out: list[str] = []
        if self.config.head_dim > 128:
            out.append(f"the backward holds dK and dV of 16 keys x head_dim in registers per warp: head_dim {self.config.head_dim} "
                       "needs 256 fp32 registers per thread for them (at most 128 fit)")
        if t.block_m % self.BACKWARD_STEP_ROWS:
            out.append(f"the backward walks q-tiles {self.BACKWARD_STEP_ROWS} rows at a time: block_m ({t.block_m}) "
                       f"must be a multiple of {self.BACKWARD_STEP_ROWS}")
        warps = self.backward_warps
        if t.block_n % 16 or not (warps % 4 == 0 or 4 % warps == 0) or warps > 32:
            out.append(f"the backward runs a warp per 16 keys: block_n ({t.block_n}) must be 16, 32 or a multiple of 64 up to 512")
        if t.block_n > 64 and t.block_n % 64:
            out.append(f"the deterministic dQ kernel scores 64 keys per step: block_n ({t.block_n}) must be <= 64 or a multiple of 64")
        if self.dq_warps > 32:
            out.append(f"the dQ kernel gives each warp 16 query rows: block_m ({t.block_m}) must be at most 512")
        chunks = self.config.head_dim // 8
        bwd_threads, dq_threads = 32 * warps, 32 * self.dq_warps
        if warps and ((self.BACKWARD_STEP_ROWS * chunks) % bwd_threads or (t.block_n * chunks) % bwd_threads
                      or bwd_threads % chunks):
            out.append(f"the dK/dV kernel's {bwd_threads} threads cannot split the copies of {chunks} chunks per row evenly")
        if (t.block_n * chunks) % dq_threads or (t.block_m * chunks) % dq_threads or dq_threads % chunks:
            out.append(f"the dQ kernel's {dq_threads} threads cannot split the copies of {chunks} chunks per row evenly")
        if not out:
            limit = ARCH_TABLE[self.config.arch].shared_memory
            needed = max(self.backward_shared_bytes, self.dq_shared_bytes)
            if needed > limit:
                out.append(f"the backward needs {needed} bytes of shared memory, {self.config.arch} allows {limit}: "
                           "lower block_m or block_n")
        return out

    def problems(self) -> list[str]:
        """Why this variant cannot be built (empty when it can)."""
        out = self.config.identity_problems()
        if out:
            return out
        if self.config.dtype in FP8_DTYPES:
            return [f"the sm80 family has no FP8 kernels: {self.config.dtype} runs on the sm90 family (sm_90a: H100, H200)"]
        t = self.config.tile
        if t.block_m % (16 * t.warps):
            out.append(f"block_m ({t.block_m}) must be a multiple of 16 x warps ({16 * t.warps}): each warp owns whole 16-row blocks")
        if t.block_n % 16:
            out.append(f"block_n ({t.block_n}) must be a multiple of 16")
        chunks = self.config.head_dim // 8
        if (t.block_m * chunks) % self.config.threads or (t.block_n * chunks) % self.config.threads:
            out.append(f"block_m and block_n times head_dim/8 ({chunks}) must be multiples of the thread count ({self.config.threads})")
        rows_per_thread_blocks = max(t.block_m // t.warps // 16, 1)
        accumulators = rows_per_thread_blocks * self.config.head_dim // 2
        if accumulators > MAX_OUTPUT_ACCUMULATORS:
            suggestion = 16 * t.warps * max(1, MAX_OUTPUT_ACCUMULATORS * 2 // self.config.head_dim)
            out.append(
                f"head_dim {self.config.head_dim} with {t.block_m // t.warps} rows per warp needs {accumulators} fp32 output "
                f"registers per thread (at most {MAX_OUTPUT_ACCUMULATORS} fit): use block_m <= {suggestion} "
                f"or more warps"
            )
        limit = ARCH_TABLE[self.config.arch].shared_memory
        if self.shared_memory_bytes > limit:
            out.append(
                f"the tile needs {self.shared_memory_bytes} bytes of shared memory, {self.config.arch} allows {limit}: "
                f"lower block_m, block_n or stages"
            )
        return out
