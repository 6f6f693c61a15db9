"""The FP8 forward's host side, without a GPU: which variants exist, V's transposed copy, and the call's errors.
(Its kernel compiles in test_toolchain.py and runs against float64 in test_fp8_gpu.py.)"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import omnigen
from omnigen.kernels import FAMILIES, default_backward, problems
from omnigen.op.fp8 import values_transposed
from omnigen.targets import KernelConfig, TileConfig
from omnigen.tune import space

RULES = omnigen.Rules(name="fp8_host", modalities={"text": "causal", "image": "full"})
TILE = TileConfig(128, 128, 12, 2)


def test_v_transposed_puts_each_key_where_the_kernel_packs_its_probability():
    """Column 16g + 4t + 2a + b of V^T holds key 16g + 8a + 2t + b (forward.cu.j2's keep_probabilities), rows past
    the sequence are zeros, and a non-contiguous V gives the same copy."""
    S, D = 40, 8
    v = torch.randn(2, 3, S, D).to(torch.float8_e4m3fn)
    vt = values_transposed(v)
    assert vt.dtype == torch.float8_e4m3fn and vt.shape == (2, 3, D, 48) and vt.is_contiguous()
    raw, keys = vt.view(torch.uint8), v.view(torch.uint8)
    for g, t, a, b in itertools.product(range(3), range(4), range(2), range(2)):
        column, key = 16 * g + 4 * t + 2 * a + b, 16 * g + 8 * a + 2 * t + b
        expected = keys[:, :, key, :] if key < S else torch.zeros_like(keys[:, :, 0, :])
        assert torch.equal(raw[:, :, :, column], expected), (column, key)
    strided = v.view(torch.uint8).transpose(1, 2).contiguous().transpose(1, 2).view(torch.float8_e4m3fn)
    assert torch.equal(values_transposed(strided).view(torch.uint8), raw)


def test_the_fp8_variant_is_the_sm90_forward_at_d128_alone():
    fp8 = KernelConfig(128, "e4m3", "sm_90a", TILE, forward_only=True)
    assert problems(fp8) == []
    assert FAMILIES["sm90"].backward_problems(fp8)
    assert "forward only" in " ".join(problems(KernelConfig(128, "e4m3", "sm_90a", TILE)))
    assert "sm90 family" in " ".join(problems(KernelConfig(128, "e4m3", "sm_80", TileConfig(128, 64, 4, 2),
                                                            forward_only=True)))
    assert "head_dim 128" in " ".join(problems(KernelConfig(64, "e4m3", "sm_90a", TILE, forward_only=True)))
    for block_n in (64, 192):  # V^T in 64-key boxes
        assert problems(KernelConfig(128, "e4m3", "sm_90a", TileConfig(128, block_n, 12, 2), forward_only=True)) == []
    for block_n in (96, 256):
        assert "block_n 64, 128, 192" in " ".join(problems(KernelConfig(128, "e4m3", "sm_90a", TileConfig(128, block_n, 12, 2),
                                                                       forward_only=True)))
    default = space.default_config(RULES, 128, "e4m3", "sm_90a")
    assert default.forward_only and default.tile.block_n == 192 and not problems(default)  # FP8's own default
    assert space.default_config(RULES, 128, "bf16", "sm_90a").tile.block_n == 128  # bf16's unchanged
    assert default_backward(default) == default  # no full FP8 variant to train with: itself, without a backward


def test_fp8_shares_nothing_with_the_bf16_modules():
    """Its own module name (the dtype and _fwd in it), and half the bf16 tile's shared memory for Q and the K/V ring
    (8-bit rows; O's staging buffer, bf16 in both, is the same 32 KB)."""
    from omnigen.jit.codegen import module_name
    from omnigen.kernels.sm90 import resources
    from omnigen.kernels.sm90.options import HopperOptions

    fp8 = KernelConfig(128, "e4m3", "sm_90a", TILE, forward_only=True)
    bf16 = KernelConfig(128, "bf16", "sm_90a", TILE)
    assert "e4m3" in module_name(RULES, fp8) and module_name(RULES, fp8) != module_name(RULES, bf16)
    staging = 128 * 128 * 2
    assert all(resources.Resources(c).output_by_tma for c in (fp8, bf16))
    q_and_ring = lambda c: resources.Resources(c).shared_storage_bytes - staging  # noqa: E731
    assert q_and_ring(fp8) < q_and_ring(bf16) * 0.55
    stores = lambda c: dataclasses.replace(c, options=HopperOptions(output_by_tma=0))  # noqa: E731
    assert q_and_ring(fp8) == resources.Resources(stores(fp8)).shared_storage_bytes


def _fp8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def test_fp8_on_the_cpu_says_to_dequantise():
    q, k, v = (_fp8(1, 2, 64, 128) for _ in range(3))
    with pytest.raises(TypeError, match=r"runs on Hopper GPUs.*dequantise first \(q.float\(\) \* its descale\)"):
        omnigen.attention(q, k, v, "text:64", RULES)


@pytest.mark.parametrize("descale,words", [
    ((1.0, 2.0), "three positive numbers"),
    ((1.0, 0.0, 1.0), "dk=0.0"),
    ((1.0, float("nan"), 1.0), "positive finite"),
    (torch.ones(3), "three positive numbers"),
    ((1.0, torch.ones(2), 1.0), r"one float32 element on q's device \(cpu\), got dk: torch.float32 with 2 elements"),
    ((torch.ones((), dtype=torch.float64), 1.0, 1.0), "dq: torch.float64 with 1 elements"),
])
def test_bad_descales_are_named(descale, words):
    from omnigen.op import fp8

    with pytest.raises(ValueError, match=words):
        fp8.check_call(_fp8(1, 1, 8, 128), _fp8(1, 1, 8, 128), _fp8(1, 1, 8, 128), descale)


def test_descales_given_as_tensors_become_one_tensor_the_kernel_reads():
    """Numbers only: none (they go in as the launch's scale). Any tensor among them: all three as one float32 [3] on
    its device, in order, the numbers turned into elements."""
    from omnigen.op import fp8

    assert fp8.descale_tensor(None) is None and fp8.descale_tensor((0.5, 2.0, 3.0)) is None
    on_device = fp8.descale_tensor((0.5, torch.tensor([2.0]), torch.tensor(3.0)))
    assert on_device.dtype == torch.float32 and on_device.tolist() == [0.5, 2.0, 3.0]
    assert fp8._descale_problems((0.5, torch.tensor([2.0]), torch.tensor(3.0)), torch.device("cpu")) == []


def test_descale_belongs_to_fp8_inputs():
    q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
    with pytest.raises(ValueError, match="descale is for FP8 inputs"):
        omnigen.attention(q, k, v, "text:64", RULES, descale=(1.0, 1.0, 1.0))


def test_mixed_fp8_and_bf16_inputs_are_refused():
    from omnigen.op import fp8

    with pytest.raises(ValueError, match="all in torch.float8_e4m3fn"):
        fp8.check_call(_fp8(1, 1, 8, 128), torch.randn(1, 1, 8, 128).bfloat16(), _fp8(1, 1, 8, 128), None)


def test_the_fp8_op_has_a_fake_for_compiled_graphs():
    """`omnigen::attention_fp8`'s fake (what torch.compile traces): out in bf16 and the ops' output layout, lse in
    float32, from q's shape; GQA's k and v shapes do not leak into them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from omnigen.kernels import launch
    from omnigen.op import fp8  # noqa: F401 - registers the op

    with FakeTensorMode():
        q = torch.empty(2, 8, 300, 128, dtype=torch.float8_e4m3fn)
        k, v = (torch.empty(2, 2, 300, 128, dtype=torch.float8_e4m3fn) for _ in range(2))
        tables = torch.empty(2, 300, dtype=torch.int32)
        out, lse = torch.ops.omnigen.attention_fp8(q, k, v, [], [], tables, tables, tables, "rules/v2:any", 0.088,
                                                   [0.01, 0.02, 0.03], None)
        on_device = torch.ops.omnigen.attention_fp8(q, k, v, [], [], tables, tables, tables, "rules/v2:any", 0.088,
                                                    [1.0, 1.0, 1.0], torch.empty(3))
    layout = launch.heads_inner(2, 8, 300, 128, dtype=torch.bfloat16, device="cpu")
    for out, lse in ((out, lse), on_device):
        assert out.dtype == torch.bfloat16 and out.shape == (2, 8, 300, 128) and out.stride() == layout.stride()
        assert lse.dtype == torch.float32 and lse.shape == (2, 8, 300)
