"""The native call path on a GPU (op/native/): the shim's C++ kernels of omnigen::attention and
omnigen::attention_backward give the same bits as the ops' Python kernels, for every case the Python path handles
(MHA and GQA, fp16, deterministic, strided inputs, masks with and without partial bits, tuned tile shapes absent
from a mask), and say the same errors.

    PYTHONPATH=. OMNIGEN_CACHE_DIR=/tmp/og python3 -m pytest -q -m gpu tests/test_native_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import omnigen
from omnigen import reference
from omnigen.op import library, native
from omnigen.tune import layouts as tune_layouts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RULES = omnigen.Rules.load(Path(__file__).resolve().parents[1] / "examples" / "rules" / "transfusion.yaml")


def _inputs(B, Hq, Hkv, S, D, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(B, Hq, S, D, device="cuda", dtype=dtype, generator=gen)


def _op_inputs(q, k, v, mask, deterministic):
    return (q, k, v, mask.schedules, list(mask.tile_shapes), mask.token_segment, mask.token_modality, mask.token_doc,
            library.RULES_PREFIX + mask.rules_key, q.shape[-1] ** -0.5, deterministic)


def test_the_shim_is_loaded_and_registered_for_cuda():
    omnigen.attention(*_inputs(1, 2, 2, 256, 64, torch.bfloat16)[:3], "text:256", RULES)  # builds, loads the shim
    assert native.loaded(), native.problem()
    dump = torch._C._dispatch_dump("omnigen::attention")
    assert "CUDA: registered at" in dump and "ops.cpp" in dump


CASES = [  # B, Hq, Hkv, S, D, dtype, deterministic, partial_bits
    (2, 4, 4, 1000, 128, torch.bfloat16, False, "auto"),
    (1, 8, 2, 2048, 64, torch.bfloat16, False, "auto"),
    (2, 4, 4, 777, 64, torch.float16, False, "none"),
    (1, 4, 4, 1536, 128, torch.bfloat16, True, "auto"),
    (1, 8, 2, 1024, 64, torch.bfloat16, True, "none"),
]


@pytest.mark.parametrize("B, Hq, Hkv, S, D, dtype, deterministic, partial_bits", CASES)
def test_native_and_python_kernels_give_the_same_bits(B, Hq, Hkv, S, D, dtype, deterministic, partial_bits):
    layouts = omnigen.Layout.batch(tune_layouts.synthetic_batch(RULES, S, B * S, seed=S))
    mask = omnigen.mask(RULES, layouts, device="cuda", head_dim=D, dtype=dtype, partial_bits=partial_bits)
    q, k, v, d_out = _inputs(B, Hq, Hkv, S, D, dtype, seed=D)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided: [B, S, H, D] memory, as projections give it
    omnigen.attention(q, k, v, mask)
    assert native.loaded(), native.problem()
    inputs = _op_inputs(q, k, v, mask, deterministic)
    out, lse = torch.ops.omnigen.attention.default(*inputs)  # the C++ kernel
    out_py, lse_py = library.attention_op._init_fn(*inputs)  # the Python kernel, called directly
    assert torch.equal(out, out_py) and torch.equal(lse, lse_py)
    assert out.stride() == out_py.stride() and out.transpose(1, 2).is_contiguous()
    grads = torch.ops.omnigen.attention_backward.default(d_out, q, k, v, out, lse, *inputs[3:])
    grads_py = library.attention_backward_op._init_fn(d_out, q, k, v, out, lse, *inputs[3:])
    for name, native_grad, python_grad in zip(("dq", "dk", "dv"), grads, grads_py):
        assert native_grad.shape == python_grad.shape and native_grad.stride() == python_grad.stride(), name
        assert native_grad.transpose(1, 2).is_contiguous(), name  # [B, S, H, D] in memory (heads_inner)
        if deterministic:
            assert torch.equal(native_grad, python_grad), name
        else:  # dQ by atomics: the order of additions differs run to run, in either path
            torch.testing.assert_close(native_grad.float(), python_grad.float(), atol=2e-2, rtol=2e-2)


def test_training_step_through_the_shim_matches_the_reference():
    layouts = omnigen.Layout.batch([omnigen.Layout.parse("text:100 image:256 text:156"),
                                    omnigen.Layout.parse("image:256 text:200 text:56@1")])
    mask = omnigen.mask(RULES, layouts, device="cuda", head_dim=64, dtype=torch.bfloat16)
    q, k, v, d_out = _inputs(2, 4, 2, 512, 64, torch.bfloat16, seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = omnigen.attention(*leaves, mask)
    out.backward(d_out)
    expected, _ = reference.attention_reference(q.double(), k.double(), v.double(), layouts, RULES)
    expected_grads = reference.attention_reference_grads(q, k, v, layouts, d_out.double(), rules=RULES)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(leaves, expected_grads):
        torch.testing.assert_close(got.grad.double(), want, atol=5e-2, rtol=5e-2)


def test_a_mask_without_the_kernels_tile_shape_is_refused_with_the_same_message():
    layouts = omnigen.Layout.batch([omnigen.Layout.parse("text:512")])
    mask = omnigen.mask(RULES, layouts, device="cuda", head_dim=64, dtype=torch.bfloat16, tiles=[(128, 64)])
    q, k, v, _ = _inputs(1, 2, 2, 512, 64, torch.bfloat16)
    assert native.load(), native.problem()  # the C++ kernel says it, whichever test ran first
    inputs = _op_inputs(q, k, v, mask, False)
    for kernel in (torch.ops.omnigen.attention.default, library.attention_op._init_fn):  # C++, then Python
        with pytest.raises(ValueError, match=r"the mask has no plan for \d+x\d+ tiles, .* \(it has 128x64\)"):
            kernel(*inputs)


def test_forgetting_launch_choices_is_harmless():
    q, k, v, _ = _inputs(1, 2, 2, 300, 64, torch.bfloat16)
    first = omnigen.attention(q, k, v, "text:300", RULES)
    native.forget()
    assert torch.equal(first, omnigen.attention(q, k, v, "text:300", RULES))


def test_outputs_are_stored_heads_inner_and_compiled_models_match_eager():
    """Every output is [B, S, H, D] in memory (`kernels.launch.heads_inner`); under torch.compile Inductor may hand
    the op q and k in the layout it finds cheapest (the ops' flexible_layout tag). The kernels read any row
    strides, so the compiled call gives the eager call's bits on the same q, k, v, and the gradients agree."""
    B, S, H, D = 2, 1024, 4, 64
    mask = omnigen.mask(RULES, omnigen.Layout.batch(tune_layouts.synthetic_batch(RULES, S, B * S, seed=3)),
                        device="cuda", head_dim=D, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(B, S, 3 * H * D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cos, sin = (f(torch.rand(S, 1, D // 2, device="cuda", generator=gen)) for f in (torch.cos, torch.sin))

    def rope(t):  # [B, S, H, D] -> [B, H, S, D], ending in a cat as rotary embeddings do
        t1, t2 = t.float().chunk(2, -1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1).to(t.dtype).transpose(1, 2)

    def block(x):  # a projection's output through rope into attention, heads back inside for the next projection
        q, k, v = x.view(B, S, 3, H, D).unbind(2)
        q, k, v = rope(q), rope(k), v.transpose(1, 2)
        out = omnigen.attention(q, k, v, mask, deterministic=True)
        return out.transpose(1, 2).reshape(B, S, H * D), q, k, v

    results = []
    try:
        for run in (block, torch.compile(block, fullgraph=True)):
            xs = x.clone().requires_grad_()
            y, q, k, v = run(xs)
            y.backward(torch.ones_like(y))
            results.append((y.detach(), q.detach(), k.detach(), v.detach(), xs.grad))
    finally:
        torch._dynamo.reset()
    (y_eager, *_, g_eager), (y_compiled, q, k, v, g_compiled) = results
    again = omnigen.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask, deterministic=True)
    assert again.stride() == (S * H * D, D, H * D, 1)  # heads inner
    assert torch.equal(again.transpose(1, 2).reshape(B, S, H * D), y_compiled)
    torch.testing.assert_close(y_compiled.float(), y_eager.float(), atol=2e-2, rtol=2e-2)  # rope's rounding
    torch.testing.assert_close(g_compiled.float(), g_eager.float(), atol=5e-2, rtol=5e-2)
