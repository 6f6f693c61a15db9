"""Context parallelism: one sequence's attention across the ranks of a torch.distributed process group.

    shard = omnigen.distributed.plan_shards(rules, layout, world_size)   # the same on every rank
    q, k, v = (shard.scatter(x) for x in (q_all, k_all, v_all))          # this rank's chunks of tokens
    out = omnigen.distributed.attention(q, k, v, shard, rules)          # differentiable
    out_all = shard.gather(out)

`plan_shards` (shard.py) deals chunks of tokens to ranks so that the exact plan's work is balanced (balance.py);
`attention` (attention.py) moves only the keys/values each rank's queries need and runs rectangles of queries
against chunks of keys (rectangle.py: the kernels on CUDA, a float64 reference on the CPU) and merges the
partial results by their log-sum-exp (lse_merge.py: one fused kernel on CUDA);
`chunk_attention` is one such rectangle on its own (chunked prefill, or a custom schedule).
"""

from .attention import attention, chunk_attention
from .balance import TILE_COST
from .lse_merge import merge
from .shard import Shard, plan_shards

__all__ = ["Shard", "TILE_COST", "attention", "chunk_attention", "merge", "plan_shards"]
