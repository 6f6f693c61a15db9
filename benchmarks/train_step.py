"""A training step of a Transfusion-style model with each attention backend (issue 26, item 2).

The model is a decoder-only transformer: pre-norm RMSNorm, rotary embeddings on q and k, a SwiGLU MLP,
attention with optional GQA, no biases. Text tokens are embedded from a vocabulary and trained with
next-token cross-entropy (a position predicts the next token only where that token is text of the same
document); image tokens are continuous patches, noised as x_noisy = sqrt(a) x + sqrt(1 - a) eps with one
random a per image, and trained to predict eps (MSE). Loss = text CE + `--image-loss-weight` x image MSE.
Every sequence holds `--documents` documents of alternating text runs (16-512 tokens) and images
(`--image-tokens`, 256 or 1024); the mask is Transfusion's (examples/rules/transfusion.yaml: text causal,
each image bidirectional, every token sees the earlier segments of its document, documents isolated).

Backends, each in this process on the same batches from the same initial weights (one seed):

  omnigen       per step: Layout.from_tensors(modality ids, document ids) and omnigen.mask(...) in the
                training loop, then omnigen.attention(q, k, v, mask) in every layer (GQA taken directly)
  flex          per step: create_block_mask of a mask_mod built from the same per-token tensors; the
                layers call flex_attention (compiled with the model, or on its own under --no-compile)
  sdpa_dense    per step: the dense boolean mask [B, 1, S, S]; SDPA's memory-efficient backend on CUDA
  cudnn_causal  SDPA on cuDNN with is_causal=True: a different (cheaper) mask on the same shapes, the speed
                a causal-only kernel reaches -- a ceiling, not a peer (its loss is not comparable)

Per run (config x S x backend): tokens/s over the timed steps (synchronize + perf_counter, the per-step
mask made inside the loop), peak memory (torch.cuda.max_memory_allocated, reset per run), the loss curve,
and the step's GPU time split by the PyTorch profiler over `--profile-steps` extra steps (by default as many as
the timed steps, replaying their batches: documents per sequence, hence attention's pairs, differ by batch) into
attention forward, attention backward, unclassified and the rest (`classify_kernel`), with the GPU's idle time
between kernels and its longest gaps; `host_step_ms`, how long a step held the host (far below step_ms: the host
ran ahead of the GPU); `--sync-debug` lists where a step made the host wait for the GPU. A backend that cannot run
(no GPU, out of memory, a refused shape) is recorded with the reason and the others carry on. The table
gives each backend's tokens/s against flex and against cudnn_causal, and the ladder
(x - sdpa_dense) / (cudnn_causal - sdpa_dense): 0% is the dense-mask baseline, 100% the causal ceiling.

    # the issue's figures on an H100: one config and two lengths per call (8 runs of ~40-70 s: compilation
    # plus 17 steps); --budget-s starts no run that would end past it, and the JSON is written after every run
    python benchmarks/train_step.py --config a --seq-lens 4096 8192 --budget-s 500 --json a-4k8k.json
    python benchmarks/train_step.py --config b --seq-lens 16384 32768 --budget-s 500 --json b-16k32k.json
    # every call's runs in one table and one plot
    python benchmarks/train_step.py --from-json a-*.json b-*.json --json all.json --png all.png
    # loss curves only (the same data and weights for every backend): compare `losses` in the JSON
    python benchmarks/train_step.py --config b --seq-lens 8192 --steps 200 --profile-steps 0 \
        --backends omnigen flex sdpa_dense --json loss.json
    # on a CPU (no omnigen or cudnn_causal; FlexAttention has no CPU backward in torch 2.13)
    python benchmarks/train_step.py --config tiny --seq-lens 256 --tokens 512 --steps 2 --warmup 1 \
        --backends sdpa_dense flex --no-compile
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import platform
import random
import re
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import click
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import omnigen  # noqa: E402
from omnigen import bench  # noqa: E402
from omnigen.tune.layouts import CAUSAL_LENGTHS  # noqa: E402  (text runs of 16-512 tokens, as the tuner's layouts)

RULES_PATH = ROOT / "examples" / "rules" / "transfusion.yaml"
BACKENDS = ("omnigen", "flex", "sdpa_dense", "cudnn_causal")
MULTIMODAL = ("omnigen", "flex", "sdpa_dense")  # backends computing the Transfusion mask (comparable losses)
IGNORE = -100  # cross_entropy's ignore_index: positions that predict no text token
TOPICS, TOPIC_WORDS = 16, 64  # the synthetic data's "language" (see `language`)


# ------------------------------------------------------------------------------------------------
# configurations


@dataclass(frozen=True)
class ModelConfig:
    """A model size. `head_dim` x `n_heads` need not equal `d_model`."""

    name: str
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    mlp_hidden: int
    vocab: int = 32000
    patch_dim: int = 64

    def describe(self) -> str:
        gqa = f", GQA {self.n_heads}/{self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return (f"({self.name}) d_model {self.d_model}, {self.n_heads} heads of {self.head_dim}{gqa}, "
                f"{self.n_layers} layers, SwiGLU {self.mlp_hidden}")

    def matmul_params(self) -> int:
        """Weights that multiply every token (the embedding lookup excluded): the 6 N FLOPs-per-token count."""
        attn = self.d_model * (2 * self.n_heads + 2 * self.n_kv_heads) * self.head_dim  # wqkv and wo
        mlp = 3 * self.d_model * self.mlp_hidden
        heads = self.d_model * self.vocab + 2 * self.d_model * self.patch_dim + self.d_model  # lm_head, patches, a
        return self.n_layers * (attn + mlp) + heads


CONFIGS = {
    "a": ModelConfig("a", d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128, n_layers=8, mlp_hidden=5632),
    "b": ModelConfig("b", d_model=1024, n_heads=16, n_kv_heads=4, head_dim=64, n_layers=12, mlp_hidden=2816),
    # CPU tests: GQA 2/1 so that the small runs go through the grouped-query paths too
    "tiny": ModelConfig("tiny", d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, n_layers=2, mlp_hidden=176,
                        vocab=1024, patch_dim=16),
}


# ------------------------------------------------------------------------------------------------
# data: Transfusion-style sequences, the same for every backend (seeded by seed, S and the batch index)


@dataclass
class Batch:
    """One step's data. `modality_ids` and `document_ids` stay on the host too (a data loader's output,
    what Layout.from_tensors reads); the rest is on the training device."""

    modality_ids: torch.Tensor  # int64 [B, S], host: rules.modality_id per token
    document_ids: torch.Tensor  # int64 [B, S], host: non-decreasing along each row
    modality: torch.Tensor      # the same two on the device
    document: torch.Tensor
    tokens: torch.Tensor        # int64 [B, S]: text token ids (0 at images)
    targets: torch.Tensor       # int64 [B, S]: the next text token of the same document, else IGNORE
    positions: torch.Tensor     # int64 [B, S]: position inside the document (RoPE)
    patches: torch.Tensor       # float32 [B, S, P]: clean image patches (0 at text)
    noise: torch.Tensor         # float32 [B, S, P]: eps, the denoising target
    alpha: torch.Tensor         # float32 [B, S]: the image's a (1 at text)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.modality_ids.shape)


def sequence_segments(seq_len: int, rng: random.Random, image_tokens: int = 256,
                      documents: tuple[int, int] = (2, 4)) -> list[tuple[str, int, int]]:
    """One sequence of exactly seq_len tokens as (modality, length, document) segments: between
    documents[0] and documents[1] documents of random lengths (0.5-1.5x the mean), each alternating text
    runs of 16-512 tokens and images of `image_tokens` (starting with either), the last one cut to fit."""
    count = max(1, min(rng.randint(*documents), seq_len))
    weights = [rng.uniform(0.5, 1.5) for _ in range(count)]
    bounds = [round(seq_len * sum(weights[: i + 1]) / sum(weights)) for i in range(count)]
    lengths = [n for n in np.diff([0] + bounds).tolist() if n > 0]
    segments = []
    for doc, length in enumerate(lengths):
        text, used = rng.random() < 0.5, 0
        while used < length:
            n = min(rng.randint(*CAUSAL_LENGTHS) if text else image_tokens, length - used)
            segments.append(("text" if text else "image", n, doc))
            used, text = used + n, not text
    return segments


@functools.lru_cache(maxsize=4)
def language(vocab: int, patch_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data's fixed structure, the same in every run: each of TOPICS topics uses TOPIC_WORDS words of
    the vocabulary and has a prototype image patch. A document has one topic, so its text and images can
    be predicted better by attending to the rest of the document."""
    g = torch.Generator().manual_seed(1234)
    words = torch.stack([torch.randperm(vocab, generator=g)[:TOPIC_WORDS] for _ in range(TOPICS)])
    prototypes = torch.randn(TOPICS, patch_dim, generator=g)
    return words, prototypes


def segment_ids(modality: torch.Tensor, document: torch.Tensor) -> torch.Tensor:
    """int32 [B, S]: a new id wherever the modality or the document changes (what Layout.from_tensors
    calls a segment: a maximal run of one modality in one document)."""
    cut = (modality[:, 1:] != modality[:, :-1]) | (document[:, 1:] != document[:, :-1])
    first = torch.zeros_like(cut[:, :1], dtype=torch.int32)
    return torch.cat([first, cut.cumsum(1, dtype=torch.int32)], dim=1)


def text_targets(tokens: torch.Tensor, modality: torch.Tensor, document: torch.Tensor, text_id: int) -> torch.Tensor:
    """int64 [B, S]: at position t, tokens[t + 1] where token t + 1 is text of t's document, else IGNORE."""
    predict = (modality[:, 1:] == text_id) & (document[:, 1:] == document[:, :-1])
    targets = torch.full_like(tokens, IGNORE)
    targets[:, :-1] = torch.where(predict, tokens[:, 1:], IGNORE)
    return targets


def document_positions(document: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: each token's position inside its document (RoPE restarts with every document)."""
    S = document.shape[1]
    index = torch.arange(S).expand_as(document)
    starts = torch.ones_like(document, dtype=torch.bool)
    starts[:, 1:] = document[:, 1:] != document[:, :-1]
    return index - torch.where(starts, index, 0).cummax(1).values


def make_batch(cfg: ModelConfig, rules: omnigen.Rules, seq_len: int, batch: int, index: int, *, seed: int = 0,
               image_tokens: int = 256, documents: tuple[int, int] = (2, 4),
               device: torch.device | str = "cpu") -> Batch:
    """Batch number `index` of a run: B sequences of seq_len tokens, a function of (seed, seq_len, index)
    and the config's vocabulary and patch size only, so every backend trains on the same data."""
    rng = random.Random(f"train_step:{seed}:{seq_len}:{batch}:{index}")
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    text_id, image_id = rules.modality_id("text"), rules.modality_id("image")
    rows = [sequence_segments(seq_len, rng, image_tokens, documents) for _ in range(batch)]
    ids = [rules.modality_id(m) for row in rows for m, _, _ in row]
    lengths = [n for row in rows for _, n, _ in row]
    modality = torch.tensor(np.repeat(ids, lengths).reshape(batch, seq_len), dtype=torch.int64)
    document = torch.tensor(np.repeat([d for row in rows for *_, d in row], lengths).reshape(batch, seq_len),
                            dtype=torch.int64)
    is_image = modality == image_id
    words, prototypes = language(cfg.vocab, cfg.patch_dim)
    topic = torch.randint(TOPICS, (batch, documents[1] + 1), generator=g).gather(1, document)  # per token
    tokens = words[topic, torch.randint(TOPIC_WORDS, (batch, seq_len), generator=g)].masked_fill(is_image, 0)
    patches = prototypes[topic] + 0.5 * torch.randn(batch, seq_len, cfg.patch_dim, generator=g)
    noise = torch.randn(batch, seq_len, cfg.patch_dim, generator=g)
    segments = segment_ids(modality, document).long()
    t = torch.rand(batch, int(segments.max()) + 1, generator=g).gather(1, segments)  # one a per image
    alpha = torch.cos(0.5 * math.pi * t).square().clamp(1e-3, 1 - 1e-3).masked_fill(~is_image, 1.0)
    zero_text = is_image[..., None].float()
    dev = torch.device(device)
    return Batch(
        modality_ids=modality, document_ids=document, modality=modality.to(dev), document=document.to(dev),
        tokens=tokens.to(dev), targets=text_targets(tokens, modality, document, text_id).to(dev),
        positions=document_positions(document).to(dev), patches=(patches * zero_text).to(dev),
        noise=(noise * zero_text).to(dev), alpha=alpha.to(dev),
    )


def attention_pairs(modality_ids: torch.Tensor, document_ids: torch.Tensor, image_id: int) -> int:
    """Allowed (query, key) pairs of the Transfusion mask over the batch, counted per segment (no S x S):
    a segment of n tokens sees the earlier segments of its document, n x (its start - the document's
    start) pairs, and itself, n x n pairs for an image, n (n + 1) / 2 for text."""
    seg = segment_ids(modality_ids, document_ids)
    total = 0
    for b in range(seg.shape[0]):
        starts = np.flatnonzero(np.diff(seg[b].numpy(), prepend=-1))
        lengths = np.diff(np.append(starts, seg.shape[1]))
        docs = document_ids[b, starts].numpy()
        new_doc = np.diff(docs, prepend=-1) != 0
        doc_start = np.maximum.accumulate(np.where(new_doc, starts, 0))
        image = modality_ids[b, starts].numpy() == image_id
        own = np.where(image, lengths * lengths, lengths * (lengths + 1) // 2)
        total += int((lengths * (starts - doc_start) + own).sum())
    return total


# ------------------------------------------------------------------------------------------------
# the mask, from the per-token tensors (FlexAttention's mask_mod and SDPA's dense mask)


def transfusion_allowed(q: torch.Tensor, k: torch.Tensor, seg_q: torch.Tensor, seg_k: torch.Tensor,
                        doc_q: torch.Tensor, doc_k: torch.Tensor, image_q: torch.Tensor) -> torch.Tensor:
    """The mask semantics (docs/semantics.md) for examples/rules/transfusion.yaml, elementwise (broadcasting):
    same document, and inside one's own segment causal for text and everything for an image, or any earlier
    segment."""
    own = (seg_q == seg_k) & (image_q | (k <= q))
    return (doc_q == doc_k) & (own | (seg_k < seg_q))


def flex_mask_mod(modality: torch.Tensor, document: torch.Tensor, image_id: int) -> Callable:
    """A FlexAttention mask_mod(b, h, q_idx, kv_idx) for the Transfusion mask of these per-token ids."""
    seg, doc, image = segment_ids(modality, document), document.to(torch.int32), modality == image_id

    def mask_mod(b, h, q, k):
        return transfusion_allowed(q, k, seg[b, q], seg[b, k], doc[b, q], doc[b, k], image[b, q])

    return mask_mod


def dense_mask(modality: torch.Tensor, document: torch.Tensor, image_id: int) -> torch.Tensor:
    """The Transfusion mask of these per-token ids as a dense bool [B, 1, S, S] (SDPA's attn_mask)."""
    seg, doc, image = segment_ids(modality, document), document.to(torch.int32), modality == image_id
    pos = torch.arange(modality.shape[1], device=modality.device)
    allowed = transfusion_allowed(pos[:, None], pos[None, :], seg[:, :, None], seg[:, None, :],
                                  doc[:, :, None], doc[:, None, :], image[:, :, None])
    return allowed[:, None]


# ------------------------------------------------------------------------------------------------
# the model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_table(positions: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """cos and sin of rotate-half RoPE's angles, float32 [2, positions, head_dim / 2], made once per model.

    Looked up by position in every step (as Llama's and torchtitan's precomputed tables are) rather than computed
    from the positions in the step: Inductor fused the angles' cos and sin into each layer's RoPE kernel, forward
    and backward, and sin/cos of angles up to S made that kernel 11 ms a step at config (a), 8K (RESULTS.md)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
    return torch.stack([angles.cos(), angles.sin()]).float()


def rotary(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, float32 [B, 1, S, head_dim / 2], at these positions (int64 [B, S]) from rotary_table's table."""
    cos_sin = table[:, positions[:, None, :]]
    return cos_sin[0], cos_sin[1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, mask: Any) -> torch.Tensor:
        B, S, _ = x.shape
        c = self.cfg
        q, k, v = self.wqkv(x).split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], -1)
        q = apply_rotary(q.view(B, S, c.n_heads, c.head_dim).transpose(1, 2), cos, sin)   # [B, Hq, S, D]
        k = apply_rotary(k.view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2), cos, sin)  # [B, Hkv, S, D]
        v = v.view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)
        out = attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(B, S, c.n_heads * c.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.d_model), RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden)

    def forward(self, x, cos, sin, attend: Attend, mask: Any) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attend, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transfusion(nn.Module):
    """Text and image tokens in one sequence; `forward` returns (loss, text CE, image MSE). `attend` is
    the attention backend's function (q [B, Hq, S, D], k/v [B, Hkv, S, D], its per-step mask)."""

    def __init__(self, cfg: ModelConfig, attend: Attend, image_loss_weight: float = 5.0,
                 max_positions: int = 32768) -> None:
        super().__init__()
        self.cfg, self.attend, self.image_loss_weight = cfg, attend, image_loss_weight
        self.register_buffer("rotary_table", rotary_table(max_positions, cfg.head_dim), persistent=False)
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.patch_in = nn.Linear(cfg.patch_dim, cfg.d_model, bias=False)
        self.noise_in = nn.Linear(1, cfg.d_model, bias=False)  # the image's noise level a, as Transfusion's timestep
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.patch_out = nn.Linear(cfg.d_model, cfg.patch_dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) everywhere, the residual branches' output projections scaled by 1/sqrt(2 layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, patches, noise, alpha, targets, positions, is_image, mask):
        a = alpha[..., None]
        noisy = a.sqrt() * patches + (1 - a).sqrt() * noise
        x = torch.where(is_image[..., None], self.patch_in(noisy) + self.noise_in(a), self.embed(tokens))
        cos, sin = rotary(self.rotary_table, positions)
        for block in self.blocks:
            x = block(x, cos, sin, self.attend, mask)
        h = self.norm(x)
        logits = self.lm_head(h).float()
        predicted = (targets != IGNORE).sum().clamp(min=1)
        text = F.cross_entropy(logits.view(-1, self.cfg.vocab), targets.view(-1), ignore_index=IGNORE,
                               reduction="sum") / predicted
        err = (self.patch_out(h).float() - noise).square().mean(-1)
        image = (err * is_image).sum() / is_image.sum().clamp(min=1)
        return text + self.image_loss_weight * image, text, image


# ------------------------------------------------------------------------------------------------
# attention backends


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


class Backend:
    """An attention backend: `make_mask(batch)` once per step in the training loop (outside the compiled
    model), `attend(q, k, v, mask)` in every layer. `prepare` runs once per run, before the steps."""

    name = ""
    mask = "transfusion"

    def __init__(self, rules: omnigen.Rules, cfg: ModelConfig, device: torch.device) -> None:
        self.rules, self.cfg, self.device = rules, cfg, device
        self.image_id = rules.modality_id("image")
        self.gqa = cfg.n_heads != cfg.n_kv_heads
        self.info: dict = {}

    def unavailable(self) -> str | None:
        """Why this backend cannot train here, or None."""
        return None

    def prepare(self, compiled: bool) -> None:
        pass

    def make_mask(self, batch: Batch) -> Any:
        return None

    def attend(self, q, k, v, mask):
        raise NotImplementedError


class OmnigenBackend(Backend):
    name = "omnigen"

    def unavailable(self) -> str | None:
        if self.device.type != "cuda":
            return "omnigen's kernels run on CUDA tensors only, and this run is on the CPU"
        return None

    def prepare(self, compiled: bool) -> None:
        start = time.perf_counter()
        omnigen.build(self.rules, head_dim=self.cfg.head_dim, dtype=torch.bfloat16)  # nvcc on a cold cache
        self.info.update(build_s=round(time.perf_counter() - start, 2), gqa="native" if self.gqa else None)

    def make_mask(self, batch: Batch) -> Any:
        layout = omnigen.Layout.from_tensors(batch.modality_ids, batch.document_ids, rules=self.rules)
        return omnigen.mask(self.rules, layout, device=self.device, head_dim=self.cfg.head_dim, dtype=torch.bfloat16)

    def attend(self, q, k, v, mask):
        return omnigen.attention(q, k, v, mask)


class FlexBackend(Backend):
    name = "flex"

    def unavailable(self) -> str | None:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:
            return f"FlexAttention is not in torch {torch.__version__} (torch.nn.attention.flex_attention, >= 2.5)"
        if self.device.type == "cuda":
            return None
        x = torch.zeros(1, 1, 128, 16, device=self.device, requires_grad=True)
        try:  # torch 2.13 runs the CPU forward but raises on a CPU input that requires grad
            flex_attention(x, x, x)
        except NotImplementedError as exc:
            return f"FlexAttention cannot train on {self.device.type} in torch {torch.__version__} ({exc})"
        return None

    def prepare(self, compiled: bool) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        on_gpu = self.device.type == "cuda"
        # Inside the compiled model flex_attention is compiled with it; alone it is compiled by itself, as
        # FlexAttention is meant to run (eager flex_attention is an unfused reference).
        self.flex = flex_attention if compiled or not on_gpu else torch.compile(flex_attention, dynamic=False)
        # the block mask compiled too (what create_block_mask's docs advise; eagerly it evaluates all S x S pairs)
        self.create_block_mask = torch.compile(create_block_mask) if on_gpu else create_block_mask
        self.info.update(gqa="enable_gqa" if self.gqa else None)

    def make_mask(self, batch: Batch) -> Any:
        B, S = batch.shape
        mask_mod = flex_mask_mod(batch.modality, batch.document, self.image_id)
        return self.create_block_mask(mask_mod, B, None, S, S, device=self.device)

    def attend(self, q, k, v, mask):
        return self.flex(q, k, v, block_mask=mask, enable_gqa=self.gqa)


class _SdpaBackend(Backend):
    """SDPA under `sdpa_kernel(self.backends)`. With GQA, enable_gqa=True where this SDPA backend takes it
    (probed on a small input in `prepare`), else k and v repeated to the query heads."""

    mask_probe = False  # probe with a boolean mask (as sdpa_dense calls it)

    def prepare(self, compiled: bool) -> None:
        self.repeat = False
        if self.gqa:
            try:
                self._probe()
            except RuntimeError as exc:
                self.repeat = True
                self.info["gqa_probe"] = _first_line(exc)
        self.info.update(gqa=("repeat_interleave" if self.repeat else "enable_gqa") if self.gqa else None)

    def _probe(self) -> None:
        c = self.cfg
        q = torch.randn(1, c.n_heads, 256, c.head_dim, device=self.device, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(1, c.n_kv_heads, 256, c.head_dim, device=self.device, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(1, 1, 256, 256, device=self.device, dtype=torch.bool).tril() if self.mask_probe else None
        self._sdpa(q, kv, kv, mask, enable_gqa=True).sum().backward()

    def _sdpa(self, q, k, v, mask, enable_gqa: bool) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, q, k, v, mask):
        if self.repeat:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self._sdpa(q, k, v, mask, enable_gqa=self.gqa and not self.repeat)


class SdpaDenseBackend(_SdpaBackend):
    name = "sdpa_dense"
    mask_probe = True

    def __init__(self, *args) -> None:
        super().__init__(*args)
        from torch.nn.attention import SDPBackend

        # the memory-efficient backend, as `omnigen bench`'s sdpa_dense; the CPU has its own kernels
        self.backends = [SDPBackend.EFFICIENT_ATTENTION] if self.device.type == "cuda" else None

    def make_mask(self, batch: Batch) -> Any:
        return dense_mask(batch.modality, batch.document, self.image_id)

    def _sdpa(self, q, k, v, mask, enable_gqa: bool) -> torch.Tensor:
        if self.backends is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


class CudnnCausalBackend(_SdpaBackend):
    name = "cudnn_causal"
    mask = "causal (not the Transfusion mask: a speed ceiling)"

    def unavailable(self) -> str | None:
        if self.device.type != "cuda":
            return "cuDNN attention runs on CUDA only, and this run is on the CPU"
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this torch build"
        return None

    def _sdpa(self, q, k, v, mask, enable_gqa: bool) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)


BACKEND_CLASSES = {cls.name: cls for cls in (OmnigenBackend, FlexBackend, SdpaDenseBackend, CudnnCausalBackend)}


def make_backend(name: str, rules: omnigen.Rules, cfg: ModelConfig, device: torch.device) -> Backend:
    return BACKEND_CLASSES[name](rules, cfg, device)


# ------------------------------------------------------------------------------------------------
# the profiler's time split


# Kernel names per backend: (backward, forward) regular expressions, searched in the demangled name.
#   omnigen: the generated modules' kernels (namespace omnigen_rules_<rules>; sm90: forward_kernel,
#     hopper_dkdv_kernel; sm80: dkdv_kernel, dq_kernel; both: delta_kernel before them and convert_kernel after
#     them, which writes the fp32 dQ (and GQA's grouped dK/dV) out in the element type).
#   flex: Inductor names its template kernels after the higher-order op: triton_tem_fused_flex_attention_N
#     and triton_tem_fused_flex_attention_backward_N. The backward's sum(dO * O) is an ordinary fused
#     reduction (triton_per_fused_..._mul_sum_N): "rest".
#   SDPA (sdpa_dense, cudnn_causal): memory-efficient (fmha_cutlassF/B, AttentionKernel /
#     AttentionBackwardKernel), flash (flash_fwd / flash_bwd) and cuDNN (..._fprop_... / ..._bprop_...).
_SDPA = (r"fmha_cutlassB|AttentionBackwardKernel|flash_bwd|bprop|dot_do_o|convert_dq",
         r"fmha_cutlassF|AttentionKernel<|flash_fwd|fprop")
KERNEL_PATTERNS = {
    "omnigen": (r"\b(hopper_dkdv_kernel|dkdv_kernel|dq_kernel|delta_kernel|convert_kernel)\b", r"\bforward_kernel\b"),
    "flex": (r"flex_attention_backward", r"flex_attention"),
    "sdpa_dense": _SDPA,
    "cudnn_causal": _SDPA,
}
# Names that look like some attention kernel (or an Inductor template: in this model only FlexAttention's)
# but match none of the backend's patterns: counted as "unclassified", listed in the JSON, never guessed.
ATTENTION_LIKE = r"attention|attn|fmha|flash|flex|sdpa|cudnn|softmax|omnigen|triton_tem_"
# The loss's fused kernels (Inductor names them after log_softmax / nll_loss): the rest of the step, not attention.
NOT_ATTENTION = r"log_softmax|nll_loss"


def classify_kernel(backend: str, name: str) -> str:
    """'attn_bwd', 'attn_fwd', 'unclassified' or 'rest' for a CUDA kernel's name in a run of `backend`
    (KERNEL_PATTERNS above says which names and why)."""
    bwd, fwd = KERNEL_PATTERNS[backend]
    if re.search(bwd, name):
        return "attn_bwd"
    if re.search(fwd, name):
        return "attn_fwd"
    if re.search(ATTENTION_LIKE, name, re.IGNORECASE) and not re.search(NOT_ATTENTION, name):
        return "unclassified"
    return "rest"


def time_split(backend: str, kernels: list[tuple[str, float]], steps: int) -> dict:
    """Per-step GPU milliseconds by class from (kernel name, microseconds) over `steps` steps, and the
    kernels that took the most time (with their class) so the classification can be checked."""
    split = {"attn_fwd": 0.0, "attn_bwd": 0.0, "unclassified": 0.0, "rest": 0.0}
    by_name: dict[str, float] = {}
    for name, us in kernels:
        split[classify_kernel(backend, name)] += us
        by_name[name] = by_name.get(name, 0.0) + us
    per_step = {f"{k}_ms": round(v / steps / 1e3, 3) for k, v in split.items()}
    per_step["kernel_ms"] = round(sum(split.values()) / steps / 1e3, 3)
    top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
    per_step["top_kernels"] = [{"name": n[:160], "ms_per_step": round(us / steps / 1e3, 3),
                                "class": classify_kernel(backend, n)} for n, us in top]
    unclassified = [n for n in by_name if classify_kernel(backend, n) == "unclassified"]
    per_step["unclassified_kernels"] = [n[:160] for n in unclassified[:10]]
    return per_step


def profile_kernels(step: Callable[[], Any], steps: int, spans: list | None = None) -> list[tuple[str, float]]:
    """(name, microseconds) of every CUDA kernel (and memcpy/memset) the device ran during `steps` calls;
    `spans`, when given, receives (start us, end us, name) of each."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if spans is not None:
        spans.extend((e.time_range.start, e.time_range.end, e.name) for e in events)
    return [(e.name, e.time_range.elapsed_us()) for e in events]


def idle_gaps(spans: list[tuple[float, float, str]], steps: int, top: int = 6) -> dict:
    """Where the GPU ran nothing between the first and last kernel of the profiled steps: the idle milliseconds a
    step, and the longest gaps with the kernels either side (a gap after a short kernel and before the next step's
    first one is the host keeping the GPU waiting: a sync, or host work longer than the queued kernels)."""
    gaps, busy_until, last = [], None, ""
    for start, end, name in sorted(spans):
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, last, name))
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    gaps.sort(key=lambda g: -g[0])
    return {"idle_ms": round(sum(g[0] for g in gaps) / steps / 1e3, 3),
            "longest_gaps": [{"us": round(us, 1), "after": a[:90], "before": b[:90]} for us, a, b in gaps[:top]]}


# ------------------------------------------------------------------------------------------------
# one run: a config, a sequence length and a backend


@dataclass
class RunSettings:
    steps: int = 10
    warmup: int = 3
    profile_steps: int | None = None  # None: as many as `steps`, on the same batches
    compile: bool = True
    fullgraph: bool = True
    lr: float = 3e-4
    image_loss_weight: float = 5.0
    seed: int = 0
    data_pool: int = 8
    image_tokens: int = 256
    documents: tuple[int, int] = (2, 4)
    sync_debug: bool = False


def find_syncs(step: Callable[[], Any], device: torch.device) -> list[str]:
    """One more step under torch.cuda.set_sync_debug_mode("warn"): where the step made the host wait for the GPU
    (`.item()`, `.tolist()`, a blocking copy, ...), as "file:line: message" with a count, most frequent first.
    Syncs inside the driver (cudaFree, cudaHostAlloc) are not reported by this mode."""
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _sync(device)
    seen: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message):
            where = f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:120]}"
            seen[where] = seen.get(where, 0) + 1
    return [f"{n}x {where}" for where, n in sorted(seen.items(), key=lambda kv: -kv[1])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    torch._dynamo.reset()  # a fresh compile per run, never past the recompile limit
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class _Quiet:
    """click.progressbar's interface, drawing nothing (where stderr is not a terminal)."""

    def __enter__(self) -> "_Quiet":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _progress(total: int, label: str):
    """A progress bar over a run's steps on a terminal; elsewhere nothing (main prints a line per run)."""
    if sys.stderr.isatty():
        return click.progressbar(length=total, label=label, file=sys.stderr)
    return _Quiet()


def train(backend: Backend, cfg: ModelConfig, seq_len: int, batch: int, batches: list[Batch], s: RunSettings,
          label: str = "") -> dict:
    """Train from the seed's initial weights on `batches` (cycled): warm-up, timed and profiled steps."""
    device = backend.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    backend.prepare(s.compile)
    prepare_s = time.perf_counter() - start
    torch.manual_seed(s.seed)  # the same initial weights for every backend
    with torch.device(device):
        model = Transfusion(cfg, backend.attend, s.image_loss_weight, max_positions=seq_len)
    forward = torch.compile(model, fullgraph=s.fullgraph, dynamic=False) if s.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    losses: list[torch.Tensor] = []

    def step(index: int | None = None) -> None:
        b = batches[(len(losses) if index is None else index) % len(batches)]
        mask = backend.make_mask(b)  # per step, inside the timed loop, outside the compiled model
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, text, image = forward(b.tokens, b.patches, b.noise, b.alpha, b.targets, b.positions,
                                        b.modality == backend.image_id, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(torch.stack([loss.detach(), text.detach(), image.detach()]))

    total = s.warmup + s.steps
    with _progress(total, label) as bar:
        first = time.perf_counter()
        step()
        _sync(device)
        first_step_s = time.perf_counter() - first
        bar.update(1)
        for _ in range(s.warmup - 1):
            step()
            bar.update(1)
        _sync(device)
        graphs, start, host = _graphs(), time.perf_counter(), []
        for _ in range(s.steps):
            entered = time.perf_counter()
            step()
            host.append(time.perf_counter() - entered)
            bar.update(1)
        _sync(device)
        seconds = time.perf_counter() - start
    out = {"prepare_s": round(prepare_s, 2), "first_step_s": round(first_step_s, 2),
           "step_ms": round(1e3 * seconds / s.steps, 2), "tokens_per_s": round(s.steps * batch * seq_len / seconds, 1),
           # how long step() held the host (median): far below step_ms, the host ran ahead of the GPU; near it, the
           # host waited for the GPU inside the step (a sync, or over a long run the launch queue full)
           "host_step_ms": round(1e3 * sorted(host)[len(host) // 2], 2),
           "recompiles_while_timed": _graphs() - graphs if s.compile else None}
    if s.sync_debug and device.type == "cuda":
        out["syncs"] = find_syncs(step, device)
    if device.type == "cuda":
        out["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        profiled = s.steps if s.profile_steps is None else s.profile_steps
        if profiled > 0:
            try:
                # the timed steps' batches again, in their order: the split then adds up to the timed step (the
                # documents per sequence, hence the attention's pairs, differ from batch to batch)
                replay = iter([s.warmup + i for i in range(profiled)])
                spans: list = []
                kernels = profile_kernels(lambda: step(next(replay)), profiled, spans)
                out.update(time_split(backend.name, kernels, profiled))
                out.update(idle_gaps(spans, profiled))
                out["profiled_batches"] = sorted({(s.warmup + i) % len(batches) for i in range(profiled)})
            except Exception as exc:  # noqa: BLE001 - the timing stands without the split
                out["profile_error"] = _first_line(exc)
    values = torch.stack(losses).float().cpu()
    curves = [[round(x, 5) for x in values[:, i].tolist()] for i in range(3)]
    out.update(losses=curves[0], text_losses=curves[1], image_losses=curves[2], final_loss=curves[0][-1],
               timed_steps=[s.warmup, s.warmup + s.steps])
    if not math.isfinite(out["final_loss"]):
        out["warning"] = "the loss is not finite"
    return out


def run_one(name: str, rules: omnigen.Rules, cfg: ModelConfig, seq_len: int, batch: int, batches: list[Batch],
            s: RunSettings, device: torch.device) -> dict:
    """One backend's run as a JSON row: status ok (with the figures), skipped or failed (with the reason)."""
    backend = make_backend(name, rules, cfg, device)
    row = {"config": cfg.name, "backend": name, "S": seq_len, "B": batch, "mask": backend.mask}
    try:
        reason = backend.unavailable()
    except Exception as exc:  # noqa: BLE001 - a probe that fails says why
        reason = f"probing it failed: {_first_line(exc)}"
    if reason:
        return {**row, "status": "skipped", "reason": reason}
    try:
        row.update(train(backend, cfg, seq_len, batch, batches, s, label=f"{cfg.name} S={seq_len} {name}"))
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - out of memory, a refused shape...: recorded, the others go on
        row.update(status="failed", error=_first_line(exc))
    finally:
        row.update(backend.info)
        del backend
        _free(device)
    return row


def step_flops(cfg: ModelConfig, tokens: int, pairs: int) -> float:
    """Training FLOPs of one step: 6 x matmul weights x tokens, plus attention over the allowed pairs at
    docs/measuring.md's count (forward 4 D pairs Hq, forward+backward 3.5x that)."""
    return 6.0 * cfg.matmul_params() * tokens + 3.5 * 4.0 * cfg.head_dim * pairs * cfg.n_heads * cfg.n_layers


def attention_flop_share(cfg: ModelConfig, tokens: int, pairs: int) -> float:
    """Attention's part of `step_flops`: how much attention can move the step at all (Amdahl)."""
    return 1 - 6.0 * cfg.matmul_params() * tokens / step_flops(cfg, tokens, pairs)


# ------------------------------------------------------------------------------------------------
# summary: ratios, loss agreement, table, plot


def add_ratios(runs: list[dict]) -> None:
    """Per (config, S): each ok run's tokens/s against flex and cudnn_causal, and the ladder
    (x - sdpa_dense) / (cudnn_causal - sdpa_dense) in percent (None where a figure is missing)."""
    for r in runs:
        if r.get("status") != "ok":
            continue
        peer = {p["backend"]: p.get("tokens_per_s") for p in runs
                if p["config"] == r["config"] and p["S"] == r["S"] and p.get("status") == "ok"}
        x, flex, cudnn, dense = r["tokens_per_s"], peer.get("flex"), peer.get("cudnn_causal"), peer.get("sdpa_dense")
        r["vs_flex"] = round(x / flex, 3) if flex else None
        r["vs_cudnn_causal"] = round(x / cudnn, 3) if cudnn else None
        r["ladder_pct"] = round(100 * (x - dense) / (cudnn - dense), 1) if cudnn and dense and cudnn != dense else None


def smoothed_gap(curve: list[float], ref: list[float], window: int = 20) -> dict:
    """`omnigen.bench.smoothed_gap` (the example's judgement of two loss curves), rounded for the JSON."""
    verdict = bench.smoothed_gap(curve, ref, window)
    return {"window": window, "within_noise": verdict["within_noise"],
            **{k: round(verdict[k], 5) for k in ("max_smoothed_gap", "step_to_step_noise")}}


def loss_agreement(runs: list[dict]) -> list[dict]:
    """Per (config, S): how far each multimodal backend's loss curve is from sdpa_dense's (or the first
    that ran): the largest absolute difference over all steps, at the first step and at the last, and, for
    runs of 40 steps or more, the smoothed gap against the step-to-step noise (`smoothed_gap`)."""
    out = []
    for key in dict.fromkeys((r["config"], r["S"]) for r in runs):
        curves = {r["backend"]: r["losses"] for r in runs if (r["config"], r["S"]) == key
                  and r.get("status") == "ok" and r["backend"] in MULTIMODAL}
        if len(curves) < 2:
            continue
        ref_name = "sdpa_dense" if "sdpa_dense" in curves else next(iter(curves))
        ref = curves[ref_name]
        for name, curve in curves.items():
            if name == ref_name:
                continue
            diffs = [abs(a - b) for a, b in zip(curve, ref)]
            row = {"config": key[0], "S": key[1], "backend": name, "reference": ref_name, "steps": len(diffs),
                   "max_abs_diff": round(max(diffs), 5), "first_step_diff": round(diffs[0], 5),
                   "last_step_diff": round(diffs[-1], 5),
                   "last_step_rel_diff": round(diffs[-1] / max(abs(ref[-1]), 1e-9), 5)}
            if len(diffs) >= 40:
                row.update(smoothed_gap(curve, ref))
            out.append(row)
    return out


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


TABLE_COLUMNS = ("config", "backend", "S", "B", "tokens/s", "x flex", "x cudnn_causal", "ladder %", "peak MiB",
                 "attn fwd ms", "attn bwd ms", "unclass. ms", "rest ms", "step ms", "final loss")


def table(result: dict) -> str:
    """The runs as a text table; skipped and failed runs show their reason under it."""
    info = result["info"]
    lines = [f"train step, bf16 autocast, {info['tokens']} tokens/step, {info['device_name']}, torch {info['torch']}, "
             f"commit {info.get('commit', '?')[:10]}{' (local changes)' if info.get('dirty') else ''}, "
             f"compile {'on' if info['settings']['compile'] else 'off'}"]
    rows, notes = [], []
    for r in result["runs"]:
        if r["status"] == "ok":
            rows.append([r["config"], r["backend"], str(r["S"]), str(r["B"]), f"{r['tokens_per_s']:,.0f}",
                         _cell(r.get("vs_flex"), "{:.2f}"), _cell(r.get("vs_cudnn_causal"), "{:.2f}"),
                         _cell(r.get("ladder_pct"), "{:.0f}"), _cell(r.get("peak_mib"), "{:,.0f}"),
                         _cell(r.get("attn_fwd_ms"), "{:.1f}"), _cell(r.get("attn_bwd_ms"), "{:.1f}"),
                         _cell(r.get("unclassified_ms"), "{:.1f}"), _cell(r.get("rest_ms"), "{:.1f}"),
                         f"{r['step_ms']:.1f}", f"{r['final_loss']:.4f}"])
            if r.get("unclassified_ms"):
                notes.append(f"{r['config']} S={r['S']} {r['backend']}: unclassified attention-like kernels: "
                             f"{', '.join(r.get('unclassified_kernels', []))[:300]}")
            if r.get("profile_error"):
                notes.append(f"{r['config']} S={r['S']} {r['backend']}: no time split ({r['profile_error']})")
            if r.get("recompiles_while_timed"):
                notes.append(f"{r['config']} S={r['S']} {r['backend']}: recompiled {r['recompiles_while_timed']} "
                             "time(s) during the timed steps: its tokens/s include compilation")
        else:
            why = r.get("reason") or r.get("error")
            rows.append([r["config"], r["backend"], str(r["S"]), str(r["B"]), r["status"]]
                        + ["-"] * (len(TABLE_COLUMNS) - 5))
            notes.append(f"{r['config']} S={r['S']} {r['backend']} {r['status']}: {why}")
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(TABLE_COLUMNS)]
    lines.append("  ".join(c.rjust(w) for c, w in zip(TABLE_COLUMNS, widths)))
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines += notes
    for a in result.get("loss_agreement", []):
        lines.append(f"loss {a['config']} S={a['S']} {a['backend']} vs {a['reference']}: "
                     f"max |diff| {a['max_abs_diff']:.4f} over {a['steps']} steps "
                     f"(first {a['first_step_diff']:.4f}, last {a['last_step_diff']:.4f})"
                     + (f"; {a['window']}-step means over the second half within {a['max_smoothed_gap']:.4f}, "
                        f"step-to-step noise {a['step_to_step_noise']:.4f}: "
                        f"{'within' if a['within_noise'] else 'NOT within'} bf16 noise" if "within_noise" in a else ""))
    lines.append("x flex, x cudnn_causal: tokens/s ratios; ladder: (x - sdpa_dense) / (cudnn_causal - sdpa_dense); "
                 "cudnn_causal computes the plain causal mask (a ceiling); ms: GPU kernel time per step (profiler; "
                 "unclass.: attention-like kernels of no known direction, see classify_kernel)")
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> Path:
    """tokens/s against S per backend, one subplot per config. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["status"] == "ok"]
    configs = list(dict.fromkeys(r["config"] for r in result["runs"])) or ["-"]
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.5), squeeze=False)
    for ax, name in zip(axes[0], configs):
        for backend in BACKENDS:
            points = sorted((r["S"], r["tokens_per_s"]) for r in runs
                            if r["config"] == name and r["backend"] == backend)
            if points:
                style = "--" if backend == "cudnn_causal" else "-"
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S (B = tokens / S)")
        ax.set_ylabel("training tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(CONFIGS[name].describe() if name in CONFIGS else name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Transfusion-style training step, {result['info']['device_name']}, torch {result['info']['torch']}",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# command line


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(args: argparse.Namespace, settings: RunSettings, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "device": device.type, "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
        "torch": torch.__version__, "cuda": torch.version.cuda, "omnigen": omnigen.__version__,
        "python": platform.python_version(), "date": now.isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD") or "?",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),  # tracked files changed
        "argv": sys.argv if args.argv is None else args.argv, "tokens": args.tokens,
        "rules": str(RULES_PATH.relative_to(ROOT)), "settings": asdict(settings),
        "configs": {c: asdict(CONFIGS[c]) for c in args.config},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", choices=sorted(CONFIGS), default=["a", "b"])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    p.add_argument("--tokens", type=int, default=32768, help="tokens per step: B = tokens // S")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--steps", type=int, default=10, help="timed steps (their losses, like all others, go to the JSON)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, kernel builds)")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="extra steps under the profiler, replaying the timed steps' batches (CUDA; default: as many "
                        "as --steps, so the time split is of the timed steps' data; 0: none)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on CUDA yes, on the CPU no)")
    p.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                   help="compile with fullgraph=True, so a graph break fails the run instead of slowing it")
    p.add_argument("--image-tokens", type=int, choices=(256, 1024), default=256)
    p.add_argument("--documents", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"),
                   help="documents per sequence")
    p.add_argument("--image-loss-weight", type=float, default=5.0, help="Transfusion's lambda")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-pool", type=int, default=8, help="distinct batches per run, made before timing, cycled")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run once the elapsed time plus the longest run so far would pass this many "
                        "seconds (those runs are recorded as skipped): a call under a time limit keeps its results")
    p.add_argument("--sync-debug", action="store_true",
                   help="one more step per run under torch.cuda.set_sync_debug_mode('warn'): list where it made "
                        "the host wait for the GPU (JSON: syncs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, help="write every figure here (after every run, and at the end)")
    p.add_argument("--from-json", type=Path, nargs="+", metavar="JSON",
                   help="run nothing: merge these earlier --json files (e.g. one per call), print their table, "
                        "and write --json / --png from them")
    p.add_argument("--png", type=Path, help="plot tokens/s against S (matplotlib)")
    args = p.parse_args(argv)
    args.argv = argv
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1 (the first step compiles)")
    if min(args.documents) < 1 or args.documents[0] > args.documents[1]:
        p.error("--documents MIN MAX: 1 <= MIN <= MAX")
    too_long = [S for S in args.seq_lens if S > args.tokens]
    if too_long:
        p.error(f"--seq-lens {too_long}: longer than --tokens {args.tokens} (B = tokens // S would be 0)")
    return args


def _write(path: Path | None, result: dict) -> None:
    if path:
        path.write_text(json.dumps(result, indent=1))


def merge(paths: list[Path]) -> dict:
    """Earlier results as one: the first file's info (with every file's commit and date), all their runs."""
    results = [json.loads(Path(path).read_text()) for path in paths]
    info = dict(results[0]["info"])
    info["merged"] = [{"file": str(path), "commit": r["info"].get("commit"), "date": r["info"].get("date"),
                       "device_name": r["info"].get("device_name")} for path, r in zip(paths, results)]
    return {"info": info, "runs": [run for r in results for run in r["runs"]], "loss_agreement": []}


def finish(result: dict, args: argparse.Namespace) -> dict:
    """Ratios and loss agreement over all runs, then the JSON, the table and the PNG."""
    add_ratios(result["runs"])
    result["loss_agreement"] = loss_agreement(result["runs"])
    _write(args.json, result)
    print()
    print(table(result))
    if args.png:
        try:
            print(f"wrote {plot(result, args.png)}")
        except ImportError:
            print("matplotlib is not installed: no PNG (the JSON has every figure)")
    return result


def main(argv: list[str] | None = None) -> dict:
    """Run every (config, S, backend), print the table; returns what --json writes."""
    args = parse_args(argv)
    if args.from_json:
        return finish(merge(args.from_json), args)
    device = torch.device(args.device)
    settings = RunSettings(steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps,
                           compile=device.type == "cuda" if args.compile is None else args.compile,
                           fullgraph=args.fullgraph, lr=args.lr, image_loss_weight=args.image_loss_weight,
                           seed=args.seed, data_pool=args.data_pool, image_tokens=args.image_tokens,
                           documents=tuple(args.documents), sync_debug=args.sync_debug)
    rules = omnigen.Rules.load(RULES_PATH)
    result: dict = {"info": run_info(args, settings, device), "runs": [], "loss_agreement": []}
    image_id = rules.modality_id("image")
    started, longest = time.perf_counter(), 0.0
    for name in args.config:
        cfg = CONFIGS[name]
        print(f"config {cfg.describe()}", flush=True)
        for S in args.seq_lens:
            B = args.tokens // S
            count = min(settings.data_pool, settings.warmup + settings.steps + 1)
            batches = [make_batch(cfg, rules, S, B, i, seed=settings.seed, image_tokens=settings.image_tokens,
                                  documents=settings.documents, device=device) for i in range(count)]
            pairs = attention_pairs(batches[0].modality_ids, batches[0].document_ids, image_id)
            share = attention_flop_share(cfg, B * S, pairs)
            print(f"  S={S}: attention is {100 * share:.0f}% of the step's FLOPs on the Transfusion mask "
                  f"({pairs / (B * S * (S + 1) / 2):.2f}x the causal mask's pairs)", flush=True)
            for backend in args.backends:
                elapsed = time.perf_counter() - started
                if args.budget_s is not None and elapsed + longest > args.budget_s:
                    row = {"config": name, "backend": backend, "S": S, "B": B, "status": "skipped",
                           "reason": f"--budget-s {args.budget_s:g}: {elapsed:.0f} s spent, the longest run "
                                     f"took {longest:.0f} s"}
                else:
                    row = run_one(backend, rules, cfg, S, B, batches, settings, device)
                    longest = max(longest, time.perf_counter() - started - elapsed)
                if row["status"] == "ok":
                    row_pairs = B * S * (S + 1) // 2 if backend == "cudnn_causal" else pairs
                    row["tflops"] = round(step_flops(cfg, B * S, row_pairs) / row["step_ms"] / 1e9, 1)
                    row["attention_flop_share"] = round(attention_flop_share(cfg, B * S, row_pairs), 3)
                    row["attention_pairs_first_batch"] = row_pairs
                    print(f"  S={S:>6} B={B:<3} {backend:<13} {row['tokens_per_s']:>12,.0f} tokens/s  "
                          f"first step {row['first_step_s']:.1f} s  final loss {row['final_loss']:.4f}  "
                          f"host {row['host_step_ms']:.1f} of {row['step_ms']:.1f} ms a step", flush=True)
                    for where in row.get("syncs", ()):
                        print(f"    sync: {where}", flush=True)
                    if "idle_ms" in row:
                        print(f"    GPU idle {row['idle_ms']:.1f} ms a step (profiled); longest gaps: " + "; ".join(
                            f"{g['us'] / 1e3:.2f} ms after {g['after'][:40]} before {g['before'][:40]}"
                            for g in row["longest_gaps"][:4]), flush=True)
                else:
                    print(f"  S={S:>6} B={B:<3} {backend:<13} {row['status']}: {row.get('reason') or row.get('error')}",
                          flush=True)
                result["runs"].append(row)
                _write(args.json, result)
            del batches
            _free(device)
    return finish(result, args)


if __name__ == "__main__":
    main()
