"""The tuning database: what won, per shape, on which GPU and toolchain -- and whether it still holds.

One JSON file under the cache dir (cache.py reads and writes it; this module decides what goes in).
An entry is keyed by

    GPU name | compute capability | nvcc version | rules hash | dtype | head dim | sequence bucket

(the rules hash leaves out the rules' `kernel:` section: it picks what to build, not what a mask
costs). Its metadata -- the database format, the omnigen version and a digest of every kernel
template -- decides staleness: a template change makes every timing meaningless, so such entries
are ignored (and shown as stale by `omnigen cache list`) until the shapes are tuned again.

Sequence buckets are powers of two, a length going to the nearest one in log scale (2800 -> 2048,
3000 -> 4096). A kernel asks for its shape's bucket and, when that bucket was not tuned, takes the
nearest tuned bucket of the same key (tile preferences change slowly with length); with nothing
tuned it runs its default config.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..version import __version__
from ..jit import cache
from ..jit.codegen import template_digest
from ..kernels import backward_problems, problems
from ..rules import Rules
from ..targets import KernelConfig, TileConfig

FORMAT = 1
MIN_BUCKET = 16

_generation = 0  # bumped by record(): in-process users of the database (omnigen.attention) re-read it
_listeners: list[Callable[[], None]] = []  # told after each record(): e.g. the op shim drops its launch choices


def on_record(listener: Callable[[], None]) -> None:
    """Call `listener()` after every record() in this process."""
    _listeners.append(listener)


def record(entries: Mapping[str, Mapping[str, Any]]) -> None:
    """Write new entries into the tuning database (the cache writes the file) and tell this process."""
    global _generation
    cache.update_tuning_db(dict(entries))
    _generation += 1
    for listener in _listeners:
        listener()


def generation() -> int:
    """How many times this process has written the database: a kernel made before the last write is stale."""
    return _generation


@dataclass(frozen=True)
class Device:
    """What about the machine decides which timings apply: the GPU model, its capability, the compiler."""

    gpu: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"
    capability: str  # "9.0"
    nvcc: str  # "13.0.88"

    @classmethod
    def current(cls, device: Any = None) -> "Device":
        """The visible GPU (or `device`) and the toolchain that builds for it. Needs CUDA."""
        import torch

        from ..jit.toolchain import find_toolchain

        major, minor = torch.cuda.get_device_capability(device)
        return cls(torch.cuda.get_device_name(device), f"{major}.{minor}", find_toolchain().nvcc_version)


def seq_bucket(seq_len: int) -> int:
    """The power of two nearest to seq_len in log scale (at least MIN_BUCKET)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return max(MIN_BUCKET, 1 << round(math.log2(seq_len)))


def rules_hash(rules: Rules) -> str:
    return rules.without_kernel().content_hash()


def entry_key(device: Device, rules: Rules | str, dtype: str, head_dim: int, bucket: int) -> str:
    digest = rules if isinstance(rules, str) else rules_hash(rules)
    return f"{device.gpu}|sm{device.capability}|nvcc{device.nvcc}|{digest}|{dtype}|d{head_dim}|S{bucket}"


def stamp() -> dict[str, Any]:
    """The metadata that makes an entry fresh: format, omnigen version, kernel templates."""
    return {"format": FORMAT, "omnigen": __version__, "templates": template_digest()[:16]}


def staleness(entry: Mapping[str, Any], current: Mapping[str, Any] | None = None) -> str | None:
    """Why an entry no longer applies (None when it does)."""
    current = current or stamp()
    meta = entry.get("meta")
    if not isinstance(meta, Mapping):
        return "no metadata"
    if meta.get("format") != current["format"]:
        return f"database format {meta.get('format')} (now {current['format']})"
    if meta.get("templates") != current["templates"]:
        return "kernel templates changed since it was tuned"
    if meta.get("omnigen") != current["omnigen"]:
        return f"tuned by omnigen {meta.get('omnigen')} (now {current['omnigen']})"
    forward = entry.get("forward")
    if not isinstance(forward, Mapping) or tile_from_dict(forward.get("tile")) is None:
        return "no forward winner"
    backward = entry.get("backward")
    if isinstance(backward, Mapping) and tile_from_dict(backward.get("tile")) is None:
        return f"backward tile {backward.get('tile')!r} is unreadable"
    return None


def tile_to_dict(tile: TileConfig) -> dict[str, int]:
    return {"block_m": tile.block_m, "block_n": tile.block_n, "warps": tile.warps, "stages": tile.stages}


def tile_from_dict(data: Any) -> TileConfig | None:
    if not isinstance(data, Mapping):
        return None
    try:
        values = {k: int(data[k]) for k in ("block_m", "block_n", "warps", "stages")}
    except (KeyError, TypeError, ValueError):
        return None
    return TileConfig(**values)


def make_entry(
    device: Device, rules: Rules, dtype: str, head_dim: int, bucket: int, *,
    forward: Mapping[str, Any], backward: Mapping[str, Any] | None, default: Mapping[str, Any],
    candidates: list[Mapping[str, Any]], space: list[str], workload: Mapping[str, Any],
) -> dict[str, Any]:
    """One database entry. forward/backward: {"tile": dict, "ms": float, "tflops": float}; candidates:
    every candidate's row as measured (for the table and for `omnigen cache list`)."""
    return {
        "gpu": device.gpu, "capability": device.capability, "nvcc": device.nvcc,
        "rules_name": rules.name, "rules_hash": rules_hash(rules), "dtype": dtype, "head_dim": head_dim,
        "seq_bucket": bucket, "forward": dict(forward), "backward": dict(backward) if backward else None,
        "default": dict(default), "candidates": [dict(c) for c in candidates], "space": list(space),
        "workload": dict(workload),
        "meta": {**stamp(), "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    }


def entries_for(device: Device, rules: Rules, dtype: str, head_dim: int,
                db: Mapping[str, Mapping[str, Any]] | None = None) -> dict[int, Mapping[str, Any]]:
    """Fresh entries of one (device, rules, dtype, head dim), by sequence bucket."""
    db = cache.read_tuning_db() if db is None else db
    prefix = entry_key(device, rules, dtype, head_dim, 0)[: -len("0")]
    current = stamp()
    out: dict[int, Mapping[str, Any]] = {}
    for key, entry in db.items():
        if not key.startswith(prefix) or staleness(entry, current) is not None:
            continue
        try:
            out[int(key[len(prefix):])] = entry
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class Choice:
    """The configs one shape runs: the forward's and the backward's (equal when one tile won both)."""

    forward: KernelConfig
    backward: KernelConfig


def choices(entries: Mapping[int, Mapping[str, Any]], head_dim: int, dtype: str, arch: str) -> dict[int, Choice]:
    """Bucket -> Choice for fresh entries; a winner that cannot be built any more is skipped."""
    out: dict[int, Choice] = {}
    for bucket, entry in entries.items():
        forward = tile_from_dict((entry.get("forward") or {}).get("tile"))
        backward = tile_from_dict((entry.get("backward") or {}).get("tile")) or forward
        if forward is None:
            continue
        configs = [KernelConfig(head_dim, dtype, arch, t) for t in (forward, backward)]
        if problems(configs[0]) or problems(configs[1]):
            continue
        if backward_problems(configs[1]):  # a backward winner must have a backward kernel
            configs[1] = configs[0]
        out[bucket] = Choice(*configs)
    return out


def nearest(table: Mapping[int, Any], seq_len: int) -> Any | None:
    """The value for seq_len's bucket, else for the nearest tuned bucket (log scale; ties go up)."""
    if not table:
        return None
    bucket = seq_bucket(seq_len)
    if bucket in table:
        return table[bucket]
    best = min(table, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), -b))
    return table[best]


def lookup(device: Device, rules: Rules, dtype: str, head_dim: int, arch: str) -> dict[int, Choice]:
    """The tuned choices a kernel for (rules, dtype, head dim) on this device should dispatch to."""
    return choices(entries_for(device, rules, dtype, head_dim), head_dim, dtype, arch)


def describe(entry: Mapping[str, Any]) -> dict[str, str]:
    """Short strings of one entry for listings."""
    def tile_label(part: str) -> str:
        tile = tile_from_dict((entry.get(part) or {}).get("tile"))
        return tile.label if tile else "-"

    def ms(part: str) -> str:
        value = (entry.get(part) or {}).get("ms")
        return f"{value:.3f}" if isinstance(value, (int, float)) else "-"

    return {"forward": tile_label("forward"), "forward_ms": ms("forward"),
            "backward": tile_label("backward"), "backward_ms": ms("backward")}


__all__ = ["Choice", "Device", "FORMAT", "choices", "describe", "entries_for", "entry_key", "lookup", "make_entry",
           "nearest", "rules_hash", "seq_bucket", "staleness", "stamp", "tile_from_dict", "tile_to_dict"]
