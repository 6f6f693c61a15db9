"""The custom op on the CPU: fake tensors, opcheck, autograd and torch.compile through the library's own
call path, with the kernels' launches emulated (tests/emulated_kernels.py). GPU checks of the same things
with the real kernels: tests/test_compile_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._subclasses.fake_tensor import FakeTensorMode

import omnigen
from omnigen.op import library
from omnigen.plan import Mask, make_mask
from omnigen.reference import attention_reference, attention_reference_grads
from omnigen.targets import TileConfig

from emulated_kernels import emulated_kernel

RULES = omnigen.Rules(name="optest", modalities={"text": "causal", "image": "full"}, see={"text -> image": "all"})
LAYOUT_A = omnigen.Layout.parse("text:20 image:40 text:13 image:17 text:6@1")
LAYOUT_B = omnigen.Layout.parse("image:33 text:29 text:34@1")


def _qkv(B=2, Hq=4, Hkv=2, S=96, D=16, dtype=torch.bfloat16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _op_args(kernel, mask, q, k, v, deterministic=False):
    return (q, k, v, mask.schedules, list(mask.tile_shapes), mask.token_segment, mask.token_modality,
            mask.token_doc, kernel.key, 0.25, deterministic)


# ------------------------------------------------------------------------------------------------
# the ops' schemas and fake tensors


def test_ops_are_registered_with_tensor_and_primitive_arguments_only():
    schema = str(torch.ops.omnigen.attention.default._schema)
    assert schema.startswith("omnigen::attention(Tensor q, Tensor k, Tensor v, Tensor[] schedules, SymInt[] tiles")
    assert "str kernel, float scale, bool deterministic) -> (Tensor, Tensor)" in schema
    backward = str(torch.ops.omnigen.attention_backward.default._schema)
    assert backward.endswith("-> (Tensor, Tensor, Tensor)")


@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (4, 1)])
def test_fake_tensors_give_the_kernels_output_shapes(Hq, Hkv):
    mask = make_mask(RULES, omnigen.Layout.batch([LAYOUT_A, LAYOUT_B]), [(32, 16)], device="cpu")
    with FakeTensorMode() as mode:
        q = torch.empty(2, Hq, 96, 64, dtype=torch.bfloat16)
        k = torch.empty(2, Hkv, 96, 64, dtype=torch.bfloat16)
        fake = [mode.from_tensor(t) for t in [*mask.schedules, mask.token_segment, mask.token_modality, mask.token_doc]]
        schedules, tables = fake[:-3], fake[-3:]
        out, lse = torch.ops.omnigen.attention(q, k, k, schedules, [32, 16], *tables, "kernel:none", 0.125, False)
        assert out.shape == (2, Hq, 96, 64) and out.dtype == torch.bfloat16
        # stored as [B, S, H, D] (as SDPA's flash/cuDNN outputs), so [B, S, H * D] is a view
        assert out.stride() == (96 * Hq * 64, 64, Hq * 64, 1) and out.transpose(1, 2).is_contiguous()
        assert lse.shape == (2, Hq, 96) and lse.dtype == torch.float32 and lse.is_contiguous()
        dq, dk, dv = torch.ops.omnigen.attention_backward(out, q, k, k, out, lse, schedules, [32, 16], *tables,
                                                          "kernel:none", 0.125, False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        assert dk.dtype == torch.bfloat16
        assert all(g.transpose(1, 2).is_contiguous() for g in (dq, dk, dv))


# ------------------------------------------------------------------------------------------------
# the real op path on CPU (emulated launches)


def test_opcheck_forward_and_backward(monkeypatch):
    kernel = emulated_kernel(monkeypatch, RULES, backward_tile=TileConfig(16, 32, 4, 2))
    mask = kernel.mask(omnigen.Layout.batch([LAYOUT_A, LAYOUT_B]), device="cpu")
    assert mask.tiles == ((32, 16), (16, 32))
    q, k, v = _qkv(grad=True)
    torch.library.opcheck(torch.ops.omnigen.attention.default, _op_args(kernel, mask, q, k, v))
    out, lse = torch.ops.omnigen.attention(*_op_args(kernel, mask, q, k, v))
    d_out = torch.randn_like(out)
    args = (d_out, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), mask.schedules,
            list(mask.tile_shapes), mask.token_segment, mask.token_modality, mask.token_doc, kernel.key, 0.25, False)
    torch.library.opcheck(torch.ops.omnigen.attention_backward.default, args)


def test_kernel_call_matches_float64_reference_with_different_forward_and_backward_tiles(monkeypatch):
    kernel = emulated_kernel(monkeypatch, RULES, dtype="fp16", backward_tile=TileConfig(16, 32, 4, 2))
    batch = omnigen.Layout.batch([LAYOUT_A, LAYOUT_B])
    q, k, v = _qkv(dtype=torch.float16, grad=True)
    for layout in (batch, kernel.mask(batch, device="cpu")):  # a plain layout and a mask: the same op
        out, lse = kernel(q, k, v, layout, return_lse=True)
        dense = RULES.dense_mask(batch)
        ref, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), dense)
        assert (out.double() - ref).abs().max() < 2e-2
        assert not lse.requires_grad
        d_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        for got, want in zip(grads, attention_reference_grads(q, k, v, dense, d_out)):
            assert got.shape == want.shape and (got.double() - want).abs().max() < 5e-2 * (want.abs().max() + 1)


def test_eager_calls_take_the_plain_function_and_match_the_ops_own_autograd_bit_for_bit(monkeypatch):
    kernel = emulated_kernel(monkeypatch, RULES, backward_tile=TileConfig(16, 32, 4, 2))
    mask = kernel.mask(omnigen.Layout.batch([LAYOUT_A, LAYOUT_B]), device="cpu")
    q, k, v = _qkv(grad=True)
    from torch.utils._python_dispatch import TorchDispatchMode

    class OmnigenOps(TorchDispatchMode):  # what a dispatch mode (a FLOP counter, a tracer) sees of a call
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "omnigen":
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with OmnigenOps() as mode:
        eager = kernel(q, k, v, mask)
        assert type(eager.grad_fn).__name__ == "EagerAttentionBackward"  # the cheap autograd path (op/autograd.py)
        through_op, _ = torch.ops.omnigen.attention(*_op_args(kernel, mask, q, k, v))
        assert "EagerAttention" not in type(through_op.grad_fn).__name__
        assert torch.equal(eager, through_op)
        d_out = torch.randn_like(eager)
        eager_grads = torch.autograd.grad(eager, (q, k, v), d_out)
        op_grads = torch.autograd.grad(through_op, (q, k, v), d_out)
    assert mode.seen == ["attention.default"] * 2 + ["attention_backward.default"] * 2  # the same ops either way
    for got, want in zip(eager_grads, op_grads):
        assert torch.equal(got, want)
    with torch.no_grad():
        assert kernel(q, k, v, mask).grad_fn is None


def test_attention_with_a_mask_needs_no_rules_and_checks_what_it_gets(monkeypatch):
    kernel = emulated_kernel(monkeypatch, RULES)
    ops = pytest.importorskip("omnigen.op.kernel")
    monkeypatch.setitem(ops._KERNELS, (RULES.key, 16, torch.bfloat16, None), kernel)
    monkeypatch.setattr(ops.tune_db, "generation", lambda: kernel.tuning_generation)
    mask = kernel.mask(LAYOUT_A.pad_end(96), device="cpu", batch=2)
    q, k, v = _qkv()
    out = omnigen.attention(q, k, v, mask)
    assert torch.equal(out, kernel(q, k, v, mask))
    with pytest.raises(ValueError, match="mask has 2 batch elements but q has batch 1"):
        omnigen.attention(q[:1], k[:1], v[:1], mask)
    with pytest.raises(ValueError, match="layout has 96 tokens but q/k/v have sequence length 95"):
        omnigen.attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], mask)
    other = omnigen.Rules(name="other", modalities={"text": "full"})
    with pytest.raises(ValueError, match="differ from the mask's"):
        omnigen.attention(q, k, v, mask, other)
    with pytest.raises(ValueError, match="made for the rules 'optest'"):
        emulated_kernel(monkeypatch, other)(q, k, v, mask)
    small = make_mask(RULES, LAYOUT_A.pad_end(96), [(64, 64)], device="cpu", batch=2)
    with pytest.raises(ValueError, match="no plan for 32x16 tiles.*it has 64x64"):
        kernel(q, k, v, small)
    with pytest.raises(ValueError, match="mask has 1 batch elements.*batch=B"):
        kernel(q, k, v, kernel.mask(LAYOUT_A.pad_end(96), device="cpu"))


def test_masks_of_one_shape_have_tensors_of_one_shape_and_copy_in_place():
    one = make_mask(RULES, omnigen.Layout.batch([LAYOUT_A, LAYOUT_B]), [(32, 16), (16, 32)], device="cpu")
    two = make_mask(RULES, omnigen.Layout.batch([LAYOUT_B, LAYOUT_B]), [(32, 16), (16, 32)], device="cpu")
    assert one.fixed and [t.shape for t in one.schedules] == [t.shape for t in two.schedules]
    want = omnigen.plan(RULES, two.layout, 32, 16)
    assert one.plan(32, 16).num_tiles != want.num_tiles
    addresses = [t.data_ptr() for t in one.schedules]
    one.copy_(two)
    assert [t.data_ptr() for t in one.schedules] == addresses
    got = one.plan(32, 16)
    assert torch.equal(got.kinds, want.kinds) and got.allowed_pairs == want.allowed_pairs
    assert torch.equal(got.fwd_kv, want.fwd_kv) and torch.equal(got.bwd_q, want.bwd_q)
    with pytest.raises(ValueError, match="tiles 32x16 instead of 32x16, 16x32"):
        one.copy_(make_mask(RULES, two.layout, [(32, 16)], device="cpu"))
    assert isinstance(one, Mask) and "B=2, S=96" in repr(one)
    assert torch.equal(RULES.dense_mask(one), RULES.dense_mask(two.layout))  # a mask is accepted as a layout


def test_mask_function_picks_default_tiles_per_head_dim_and_checks_modalities():
    m = omnigen.mask(RULES, LAYOUT_A, device="cpu")
    assert (128, 64) in m.tiles  # the sm80 default tile of d64 and d128
    with pytest.raises(ValueError, match="do not declare"):
        omnigen.mask(RULES, "audio:10", device="cpu")
    assert omnigen.mask(RULES, LAYOUT_A, device="cpu", tiles=[(16, 16)]).tiles == ((16, 16),)


# ------------------------------------------------------------------------------------------------
# torch.compile over a model that calls the op


class TwoLayers(torch.nn.Module):
    def __init__(self, attend, heads=2, dim=32):
        super().__init__()
        self.attend, self.heads = attend, heads
        g = torch.Generator().manual_seed(1)
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.ModuleDict({"qkv": torch.nn.Linear(dim, 3 * dim), "out": torch.nn.Linear(dim, dim)})
            for p in layer.parameters():
                torch.nn.init.normal_(p, std=0.2, generator=g)
            self.layers.append(layer)

    def forward(self, x, layout):
        B, S, dim = x.shape
        for layer in self.layers:
            q, k, v = layer["qkv"](x).view(B, S, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            a = self.attend(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), layout)
            x = x + layer["out"](a.float().transpose(1, 2).reshape(B, S, dim))
        return x


def _step(model, x, layout):
    model.zero_grad()
    loss = model(x, layout).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compile_fullgraph_with_a_mask_matches_eager_bit_for_bit(monkeypatch, backend):
    torch._dynamo.reset()
    kernel = emulated_kernel(monkeypatch, RULES, backward_tile=TileConfig(16, 32, 4, 2))
    batch = omnigen.Layout.batch([LAYOUT_A, LAYOUT_B])
    model = TwoLayers(kernel)
    x = torch.randn(2, 96, 32, generator=torch.Generator().manual_seed(3))
    mask = kernel.mask(batch, device="cpu")
    eager_loss, eager_grads = _step(model, x, mask)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    loss, grads = _step(compiled, x, mask)
    assert torch.equal(loss, eager_loss) or backend == "inductor"  # inductor may fuse the float math
    if backend == "inductor":
        assert torch.allclose(loss, eager_loss, rtol=1e-5)
        return
    for got, want in zip(grads, eager_grads):
        assert torch.equal(got, want)


def test_compile_does_not_recompile_for_a_new_mask_of_the_same_shape(monkeypatch):
    torch._dynamo.reset()
    kernel = emulated_kernel(monkeypatch, RULES)
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    model = TwoLayers(kernel)
    compiled = torch.compile(model, fullgraph=True, backend=counting_backend)
    x = torch.randn(2, 96, 32)
    for layouts in ([LAYOUT_A, LAYOUT_B], [LAYOUT_B, LAYOUT_A], [LAYOUT_B, LAYOUT_B]):
        batch = omnigen.Layout.batch(layouts)
        mask = kernel.mask(batch, device="cpu")
        assert torch.equal(compiled(x, mask), model(x, mask))
    assert len(compiles) == 1


def test_compile_with_a_plain_layout_breaks_the_graph_by_default_and_plans_while_tracing_in_fullgraph(monkeypatch):
    """A Kernel called with a plain layout: by default planning is one graph break (no retrace for a new layout);
    under fullgraph=True it is planned while Dynamo traces (op/traced_layouts.py), one graph, a new one for a new
    layout. Both bit for bit eager."""
    third = omnigen.Layout.parse("text:96")
    batches = [omnigen.Layout.batch(pair) for pair in ([LAYOUT_A, LAYOUT_B], [LAYOUT_B, LAYOUT_B], [third, LAYOUT_A],
                                                       [third, third])]
    x = torch.randn(2, 96, 32)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        kernel = emulated_kernel(monkeypatch, RULES)
        model = TwoLayers(kernel)
        graphs = []
        compiled = torch.compile(model, fullgraph=fullgraph,
                                 backend=lambda gm, inputs: graphs.append(gm) or aot_eager(gm, inputs))
        traced = []
        for batch in batches:
            eager_loss, eager_grads = _step(model, x, batch)
            loss, grads = _step(compiled, x, batch)
            assert torch.equal(loss, eager_loss) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
            traced.append(len(graphs))
        # fullgraph: one graph per layout. By default the graphs around the planning breaks: the first call traces
        # one, the second the rest (Dynamo compiles a resumed frame on its second call), and new layouts none.
        assert traced == ([1, 2, 3, 4] if fullgraph else [1, 2, 2, 2]), (fullgraph, traced)


def test_op_keys_name_kernels_and_rules():
    with pytest.raises(ValueError, match="no kernel 'kernel/v2:gone#1'"):
        library.resolve("kernel/v2:gone#1", torch.empty(1, 1, 1, 16))
    with pytest.raises(ValueError, match="'kernel/v2:<key>' or 'rules/v2:<key>'"):
        library.resolve("what", torch.empty(1, 1, 1, 16))
    with pytest.raises(ValueError, match="'kernel/v2:<key>' or 'rules/v2:<key>', not 'kernel:gone#1'"):
        library.resolve("kernel:gone#1", torch.empty(1, 1, 1, 16))  # a string of an older omnigen's graph
    with pytest.raises(ValueError, match="not alive"):
        library.resolve("rules/v2:nobody-0000", torch.empty(1, 1, 1, 16))
