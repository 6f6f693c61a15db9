"""The sm90 family's tuning candidates per head dim (block_m 128 and 12 warps throughout)."""

from __future__ import annotations

from ...targets import TileConfig


def _tiles(*shapes: tuple[int, int]) -> tuple[TileConfig, ...]:
    return tuple(TileConfig(128, block_n, 12, stages) for block_n, stages in shapes)


# Wider kv-tiles amortise each step's fixed costs (barrier waits, row max, rescale) over more keys, as
# far as the consumer's registers allow (resources.MAX_TILE_REGISTERS). The tiles the Hopper backward takes
# (block_n 128 at d64 and d128, 64 at d256) are the candidates with a backward; the others are forward-only.
DEFAULT_SPACE: dict[int, tuple[TileConfig, ...]] = {
    64: _tiles((128, 2), (176, 2), (192, 2), (128, 3)),
    128: _tiles((128, 2), (160, 2), (96, 2), (64, 2)),
    256: _tiles((64, 2), (48, 2)),
}
