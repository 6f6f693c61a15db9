"""CPU stand-ins for built kernels: the library's own op path (custom op, autograd, masks) with the kernel
launches replaced by the float32 emulator of the kernels' tile loops (omnigen/reference.py), so the op,
its fake tensors, opcheck and torch.compile can be tested without a GPU.

    kernel = emulated_kernel(monkeypatch, RULES, head_dim=16)
    out = kernel(q_cpu, k_cpu, v_cpu, kernel.mask(layout, device="cpu"))
"""

from __future__ import annotations

import torch

from omnigen.kernels import launch as sm80_launch
from omnigen.op import checks
from omnigen.op import kernel as ops
from omnigen.reference import emulate_backward, emulate_forward
from omnigen.targets import KernelConfig, TileConfig


class EmulatedModule:
    HAS_BACKWARD = True

    def __init__(self, rules, config: KernelConfig):
        self.MODULE_NAME = f"emulated_{rules.name}_{config.label}"
        self.rules = rules
        self.BLOCK_M, self.BLOCK_N = config.tile.block_m, config.tile.block_n


def _forward_pass(module, p, q, k, v, scale):
    assert (p.block_m, p.block_n) == (module.BLOCK_M, module.BLOCK_N), "planned with another tile shape"
    out, lse = emulate_forward(module.rules, p, q, k, v, scale)
    return out.to(q.dtype), lse.float()


def _backward_pass(module, p, q, k, v, out, lse, d_out, scale, deterministic=False):
    assert (p.block_m, p.block_n) == (module.BLOCK_M, module.BLOCK_N), "planned with another tile shape"
    dq, dk, dv = emulate_backward(module.rules, p, q, k, v, out, lse, d_out, scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def install(monkeypatch) -> None:
    """Let the op run on CPU tensors, with the shared launches emulated."""
    monkeypatch.setattr(checks, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(sm80_launch, "forward_pass", _forward_pass)
    monkeypatch.setattr(sm80_launch, "backward_pass", _backward_pass)


def emulated_kernel(monkeypatch, rules, head_dim=16, dtype="bf16", tile=TileConfig(32, 16, 4, 2),
                    backward_tile=None) -> ops.Kernel:
    """A Kernel whose modules are emulated (forward tile `tile`, backward tile `backward_tile` or the same).
    Head dim 16 is not one omnigen builds; the emulator does not care, and it keeps the tests fast."""
    from omnigen.tune import db as tune_db

    install(monkeypatch)
    config = KernelConfig(head_dim=head_dim, dtype=dtype, arch="sm_80", tile=tile)
    kernel = ops.Kernel(rules, config, EmulatedModule(rules, config))
    if backward_tile is not None:
        backward = KernelConfig(head_dim=head_dim, dtype=dtype, arch="sm_80", tile=backward_tile)
        kernel._modules[backward] = EmulatedModule(rules, backward)
        kernel._untuned = tune_db.Choice(config, backward)
    return kernel
