"""Verifying and timing a tuning job's candidates on the GPU, picking the winners, writing the database.

A candidate is first checked against a float64 reference on a small case of the rules' own layouts
(forward and backward), then against the default config's output on the timed inputs: a fast
wrong kernel is disqualified, not picked. Timing: CUDA events, warm-up, L2 flush, candidates
interleaved round-robin, median of rounds x reps runs, forward and backward separately. A candidate
replaces the default for a pass only when its median is more than WIN_MARGIN faster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from ..jit import cache
from ..kernels import TORCH_DTYPES, family_of
from ..layout import LayoutBatch
from ..targets import KernelConfig
from . import db as tune_db
from . import layouts as tune_layouts
from . import space as tune_space
from . import timing as tune_timing
from .job import Job

WIN_MARGIN = 0.01  # a candidate must beat the default's median by more than 1% to replace it
VERIFY_SEQ_LEN = 1000  # not a multiple of any tile: the last q/kv tiles are ragged

Progress = Callable[[int], None]


def _close(got, ref, relative: float = 2e-2, absolute: float = 1e-3) -> str | None:
    """None when got matches ref (float64) within relative * max|ref| + absolute, else the error found."""
    import torch

    if torch.isnan(got).any():
        return "NaN in the output"
    error = (got.double() - ref.double()).abs().max().item()
    bound = relative * ref.double().abs().max().item() + absolute
    return None if error <= bound else f"max error {error:.3g} > {bound:.3g}"


def _verification_case(job: Job, head_dim: int, dtype: str, device: str):
    """A small case of the rules' own layouts (B=2, GQA 4:2, S not a multiple of any tile) and its float64
    reference forward and gradients."""
    import random

    import torch

    from ..reference import attention_reference, attention_reference_grads

    torch_dtype = TORCH_DTYPES[dtype]
    rng = random.Random(f"verify:{job.rules.name}")
    batch = LayoutBatch([tune_layouts.synthetic_layout(job.rules, VERIFY_SEQ_LEN, rng) for _ in range(2)])
    g = torch.Generator(device=device).manual_seed(1234)
    q = torch.randn(2, 4, VERIFY_SEQ_LEN, head_dim, device=device, dtype=torch_dtype, generator=g)
    k, v = (torch.randn(2, 2, VERIFY_SEQ_LEN, head_dim, device=device, dtype=torch_dtype, generator=g) for _ in range(2))
    d_out = torch.randn_like(q)
    mask = job.rules.dense_mask(batch, device=device)
    out, lse = attention_reference(q, k, v, mask)
    grads = attention_reference_grads(q, k, v, mask, d_out)
    return batch, (q, k, v, d_out), (out, lse), grads


def _verify(job: Job, candidate: tune_space.Candidate, module: Any, case) -> tune_space.Candidate:
    """Check one candidate against the float64 reference; a pass that is wrong is disqualified."""
    from ..plan import plan

    family = family_of(candidate.config)
    batch, (q, k, v, d_out), (out_ref, lse_ref), grads_ref = case
    tile = candidate.config.tile
    p = plan(job.rules, batch, tile.block_m, tile.block_n, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    forward_problem, backward_problem = candidate.forward_problem, candidate.backward_problem
    out, _ = family.forward(module, p, q, k, v, scale)
    wrong = _close(out, out_ref)
    if wrong and candidate.forward:
        forward_problem = f"wrong forward output vs float64 ({wrong})"
    if candidate.backward:
        # The backward is checked on the reference's own forward output: a wrong forward does not
        # disqualify a correct backward.
        dq, dk, dv = family.backward(module, p, q, k, v, out_ref.to(q.dtype), lse_ref.float(), d_out, scale)
        for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
            wrong = _close(got, ref)
            if wrong:
                backward_problem = f"wrong {name} vs float64 ({wrong})"
                break
    return replace(candidate, forward_problem=forward_problem, backward_problem=backward_problem)


@dataclass
class _Timed:
    candidate: tune_space.Candidate
    module: Any
    plan: Any  # planned with the candidate's block_m x block_n: its forward and its backward use it
    fwd_ms: float = math.inf
    bwd_ms: float = math.inf


def _pick(default: str, medians: Mapping[str, float]) -> str | None:
    """The winner of one pass: the fastest, unless the default is within WIN_MARGIN of it."""
    finite = {name: ms for name, ms in medians.items() if math.isfinite(ms)}
    if not finite:
        return None
    best = min(finite, key=finite.get)
    if default in finite and finite[best] > finite[default] * (1 - WIN_MARGIN):
        return default
    return best


def count_steps(job: Job, rounds: int) -> int:
    """Progress-bar length of measure(): one step per timing round, forward and backward, per shape."""
    return len(job.spaces) * len(job.layouts) * 2 * rounds


def measure(job: Job, rounds: int = tune_timing.DEFAULT_ROUNDS, reps: int = tune_timing.DEFAULT_REPS,
            on_step: Progress | None = None, write: bool = True, device: str = "cuda") -> dict[str, dict[str, Any]]:
    """Verify and time every candidate of every (shape, bucket); pick winners; write the database.

    Returns the new entries by key (tune_db.make_entry). `device` is "cuda" but for the CPU test of
    this orchestration (with stand-ins for the kernels and the timer)."""
    import torch

    from ..plan import plan

    step = on_step or (lambda _n: None)
    entries: dict[str, dict[str, Any]] = {}
    for space in job.spaces:
        torch_dtype = TORCH_DTYPES[space.dtype]
        family = family_of(space.default)
        forward_pass, backward_pass = family.forward, family.backward
        modules = {c.config: cache.get_module(job.rules, c.config) for c in space.candidates}
        case = _verification_case(job, space.head_dim, space.dtype, device)
        verified = [_verify(job, c, modules[c.config], case) for c in space.candidates]
        del case
        scale = 1.0 / math.sqrt(space.head_dim)
        for bucket, layouts in sorted(job.layouts.items()):
            batch = LayoutBatch(layouts)
            B, S, H, D = batch.batch_size, batch.seq_len, job.heads, space.head_dim
            g = torch.Generator(device=device).manual_seed(bucket + D)
            q, k, v, d_out = (torch.randn(B, H, S, D, device=device, dtype=torch_dtype, generator=g) for _ in range(4))
            plans: dict[tuple[int, int], Any] = {}

            def plan_for(config: KernelConfig):
                shape = (config.tile.block_m, config.tile.block_n)
                if shape not in plans:
                    plans[shape] = plan(job.rules, batch, *shape, device=device)
                return plans[shape]

            timed = {c.label: _Timed(c, modules[c.config], plan_for(c.config)) for c in verified}
            default_label = space.default.tile.label
            # The anchor: the default config's results on the timed inputs (the first verified candidate
            # if the default itself failed); every other candidate must agree with it before it is timed.
            order = [t for t in (timed.get(default_label), *timed.values()) if t is not None]
            anchor_fwd = next((t for t in order if t.candidate.forward), None)
            anchor_bwd = next((t for t in order if t.candidate.backward), None)
            problems: dict[str, dict[str, str]] = {label: {} for label in timed}
            out_ref = lse_ref = None
            if anchor_fwd is not None:
                out_ref, lse_ref = forward_pass(anchor_fwd.module, anchor_fwd.plan, q, k, v, scale)
                for label, t in timed.items():
                    if t.candidate.forward and t is not anchor_fwd:
                        wrong = _close(forward_pass(t.module, t.plan, q, k, v, scale)[0], out_ref)
                        if wrong:
                            problems[label]["forward"] = f"disagrees with the default on the timed inputs ({wrong})"
            fwd_functions = {label: (lambda t=t: forward_pass(t.module, t.plan, q, k, v, scale))
                             for label, t in timed.items() if t.candidate.forward and "forward" not in problems[label]}
            fwd_times = tune_timing.time_round_robin(fwd_functions, rounds, reps, on_round=lambda _r: step(1))
            grads_ref = None
            bwd_functions = {}
            if anchor_bwd is not None and out_ref is not None:
                grads_ref = backward_pass(anchor_bwd.module, anchor_bwd.plan, q, k, v, out_ref, lse_ref, d_out, scale)
                for label, t in timed.items():
                    if not t.candidate.backward:
                        continue
                    if t is not anchor_bwd:
                        got = backward_pass(t.module, t.plan, q, k, v, out_ref, lse_ref, d_out, scale)
                        wrong = next((f"{n}: {w}" for n, a, b in zip(("dq", "dk", "dv"), got, grads_ref)
                                      if (w := _close(a, b))), None)
                        del got
                        if wrong:
                            problems[label]["backward"] = f"disagrees with the default on the timed inputs ({wrong})"
                            continue
                    bwd_functions[label] = (lambda t=t: backward_pass(t.module, t.plan, q, k, v, out_ref,
                                                                      lse_ref, d_out, scale))
            del grads_ref
            bwd_times = tune_timing.time_round_robin(bwd_functions, rounds, reps, on_round=lambda _r: step(1))

            pairs = plan_for(space.default).allowed_pairs
            flops = 4.0 * D * pairs * H
            rows = []
            fwd_medians = {label: tune_timing.median(ts) for label, ts in fwd_times.items()}
            bwd_medians = {label: tune_timing.median(ts) for label, ts in bwd_times.items()}
            fwd_winner = _pick(default_label, fwd_medians)
            bwd_winner = _pick(default_label, bwd_medians)
            for label, t in timed.items():
                fwd_ms, bwd_ms = fwd_medians.get(label, math.inf), bwd_medians.get(label, math.inf)
                rows.append(_row(t.candidate, fwd_ms, bwd_ms, flops, problems[label], label == default_label,
                                 label == fwd_winner, label == bwd_winner))
            for config, error in space.failed.items():
                failed = tune_space.Candidate(config, forward_problem=f"failed to compile: {error}")
                rows.append(_row(failed, math.inf, math.inf, flops, {}, config == space.default, False, False))
            if fwd_winner is None:
                continue  # nothing ran: no entry (the default keeps being used)
            forward = {"tile": tune_db.tile_to_dict(timed[fwd_winner].candidate.config.tile),
                       "ms": _round(fwd_medians[fwd_winner]), "tflops": _tflops(flops, fwd_medians[fwd_winner])}
            backward = None
            if bwd_winner is not None:
                backward = {"tile": tune_db.tile_to_dict(timed[bwd_winner].candidate.config.tile),
                            "ms": _round(bwd_medians[bwd_winner]),
                            "tflops": _tflops(2.5 * flops, bwd_medians[bwd_winner])}
            default = {"tile": tune_db.tile_to_dict(space.default.tile),
                       "fwd_ms": _round(fwd_medians.get(default_label, math.inf)),
                       "bwd_ms": _round(bwd_medians.get(default_label, math.inf))}
            workload = dict(job.workload, batch=B, seq_len=S, pairs=pairs, density=round(pairs / (B * S * S), 4),
                            rounds=rounds, reps=reps)
            key = job.key(space, bucket)
            entries[key] = tune_db.make_entry(job.device, job.rules, space.dtype, space.head_dim, bucket,
                                              forward=forward, backward=backward, default=default,
                                              candidates=rows, space=space.labels, workload=workload)
            del q, k, v, d_out, out_ref, lse_ref, fwd_functions, bwd_functions, timed, plans
            if device == "cuda":
                torch.cuda.empty_cache()
    if write and entries:
        tune_db.record(entries)  # attention() in this process picks the new choices up on its next call
    return entries


def _round(ms: float) -> float | None:
    return round(ms, 4) if math.isfinite(ms) else None


def _tflops(flops: float, ms: float) -> float | None:
    return round(flops / ms / 1e9, 1) if math.isfinite(ms) and ms > 0 else None


def _row(candidate: tune_space.Candidate, fwd_ms: float, bwd_ms: float, flops: float, problems: Mapping[str, str],
         is_default: bool, fwd_winner: bool, bwd_winner: bool) -> dict[str, Any]:
    notes = [p for p in (candidate.forward_problem, candidate.backward_problem, problems.get("forward"),
                         problems.get("backward")) if p]
    winner = "+".join(w for w, won in (("fwd", fwd_winner), ("bwd", bwd_winner)) if won)
    return {"tile": candidate.label, "fwd_ms": _round(fwd_ms), "bwd_ms": _round(bwd_ms),
            "fwd_tflops": _tflops(flops, fwd_ms), "bwd_tflops": _tflops(2.5 * flops, bwd_ms),
            "default": is_default, "winner": winner, "status": "; ".join(notes) or "ok"}
