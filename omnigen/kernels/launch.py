"""Launching a built module from Python: the pointer, stride and size arguments its binding takes.

Every family shares the binding (common/templates/binding.cpp.j2): raw pointers, strides and a CUDA
stream, so the extension never includes torch headers. The arguments are named here and put in the binding's
order by their one description (kernels/arguments.py), which also makes the C structs and the binding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch

from .arguments import BACKWARD, CONVERT, DELTA, FORWARD, call_arguments


@dataclass(frozen=True)
class VariantTraits:
    """What a variant's module does besides the launches every module has. Its family states them when the variant
    is rendered (`KernelFamily.traits`), the binding exports them as the module's attributes (HAS_BACKWARD,
    BACKWARD_PROBLEM, PERSISTENT_FORWARD, PARTIAL_BITS, ORDERED_DQ, GROUP_DKDV, DQ_INTERLEAVED, PERSISTENT_BACKWARD), and
    `capabilities` reads them back."""

    has_backward: bool
    backward_problem: str | None  # why not, when it has none
    persistent_forward: bool  # the forward takes its work tiles from a counter (tile_counter) its launch zeroes
    partial_bits: bool  # the launches read a mask's partial tiles as bits (omnigen.plan.bits)
    ordered_dq: bool  # deterministic mode adds dQ in kv-tile order from the Hopper backward (dq_rank, dq_semaphore)
    group_dkdv: bool  # under GQA the backward adds each group's dK/dV into fp32 [B, Hkv, S, D] (dkdv_group)
    dq_interleaved: bool  # the backward's fp32 dQ has each 8-column group as 0, 2, 4, 6, 1, 3, 5, 7 (convert_gradient)
    persistent_backward: bool  # the atomic-order backward takes its kv-tiles from a counter (zeroed by Delta's pass)


@dataclass(frozen=True)
class Capabilities(VariantTraits):
    """What a built module can do and reads besides the arguments every launch takes (its VariantTraits' fields),
    and where its launches are, read once from its attributes (common/templates/binding.cpp.j2 sets them)."""

    launch_abi: int | None  # omnigen/launch_abi.h's kLaunchAbi; None: a module without native launches
    forward_launch: int  # the launch functions' addresses, for the op shim (omnigen/op/native/)
    backward_launch: int
    delta_launch: int
    convert_launch: int  # 0: none (a stand-in without the pass: the caller zeroes and copies itself)


_capabilities: dict[str, Capabilities] = {}  # by MODULE_NAME: an extension module is loaded once per process


def capabilities(module: Any) -> Capabilities:
    """The module's Capabilities (modules without an attribute, e.g. older builds or stand-ins, have it off).
    Read once per built module; stand-ins (not extension modules) are read on every call."""
    name = getattr(module, "MODULE_NAME", None) if isinstance(module, ModuleType) else None
    found = _capabilities.get(name) if name else None
    if found is None:
        def flag(attribute: str) -> bool:
            return bool(getattr(module, attribute, False))

        traits = VariantTraits(
            has_backward=bool(getattr(module, "HAS_BACKWARD", hasattr(module, "backward"))),
            backward_problem=getattr(module, "BACKWARD_PROBLEM", None),
            persistent_forward=flag("PERSISTENT_FORWARD"), partial_bits=flag("PARTIAL_BITS"),
            ordered_dq=flag("ORDERED_DQ"), group_dkdv=flag("GROUP_DKDV"),
            dq_interleaved=flag("DQ_INTERLEAVED"), persistent_backward=flag("PERSISTENT_BACKWARD"))
        found = Capabilities(
            **asdict(traits),
            launch_abi=getattr(module, "LAUNCH_ABI", None), forward_launch=int(getattr(module, "FORWARD_LAUNCH", 0)),
            backward_launch=int(getattr(module, "BACKWARD_LAUNCH", 0)),
            delta_launch=int(getattr(module, "DELTA_LAUNCH", 0)),
            convert_launch=int(getattr(module, "CONVERT_LAUNCH", 0)))
        if name:
            _capabilities[name] = found
    return found


def heads_inner(batch: int, heads: int, seq_len: int, head_dim: int, *, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """An uninitialised [B, H, S, D] tensor stored as [B, S, H, D]: the layout of every tensor the ops return
    (out, dq, dk, dv), as SDPA's flash and cuDNN kernels return theirs. A model's next step reads it as
    [B, S, H * D] (`out.transpose(1, 2).reshape(B, S, -1)` for the output projection, the backward of the q/k/v
    projection for the gradients), a view instead of a transposing copy. The kernels take any row strides."""
    return torch.empty(batch, seq_len, heads, head_dim, dtype=dtype, device=device).transpose(1, 2)


def as_heads_inner(t: torch.Tensor) -> torch.Tensor:
    """`t` [B, H, S, D] in the ops' output layout (`heads_inner`): itself when it is, else a copy."""
    B, H, S, D = t.shape
    if t.stride() == (S * H * D, D, H * D, 1) or t.numel() == 0:
        return t
    return heads_inner(B, H, S, D, dtype=t.dtype, device=t.device).copy_(t)


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels need a contiguous last dim, 16-byte aligned rows: copy only when that fails."""
    size = t.element_size()
    aligned = t.stride(-1) == 1 and all(s * size % 16 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    return t if aligned else t.contiguous()


# The current device's current stream as a raw handle, without the torch.cuda.Stream object current_stream()
# builds (5 us of host time against 0.2: three per training step).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream() -> int:
    if _raw_stream is not None:
        return _raw_stream(torch.cuda.current_device())
    return torch.cuda.current_stream().cuda_stream  # pragma: no cover - a torch without the raw accessor


def _partial_bits_keywords(module: Any, slot: torch.Tensor | None, bits: torch.Tensor | None) -> dict[str, int]:
    """The binding's keywords for a schedule's partial tiles as bits (omnigen.plan.bits): a Mask's schedules hold
    them, a bare Plan does not; a module that does not read them (PARTIAL_BITS False) gets none."""
    if bits is None or bits.numel() == 0 or not capabilities(module).partial_bits:
        return {}
    return {"partial_slot": slot.data_ptr(), "partial_bits": bits.data_ptr(), "partial_bits_words": bits.numel()}


def _tensor_values(**tensors: torch.Tensor) -> dict[str, Any]:
    """Each tensor's address by its name and its strides as `<name>_strides` (what call_arguments reads)."""
    values: dict[str, Any] = {}
    for name, t in tensors.items():
        values[name] = t.data_ptr()
        values[f"{name}_strides"] = t.stride()
    return values


def _sizes(q: torch.Tensor, k: torch.Tensor) -> dict[str, int]:
    B, Hq, S, _ = q.shape
    return {"batch": B, "heads_q": Hq, "heads_kv": k.shape[1], "seq_len": S}


def _tables(p: Any) -> dict[str, int]:
    """The plan's schedules and the layout's token tables, by field name."""
    t = p.tables
    return {"fwd_ptr": p.fwd_ptr.data_ptr(), "fwd_kv": p.fwd_kv.data_ptr(),
            "token_segment": t.token_segment.data_ptr(), "token_modality": t.token_modality.data_ptr(),
            "token_doc": t.token_doc.data_ptr()}


def launch_forward(module: Any, p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, value_scale: float | None = None,
                   descale: torch.Tensor | None = None) -> None:
    """The forward kernel into given `out` [B, Hq, S, D] and `lse` [B, Hq, S] float32 (any strides). FP8 modules
    take v as V^T (op/fp8.py) and multiply O by `value_scale`, or read the three factors (dq, dk, dv) from
    `descale` (float32 [3] on q's device) instead of value_scale and the descale part of `scale`."""
    values = {**_tensor_values(q=q, k=k, v=v, o=out), "lse": lse.data_ptr(), **_sizes(q, k), "scale": scale,
              **_tables(p)}
    keywords: dict[str, Any] = {}
    if capabilities(module).persistent_forward:  # its work tiles come from a counter its launch zeroes
        # A fresh one per call: two launches on two streams never share a counter.
        counter = torch.empty(1, dtype=torch.int32, device=q.device)
        keywords["tile_counter"] = counter.data_ptr()
    keywords.update(_partial_bits_keywords(module, getattr(p, "partial_slot", None), getattr(p, "partial_bits", None)))
    if value_scale is not None:
        keywords["value_scale"] = value_scale
    if descale is not None:
        keywords["descale"] = descale.data_ptr()
    module.forward(*call_arguments(FORWARD, values, _stream()), **keywords)


def launch_delta(module: Any, out: torch.Tensor, d_out: torch.Tensor, delta: torch.Tensor,
                 dq_accum: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> None:
    """Delta = rowsum(dO * O) into `delta` [B, Hq, S] float32; `dq_accum` (float32 [B, Hq, S, D], contiguous) and
    `counters` (the backward's int32 counters, `backward_counters`), if given, zeroed in the same pass."""
    B, Hq, S, _ = out.shape
    values = {**_tensor_values(o=out, d_o=d_out), "delta": delta.data_ptr(), "batch": B, "heads_q": Hq, "seq_len": S}
    keywords: dict[str, Any] = {"dq_accum": dq_accum.data_ptr()} if dq_accum is not None else {}
    if counters is not None:
        keywords.update(zero_ints=counters.data_ptr(), zero_int_count=counters.numel())
    module.backward_delta(*call_arguments(DELTA, values, _stream()), **keywords)


def backward_counters(module: Any, q: torch.Tensor, deterministic: bool) -> torch.Tensor | None:
    """The int32 counters the backward takes zeroed (dq_semaphore), not yet zeroed: on ORDERED_DQ modules in
    deterministic mode one per (batch, query head, 64-row block of dQ), on PERSISTENT_BACKWARD modules in atomic mode
    the kv-tiles' counter; else None. A fresh one per call: two launches on two streams never share one."""
    caps = capabilities(module)
    B, Hq, S, _ = q.shape
    if deterministic and caps.ordered_dq:
        return torch.empty(B, Hq, -(-S // 64), dtype=torch.int32, device=q.device)
    if not deterministic and caps.persistent_backward:
        return torch.empty(1, dtype=torch.int32, device=q.device)
    return None


def columns_in_order(interleaved: torch.Tensor) -> torch.Tensor:
    """[..., D] with each group of 8 columns stored as 0, 2, 4, 6, 1, 3, 5, 7 (a DQ_INTERLEAVED module's fp32 dQ),
    put in order: what the module's conversion pass does on the GPU."""
    *lead, D = interleaved.shape
    return interleaved.reshape(*lead, D // 8, 2, 4).transpose(-1, -2).reshape(*lead, D)


def convert_gradient(module: Any, source: torch.Tensor, destination: torch.Tensor,
                     interleaved: bool = False) -> torch.Tensor:
    """`destination` (the element type, [B, H, S, D], last dim contiguous) = `source` (float32, contiguous) by the
    module's own pass (a plain copy for modules built without one). `interleaved`: the source's columns lie in
    each group of 8 as 0, 2, 4, 6, 1, 3, 5, 7 (the dQ of a module with `dq_interleaved`)."""
    if not capabilities(module).convert_launch:
        return destination.copy_(columns_in_order(source) if interleaved else source)
    B, H, S, _ = source.shape
    values = {"source": source.data_ptr(), "destination": destination.data_ptr(),
              "destination_strides": destination.stride(), "batch": B, "heads": H, "seq_len": S}
    keywords = {"interleaved": True} if interleaved else {}
    module.backward_convert(*call_arguments(CONVERT, values, _stream()), **keywords)
    return destination


def launch_backward(module: Any, p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                    d_out: torch.Tensor, delta: torch.Tensor, dq_accum: torch.Tensor, dk: torch.Tensor,
                    dv: torch.Tensor, scale: float, deterministic: bool, dkdv_group: int = 1,
                    counters: torch.Tensor | None = None) -> None:
    """The dK/dV and dQ kernels. `dq_accum` is float32 [B, Hq, S, D], zeroed (unless deterministic on a module
    without ORDERED_DQ: then overwritten); dk/dv are the element type [B, Hkv, S, D], or under GQA float32: per
    query head [B, Hq, S, D] (dkdv_group 1: the caller sums each group), or [B, Hkv, S, D] zeroed, the groups added
    by the kernel (dkdv_group = Hq / Hkv: GROUP_DKDV modules, atomic mode). `counters`: `backward_counters`'
    tensor zeroed by the Delta pass, or None (then made and zeroed here where the module takes them)."""
    values = {**_tensor_values(q=q, k=k, v=v, d_o=d_out, dk=dk, dv=dv), "lse": lse.data_ptr(),
              "delta": delta.data_ptr(), "dq_accum": dq_accum.data_ptr(), **_sizes(q, k), "scale": scale,
              **_tables(p), "bwd_ptr": p.bwd_ptr.data_ptr(), "bwd_q": p.bwd_q.data_ptr(),
              "deterministic": deterministic}
    keywords: dict[str, Any] = {"dkdv_group": dkdv_group} if dkdv_group > 1 else {}
    if counters is None:
        counters = backward_counters(module, q, deterministic)
        if counters is not None:
            counters.zero_()
    # (ranks and counters are held until the launch is queued: the caching allocator may hand a freed block on)
    if deterministic and capabilities(module).ordered_dq:  # the order of the dQ additions, per 64-row block
        ranks = p.dq_ranks()
        keywords = {"dq_rank": ranks.data_ptr(), "dq_semaphore": counters.data_ptr()}
    elif counters is not None:  # the persistent backward's kv-tiles come from a counter
        keywords["dq_semaphore"] = counters.data_ptr()
    keywords.update(_partial_bits_keywords(module, getattr(p, "partial_slot_bwd", None),
                                           getattr(p, "partial_bits_bwd", None)))
    module.backward(*call_arguments(BACKWARD, values, _stream()), **keywords)


def forward_pass(module: Any, p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a built module: (out, lse). Inputs already checked (omnigen.op)."""
    B, Hq, S, D = q.shape
    out = heads_inner(B, Hq, S, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    launch_forward(module, p, q, k, v, out, lse, scale)
    return out, lse


def backward_pass(module: Any, p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, d_out: torch.Tensor, scale: float,
                  deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a built module -- Delta, dQ/dK/dV kernels, GQA's groups summed: (dq, dk, dv).

    `p` must be planned with this module's block_m x block_n; out/lse may come from any forward
    (they do not depend on the tile), which is what lets the forward and backward tiles differ."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    d_out = kernel_ready(d_out)
    lse = lse.contiguous()  # the kernels index it as [B, Hq, S] with no strides (a slice of a longer one is not)
    delta = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)  # dO . O per row
    # Modules with their own conversion pass (CONVERT_LAUNCH) also zero the fp32 dQ in the Delta pass.
    caps = capabilities(module)
    own_passes = bool(caps.convert_launch)
    dq_accum = (torch.empty if own_passes else torch.zeros)(B, Hq, S, D, dtype=torch.float32, device=q.device)
    counters = backward_counters(module, q, deterministic) if own_passes else None  # zeroed by Delta too
    launch_delta(module, out, d_out, delta, dq_accum if own_passes else None, counters)
    partials = Hq != Hkv
    # GQA: the kernel adds each group's dK/dV in fp32 itself (atomic mode of GROUP_DKDV modules, groups a power of
    # two), else writes fp32 per query head and the groups are summed here (deterministic: a fixed order)
    group = Hq // Hkv
    grouped = partials and not deterministic and caps.group_dkdv and group & (group - 1) == 0
    dk, dv = (heads_inner(B, Hkv, S, D, dtype=t.dtype, device=q.device) for t in (k, v))
    if not partials:
        dk_kernel, dv_kernel = dk, dv
    else:
        make = torch.zeros if grouped else torch.empty  # the kernel adds into the grouped buffers
        dk_kernel, dv_kernel = (make(B, Hkv if grouped else Hq, S, D, dtype=torch.float32, device=q.device)
                                for _ in range(2))
    launch_backward(module, p, q, k, v, lse, d_out, delta, dq_accum, dk_kernel, dv_kernel, scale, deterministic,
                    group if grouped else 1, counters)
    if grouped:
        convert_gradient(module, dk_kernel, dk)
        convert_gradient(module, dv_kernel, dv)
    elif partials:
        dk.copy_(dk_kernel.view(B, Hkv, Hq // Hkv, S, D).sum(2))
        dv.copy_(dv_kernel.view(B, Hkv, Hq // Hkv, S, D).sum(2))
    dq = heads_inner(B, Hq, S, D, dtype=q.dtype, device=q.device)
    return convert_gradient(module, dq_accum, dq, caps.dq_interleaved), dk, dv
