"""Masks made from data (`mask_from_dense`, `mask_from_mod`, `mask_from_intervals`) through the kernels on a GPU:
forward and backward against a float64 reference on the dense mask, on masks no rule says. Partial tiles come
from the mask's bits only (plan/ruleless.py); where a kernel cannot read them the op must refuse.

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -m gpu tests/test_mask_makers_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import omnigen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


def _medusa_tree(S: int, prefix: int, gen: torch.Generator) -> torch.Tensor:
    """A causal prefix, then a tree of candidate tokens: each sees the prefix and its ancestors (random parents)."""
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    parent = torch.randint(0, 4, (S,), generator=gen)
    allowed[prefix:, prefix:] = False
    for i in range(prefix, S):
        allowed[i, i] = True
        j = i - 1 - int(parent[i])
        if j >= prefix:
            allowed[i, prefix:] |= allowed[j, prefix:]
    return allowed


def _window_and_globals(S: int, window: int, globals_: int) -> torch.Tensor:
    q = torch.arange(S)[:, None]
    k = torch.arange(S)[None, :]
    return (k <= q) & ((q - k < window) | (k < globals_) | (q < globals_))


def _reference(q, k, v, allowed, d_out):
    """float64 attention over the allowed keys; rows with none give zeros."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k64, v64))
    scores = (q64 @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    out = p @ vv
    out.backward(d_out.double())
    return out, (q64.grad, k64.grad, v64.grad)


MASKS = {
    "medusa": lambda S, g: _medusa_tree(S, S // 2, g),
    "window_globals": lambda S, g: _window_and_globals(S, 200, 24),
    "random_eviction": lambda S, g: torch.ones(S, S, dtype=torch.bool).tril() & (torch.rand(S, S, generator=g) > 0.3),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("D", [64, 128])
def test_masks_from_data_match_the_dense_reference(name, D):
    if not _hopper():
        pytest.skip("masks made from data run on the sm90 family (Hopper)")
    B, Hq, Hkv, S = 2, 4, 2, 1024
    gen = torch.Generator().manual_seed(D)
    allowed = torch.stack([MASKS[name](S, gen) for _ in range(B)])
    mask = omnigen.mask_from_dense(allowed.cuda(), device="cuda", head_dim=D, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    d_out = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = omnigen.attention(q, k, v, mask)
    out.backward(d_out)
    want, grads = _reference(q, k, v, allowed.cuda(), d_out)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    for name_, got, expected in zip("qkv", (q.grad, k.grad, v.grad), grads):
        torch.testing.assert_close(got.double(), expected, atol=6e-2, rtol=5e-2, msg=lambda m: f"d{name_}: {m}")


def test_mod_and_dense_give_the_same_outputs():
    if not _hopper():
        pytest.skip("masks made from data run on the sm90 family (Hopper)")
    S, D = 768, 64

    def mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < 100) | (kv_idx < 16))

    q = torch.arange(S)[:, None]
    k = torch.arange(S)[None, :]
    dense = (k <= q) & ((q - k < 100) | (k < 16))
    a = omnigen.mask_from_mod(mod, 1, S, device="cuda", head_dim=D, dtype=torch.bfloat16)
    b = omnigen.mask_from_dense(dense.cuda(), device="cuda", head_dim=D, dtype=torch.bfloat16)
    x = torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(omnigen.attention(x, x, x, a), omnigen.attention(x, x, x, b))
