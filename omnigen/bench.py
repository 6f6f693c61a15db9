"""omnigen against its peers on this GPU (the method: docs/measuring.md): what `omnigen bench` and
`benchmarks/bench_attention.py` both run (one implementation).

For each head dim D and sequence length S (B = tokens // S batch elements, every one its own layout:
the rules' synthetic layouts of `tune.layouts`, or the user's `--layouts FILE`), in one process:

  omnigen        omnigen.attention with a mask made beforehand (omnigen.mask)
  flex           torch.compile(flex_attention), block mask built beforehand (create_block_mask)
  sdpa_dense     SDPA with the dense boolean mask [B, 1, S, S] (memory-efficient backend)
  cudnn_dense    SDPA with the dense boolean mask on the cuDNN backend (where it accepts one)
  flash_causal   SDPA flash on the plain causal mask  } a different, cheaper mask: the speed a
  cudnn_causal   SDPA cuDNN on the plain causal mask  } causal-only kernel reaches

Masks no rule says (issue 29; `run_masks`, `omnigen bench --mask NAME` or `--mask-mod MODULE:FUNCTION`): one
`mask_mod` -- a mask of `omnigen.mask_catalogue` or the user's -- timed two ways on the same inputs:

  omnigen        omnigen.attention with omnigen.mask_from_mod(mod, B, S) made beforehand
  flex           torch.compile(flex_attention) with create_block_mask(mod, B, None, S, S) made beforehand

and the making itself: each row also has `make_ms` (mask_from_mod, or create_block_mask; wall clock between
device synchronisations, median of MAKE_RUNS after one call timed apart as `make_first_ms`: mask_from_mod compiles a
new mod there), `mask_mib` (the tensors the mask holds) and, for omnigen, `partial_tiles` (mask memory is O(S +
partial tiles): the bits are 1 bit a pair of each). flex's row also has `make_compiled_ms` / `make_compiled_first_ms`:
create_block_mask(_compile=True), FlexAttention's compiled making (`make_vs_flex` compares with its default). With
`tile_cost` (`--tile-cost`), `mask_tile_cost` times each mask's visited tiles all partial against all full.

Effective TFLOP/s counts only allowed pairs: forward 4 * D * pairs * Hq / t (pairs summed over the
batch); forward+backward uses 3.5x the forward FLOPs. Times are CUDA events after warm-up, the median
of every run, all peers of one shape interleaved round-robin with the L2 flushed before each run
(`tune.timing.time_round_robin`); in every round each peer first runs untimed for `settle_ms`, so that
it is timed at the clocks its own load settles to under the GPU's power limit, not in the burst that
follows a lighter peer. A peer that cannot run a shape (not installed, out of memory, a
backend that refuses the inputs) is skipped with the reason, never fatal.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import exception_line
from .layout import Layout, LayoutBatch
from .semantics import rule_tensors
from .mask_catalogue import NAMES as CATALOGUE_NAMES
from .mask_catalogue import catalogue_mask, load_mask_mod
from .op import attention, mask as make_mask, mask_from_mod
from .rules import Rules
from .tune import layouts as tune_layouts
from .tune import timing

PEERS = ("omnigen", "flex", "sdpa_dense", "cudnn_dense", "flash_causal", "cudnn_causal")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DIMS = (64, 128)
DEFAULT_SIZES = (4096, 8192, 16384, 32768)
DEFAULT_TOKENS = 32768
DEFAULT_HEADS = 16
# Masks no rule says: the peers that take a mask_mod, and the lengths issue 29's acceptance names.
MASK_PEERS = ("omnigen", "flex")
DEFAULT_MASK_SIZES = (8192, 32768)
MAKE_RUNS = 5


class NoGPU(RuntimeError):
    """The benchmark needs a CUDA GPU and there is none."""


@dataclass
class Workload:
    """One shape: B layouts of S tokens, H query heads of dim D (heads_kv key/value heads, 0: H), in `dtype`."""

    rules: Rules
    layouts: LayoutBatch
    dim: int
    heads: int
    heads_kv: int = 0
    dtype: str = "bf16"

    @property
    def batch(self) -> int:
        return self.layouts.batch_size

    @property
    def seq_len(self) -> int:
        return self.layouts.seq_len


@dataclass
class Result:
    """Rows (one per workload and peer that ran), what was skipped and why, and where it ran."""

    rows: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    tile_costs: list[dict] = field(default_factory=list)  # mask_tile_cost rows (omnigen bench --mask ... --tile-cost)

    def to_json(self) -> str:
        data = {"info": self.info, "rows": self.rows, "skipped": self.skipped}
        if self.tile_costs:
            data["tile_costs"] = self.tile_costs
        return json.dumps(data, indent=1)


def workloads(rules: Rules, dims=DEFAULT_DIMS, sizes=DEFAULT_SIZES, tokens: int = DEFAULT_TOKENS,
              heads: int = DEFAULT_HEADS, seed: int = 0, layouts: list[Layout] | None = None, heads_kv: int = 0,
              dtype: str = "bf16") -> list[Workload]:
    """The rules' synthetic layouts per S in `sizes`, or the user's layouts grouped by length bucket."""
    check_heads_and_dtype(heads, heads_kv, dtype)
    if layouts:
        groups = [LayoutBatch(group) for group in tune_layouts.bucket_user_layouts(layouts, tokens).values()]
    else:
        groups = [LayoutBatch(tune_layouts.synthetic_batch(rules, S, tokens, seed)) for S in sizes]
    return [Workload(rules, group, dim, heads, heads_kv, dtype) for dim in dims for group in groups]


def check_heads_and_dtype(heads: int, heads_kv: int, dtype: str) -> None:
    """ValueError unless `heads_kv` (0: `heads`) divides `heads` (GQA groups) and `dtype` is one of DTYPES."""
    if heads_kv < 0 or (heads_kv and heads % heads_kv):
        raise ValueError(f"--heads-kv {heads_kv} must divide --heads {heads} (each key/value head serves a group of "
                         "query heads), e.g. --heads 16 --heads-kv 4")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


def rules_mask_mod(rules: Rules, tables: Any) -> Callable:
    """A FlexAttention mask_mod evaluating the mask (docs/semantics.md) from the layout's per-token tables."""
    rt = rule_tensors(rules, tables.token_segment.device)
    segment, modality, document = tables.token_segment, tables.token_modality, tables.token_doc
    see, causal, window = rt["see"], rt["causal"], rt["window"]
    pad = rules.pad_id

    def mask_mod(b, h, q, k):
        sq, sk = segment[b, q], segment[b, k]
        mq, mk = modality[b, q], modality[b, k]
        policy = see[mq, mk]
        own = torch.where(causal[mq], k <= q, True)
        other = torch.where(sk < sq, policy >= 1, policy == 2)
        ok = torch.where(sq == sk, own, other) & (mq != pad) & (mk != pad)
        if rules.isolated_documents:
            ok = ok & (document[b, q] == document[b, k])
        if rules.has_windows:
            ok = ok & ((window[mq] == 0) | (q - k < window[mq]))
        return ok

    return mask_mod


def random_inputs(B: int, heads: int, S: int, dim: int, seed: int, heads_kv: int = 0,
                  dtype: str = "bf16") -> tuple[torch.Tensor, ...]:
    """q (requiring grad) [B, heads, S, dim], k and v (requiring grad) [B, heads_kv or heads, S, dim] and dO like q,
    in `dtype` (DTYPES), never zeros, from a seeded CUDA generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    element = DTYPES[dtype]
    q, k, v = (torch.randn(B, h, S, dim, device="cuda", dtype=element, generator=gen).requires_grad_()
               for h in (heads, heads_kv or heads, heads_kv or heads))
    return q, k, v, torch.randn(B, heads, S, dim, device="cuda", dtype=element, generator=gen)


def _first_line(exc: BaseException) -> str:
    return exception_line(exc, limit=160)  # a skipped peer's reason, one table cell


def _flex_missing() -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return f"FlexAttention is not in torch {torch.__version__} (torch.nn.attention.flex_attention, torch >= 2.5)"
    return None


def peers(work: Workload, q, k, v, only: tuple[str, ...] = PEERS) -> tuple[dict[str, tuple[Callable, int]], list[dict]]:
    """name -> (forward callable, allowed pairs of the mask it computes), and the peers skipped (with why)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    B, S = work.batch, work.seq_len
    skipped: list[dict] = []
    out: dict[str, tuple[Callable, int]] = {}

    def skip(name: str, reason: str) -> None:
        skipped.append({"impl": name, "D": work.dim, "S": S, "B": B, "reason": reason})

    gqa = k.shape[1] != q.shape[1]
    omnigen_mask = make_mask(work.rules, work.layouts, device="cuda", head_dim=work.dim, dtype=q.dtype)
    pairs = omnigen_mask.allowed_pairs
    causal_pairs = B * S * (S + 1) // 2
    if "omnigen" in only:
        out["omnigen"] = (lambda: attention(q, k, v, omnigen_mask), pairs)
    if "flex" in only:
        missing = _flex_missing()
        if missing:
            skip("flex", missing)
        else:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            try:
                tables = work.layouts.tables(work.rules, "cuda")
                block_mask = create_block_mask(rules_mask_mod(work.rules, tables), B, None, S, S, device="cuda")
                flex = torch.compile(flex_attention, dynamic=False)
                out["flex"] = (lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa), pairs)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
                skip("flex", _first_line(exc))

    def sdpa_with(backend, **kwargs):
        if gqa:  # SDPA's own grouped heads (a backend without them is skipped, with SDPA's reason)
            kwargs["enable_gqa"] = True

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)

        return run

    if {"sdpa_dense", "cudnn_dense"} & set(only):
        dense = None
        need = B * S * S
        try:
            dense = work.rules.dense_mask(work.layouts, device="cuda")[:, None]  # [B, 1, S, S]
        except torch.cuda.OutOfMemoryError:
            reason = f"out of memory for the dense mask ({need / 2**30:.1f} GiB of bool, plus the S x S scores)"
            for name in ("sdpa_dense", "cudnn_dense"):
                if name in only:
                    skip(name, reason)
            torch.cuda.empty_cache()
        if dense is not None:
            if "sdpa_dense" in only:
                out["sdpa_dense"] = (sdpa_with(SDPBackend.EFFICIENT_ATTENTION, attn_mask=dense), pairs)
            if "cudnn_dense" in only:
                out["cudnn_dense"] = (sdpa_with(SDPBackend.CUDNN_ATTENTION, attn_mask=dense), pairs)
    if "flash_causal" in only:
        out["flash_causal"] = (sdpa_with(SDPBackend.FLASH_ATTENTION, is_causal=True), causal_pairs)
    if "cudnn_causal" in only:
        out["cudnn_causal"] = (sdpa_with(SDPBackend.CUDNN_ATTENTION, is_causal=True), causal_pairs)
    return out, skipped


def peak_extra_mib(fn: Callable) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(work: Workload, *, seed: int = 0, rounds: int = 6, reps: int = 3, only: tuple[str, ...] = PEERS,
            on_step: Callable[[str], None] | None = None,
            settle_ms: float = timing.BENCH_SETTLE_MS) -> tuple[list[dict], list[dict]]:
    """Rows and skips for one workload: every peer warmed up, then all timed round-robin, forward and
    forward+backward."""
    B, S, D, H = work.batch, work.seq_len, work.dim, work.heads
    step = _labelled(on_step, f"{work.rules.name} D{D} S{S}")
    q, k, v, d_out = random_inputs(B, H, S, D, seed, work.heads_kv, work.dtype)
    try:
        candidates, skipped = peers(work, q, k, v, only)
    except torch.cuda.OutOfMemoryError as exc:
        return [], [{"impl": "all", "D": D, "S": S, "B": B, "reason": f"out of memory: {_first_line(exc)}"}]
    step("prepared")
    rows = _time_candidates(candidates, skipped, {"rules": work.rules.name}, (q, k, v, d_out), rounds=rounds,
                            reps=reps, settle_ms=settle_ms, step=step)
    del q, k, v, d_out, candidates
    torch.cuda.empty_cache()
    return rows, skipped


def _time_candidates(candidates: dict[str, tuple[Callable, int]], skipped: list[dict], first: dict,
                     tensors: tuple[torch.Tensor, ...], *, rounds: int, reps: int, settle_ms: float,
                     step: Callable[[str], None]) -> list[dict]:
    """Rows of the peers in `candidates` (name -> (forward, allowed pairs)) on q, k, v, dO = `tensors`: warmed up,
    then timed round-robin, forward and forward+backward; a peer that fails its warm-up joins `skipped`. Each row
    starts with the items of `first` (what the workload is)."""
    q, k, v, d_out = tensors
    B, H, S, D = q.shape
    forwards: dict[str, Callable] = {}
    both: dict[str, Callable] = {}
    for name, (forward, _pairs) in candidates.items():
        def fwd_bwd(forward=forward):
            return torch.autograd.grad(forward(), (q, k, v), d_out)

        try:
            forward()  # compiles flex, builds omnigen's kernel; a backend that refuses the inputs raises here
            fwd_bwd()
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError as exc:
            skipped.append({"impl": name, "D": D, "S": S, "B": B, "reason": f"out of memory ({_first_line(exc)})"})
            torch.cuda.empty_cache()
            continue
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this shape is reported, not fatal
            skipped.append({"impl": name, "D": D, "S": S, "B": B, "reason": _first_line(exc)})
            continue
        forwards[name], both[name] = forward, fwd_bwd
    step("warmed up")
    fwd_times = timing.time_round_robin(forwards, rounds=rounds, reps=reps, settle_ms=settle_ms) if forwards else {}
    step("forward timed")
    both_times = timing.time_round_robin(both, rounds=rounds, reps=reps, settle_ms=settle_ms) if both else {}
    step("forward+backward timed")
    rows = []
    for name in forwards:
        pairs = candidates[name][1]
        flops = 4.0 * D * pairs * H
        fwd_ms, both_ms = timing.median(fwd_times[name]), timing.median(both_times[name])
        rows.append({
            **first, "impl": name, "D": D, "S": S, "B": B, "H": H, "pairs": pairs,
            "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(both_ms, 4),
            "fwd_tflops": round(flops / fwd_ms / 1e9, 1), "fwd_bwd_tflops": round(3.5 * flops / both_ms / 1e9, 1),
            "peak_mib": round(peak_extra_mib(both[name]), 1),
        })
    flex = next((r for r in rows if r["impl"] == "flex"), None)
    for r in rows:
        if flex:
            r["fwd_vs_flex"] = round(flex["fwd_ms"] / r["fwd_ms"], 2)
            r["fwd_bwd_vs_flex"] = round(flex["fwd_bwd_ms"] / r["fwd_bwd_ms"], 2)
    return rows


# ---- masks no rule says: one mask_mod through omnigen and FlexAttention --------------------------------------


@dataclass
class MaskWorkload:
    """One shape of a mask given as a mask_mod: `mask` is a catalogue name (omnigen.mask_catalogue) or the user's
    "MODULE:FUNCTION" (a mask_mod, or a factory (B, S, device) returning one); B sequences of S tokens."""

    mask: str
    batch: int
    seq_len: int
    dim: int
    heads: int
    heads_kv: int = 0
    dtype: str = "bf16"

    def mask_mod(self, seed: int = 0) -> Callable:
        """The mask_mod for this shape, its tensors on the current CUDA device."""
        if self.mask in CATALOGUE_NAMES:
            return catalogue_mask(self.mask, self.batch, self.seq_len, "cuda", seed).mask_mod
        return load_mask_mod(self.mask, self.batch, self.seq_len, "cuda")


def check_mask_specs(masks: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The masks to time: catalogue names ("all": every one) and MODULE:FUNCTION specs; ValueError naming a
    name that is neither."""
    out: list[str] = []
    for spec in masks:
        if spec == "all":
            out += CATALOGUE_NAMES
        elif spec in CATALOGUE_NAMES or ":" in spec:
            out.append(spec)
        else:
            raise ValueError(f"--mask {spec!r} is not in the catalogue ({', '.join(CATALOGUE_NAMES)}, or all); a mask "
                             "of your own goes in --mask-mod MODULE:FUNCTION")
    if not out:
        raise ValueError("no mask to time: --mask NAME[,NAME...] (or all) or --mask-mod MODULE:FUNCTION")
    return tuple(dict.fromkeys(out))


def mask_workloads(masks: list[str] | tuple[str, ...], dims=DEFAULT_DIMS, sizes=DEFAULT_MASK_SIZES,
                   tokens: int = DEFAULT_TOKENS, heads: int = DEFAULT_HEADS, heads_kv: int = 0,
                   dtype: str = "bf16") -> list[MaskWorkload]:
    """Every (mask, S, D): B = tokens // S sequences (at least one)."""
    check_heads_and_dtype(heads, heads_kv, dtype)
    return [MaskWorkload(spec, max(1, tokens // S), S, dim, heads, heads_kv, dtype)
            for spec in check_mask_specs(masks) for S in sizes for dim in dims]


def time_making(make: Callable[[], Any], runs: int = MAKE_RUNS) -> tuple[float, float, Any]:
    """(median milliseconds of make(), between device synchronisations, after one call timed apart; that first call's
    milliseconds (compilation included: mask_from_mod's compiled mod, create_block_mask(_compile=True)); the last
    result)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    made = make()
    torch.cuda.synchronize()
    first = (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        made = make()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), first, made


def tensor_mib(obj: Any) -> float:
    """MiB of the tensors an object holds as attributes (a FlexAttention BlockMask) or in a list (a Mask's)."""
    tensors = [t for t in vars(obj).values() if isinstance(t, torch.Tensor)]
    tensors += [t for value in vars(obj).values() if isinstance(value, (list, tuple))
                for t in value if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values()) / 2**20


def _labelled(on_step: Callable[[str], None] | None, shape: str) -> Callable[[str], None]:
    """on_step with the workload named in each label ("causal_documents D128 S8192: masks made"); a no-op without."""
    if on_step is None:
        return lambda _label: None
    return lambda label: on_step(f"{shape}: {label}")


def measure_mask(work: MaskWorkload, *, seed: int = 0, rounds: int = 6, reps: int = 3,
                 only: tuple[str, ...] = MASK_PEERS, on_step: Callable[[str], None] | None = None,
                 settle_ms: float = timing.BENCH_SETTLE_MS) -> tuple[list[dict], list[dict]]:
    """Rows and skips for one mask workload: the masks made and timed (omnigen's mask_from_mod, FlexAttention's
    create_block_mask, same mod), then both attentions timed as `measure` times the rules' peers."""
    B, S, D, H = work.batch, work.seq_len, work.dim, work.heads
    step = _labelled(on_step, f"{work.mask} D{D} S{S}")
    skipped: list[dict] = []

    def skip(name: str, reason: str) -> None:
        skipped.append({"impl": name, "D": D, "S": S, "B": B, "reason": reason})

    q, k, v, d_out = random_inputs(B, H, S, D, seed, work.heads_kv, work.dtype)
    mod = work.mask_mod(seed)
    candidates: dict[str, tuple[Callable, int]] = {}
    made: dict[str, dict] = {}
    omnigen_mask = None
    try:
        make_ms, first_ms, omnigen_mask = time_making(
            lambda: mask_from_mod(mod, B, S, "cuda", head_dim=D, dtype=q.dtype))
        # partial tiles over every tile shape the mask holds, as its bits (in mask_mib) are
        partial = sum(omnigen_mask.plan(*shape).counts()["partial"] for shape in omnigen_mask.tiles)
        made["omnigen"] = {"make_ms": round(make_ms, 3), "make_first_ms": round(first_ms, 1),
                           "mask_mib": round(omnigen_mask.nbytes() / 2**20, 3), "partial_tiles": partial}
    except Exception as exc:  # noqa: BLE001 - reported; flex may still run
        skip("omnigen", f"making the mask: {_first_line(exc)}")
    pairs = omnigen_mask.allowed_pairs if omnigen_mask is not None else None
    if omnigen_mask is not None and "omnigen" in only:
        candidates["omnigen"] = (lambda: attention(q, k, v, omnigen_mask), pairs)
    missing = _flex_missing()
    if missing:
        skip("flex", missing)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        try:
            make_ms, first_ms, block_mask = time_making(lambda: create_block_mask(mod, B, None, S, S, device="cuda"))
            made["flex"] = {"make_ms": round(make_ms, 3), "make_first_ms": round(first_ms, 1),
                            "mask_mib": round(tensor_mib(block_mask), 3)}
            try:  # FlexAttention's compiled making beside its default (what make_vs_flex compares with)
                compiled_ms, compiled_first_ms, _ = time_making(
                    lambda: create_block_mask(mod, B, None, S, S, device="cuda", _compile=True))
                made["flex"].update(make_compiled_ms=round(compiled_ms, 3),
                                    make_compiled_first_ms=round(compiled_first_ms, 1))
            except Exception as exc:  # noqa: BLE001 - an extra figure; its absence is said in the row
                made["flex"]["make_compiled_error"] = _first_line(exc)
            if "flex" in only and pairs is None:
                skip("flex", "its effective TFLOP/s need the allowed pairs, counted by omnigen's mask, which failed")
            elif "flex" in only:
                flex = torch.compile(flex_attention, dynamic=False)
                candidates["flex"] = (lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != H), pairs)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
            skip("flex", _first_line(exc))
    step("masks made")
    rows = _time_candidates(candidates, skipped, {"mask": work.mask}, (q, k, v, d_out), rounds=rounds, reps=reps,
                            settle_ms=settle_ms, step=step)
    for row in rows:
        row.update(made.get(row["impl"], {}))
        if "flex" in made and "make_ms" in row:
            row["make_vs_flex"] = round(made["flex"]["make_ms"] / row["make_ms"], 2)
    del q, k, v, d_out, candidates, omnigen_mask
    torch.cuda.empty_cache()
    return rows, skipped


def run_masks(masks: list[str] | tuple[str, ...], *, dims=DEFAULT_DIMS, sizes=DEFAULT_MASK_SIZES,
              tokens: int = DEFAULT_TOKENS, heads: int = DEFAULT_HEADS, seed: int = 0, rounds: int = 6,
              reps: int = 3, only: tuple[str, ...] = MASK_PEERS, on_step: Callable[[str], None] | None = None,
              on_row: Callable[[dict], None] | None = None, settle_ms: float = timing.BENCH_SETTLE_MS,
              tile_cost: bool = False, heads_kv: int = 0, dtype: str = "bf16") -> Result:
    """Every (mask, S, D) of `mask_workloads` through omnigen and FlexAttention; with `tile_cost`, also each one's
    `mask_tile_cost` (into `result.tile_costs`). Raises NoGPU without CUDA."""
    work = mask_workloads(masks, dims, sizes, tokens, heads, heads_kv, dtype)  # bad input fails before the GPU check
    if not torch.cuda.is_available():
        raise NoGPU("omnigen bench needs a CUDA GPU, and none is visible here")
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)  # flex: one per shape
    result = Result(info={
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "masks": list(check_mask_specs(masks)),
        "tokens": tokens, "heads": heads, "heads_kv": heads_kv or heads, "dtype": dtype, "seed": seed,
        "settle_ms": settle_ms,
    })
    for shape in work:
        rows, skipped = measure_mask(shape, seed=seed, rounds=rounds, reps=reps, only=only, on_step=on_step,
                                     settle_ms=settle_ms)
        result.rows += rows
        result.skipped += skipped
        if tile_cost:
            try:
                result.tile_costs.append(mask_tile_cost(shape, seed=seed, rounds=rounds, reps=reps,
                                                        settle_ms=settle_ms))
            except Exception as exc:  # noqa: BLE001 - reported with the skips, never fatal
                result.skipped.append({"impl": "tile_cost", "D": shape.dim, "S": shape.seq_len, "B": shape.batch,
                                       "reason": _first_line(exc)})
            if on_step:
                on_step(f"{shape.mask} D{shape.dim} S{shape.seq_len}: tile cost timed")
        for row in rows:
            if on_row:
                on_row(row)
    return result


def mask_tile_cost(work: MaskWorkload, *, seed: int = 0, rounds: int = 6, reps: int = 3,
                   settle_ms: float = timing.BENCH_SETTLE_MS) -> dict:
    """What a partial tile costs against a full one on this mask (issue 29: "a partial tile costs <= 1.2x a full
    one"), for masks made from data, whose partial tiles always come from bits.

    The mask is made from its mod (mask_from_mod), then run two ways that visit exactly its tiles, in its schedules'
    order (`plan.ruleless.every_tile_as`): every visited tile partial (read from bits; the same output) and every
    visited tile full (no mask work). The ratio of the two times is the cost of a partial tile over a full one on
    this mask's grid, tail and load balance -- unlike `tile_cost`, whose synthetic layouts are every tile partial
    or every tile full by construction and whose partial tiles come from a rules mask. Times: round robin, medians."""
    from .plan.ruleless import every_tile_as
    from .semantics import EMPTY, FULL, PARTIAL

    B, S, D, H = work.batch, work.seq_len, work.dim, work.heads
    q, k, v, d_out = random_inputs(B, H, S, D, seed, work.heads_kv, work.dtype)
    mask = mask_from_mod(work.mask_mod(seed), B, S, "cuda", head_dim=D, dtype=q.dtype)
    variants = {"full": every_tile_as(mask, FULL), "partial": every_tile_as(mask, PARTIAL)}
    functions: dict[str, Callable] = {}
    for name, m in variants.items():
        forward = lambda m=m: attention(q, k, v, m)  # noqa: E731
        functions[f"{name}_fwd"] = forward
        functions[f"{name}_fwd_bwd"] = lambda forward=forward: torch.autograd.grad(forward(), (q, k, v), d_out)
    for function in functions.values():
        function()  # builds the kernels before timing
    times = timing.time_round_robin(functions, rounds=rounds, reps=reps, settle_ms=settle_ms)
    kinds = mask.plan(*mask.tiles[0]).kinds
    row: dict = {"mask": work.mask, "D": D, "S": S, "B": B, "H": H, "tile": "x".join(map(str, mask.tiles[0])),
                 "visited_tiles": int((kinds != EMPTY).sum()), "partial_tiles": int((kinds == PARTIAL).sum())}
    for label, values in times.items():
        row[f"{label}_ms"] = round(timing.median(values), 4)
    for part in ("fwd", "fwd_bwd"):
        row[f"partial_over_full_{part}"] = round(row[f"partial_{part}_ms"] / row[f"full_{part}_ms"], 3)
    del q, k, v, d_out, functions, variants, mask
    torch.cuda.empty_cache()
    return row


STEPS_PER_MASK_WORKLOAD = 4


def count_mask_steps(masks: list[str] | tuple[str, ...], dims=DEFAULT_DIMS, sizes=DEFAULT_MASK_SIZES,
                     tile_cost: bool = False) -> int:
    """How many on_step calls `run_masks` makes (for a progress bar)."""
    per_workload = STEPS_PER_MASK_WORKLOAD + (1 if tile_cost else 0)
    return per_workload * len(check_mask_specs(masks)) * len(tuple(dims)) * len(tuple(sizes))


STEPS_PER_WORKLOAD = 4


def run(rules: Rules, *, dims=DEFAULT_DIMS, sizes=DEFAULT_SIZES, tokens: int = DEFAULT_TOKENS,
        heads: int = DEFAULT_HEADS, seed: int = 0, layouts: list[Layout] | None = None, rounds: int = 6,
        reps: int = 3, only: tuple[str, ...] = PEERS, on_step: Callable[[str], None] | None = None,
        on_row: Callable[[dict], None] | None = None, settle_ms: float = timing.BENCH_SETTLE_MS,
        heads_kv: int = 0, dtype: str = "bf16") -> Result:
    """Every workload of the rules against every peer (see the module docstring); `heads_kv` key/value heads (0:
    `heads`; fewer: grouped-query attention, SDPA's and FlexAttention's enable_gqa), inputs in `dtype` ("bf16",
    "fp16"). Raises NoGPU without CUDA."""
    check_heads_and_dtype(heads, heads_kv, dtype)  # bad input fails before the GPU check (and the layouts)
    if not torch.cuda.is_available():
        raise NoGPU("omnigen bench needs a CUDA GPU, and none is visible here")
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)  # flex: one per shape
    result = Result(info={
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rules": rules.name, "tokens": tokens,
        "heads": heads, "heads_kv": heads_kv or heads, "dtype": dtype, "seed": seed, "settle_ms": settle_ms,
    })
    for work in workloads(rules, dims, sizes, tokens, heads, seed, layouts, heads_kv, dtype):
        rows, skipped = measure(work, seed=seed, rounds=rounds, reps=reps, only=only, on_step=on_step,
                                settle_ms=settle_ms)
        result.rows += rows
        result.skipped += skipped
        for row in rows:
            if on_row:
                on_row(row)
    return result


def count_steps(rules: Rules, dims=DEFAULT_DIMS, sizes=DEFAULT_SIZES, tokens: int = DEFAULT_TOKENS,
                layouts: list[Layout] | None = None) -> int:
    """How many on_step calls `run` makes (for a progress bar)."""
    if layouts:
        groups = len(tune_layouts.bucket_user_layouts(layouts, tokens))
    else:
        groups = len(tuple(sizes))
    return STEPS_PER_WORKLOAD * groups * len(tuple(dims))


COLUMNS = ("rules", "impl", "D", "S", "B", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "fwd_vs_flex",
           "fwd_bwd_vs_flex", "peak_mib")
# Rows of masks given as a mask_mod (run_masks): what the mask is, and the making of it.
MASK_COLUMNS = ("mask",) + COLUMNS[1:-1] + ("make_ms", "make_vs_flex", "mask_mib", "partial_tiles", "peak_mib")


def table(result: Result) -> str:
    """The rows as a text table, then one line per skipped peer (what and why)."""
    info = result.info
    settled = f", each peer timed after {info['settle_ms']:g} ms of its own load" if info.get("settle_ms") else ""
    kv = info.get("heads_kv", info.get("heads"))
    heads = f"H={info.get('heads')}" + (f", Hkv={kv}" if kv != info.get("heads") else "")
    lines = [f"attention, {info.get('dtype', 'bf16')}, {heads}, B*S={info.get('tokens')}, "
             f"GPU: {info.get('gpu')}, torch {info.get('torch')}{settled}"]
    columns = MASK_COLUMNS if any("mask" in r for r in result.rows) else COLUMNS
    cells = [[str(r.get(c, "-")) for c in columns] for r in result.rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in cells]
    if not result.rows:
        lines.append("(no measurements)")
    for c in result.tile_costs:
        lines.append(f"tile cost, {c['mask']} D={c['D']} S={c['S']} B={c['B']} ({c['visited_tiles']} visited "
                     f"{c['tile']} tiles, {c['partial_tiles']} of them partial): every visited tile partial / every "
                     f"one full = {c['partial_over_full_fwd']} forward, {c['partial_over_full_fwd_bwd']} "
                     "forward+backward")
    for s in result.skipped:
        lines.append(f"skipped {s['impl']} at D={s['D']} S={s['S']} B={s['B']}: {s['reason']}")
    lines.append("effective TFLOP/s count allowed pairs only (causal peers: the causal mask's pairs); "
                 "fwd+bwd = 3.5x forward FLOPs; x_vs_flex > 1: faster than FlexAttention")
    if columns is MASK_COLUMNS:
        lines.append("make_ms: making the mask from the mask_mod (omnigen.mask_from_mod / create_block_mask), "
                     "median wall clock; mask_mib: the tensors the mask holds; partial_tiles: omnigen's, over its "
                     "tile shapes (each holds bits, 1 bit a pair, in both schedules)")
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path) -> Path:
    """Effective TFLOP/s against S, per head dim, forward and forward+backward. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["D"] for r in rows}) or [0]
    fig, axes = plt.subplots(len(dims), 2, figsize=(12, 4 * len(dims)), squeeze=False)
    for row_axes, dim in zip(axes, dims):
        for ax, metric, title in zip(row_axes, ("fwd_tflops", "fwd_bwd_tflops"), ("forward", "forward + backward")):
            # one line per implementation (and per mask, for rows of masks given as a mask_mod)
            for line in sorted({(r.get("mask", ""), r["impl"]) for r in rows}):
                points = sorted((r["S"], r[metric]) for r in rows
                                if (r.get("mask", ""), r["impl"]) == line and r["D"] == dim and metric in r)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=" ".join(filter(None, line)))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{title}, D={dim}, bf16")
            ax.set_ylabel("effective TFLOP/s (allowed pairs only)")
            ax.set_xlabel("sequence length")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


TILE_COST = Rules(
    name="tile_cost", modalities={"a": "full", "b": "full"}, see={"default": "all", "a -> b": "none"}, documents="shared"
)


def tile_cost(dim: int, S: int, tokens: int, heads: int, seed: int = 0) -> dict:
    """What a partial tile costs against a full one: the same kernel, grid and number of visited tiles.

    One layout is a single `a` segment (every tile full); the other alternates `a` and `b` every 40
    tokens with `a -> b: none`, so every tile mixes allowed and masked pairs (every tile partial). The partial
    layout runs twice: with its tiles' masks evaluated in the kernel (`partial`, a mask with partial_bits="none";
    what a mask's tiles past its capacity cost) and read as bits made once per layout (`partial_bits`, "all")."""
    B = max(1, tokens // S)
    alternating = [("a" if i % 2 == 0 else "b", 40) for i in range(S // 40)]
    if S % 40:
        alternating.append(("a", S % 40))
    partial_layout = LayoutBatch([Layout.from_segments(alternating)] * B)
    masks = {
        "full": (LayoutBatch([Layout.from_segments([("a", S)])] * B), "auto"),
        "partial": (partial_layout, "none"),
        "partial_bits": (partial_layout, "all"),
    }
    q, k, v, d_out = random_inputs(B, heads, S, dim, seed)
    row: dict = {"D": dim, "S": S, "B": B, "H": heads}
    functions = {}
    for name, (layout, bits) in masks.items():
        m = make_mask(TILE_COST, layout, device="cuda", head_dim=dim, dtype=q.dtype, partial_bits=bits)
        forward = lambda m=m: attention(q, k, v, m)  # noqa: E731
        functions[f"{name}_fwd"] = forward
        functions[f"{name}_fwd_bwd"] = lambda forward=forward: torch.autograd.grad(forward(), (q, k, v), d_out)
    times = timing.time_round_robin(functions)
    for label, values in times.items():
        row[f"{label}_ms"] = round(timing.median(values), 4)
    for name in ("partial", "partial_bits"):
        row[f"{name}_over_full_fwd"] = round(row[f"{name}_fwd_ms"] / row["full_fwd_ms"], 3)
        row[f"{name}_over_full_fwd_bwd"] = round(row[f"{name}_fwd_bwd_ms"] / row["full_fwd_bwd_ms"], 3)
    return row


__all__ = ["COLUMNS", "MASK_COLUMNS", "MASK_PEERS", "MaskWorkload", "NoGPU", "PEERS", "Result", "Workload",
           "check_mask_specs", "count_mask_steps", "count_steps", "mask_tile_cost", "mask_workloads", "measure",
           "measure_mask", "peers", "plot", "random_inputs", "rules_mask_mod", "run", "run_masks", "table", "tile_cost",
           "workloads"]


def smoothed_gap(curve: list[float], ref: list[float], window: int = 20,
                 ref_again: list[float] | None = None) -> dict:
    """Whether two loss curves agree within bf16 noise. Runs that start from the same weights on the same data
    differ only by rounding (other kernels, other summation orders), which grows into a different trajectory, so
    single steps drift apart; the `window`-step means over the second half must stay within `curve`'s own
    step-to-step noise (mean |loss[i] - loss[i-1]|), or within 2% of the loss where that noise is tiny. With
    `ref_again`, a second run of the reference from the same seed, also within the reference's own gap between its
    two runs ("reference_spread"): a backend whose atomics add in a different order each run drifts from itself as
    far as from another backend. Used by examples/train_transfusion.py and benchmarks/train_step.py."""
    def smooth(xs: list[float]) -> list[float]:
        return [sum(xs[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(xs))]

    n = min(len(curve), len(ref))
    half = n // 2
    a, b = smooth(curve[:n]), smooth(ref[:n])
    gap = max(abs(x - y) for x, y in zip(a[half:], b[half:]))
    relative = max(abs(x - y) / max(abs(y), 1e-9) for x, y in zip(a[half:], b[half:]))
    steps = [abs(x - y) for x, y in zip(curve[half + 1:n], curve[half:n - 1])]
    noise = sum(steps) / max(1, len(steps))
    verdict = {"window": window, "max_smoothed_gap": gap, "max_smoothed_gap_relative": relative,
               "step_to_step_noise": noise}
    allowed = max(noise, 0.02 * abs(b[-1]))
    if ref_again is not None:
        spread = smoothed_gap(ref_again, ref, window)["max_smoothed_gap"]
        verdict["reference_spread"] = spread
        allowed = max(allowed, spread)
    return {**verdict, "within_noise": bool(gap <= allowed)}
