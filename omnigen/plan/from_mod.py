"""`mask_from_mod`: a FlexAttention-style `mask_mod(b, h, q_idx, kv_idx) -> bool` as a `Mask`.

The mod is called on index tensors that broadcast against each other -- b [n, 1, 1], q_idx [1, rows, 1],
kv_idx [1, 1, keys], h a 0-d zero -- one slab at a time (block-rows of tiles: COMPILED_SLAB_ELEMENTS pairs in one
call for a compiled mod on a GPU, else `ruleless.slab_elements` pairs in calls of at most EVAL_ELEMENTS, one call on a
GPU and several on a CPU), never on an S x S grid; each slab is
evaluated once for every tile shape, classified exactly and its partial tiles packed to bits
(`omnigen.plan.ruleless.classify_shapes`). A mod written for FlexAttention works unchanged when it uses tensor
operations (FlexAttention vmaps it over scalars; here it sees whole blocks), which is what `create_block_mask` needs
too.

Masks are the same for every head: a mod that depends on `h` is refused, found by evaluating a sample of positions
with two heads (a dependence the sample misses goes unnoticed: the mask is made with h = 0).

On a GPU the mod goes through `torch.compile` (compile_mod=None: on CUDA): Inductor fuses its operations into one
kernel that writes a slab's booleans, where eagerly each operation writes a whole slab of int64 temporaries (a
sliding window's five operations took ~3 ms of a 4.8 ms mask at 8K x 4 on an H100; RESULTS.md). FlexAttention's own
kernels run the mod compiled too, static for each shape of the index tensors (a kernel compiled for dynamic shapes ran
a mask 2.2x slower). Dynamo caches by the mod's code, so a mod remade every step as a closure over new tensors
(document ids) compiles once per S (past a few S, once more for dynamic shapes); the first call of a new mod or S pays
the compilation (seconds). Where a compiled
call fails, the mod is called eagerly: a mod that cannot work on tensors gets the same message either way; one that
only the compiler refuses is evaluated eagerly from then on, with a warning that says why.
"""

from __future__ import annotations

import inspect
import types
import warnings
from typing import Callable, Iterable

import torch

from ..errors import InputError, exception_line, type_name
from .masks import Mask
from .planners import _check_device
from .ruleless import check_capacity_choice, classify_shapes, ruleless_mask, ruleless_tables, tile_shapes

# Pairs one call of the mod evaluates at most (its temporaries are a few int64 tensors of this many elements). On a
# GPU a whole slab in one call, since making a mask there was bound by the host's launches (a quarter of a slab a call
# made 547 launches for a sliding window at 8K x 4, 108 of them the mod's, against create_block_mask's 79; RESULTS.md);
# the temporaries, ~512 MiB each and freed before the slab is classified, are the price. On a CPU few enough that the
# temporaries stay in cache (8 MiB each: a mod over 2^24 pairs a call ran ~2x slower than over 2^20, measured on
# catalogue masks).
EVAL_ELEMENTS = 1 << 26
CPU_EVAL_ELEMENTS = 1 << 20
# Pairs of one slab, evaluated in one call, where the mod runs compiled on a GPU: its kernel writes the slab's
# booleans and no temporaries, so the slab's 256 MiB (freed before the mask is returned) are the price of fewer
# compiled calls and launches -- the host, not the GPU, bounds these makes. 8K x 4 is then one slab instead of four;
# on an H200 a Longformer mask at 8K x 4 took 3.28 ms against 4.24 with slabs of 2^26 pairs, create_block_mask 4.0
# (RESULTS.md, thirty-fourth session). A compiled call that fails is repeated eagerly on the same slab once, with
# temporaries of its size; the mod's later slabs are eager and split by EVAL_ELEMENTS.
COMPILED_SLAB_ELEMENTS = 1 << 28

# Positions per axis of the sample that checks the mod against two heads.
HEAD_SAMPLE = 96

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_TENSOR_FIX = ("omnigen calls it on whole blocks of positions at once: b, h, q_idx and kv_idx are int64 tensors that "
               "broadcast against each other, so write it with tensor operations (torch.where instead of if/else, "
               "& | ~ instead of and/or/not, q_idx >= kv_idx, indexing a tensor with q_idx)")


def _evaluate(mod: MaskMod, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return mod(b, h, q, kv)


# One compiled copy of `_evaluate` per mod code (or type, for callables without code) and per shape of the index
# tensors, each compiled with dynamic=False; the mod is passed in as an argument. Why not torch.compile(mod) per call:
# making the wrapper copies Inductor's config, 3.5 ms on an H100's host against 0.1 ms for a compiled slab (RESULTS.md),
# and a training loop remakes its mod, a closure over the step's document ids, every step; Dynamo inlines the mod and
# guards on its code, so closures of one code share a graph. Why static copies: a copy that saw a second shape (a
# shorter last slab, another S) would recompile with Dynamo's automatic dynamic shapes, and the dynamic kernel divides
# its flat index by run-time sizes per element -- random eviction at 32K took 15.5 ms a mask so against 7.1 static on
# an H200 (RESULTS.md, thirty-first session). Why copies at all: Dynamo's cache and its recompile limit (8) are per
# code object, so one shared `_evaluate` would stop compiling after eight mods or shapes. A mask at one S compiles one
# or two shapes (its slabs, a shorter last slab), and the head sample one shape for every S (of batches of up to 4);
# past STATIC_SHAPES shapes of one code (S changing from step to step: three S, then) one copy compiled for dynamic
# shapes takes every further shape, so that a new S no longer costs a compilation.
STATIC_SHAPES = 7
_COMPILED: dict[tuple[object, tuple | None], Callable] = {}  # (code, shapes); shapes None: the dynamic copy
# Mod codes whose compilation failed: evaluated eagerly from then on, warned about once.
_NOT_COMPILED: set[object] = set()


def _code_of(mod: MaskMod) -> object:
    return getattr(mod, "__code__", None) or type(mod)


def _compiled_evaluator(mod: MaskMod, shapes: tuple) -> Callable | None:
    """The compiled `_evaluate` for `mod`'s code and index tensors of `shapes` (static, or the code's dynamic copy once
    it has STATIC_SHAPES static ones); None where that code failed to compile before."""
    code_key = _code_of(mod)
    if code_key in _NOT_COMPILED:
        return None
    key = (code_key, shapes)
    if key not in _COMPILED:
        static = sum(1 for code, shape in _COMPILED if code == code_key and shape is not None) < STATIC_SHAPES
        key = key if static else (code_key, None)
        if key not in _COMPILED:
            code = _evaluate.__code__.replace(co_name=f"_evaluate_{len(_COMPILED)}")
            _COMPILED[key] = torch.compile(types.FunctionType(code, _evaluate.__globals__), dynamic=not static)
    return _COMPILED[key]


def compiles_by_default(device: torch.device) -> bool:
    """Whether `mask_from_mod(compile_mod=None)` compiles the mod on `device`: on CUDA, outside a compiled region."""
    return device.type == "cuda" and not torch.compiler.is_compiling()


class _Mod:
    """The user's mod, called on broadcasting index tensors, its result checked and made a bool block.

    `compiled`: calls go through the mod's compiled evaluator for their shapes (eagerly again where it fails: the
    eager call tells the mod's own faults from the compiler's)."""

    def __init__(self, mod: MaskMod, device: torch.device, compiled: bool = False) -> None:
        self.mod, self.device = mod, device
        self.compiled = compiled and _code_of(mod) not in _NOT_COMPILED
        self.h = torch.zeros((), dtype=torch.int64, device=device)

    def __call__(self, b: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                 h: torch.Tensor | None = None) -> torch.Tensor:
        shape = torch.broadcast_shapes(b.shape, q.shape, kv.shape)
        h = self.h if h is None else h
        out = failure = None
        evaluator = None
        if self.compiled:
            evaluator = _compiled_evaluator(self.mod, (tuple(b.shape), tuple(q.shape), tuple(kv.shape)))
        if evaluator is not None:
            try:
                out = evaluator(self.mod, b, h, q, kv)
            except Exception as exc:  # noqa: BLE001 - Dynamo's and Inductor's failures vary; the eager call decides
                failure = exc
        if out is None:
            try:
                out = self.mod(b, h, q, kv)
            except Exception as exc:  # the mod's own fault, compiled or not: say so, and not a word of compiling
                raise InputError([f"mask_mod failed on index tensors ({exception_line(exc)}); {_TENSOR_FIX}"]) from exc
        if failure is not None:
            warnings.warn(f"omnigen.mask_from_mod: the mask_mod could not be compiled ({exception_line(failure)}); "
                          "evaluating it eagerly from now on (slower; compile_mod=False skips the attempt)",
                          stacklevel=4)
            self.compiled = False
            _NOT_COMPILED.add(_code_of(self.mod))
        if isinstance(out, bool):
            return torch.full(shape, out, dtype=torch.bool, device=self.device)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            what = f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type_name(out)
            raise InputError([f"mask_mod must return a bool tensor (True = may attend), not {what}; "
                              "e.g. `return q_idx >= kv_idx`, or `(x != 0)` for a 0/1 result"])
        try:
            return torch.broadcast_to(out, shape).to(self.device)
        except RuntimeError:
            raise InputError([f"mask_mod returned shape {tuple(out.shape)} for index tensors broadcasting to "
                              f"{tuple(shape)}; {_TENSOR_FIX}"]) from None


def _signature_problem(mod: Callable) -> str | None:
    """Why `mod` cannot be called as mod(b, h, q_idx, kv_idx), when its signature says so (None where it can, or
    where Python cannot tell: builtins, some C extensions)."""
    try:
        signature = inspect.signature(mod)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(0, 0, 0, 0)
    except TypeError:
        return (f"mask_mod must take four positional arguments (b, h, q_idx, kv_idx), FlexAttention's signature; "
                f"{getattr(mod, '__name__', 'it')}{signature} does not (a mod that ignores the batch or the head still "
                "takes them: def mod(b, h, q_idx, kv_idx): return q_idx >= kv_idx)")
    return None


def _positive(name: str, value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name} must be a positive integer, not {value!r}"
    return None


def _head_sample(mod: _Mod, batches: torch.Tensor, S: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, mask with h = 0, mask with h = 1) at a sample of positions (`batches`: arange(B) on `device`):
    launches only, nothing read back, so on a GPU it can run under the slabs' work (`_check_heads` reads it)."""
    # HEAD_SAMPLE evenly spread positions whatever S (repeated below HEAD_SAMPLE tokens), so that the sample has one
    # shape for every S and a compiled mod one evaluator for it; made on the device, since a copy from pageable host
    # memory would wait for the stream.
    positions = torch.arange(HEAD_SAMPLE, device=device) * (S - 1) // (HEAD_SAMPLE - 1)
    b = batches[:4, None, None]
    q, kv = positions[None, :, None], positions[None, None, :]
    # Through the mod's compiled evaluator where it has one: eagerly, every operation of the mod was a launch, twice
    # (MEDUSA's tree, 7 levels of ancestors: ~100 launches, 2.6 ms of a 5.8 ms mask at 8K x 4 on an H200's host,
    # RESULTS.md, thirty-third session); compiled, two. The price: one more compilation on a mod's first call.
    ones = torch.ones((), dtype=torch.int64, device=device)
    return positions, mod(b, q, kv), mod(b, q, kv, ones)


def _check_heads(positions: torch.Tensor, first: torch.Tensor, other: torch.Tensor) -> None:
    """`_head_sample`'s two masks must agree (masks are head-independent)."""
    if bool((first != other).any()):
        bi, qi, ki = (first != other).nonzero()[0].tolist()
        raise InputError([f"mask_mod depends on the head h: at b={bi}, q_idx={int(positions[qi])}, "
                          f"kv_idx={int(positions[ki])} it gives {bool(first[bi, qi, ki])} for h=0 and "
                          f"{bool(other[bi, qi, ki])} for h=1; an omnigen mask is the same for every head, so make the "
                          "mod ignore h (or call omnigen.attention once per group of heads, each with its own mask)"])


def mask_from_mod(
    mask_mod: MaskMod,
    B: int,
    S: int,
    device: torch.device | str = "cuda",
    *,
    kv_len: int | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    tiles: Iterable[tuple[int, int]] | None = None,
    partial_bits: int | str = "exact",
    compile_mod: bool | None = None,
) -> Mask:
    """A `Mask` from a FlexAttention-style `mask_mod(b, h, q_idx, kv_idx)` over B sequences of S tokens.

    `create_block_mask(mod, B, None, S, S)` becomes `omnigen.mask_from_mod(mod, B, S)`. The mod is evaluated exactly,
    a slab of block-rows at a time on `device` (never an S x S tensor); tiles are classified exactly and every
    partial tile's mask kept as bits. `kv_len`: only S (omnigen's masks are square). `tiles`, `head_dim`, `dtype`,
    `partial_bits`: as for `omnigen.mask_from_dense`. `compile_mod`: evaluate the mod through torch.compile (one fused
    kernel a slab; the first call of a new mod compiles it); None: on CUDA only."""
    problems = [p for p in (_positive("B", B), _positive("S", S)) if p]
    if not callable(mask_mod):
        problems.append(f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) -> bool tensor, not "
                        f"{type_name(mask_mod)}")
    elif _signature_problem(mask_mod):
        problems.append(_signature_problem(mask_mod))
    if compile_mod is not None and not isinstance(compile_mod, bool):
        problems.append(f"compile_mod must be True, False or None (None: compile on CUDA), not {compile_mod!r}")
    if kv_len is not None and kv_len != S:
        problems.append(f"kv_len={kv_len!r}, but omnigen masks are square: keys and queries are the same S={S} "
                        "tokens (leave kv_len out)")
    if problems:
        raise InputError(problems)
    check_capacity_choice(partial_bits)
    device = _check_device(device)
    mod = _Mod(mask_mod, device, compiles_by_default(device) if compile_mod is None else compile_mod)
    batches = torch.arange(B, device=device)
    # Every slab's indices are views of these (no launches per slab).
    positions = torch.arange(S, device=device)
    keys = positions[None, None, :]

    def slab(b0: int, b1: int, r0: int, r1: int) -> torch.Tensor:
        b = batches[b0:b1, None, None]
        if device.type == "cpu":
            budget = CPU_EVAL_ELEMENTS
        else:  # mod.compiled turns False once a compiled call has failed
            budget = COMPILED_SLAB_ELEMENTS if mod.compiled else EVAL_ELEMENTS
        rows = max(1, budget // ((b1 - b0) * S))
        if rows >= r1 - r0:  # one call: its result is the slab (no copy)
            return mod(b, positions[r0:r1, None][None], keys)
        out = torch.empty(b1 - b0, r1 - r0, S, dtype=torch.bool, device=device)
        width = max(1, budget // (b1 - b0))  # keys per call when even one row is too many
        for q0 in range(r0, r1, rows):
            q = positions[q0 : min(r1, q0 + rows), None][None]
            for c0 in range(0, S, width):
                c1 = min(S, c0 + width)
                out[:, q0 - r0 : q0 - r0 + q.shape[1], c0:c1] = mod(b, q, keys[..., c0:c1])
        return out

    shapes = tile_shapes(S, device, tiles, head_dim, dtype)
    # What need not wait for the classification runs while the host would wait for it: the head check's launches and
    # the stand-in tables (on an H100 they had kept the GPU idle ~1 ms of a ~6 ms mask, before and after the slabs).
    meanwhile: dict[str, tuple] = {}

    def while_classifying() -> None:
        meanwhile["heads"] = _head_sample(mod, batches, S, device)
        meanwhile["stand_in"] = ruleless_tables(B, S, True, device)

    # the mod evaluated once per tile shape; a compiled one on a GPU a COMPILED_SLAB_ELEMENTS slab a call
    plans = classify_shapes(slab, B, S, shapes, device, while_classifying,
                            budget=COMPILED_SLAB_ELEMENTS if device.type != "cpu" and mod.compiled else None)
    _check_heads(*meanwhile["heads"])
    return ruleless_mask(plans, B, S, True, device, partial_bits, made_by="mask_from_mod", stand_in=meanwhile["stand_in"])
