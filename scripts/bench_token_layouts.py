"""How long Layout.from_tensors and Layout.from_cu_seqlens take: B*S = 128K tokens in 4K segments (issue 12's
budget: 2 ms on the GPU host). Median of 50 calls; the ids on the CPU, and on the GPU where there is one.

    PYTHONPATH=. python scripts/bench_token_layouts.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import omnigen

RULES = omnigen.Rules(name="transfusion", modalities={"text": "causal", "image": "full"})


def median_ms(fn, calls: int = 50) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def token_ids(B: int, S: int, segments: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] modality ids (text and image alternating) and document ids (a new document every 8 segments)."""
    rng = np.random.default_rng(seed)
    per = segments // B
    ids = np.empty((B, S), dtype=np.int64)
    docs = np.empty((B, S), dtype=np.int64)
    for b in range(B):
        starts = np.r_[0, np.sort(rng.choice(np.arange(1, S), per - 1, replace=False))]
        lengths = np.diff(np.r_[starts, S])
        ids[b] = np.repeat(np.arange(per) % 2, lengths)
        docs[b] = np.repeat(np.arange(per) // 8, lengths)
    return torch.from_numpy(ids), torch.from_numpy(docs)


def main() -> None:
    B, S, segments = 4, 32768, 4096
    ids, docs = token_ids(B, S, segments)
    cu = torch.from_numpy(np.r_[0, np.cumsum(np.random.default_rng(1).integers(1, 63, segments))])
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"B*S = {B * S} tokens, {segments} segments")
    for device in devices:
        i, d, c = ids.to(device), docs.to(device), cu.to(device)
        t1 = median_ms(lambda: omnigen.Layout.from_tensors(i, d, rules=RULES))
        t2 = median_ms(lambda: omnigen.Layout.from_cu_seqlens(c, rules=RULES))
        print(f"{device:5s} from_tensors {t1:.3f} ms   from_cu_seqlens ({segments} documents) {t2:.3f} ms")


if __name__ == "__main__":
    main()
