"""The tuning job: for the rules, find the fastest forward and backward config per shape on this GPU, and
remember it (tune.db). The steps, each its own function so the CLI can show progress between them:

    job = prepare(rules, head_dims, dtypes, arch, device)      # candidate space, layouts per bucket (CPU)
    reused = reusable(job)                                     # fresh database entries for the same job
    notes = compile_candidates(job)                            # one parallel ninja graph, keep going
    entries = measure(job)                                     # verify, time, pick, write the database

The space comes from tune.space (rules' tiles or the kernel family's candidates, pruned before compiling and
again by ptxas after). Every candidate is verified once before it is timed: against a float64
reference on a small case of the rules' own layouts (forward and backward), and against the
default config's output on the timed inputs -- a fast wrong kernel is disqualified, not picked.
Timing (tune.timing, in tune.measurement): CUDA events, warm-up, L2 flush, candidates interleaved round-robin, median
of rounds x reps runs, forward and backward separately. A candidate replaces the default for a
pass only when its median is more than WIN_MARGIN faster: within the noise the default stays, so
the tuned choice is never measurably slower than the default of the same run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..jit import cache
from ..jit.toolchain import Toolchain
from ..layout import Layout
from ..rules import Rules
from ..targets import KernelConfig
from . import db as tune_db
from . import layouts as tune_layouts
from . import space as tune_space

DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
HEADS = 16
SYNTHETIC_WORKLOAD = "synthetic-v1"


@dataclass
class ShapeSpace:
    """The candidates of one (head dim, dtype) and what was pruned before compiling."""

    head_dim: int
    dtype: str
    default: KernelConfig
    candidates: list[tune_space.Candidate]
    pruned: list[tuple[KernelConfig, str]]
    failed: dict[KernelConfig, str] = field(default_factory=dict)  # compile failures: score infinity

    @property
    def labels(self) -> list[str]:
        return [c.label for c in self.candidates]


@dataclass
class Job:
    rules: Rules
    arch: str
    device: tune_db.Device
    spaces: list[ShapeSpace]
    layouts: dict[int, list[Layout]]  # sequence bucket -> the batch timed for it
    workload: dict[str, Any]
    heads: int = HEADS

    def key(self, space: ShapeSpace, bucket: int) -> str:
        return tune_db.entry_key(self.device, self.rules, space.dtype, space.head_dim, bucket)

    @property
    def configs(self) -> list[KernelConfig]:
        return [c.config for s in self.spaces for c in s.candidates]


def prepare(rules: Rules, head_dims: list[int] | tuple[int, ...], dtypes: list[str] | tuple[str, ...], arch: str,
            device: tune_db.Device, seq_lens: tuple[int, ...] | list[int] | None = None,
            layouts_file: str | Path | None = None, tokens: int = tune_layouts.DEFAULT_TOKENS) -> Job:
    """The whole tuning job, decided on the CPU: spaces per (head dim, dtype), layouts per bucket."""
    spaces = []
    for head_dim in head_dims:
        for dtype in dtypes:
            candidates, pruned = tune_space.candidate_space(rules, head_dim, dtype, arch)
            spaces.append(ShapeSpace(head_dim, dtype, tune_space.default_config(rules, head_dim, dtype, arch),
                                     candidates, pruned))
    if layouts_file is not None:
        user = tune_layouts.read_layouts_file(layouts_file, rules)
        layouts = tune_layouts.bucket_user_layouts(user, tokens)
        if seq_lens:
            wanted = {tune_db.seq_bucket(s) for s in seq_lens}
            layouts = {b: ls for b, ls in layouts.items() if b in wanted}
        digest = hashlib.sha256("\n".join(str(layout) for layout in user).encode()).hexdigest()[:16]
        workload = {"layouts": f"file:{digest}", "source": str(layouts_file)}
    else:
        buckets = sorted({tune_db.seq_bucket(s) for s in (seq_lens or DEFAULT_SEQ_LENS)})
        layouts = {b: tune_layouts.synthetic_batch(rules, b, tokens) for b in buckets}
        workload = {"layouts": SYNTHETIC_WORKLOAD}
    workload.update(tokens=tokens, heads=HEADS)
    return Job(rules, arch, device, spaces, layouts, workload)


def reusable(job: Job, db: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Mapping[str, Any]]:
    """Fresh entries for every (shape, bucket) of the job, tuned over the same space and workload; empty
    unless all of them are there (then nothing needs timing again)."""
    db = cache.read_tuning_db() if db is None else db
    current = tune_db.stamp()
    found = {}
    for space in job.spaces:
        for bucket in job.layouts:
            key = job.key(space, bucket)
            entry = db.get(key)
            workload = (entry or {}).get("workload") or {}
            if (entry is None or tune_db.staleness(entry, current) is not None or entry.get("space") != space.labels
                    or any(workload.get(k) != job.workload[k] for k in ("layouts", "tokens", "heads"))):
                return {}
            found[key] = entry
    return found


# ------------------------------------------------------------------------------------------------
# compiling


def compile_candidates(job: Job, toolchain: Toolchain | None = None, jobs: int | None = None,
                       on_progress: Callable[[int, int, str], None] | None = None) -> list[str]:
    """Build every candidate as one ninja graph, keeping going past failures; then apply_builds()."""
    variants = [cache.variant(job.rules, config, toolchain) for config in job.configs]
    results = cache.build_variants(variants, jobs=jobs, on_progress=on_progress, keep_going=True)
    return apply_builds(job, results)


def apply_builds(job: Job, results: list[cache.BuildResult]) -> list[str]:
    """Record what the build said in the job: a candidate that failed to compile scores infinity (it
    leaves the timed list, its failure stays in the table); a pass whose kernel spills is pruned
    (ptxas). Returns one line per candidate pruned here."""
    by_config = {r.variant.config: r for r in results}
    notes = []
    for space in job.spaces:
        kept = []
        for candidate in space.candidates:
            result = by_config[candidate.config]
            if result.error is not None:
                space.failed[candidate.config] = result.error
                continue
            pruned = tune_space.prune_by_ptxas(candidate, result.meta.get("ptxas") or {})
            for before, after in ((candidate.forward_problem, pruned.forward_problem),
                                  (candidate.backward_problem, pruned.backward_problem)):
                if after != before:
                    notes.append(f"{candidate.config.label}: {after}")
            kept.append(pruned)
        space.candidates = kept
    return notes
