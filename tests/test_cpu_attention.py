"""Attention on the CPU (issue 28 item 3): `omnigen.attention` on CPU tensors runs the plan-driven PyTorch path of
omnigen/op/cpu.py. Held to the float64 reference (omnigen/reference.py) on every examples/rules file with random
layouts, forward and backward; its errors; and its memory (no S x S tensor, bounded peak RSS).

Output buffers are filled with NaN before the walk writes them (the `poisoned` fixture), and inputs are random
normals, never zeros: an element the walk forgot to write, or a row it wrongly left empty, shows up.

Tolerances: float64 inputs 1e-5 (the log-sum-exp crosses the op in float32, as on CUDA, so the backward's
probabilities carry ~1e-7 relative error); float32 2e-5 forward, 1e-4 gradients (float32 accumulation over a few
hundred keys); bfloat16 and float16 compare their float32-accumulated results after rounding to 8 / 11 bits of
mantissa: 3e-2 / 4e-3 of the largest value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import omnigen
from omnigen.op import cpu, library
from omnigen.op import kernel as ops
from omnigen.reference import attention_reference, attention_reference_grads

import strategies

ROOT = Path(__file__).resolve().parents[1]
RULES_FILES = sorted((ROOT / "examples" / "rules").glob("*.yaml"))
RULES = omnigen.Rules.load(ROOT / "examples" / "rules" / "transfusion.yaml")
D = 64  # the smallest head dim omnigen builds: the CPU path takes the same head dims as the kernels


@pytest.fixture(autouse=True, scope="module")
def poisoned():
    """Every output buffer of the CPU path starts as NaN (instead of whatever torch.empty gives). And one thread:
    on a shared 2-core machine torch's two OpenMP threads wait on each other, which made this module 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        allocate = cpu._empty
        patch.setattr(cpu, "_empty", lambda *shape, dtype: allocate(*shape, dtype=dtype).fill_(float("nan")))
        yield
    torch.set_num_threads(threads)


def _qkv(B, Hq, Hkv, S, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v)]


def _compare(rules, layout, mask_or_layout, B, Hq, Hkv, dtype, scale=None, seed=0, out_tol=1e-5, grad_tol=1e-5):
    """The CPU path against the float64 reference: out, lse (same -inf rows, finite values close) and dq, dk, dv,
    each within `tol` times (1 + the reference's largest magnitude)."""
    q, k, v = _qkv(B, Hq, Hkv, layout.seq_len, dtype, seed)
    if isinstance(mask_or_layout, omnigen.Mask):
        out, lse = omnigen.attention(q, k, v, mask_or_layout, scale=scale, return_lse=True)
    else:
        out, lse = omnigen.attention(q, k, v, mask_or_layout, rules, scale=scale, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), layout, rules, scale)
    assert (out.double() - ref).abs().max() <= out_tol * (1 + ref.abs().max())
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max() <= out_tol * (1 + ref_lse[finite].abs().max())
    g = torch.Generator().manual_seed(seed + 1)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(dtype))
    want = attention_reference_grads(q, k, v, layout, d_out, scale, rules)
    for name, got, expected in zip("qkv", grads, want):
        assert got.dtype == dtype and got.shape == expected.shape and not torch.isnan(got).any(), name
        error = (got.double() - expected).abs().max()
        assert error <= grad_tol * (1 + expected.abs().max()), f"d{name}: {error}"
    return out, lse, grads


def _batch_of(layouts):
    length = max(layout.seq_len for layout in layouts)
    return omnigen.Layout.batch([layout.pad_end(length) if layout.seq_len < length else layout for layout in layouts])


# ------------------------------------------------------------------------------------------------
# against the float64 reference


@pytest.mark.parametrize("rules_file", RULES_FILES, ids=[p.stem for p in RULES_FILES])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_float64_matches_the_reference_on_every_example_rules_file(rules_file, data):
    rules = omnigen.Rules.load(rules_file)
    drawn = data.draw(st.lists(strategies.layouts(rules, max_segments=8, max_length=80), min_size=1, max_size=2))
    layout = drawn[0] if len(drawn) == 1 else _batch_of(drawn)
    B = len(drawn) if len(drawn) > 1 else data.draw(st.sampled_from((1, 2)))
    Hq, Hkv = data.draw(st.sampled_from(((1, 1), (2, 2), (4, 2), (3, 1))))
    scale = data.draw(st.sampled_from((None, 0.05, 0.4)))
    how = data.draw(st.sampled_from(("layout", "mask")))
    if how == "mask":  # a mask made once, on the drawn tile shapes (the path picks the largest)
        shapes = data.draw(st.lists(st.tuples(strategies.block_sizes, strategies.block_sizes), min_size=1, max_size=2))
        given_layout = omnigen.mask(rules, layout, device="cpu", tiles=shapes, batch=B if len(drawn) == 1 else None)
    else:
        given_layout = layout
    _compare(rules, layout, given_layout, B, Hq, Hkv, torch.float64, scale, seed=data.draw(st.integers(0, 99)))


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [
    (torch.float32, 2e-5, 1e-4),
    (torch.bfloat16, 3e-2, 3e-2),
    (torch.float16, 4e-3, 4e-3),
])
def test_lower_precisions_match_the_reference(dtype, out_tol, grad_tol):
    layout = omnigen.Layout.parse("text:40 image:64 text:31 pad:9 image:48@1 text:100@1")
    _compare(RULES, layout, layout, 2, 4, 2, dtype, out_tol=out_tol, grad_tol=grad_tol)
    mask = omnigen.mask(RULES, layout, device="cpu", batch=2)
    _compare(RULES, layout, mask, 2, 4, 2, dtype, out_tol=out_tol, grad_tol=grad_tol)


def test_empty_rows_give_zeros_minus_inf_and_zero_gradients():
    layout = omnigen.Layout.parse("pad:20 text:30 pad:50 image:20")  # q-tiles of pad only, and pad inside tiles
    out, lse, (dq, _, _) = _compare(RULES, layout, layout, 1, 2, 2, torch.float64)
    pad = torch.tensor([s.modality == "pad" for s in layout.segments for _ in range(s.length)])
    assert torch.equal(out[:, :, pad], torch.zeros_like(out[:, :, pad]))
    assert torch.isneginf(lse[:, :, pad]).all() and torch.isfinite(lse[:, :, ~pad]).all()
    assert torch.equal(dq[:, :, pad], torch.zeros_like(dq[:, :, pad]))


def test_strided_inputs_and_spans_cut_to_the_chunk(monkeypatch):
    layout = omnigen.Layout.parse("text:300 image:200 text:140")
    S = layout.seq_len
    g = torch.Generator().manual_seed(3)
    # [B, S, H, D] storage seen as [B, H, S, D]: only the last dim is contiguous, as SDPA takes it
    q, k, v = (torch.randn(2, S, h, D, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_(True)
               for h in (4, 2, 2))
    want = omnigen.attention(q, k, v, layout, RULES)
    ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), layout, RULES)
    assert (want - ref).abs().max() < 1e-10
    # With a chunk of one tile's scores every span is cut into single tiles: the same result.
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 1)
    mask = omnigen.mask(RULES, layout, device="cpu", tiles=[(64, 32)], batch=2)
    assert torch.allclose(omnigen.attention(q, k, v, mask), want, atol=1e-12, rtol=0)


def test_the_walk_visits_only_the_plans_tiles_and_masks_only_what_needs_it(monkeypatch):
    """Full spans get no mask work, causal spans one compare, partial spans the rules' predicate; empty tiles none."""
    layout = omnigen.Layout.parse("text:64 image:128 text:64 image:64@1 text:64@1")
    plan = omnigen.plan(RULES, layout, 64, 64)
    seen = []
    original = cpu._Masker.apply_

    def record(self, scores, kind, b, r0, r1, c0, c1):
        seen.append((kind, r0 // 64, c0 // 64, -(-c1 // 64)))
        return original(self, scores, kind, b, r0, r1, c0, c1)

    monkeypatch.setattr(cpu._Masker, "apply_", record)
    q, k, v = _qkv(1, 2, 2, layout.seq_len)
    with torch.no_grad():
        cpu.forward(RULES, plan, q, k, v, 0.125)
    kinds = plan.kinds
    visited = {(i, j): kind for kind, i, j0, j1 in seen for j in range(j0, j1)}
    assert visited == {(i, j): int(kinds[i, j]) for i in range(kinds.shape[0]) for j in range(kinds.shape[1])
                       if kinds[i, j] != 0}


# ------------------------------------------------------------------------------------------------
# the same API: Kernel, the op, torch.compile


def test_a_kernel_runs_on_the_cpu_with_its_rules():
    from omnigen.jit import codegen

    class Module:
        MODULE_NAME = "not_built"

    kernel = ops.Kernel(RULES, codegen.KernelConfig(head_dim=64, dtype="bf16", arch="sm_80"), Module())
    layout = omnigen.Layout.parse("text:40 image:64 text:24@1")
    q, k, v = _qkv(2, 2, 1, layout.seq_len, torch.bfloat16)
    out, lse = kernel(q, k, v, layout, return_lse=True)
    ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), layout, RULES)
    assert (out.double() - ref).abs().max() < 3e-2 * (1 + ref.abs().max())
    out.sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape


def test_opcheck_of_both_ops_on_the_cpu():
    layout = omnigen.Layout.batch([omnigen.Layout.parse("text:20 image:40 text:36"),
                                   omnigen.Layout.parse("image:33 text:29 text:34@1")])
    mask = omnigen.mask(RULES, layout, device="cpu", tiles=[(32, 16), (16, 32)])
    q, k, v = _qkv(2, 4, 2, 96, torch.float32)
    args = (q, k, v, mask.schedules, list(mask.tile_shapes), mask.token_segment, mask.token_modality,
            mask.token_doc, library.RULES_PREFIX + RULES.key, 0.125, False)
    torch.library.opcheck(torch.ops.omnigen.attention.default, args)
    out, lse = torch.ops.omnigen.attention(*args)
    back = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, *args[3:])
    torch.library.opcheck(torch.ops.omnigen.attention_backward.default, back)


def test_compiled_with_fullgraph_equals_eager():
    layout = omnigen.Layout.parse("text:40 image:64 text:24@1")
    mask = omnigen.mask(RULES, layout, device="cpu", batch=2)
    q, k, v = _qkv(2, 4, 2, layout.seq_len, torch.float32)
    step = torch.compile(lambda q, k, v, mask: omnigen.attention(q, k, v, mask).square().sum(), fullgraph=True,
                         backend="aot_eager")
    compiled = torch.autograd.grad(step(q, k, v, mask), (q, k, v))
    eager = torch.autograd.grad(omnigen.attention(q, k, v, mask).square().sum(), (q, k, v))
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# errors: the same doors as on CUDA


def test_errors_name_the_argument_and_the_fix():
    layout = omnigen.Layout.parse("text:32")
    q, k, v = _qkv(1, 2, 2, 32, torch.float32)
    with pytest.raises(TypeError, match=r"q is torch.int64; omnigen on the CPU takes torch.float32"):
        omnigen.attention(q.detach().long(), k, v, layout, RULES)
    with pytest.raises(ValueError, match=r"q, k and v must have one dtype"):
        omnigen.attention(q, k.double(), v, layout, RULES)
    with pytest.raises(ValueError, match=r"layout has 40 tokens but q/k/v have sequence length 32"):
        omnigen.attention(q, k, v, "text:40", RULES)
    with pytest.raises(ValueError, match=r"head dim 48 is not one omnigen builds"):
        omnigen.attention(*(torch.randn(1, 2, 32, 48) for _ in range(3)), layout, RULES)
    with pytest.raises(ValueError, match=r"q, k, v are on meta; omnigen runs CUDA tensors on its kernels and CPU"):
        omnigen.attention(q.to("meta"), k.to("meta"), v.to("meta"), layout, RULES)
    with pytest.raises(ValueError, match=r"the mask has 1 batch elements but q has batch 2"):
        omnigen.attention(*_qkv(2, 2, 2, 32, torch.float32), omnigen.mask(RULES, layout, device="cpu"))
    with pytest.raises(ValueError, match=r"omnigen::attention: no kernel 'kernel/v2:gone'"):
        mask = omnigen.mask(RULES, layout, device="cpu")
        torch.ops.omnigen.attention(q, k, v, mask.schedules, list(mask.tile_shapes), mask.token_segment,
                                    mask.token_modality, mask.token_doc, "kernel/v2:gone", 0.125, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_mask_without_a_gpu_says_to_use_the_cpu():
    for make in (lambda: omnigen.mask(RULES, "text:40", device="cuda"),
                 lambda: omnigen.mask(RULES, "text:40")):  # the default device is CUDA's
        with pytest.raises(ValueError) as caught:
            make()
        message = str(caught.value)
        assert "device='cuda'" in message and "device='cpu'" in message and "\n" not in message


# ------------------------------------------------------------------------------------------------
# memory


class _LargestTensor(TorchDispatchMode):
    """The most elements any op's result had while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


def test_no_tensor_grows_with_s_squared():
    """At S = 8K (S^2 = 64M) no intermediate is larger than the inputs or one chunk of scores."""
    layout = omnigen.Layout.parse(" ".join(["text:500 image:1024"] * 5) + " text:572")
    S = layout.seq_len
    assert S == 8192
    plan = omnigen.plan(RULES, layout, *cpu.TILE)
    q, k, v = (t.detach() for t in _qkv(1, 2, 1, S, torch.float32))
    with _LargestTensor() as forward_mode:
        out, lse = cpu.forward(RULES, plan, q, k, v, 0.125)
    with _LargestTensor() as backward_mode:
        cpu.backward(RULES, plan, q, k, v, out, lse, torch.randn_like(out), 0.125)
    bound = max(q.numel(), cpu.CHUNK_ELEMENTS)
    assert forward_mode.largest <= bound and backward_mode.largest <= bound
    assert S * S >= 32 * bound


def test_peak_memory_at_16k_tokens_is_far_below_one_attention_matrix():
    """Forward and backward at S = 16K in a fresh process: peak RSS grows by far less than one float32 S x S
    matrix (1 GiB)."""
    code = textwrap.dedent("""
        import resource, torch, omnigen
        torch.manual_seed(0)
        rules = omnigen.Rules.load("examples/rules/transfusion.yaml")
        layout = omnigen.Layout.parse(" ".join(["text:512 image:1024"] * 10) + " text:1024")
        q, k, v = (torch.randn(1, 1, layout.seq_len, 64, requires_grad=True) for _ in range(3))
        omnigen.attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], "text:256", rules)  # imports, first call
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        omnigen.attention(q, k, v, layout, rules).sum().backward()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    grown = int(result.stdout.split()[-1])
    one_matrix = 16384 * 16384 * 4
    assert grown < one_matrix / 8, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_fullgraph_with_a_layout_plans_while_tracing():
    """A layout (not a mask) under torch.compile(fullgraph=True): planned while Dynamo traces (op/traced_layouts.py),
    one graph, forward and backward bit for bit eager's; a new layout traces anew (Dynamo guards on it), a layout seen
    before does not. Without fullgraph the planning stays a graph break that plans at run time: no new trace for a
    new layout."""
    layouts = [omnigen.Layout.parse("text:40 image:64 text:24@1"), "image:50 text:78", omnigen.Layout.parse("text:128")]
    q, k, v = _qkv(1, 2, 2, 128, torch.float32)
    for tensor in (q, k, v):
        tensor.requires_grad_(True)

    def step(q, k, v, layout):
        return omnigen.attention(q, k, v, layout, RULES).square().sum()

    def eager(layout):
        loss = step(q, k, v, layout)
        return (loss, *torch.autograd.grad(loss, (q, k, v)))

    for fullgraph in (True, False):
        torch._dynamo.reset()
        graphs = []
        compiled = torch.compile(step, fullgraph=fullgraph,
                                 backend=lambda gm, _inputs: graphs.append(gm) or gm.forward)
        for number, layout in enumerate([*layouts, layouts[0]]):
            loss = compiled(q, k, v, layout)
            got = (loss, *torch.autograd.grad(loss, (q, k, v)))
            for a, b in zip(got, eager(layout)):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            if fullgraph:  # one graph per distinct layout, the repeat from the cache
                assert len(graphs) == min(number + 1, len(layouts)), (number, len(graphs))
        if not fullgraph:  # the graphs around the break, traced once for every layout
            assert len(graphs) == 2, len(graphs)


def test_fullgraph_with_a_layout_that_does_not_fit_q_says_so():
    """The call's checks run as they do eagerly, before planning while tracing: the eager call's message (inside
    Dynamo's report of the exception, as every input error under torch.compile)."""
    q, k, v = _qkv(1, 2, 2, 128, torch.float32)
    with pytest.raises(ValueError) as eager:
        omnigen.attention(q, k, v, "text:100", RULES)
    step = torch.compile(lambda q, k, v: omnigen.attention(q, k, v, "text:100", RULES), fullgraph=True, backend="eager")
    with pytest.raises(Exception) as compiled:
        step(q, k, v)
    assert str(eager.value) in str(compiled.value), (str(compiled.value), str(eager.value))


def test_fullgraph_with_a_layout_and_dynamic_shapes_plans_for_the_sizes_it_gets():
    """dynamic=True: the plan is for q's sizes, which specialise (a new length traces anew); each call is right."""
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, layout: omnigen.attention(q, k, v, layout, RULES), fullgraph=True,
                         backend="eager", dynamic=True)
    for text in ("text:40 image:64 text:24@1", "image:40 text:56", "text:40 image:64 text:24@1"):
        layout = omnigen.Layout.parse(text)
        q, k, v = _qkv(2, 2, 2, layout.seq_len, torch.float32)
        torch.testing.assert_close(step(q, k, v, layout), omnigen.attention(q, k, v, layout, RULES), rtol=0, atol=0)


def test_fullgraph_hands_the_planner_constants_only():
    """What a trace hands the planner must be Python constants: torch 2.11's Dynamo refuses any object there (later
    versions pass objects). Each kind of layout becomes strings, ints and tuples, and comes back as the same layout."""
    from omnigen.op import traced_layouts

    def constants_only(value):
        if isinstance(value, tuple):
            return all(constants_only(item) for item in value)
        return isinstance(value, (str, int))

    one, other = omnigen.Layout.parse("text:40 image:64 text:24@1"), omnigen.Layout.parse("image:50 text:78")
    for layout in ("text:128", one, omnigen.Layout.batch([one, other]), [one, other], (other,)):
        constant = traced_layouts._layout_constant(layout)
        assert constants_only(constant), constant
        assert omnigen.layout.as_layout(traced_layouts._layout_again(constant)) == omnigen.layout.as_layout(layout)
    assert traced_layouts._layout_constant(torch.zeros(2)) is None
    assert constants_only(("rules", RULES.canonical))


def test_fullgraph_with_a_layout_built_inside_the_trace():
    """A layout built inside the compiled function has no handle (built while tracing): its segments go instead."""
    q, k, v = _qkv(2, 2, 2, 128, torch.float32)

    def step(q, k, v):
        batch = omnigen.Layout.batch([omnigen.Layout.from_segments([("text", 40), ("image", 64), ("text", 24, 1)]),
                                      omnigen.Layout.parse("text:128")])
        return omnigen.attention(q, k, v, batch, RULES)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v), rtol=0, atol=0)
