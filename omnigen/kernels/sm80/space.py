"""The sm80 family's tuning candidates per head dim (the tuner compiles and times these)."""

from __future__ import annotations

from ...targets import TileConfig

T = TileConfig
# Per head dim: the default tile first, then shapes that trade rows per warp (registers), kv-tile
# width (fewer, longer inner loops; fewer dK/dV CTAs in the backward), warps and pipeline depth.
# Measured earlier on an H200 (RESULTS.md, issue 4): 128x128 / 8 warps is 8% faster for the d128
# backward and 5% slower for its forward -- the kind of split this space is meant to find.
DEFAULT_SPACE: dict[int, tuple[TileConfig, ...]] = {
    64: (T(128, 64, 4, 2), T(128, 128, 8, 2), T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 64, 4, 3), T(64, 128, 4, 2)),
    128: (T(128, 64, 4, 2), T(128, 128, 8, 2), T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 64, 4, 3), T(64, 128, 4, 2)),
    256: (T(64, 32, 4, 2), T(64, 64, 4, 2), T(64, 32, 4, 3), T(128, 64, 8, 2)),
}
