"""The FP8 forward: e4m3 q, k, v in, bf16 out, on the sm90 family's FP8 variants (forward-only, head dim 128).

    out = omnigen.attention(q8, k8, v8, mask, descale=(dq, dk, dv))   # q8/k8/v8: torch.float8_e4m3fn

`descale` holds the per-tensor factors that turn the stored values back into real ones (x = x8 * d, as
`torch._scaled_mm`'s scales and FlashAttention-3's descales): the scores are scale * dq * dk * q8 . k8, and O
comes out multiplied by dv. Each factor is a Python number or a one-element float32 tensor on q's device; with any
tensor among them the three go to the kernel as one float32 [3] tensor it reads itself, so that under torch.compile
new values are new inputs, not new constants (no recompilation), and CUDA graphs replay whatever the tensors hold.
No autograd (FP8 has no backward here): a call makes V's transposed copy the kernel
reads, then launches the module's forward. Under torch.compile it is one node, the op `omnigen::attention_fp8`
(tensors and primitive values only, like `omnigen::attention`; its fake gives out's and lse's shapes); eager calls
run the same function without the op's dispatch.

Why the copy: 8-bit wgmma takes both operands K-major, so P V needs V as [head_dim][keys]. The copy also permutes
the keys inside each group of 16 to the order in which the kernel packs P's registers (forward.cu.j2,
keep_probabilities): key 8a + 2t + b of a group sits at column 4t + 2a + b. On CUDA a Triton kernel makes it in one
pass over V (1 byte a value; torch's permuted copy of the same took 0.44 ms at B * S = 32K, H = 16: a quarter of the
8K forward); `values_transposed` is the same copy in torch, for the CPU and as the kernel's reference.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..errors import InputError
from ..kernels import launch
from ..plan import Mask
from . import library
from .library import TokenTables

try:  # Triton is optional: without it the copy is torch's
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
# Keys per group of V^T's permutation (the kernel's 16-key halves of a k32 step); V^T's rows are padded to it.
KEY_GROUP = 16


def is_fp8(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == FP8_DTYPE


def _descale_problems(descale: Any, device: torch.device) -> list[str]:
    if descale is None:
        return []
    if isinstance(descale, torch.Tensor) or not isinstance(descale, Sequence) or len(descale) != 3:
        return [f"descale must be three positive numbers (dq, dk, dv), per-tensor factors, each a Python number or a "
                f"one-element float32 tensor, not {descale!r}"]
    bad, tensors = [], []
    for name, value in zip(("dq", "dk", "dv"), descale):
        if isinstance(value, torch.Tensor):
            if value.dtype != torch.float32 or value.numel() != 1 or value.device != device:
                tensors.append(f"{name}: {value.dtype} with {value.numel()} elements on {value.device}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            bad.append(f"{name}={value!r}")
    problems = []
    if bad:
        problems.append(f"descale must hold positive finite numbers (per-tensor factors), got {', '.join(bad)}")
    if tensors:
        problems.append(f"a descale given as a tensor must be one float32 element on q's device ({device}), got "
                        f"{'; '.join(tensors)}")
    return problems


def descale_tensor(descale: Sequence[Any] | None) -> torch.Tensor | None:
    """The three factors as one float32 [3] tensor on their tensors' device, where any of them is a tensor (the
    kernel reads them there); None where all are numbers (they go in as the launch's own scale)."""
    if descale is None or not any(isinstance(x, torch.Tensor) for x in descale):
        return None
    device = next(x.device for x in descale if isinstance(x, torch.Tensor))
    # Numbers by a fill, not a host-to-device copy: a CUDA graph can capture the one and not the other.
    return torch.stack([x.reshape(()) if isinstance(x, torch.Tensor)
                        else torch.full((), float(x), dtype=torch.float32, device=device) for x in descale])


def check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: Any) -> None:
    """What the FP8 path adds to the common checks: all three e4m3 on CUDA, no gradient asked, valid descales."""
    problems = []
    if not (is_fp8(q) and is_fp8(k) and is_fp8(v)):
        problems.append(f"the FP8 forward takes q, k and v all in torch.float8_e4m3fn, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    elif q.device.type != "cuda":
        problems.append(f"the FP8 forward runs on Hopper GPUs (sm_90a); q is on {q.device}. On the CPU, dequantise "
                        "first: omnigen.attention(q.float() * dq, k.float() * dk, v.float() * dv, ...)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        problems.append("the FP8 forward has no backward: call it under torch.no_grad() (train in bf16 or fp16)")
    problems += _descale_problems(descale, q.device)
    if problems:
        raise InputError("; ".join(problems))


def values_transposed(v: torch.Tensor) -> torch.Tensor:
    """V [B, H, S, D] (e4m3) as the kernel reads it: [B, H, D, S16], S padded with zeros to a multiple of 16, key
    16g + 8a + 2t + b at column 16g + 4t + 2a + b (the order in which the kernel packs P)."""
    B, H, S, D = v.shape
    padded = -(-S // KEY_GROUP) * KEY_GROUP
    raw = v.view(torch.uint8)  # bytes: padding and copies of float8 tensors without relying on float8 kernels
    if padded != S:
        raw = torch.nn.functional.pad(raw, (0, 0, 0, padded - S))
    grouped = raw.reshape(B, H, padded // KEY_GROUP, 2, 4, 2, D)  # (g, a, t, b): key 16g + 8a + 2t + b
    return grouped.permute(0, 1, 6, 2, 4, 3, 5).reshape(B, H, D, padded).view(FP8_DTYPE)


if triton is not None:

    @triton.jit
    def _transpose_values_kernel(v, vt, seq_len, heads, stride_b, stride_h, stride_s, padded,
                                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        # Program (batch * heads + head, block): V^T's columns BLOCK * block on of that head, as [HEAD_DIM, BLOCK].
        pair = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        within = columns % 16  # column 4t + 2a + b of a group holds key 8a + 2t + b
        keys = columns - within + 8 * ((within // 2) % 2) + 2 * (within // 4) + within % 2
        dims = tl.arange(0, HEAD_DIM)
        source = v + (pair // heads) * stride_b + (pair % heads) * stride_h
        rows = tl.load(source + keys[:, None] * stride_s + dims[None, :], mask=(keys < seq_len)[:, None], other=0)
        target = vt + pair.to(tl.int64) * HEAD_DIM * padded + dims[:, None] * padded + columns[None, :]
        tl.store(target, tl.trans(rows), mask=(columns < padded)[None, :])


def transpose_values(v: torch.Tensor) -> torch.Tensor:
    """`values_transposed(v)`, by the Triton kernel on CUDA (where Triton is installed)."""
    B, H, S, D = v.shape
    if triton is None or not v.is_cuda:
        return values_transposed(v)
    padded = -(-S // KEY_GROUP) * KEY_GROUP
    raw = v.view(torch.uint8)
    vt = torch.empty(B, H, D, padded, dtype=torch.uint8, device=v.device)
    block = 128
    _transpose_values_kernel[(B * H, -(-padded // block))](raw, vt, S, H, *raw.stride()[:3], padded,
                                                           HEAD_DIM=D, BLOCK=block, num_warps=4)
    return vt.view(FP8_DTYPE)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, kernel_key: str, scale: float,
            descale: Sequence[Any] | None, return_lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One FP8 forward over a checked call's mask (check_call passed): out [B, Hq, S, D] bf16 (and lse [B, Hq, S]
    float32). The op when compiling, else its function directly."""
    if mask.permutation is not None:
        raise InputError("the FP8 forward does not take reordered masks (omnigen.reorder) yet: pass the mask "
                         "without its permutation, or run the call in bf16")
    on_device = descale_tensor(descale)
    factors = [float(x) for x in descale] if descale is not None and on_device is None else [1.0, 1.0, 1.0]
    inputs = (q, k, v, mask.schedules, list(mask.tile_shapes), mask.token_segment, mask.token_modality,
              mask.token_doc, kernel_key, scale, factors, on_device)
    out, lse = attention_fp8_op(*inputs) if torch.compiler.is_compiling() else _attention_fp8(*inputs)
    return (out, lse) if return_lse else out


def _attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedules: list[torch.Tensor], tiles: list[int],
                   token_segment: torch.Tensor, token_modality: torch.Tensor, token_doc: torch.Tensor, kernel: str,
                   scale: float, descale: list[float], descale_on_device: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    dq, dk, dv = descale  # (1, 1, 1 with descale_on_device, which the kernel reads instead)
    _, module, plan = library.pass_plan(kernel, q, False, schedules, tiles,
                                        TokenTables(token_segment, token_modality, token_doc))
    q, k = (launch.kernel_ready(t) for t in (q, k))
    vt = transpose_values(v)
    B, Hq, S, D = q.shape
    out = launch.heads_inner(B, Hq, S, D, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    launch.launch_forward(module, plan, q, k, vt, out, lse, scale * dq * dk, value_scale=dv,
                          descale=descale_on_device)
    return out, lse


# q, k and v may come in any row strides (kernel_ready copies only what the kernel cannot read; V is copied anyway),
# and out's layout is fixed: the same flexible-layout tag as omnigen::attention's.
attention_fp8_op = torch.library.custom_op("omnigen::attention_fp8", _attention_fp8, mutates_args=(),
                                           tags=library.LAYOUT_TAGS)


@attention_fp8_op.register_fake
def _attention_fp8_fake(q, k, v, schedules, tiles, token_segment, token_modality, token_doc, kernel, scale, descale,
                        descale_on_device):
    B, Hq, S, D = q.shape
    return (launch.heads_inner(B, Hq, S, D, dtype=torch.bfloat16, device=q.device),
            q.new_empty(B, Hq, S, dtype=torch.float32))
