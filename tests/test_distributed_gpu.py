"""Context parallelism on GPUs: rectangles run by the kernels against the float64 reference (one GPU), and
`omnigen.distributed.attention` over NCCL (two and four GPUs) against single-process float64 attention."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import omnigen
from omnigen.distributed import chunk_attention, plan_shards
from omnigen.distributed.balance import chunk_positions
from omnigen.distributed.rectangle import ReferenceRectangle, batched

sys.path.insert(0, os.path.dirname(__file__))
from ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
RULES_DIR = os.path.join(os.path.dirname(__file__), "..", "examples", "rules")

LAYOUT = [("text", 300), ("image", 256), ("text", 1000), ("image", 512, 1), ("text", 700, 1), ("image", 128, 1),
          ("text", 100, 1)]  # 2996 tokens: the last chunk of 128 is short


def _close(mine: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (mine.double() - ref).abs().max().item()
    bound = 2e-2 * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{what}: max abs error {err:.3e} > {bound:.3e}"


@needs_cuda
@pytest.mark.parametrize("rules_file", ["transfusion.yaml", "sliding_window.yaml", "share_question.yaml"])
def test_rectangles_match_reference(rules_file):
    rules = omnigen.Rules.load(os.path.join(RULES_DIR, rules_file))
    names = list(rules.modality_names)
    layout = omnigen.Layout.from_segments([(names[i % len(names)], *rest) for i, (_, *rest) in enumerate(LAYOUT)])
    shard = plan_shards(rules, layout, 3, chunk=128)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(shard.chunks(0), shard.chunks(0)), (shard.chunks(1), shard.chunks(2)), (np.array([23, 4, 9]),
                                                                                      np.array([9, 0, 23, 5]))]
    for q_chunks, kv_chunks in cases:
        q_pos = chunk_positions(q_chunks, 128, shard.lengths)
        k_pos = chunk_positions(kv_chunks, 128, shard.lengths)
        q = torch.randn(2, 4, len(q_pos), 128, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(2, 2, len(k_pos), 128, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(2, 2, len(k_pos), 128, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
        d_out = torch.randn(2, 4, len(q_pos), 128, generator=g, device="cuda", dtype=torch.bfloat16)
        out, lse = chunk_attention(q, k, v, shard, q_chunks, kv_chunks)
        out.backward(d_out)
        ref = ReferenceRectangle(rules, batched(layout, 2), q_pos, k_pos, 128 ** -0.5, device="cuda")
        ref_out, ref_lse = ref.forward(q.detach(), k.detach(), v.detach())
        ref_grads = ref.backward(d_out, q.detach(), k.detach(), v.detach(), ref_out, ref_lse)
        _close(out, ref_out, "out")
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
        finite = torch.isfinite(ref_lse)
        _close(lse[finite], ref_lse[finite], "lse")
        for name, mine, theirs in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads):
            _close(mine, theirs, name)


def _gpus_worker(rank: int, world: int) -> None:
    from omnigen.distributed import attention
    from omnigen.reference import attention_reference

    rules = omnigen.Rules.load(os.path.join(RULES_DIR, "transfusion.yaml"))
    layout = omnigen.Layout.from_segments(LAYOUT)
    S = layout.seq_len
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, d_out = (torch.randn(1, h, S, 128, generator=g, device="cuda", dtype=torch.bfloat16)
                      for h in (4, 2, 2, 4))
    results = []
    # several rounds of pieces and blocks of queries (256 tokens), and one piece per stream
    for method, block_tokens in (("balanced", 256), ("even", 1 << 20)):
        shard = plan_shards(rules, layout, world, chunk=128, method=method)
        ql, kl, vl = (shard.scatter(x).detach().requires_grad_() for x in (q, k, v))
        out = attention(ql, kl, vl, shard, rules, block_tokens=block_tokens)
        out.backward(shard.scatter(d_out))
        results.append([shard.gather(x) for x in (out.detach(), ql.grad, kl.grad, vl.grad)])
    if rank == 0:
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref, _ = attention_reference(*leaves, layout, rules)
        ref.backward(d_out.double())
        refs = [ref.detach()] + [x.grad for x in leaves]
        for gathered in results:
            for name, mine, theirs in zip(("out", "dq", "dk", "dv"), gathered, refs):
                _close(mine, theirs, name)


@pytest.mark.parametrize("world", [2, 4])
def test_gpus_match_reference(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run_ranks(_gpus_worker, world, backend="nccl")
