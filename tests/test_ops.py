"""omnigen.build / omnigen.attention: argument checks (CPU) and end-to-end numerics (GPU)."""

import math

import pytest
import torch

import omnigen
from omnigen.op import kernel as ops
from omnigen.reference import attention_reference, attention_reference_grads

RULES = omnigen.Rules(name="opstest", modalities={"text": "causal", "image": "full"}, see={"text -> image": "all"})


class _FakeModule:
    MODULE_NAME = "fake"


def _kernel(head_dim=64, dtype="bf16"):
    from omnigen.jit import codegen

    config = codegen.KernelConfig(head_dim=head_dim, dtype=dtype, arch="sm_80")
    return ops.Kernel(RULES, config, _FakeModule())


def _tensors(B=1, H=2, S=16, D=64, dtype=torch.bfloat16, device="cpu"):
    return [torch.randn(B, H, S, D, dtype=dtype, device=device) for _ in range(3)]


@pytest.mark.parametrize(
    "change, error, fragment",
    [
        (lambda q, k, v: ("not a tensor", k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[0], k, v), ValueError, "4 dimensions"),
        (lambda q, k, v: (q.to("meta"), k.to("meta"), v.to("meta")), ValueError, "CUDA tensors"),  # neither CUDA nor CPU
    ],
)
def test_bad_inputs_are_named(change, error, fragment):
    q, k, v = _tensors()
    with pytest.raises(error, match=fragment):
        _kernel()(*change(q, k, v), "text:16")


def test_attention_checks_before_building():
    q, k, v = (t.to("meta") for t in _tensors())
    with pytest.raises(ValueError, match="CUDA tensors"):
        omnigen.attention(q, k, v, "text:16", RULES)
    with pytest.raises(TypeError, match="rules must be omnigen.Rules"):
        omnigen.attention(q, k, v, "text:16", "rules.yaml")


def test_build_without_a_gpu_says_what_to_do(monkeypatch):
    monkeypatch.setattr(ops.toolchain, "visible_gpu_arch", lambda: None)
    with pytest.raises(RuntimeError, match="arch='sm_80'"):
        omnigen.build(RULES, head_dim=64)
    with pytest.raises(TypeError, match="bfloat16 or torch.float16"):
        omnigen.build(RULES, head_dim=64, dtype=torch.float32, arch="sm_80")
    with pytest.raises(ValueError, match="head_dim"):
        omnigen.build(RULES, head_dim=48, arch="sm_80")
    with pytest.raises(RuntimeError, match="tune=True needs a CUDA GPU"):
        omnigen.build(RULES, head_dim=64, tune=True, arch="sm_80")


def test_a_forward_only_build_runs_forward_only_configs_tuned_ones_too(monkeypatch):
    from omnigen.tune import db as tune_db

    built = []

    def module(rules, config):
        built.append(config)
        return _FakeModule()

    full = ops._variant_config(RULES, 64, torch.bfloat16, "sm_80", None)
    tuned = {4096: tune_db.Choice(full, full)}
    monkeypatch.setattr(ops.cache, "get_module", module)
    monkeypatch.setattr(ops, "_tuned_choices", lambda rules, config: tuned)
    kernel = omnigen.build(RULES, head_dim=64, arch="sm_80", forward_only=True)
    assert built == [kernel.config] and kernel.config.forward_only and kernel.config.label.endswith("_fwd")
    for seq_len in (128, 4096):  # untuned and tuned lengths alike
        choice = kernel.choice(seq_len)
        assert choice.forward.forward_only and choice.backward.forward_only, seq_len
    assert not omnigen.build(RULES, head_dim=64, arch="sm_80").config.forward_only


@pytest.mark.gpu
def test_a_forward_only_kernel_gives_the_full_kernels_forward_and_refuses_a_backward():
    layout, q, k, v = _case("text:100 image:256 text:28", 2, 4, 2, 128, torch.bfloat16, 3)
    full = omnigen.build(RULES, head_dim=128)
    forward_only = omnigen.build(RULES, head_dim=128, forward_only=True)
    assert not forward_only.has_backward
    with torch.no_grad():
        assert torch.equal(forward_only(q, k, v, layout), full(q, k, v, layout))
    q_ = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="forward-only"):
        forward_only(q_, k, v, layout).sum().backward()


def test_kernel_picks_the_rules_tile_that_fits():
    rules = omnigen.Rules.from_dict({**RULES.to_dict(), "kernel": {"tiles": [{"block_m": 128, "block_n": 256, "warps": 4, "stages": 4},
                                                                             {"block_m": 64, "block_n": 64, "warps": 4, "stages": 2}]}})
    config = ops._variant_config(rules, 128, torch.bfloat16, "sm_80", None)
    assert (config.tile.block_m, config.tile.block_n) == (64, 64)


# ------------------------------------------------------------------------------------------------
# GPU


def _case(layout_text, B, Hq, Hkv, D, dtype, seed):
    layout = omnigen.Layout.parse(layout_text)
    S = layout.seq_len
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, generator=g)
    return layout, q, k, v


def _sdpa_error(q, k, v, mask, out_ref):
    """Error of torch's own same-precision computation (SDPA math, dense mask) against float64."""
    expanded = [t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v)]
    rows_ok = mask.any(-1)
    out = torch.nn.functional.scaled_dot_product_attention(q, *expanded, attn_mask=mask[:, None] if mask.dim() == 3 else mask)
    out = torch.where(rows_ok[..., None] if mask.dim() == 3 else rows_ok[None, None, :, None], out, 0)
    return (out.double() - out_ref).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout_text, B, Hq, Hkv, D", [
    ("text:1", 1, 2, 2, 64),
    ("text:17", 2, 4, 2, 128),
    ("text:40 image:256 text:24@1 pad:9@1", 2, 4, 4, 64),
    ("text:100 image:256 text:77 image:256 text:311", 1, 8, 2, 128),
])
def test_attention_forward_and_backward_match_float64(dtype, layout_text, B, Hq, Hkv, D):
    layout, q, k, v = _case(layout_text, B, Hq, Hkv, D, dtype, seed=hash(layout_text) % 1000)
    mask = RULES.dense_mask(layout).cuda()
    out_ref, lse_ref = attention_reference(q, k, v, mask)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = omnigen.attention(q_, k_, v_, layout, RULES, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    bound = 2 * _sdpa_error(q, k, v, mask, out_ref) + 1e-3
    assert (out.double() - out_ref).abs().max().item() <= bound
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - lse_ref[finite]).abs().max().item() <= 1e-2
    kernel = next(iter(ops._KERNELS.values()))
    if not kernel.has_backward:
        pytest.skip("this build has no backward kernel yet")
    d_out = torch.randn_like(q)
    out.backward(d_out)
    grads_ref = attention_reference_grads(q, k, v, mask, d_out)
    for name, got, ref in zip(("dq", "dk", "dv"), (q_.grad, k_.grad, v_.grad), grads_ref):
        assert got.shape == ref.shape and not torch.isnan(got).any(), name
        scale = ref.abs().max().item() + 1e-6
        assert (got.double() - ref).abs().max().item() <= 2e-2 * scale + 1e-3, name


@pytest.mark.gpu
def test_attention_rejects_what_was_not_built():
    layout, q, k, v = _case("text:20", 1, 2, 2, 64, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="layout has 21 tokens"):
        omnigen.attention(q, k, v, "text:21", RULES)
    with pytest.raises(ValueError, match="do not declare"):
        omnigen.attention(q, k, v, "audio:20", RULES)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        omnigen.attention(torch.cat([q, q[:, :1]], 1), k, v, layout, RULES)  # 3 q heads, 2 kv heads


def test_input_errors_keep_their_message_under_compile_and_pickle():
    """InputError has no __init__ of its own: TorchDynamo traces the raise and shows the problems (it used to report
    its own failure to trace `super().__init__`), and the error pickles (worker processes send it)."""
    import pickle

    rules = omnigen.Rules.load("examples/rules/transfusion.yaml")
    q = torch.randn(1, 2, 64, 16)  # head dim 16: not built

    def call(x):
        return omnigen.attention(x, x, x, "text:64", rules)

    with pytest.raises(Exception, match="head dim 16 is not one omnigen builds"):
        torch.compile(call, fullgraph=True, backend="eager")(q)
    error = omnigen.InputError(["first problem", "second problem"])
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, ValueError) and isinstance(again, TypeError)
    assert again.problems == ["first problem", "second problem"]
    assert str(again) == "2 problems with these arguments: (1) first problem; (2) second problem"
    assert str(omnigen.InputError(["only one"])) == "only one"
