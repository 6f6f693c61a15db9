"""The sm90 family's tuning candidates per head dim (block_m 128 and 12 warps throughout)."""

from __future__ import annotations

from ...targets import TileConfig


def _tiles(*shapes: tuple[int, int]) -> tuple[TileConfig, ...]:
    return tuple(TileConfig(128, block_n, 12, stages) for block_n, stages in shapes)


# FlashAttention-3 found 128 x 176 best for d64 and 128 x 128 (d128), 128 x 80 (d256) on H100; the
# space holds those beside the power-of-two shapes the sm80 backward can share a plan with.
DEFAULT_SPACE: dict[int, tuple[TileConfig, ...]] = {
    64: _tiles((128, 2), (176, 2), (192, 2), (128, 3)),
    128: _tiles((128, 2), (176, 2), (128, 3), (64, 2)),
    256: _tiles((64, 2), (80, 2), (64, 3)),
}
