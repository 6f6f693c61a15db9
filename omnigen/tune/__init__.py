"""Auto-tuning: for the rules, find the fastest forward and backward config per shape on this GPU and
remember it. `job` decides what to compile and time (CPU), `measurement` verifies and times on the GPU,
`db` keeps the winners in the cache's tuning.json, `space` and `layouts` say what is tried on what.
"""

from __future__ import annotations

from ..jit.toolchain import visible_gpu_arch
from ..rules import Rules
from . import db as tune_db
from . import layouts as tune_layouts
from .job import DEFAULT_SEQ_LENS, Job, ShapeSpace, apply_builds, compile_candidates, prepare, reusable
from .measurement import count_steps, measure


def tune_kernel(rules: Rules, head_dim: int, dtype: str, seq_lens: tuple[int, ...] | None = None,
                tokens: int = tune_layouts.DEFAULT_TOKENS) -> dict[int, tune_db.Choice]:
    """Tune one (head dim, dtype) on the visible GPU -- or reuse the database when it already holds the
    same job -- and return the kernel's choices per bucket."""
    arch = visible_gpu_arch()
    if arch is None:
        raise RuntimeError("tuning needs a CUDA GPU, and none is visible")
    device = tune_db.Device.current()
    job = prepare(rules, [head_dim], [dtype], arch, device, seq_lens, tokens=tokens)
    if not reusable(job):
        compile_candidates(job)
        if any(c.forward for s in job.spaces for c in s.candidates):
            measure(job)
    return tune_db.lookup(device, rules, dtype, head_dim, arch)


__all__ = ["DEFAULT_SEQ_LENS", "Job", "ShapeSpace", "apply_builds", "compile_candidates", "count_steps", "measure",
           "prepare", "reusable", "tune_kernel"]
