"""Train a small Transfusion-style transformer with omnigen, then with FlexAttention, from the same seed.

The model: 4 layers, d_model 512, 8 heads of 64, text tokens (next-token cross-entropy) and continuous
image patches (denoising: noisy patches in, clean patches out, MSE) in one sequence under the
Transfusion mask (text causal, each image bidirectional inside itself, every token sees the earlier
segments of its sequence). The data is synthetic and made here: every sequence has a topic; its text
is drawn from the topic's words and its images are the topic's prototype plus noise, so the images can
only be denoised well by attending to earlier text.

Both runs see the same batches (the same seed) and start from the same weights; both use
torch.compile(fullgraph=True) and bf16 autocast, and both make their mask per batch inside the timed
loop (omnigen: `kernel.mask(layout)`; FlexAttention: `create_block_mask`). Per-token modality ids
become layouts with `omnigen.Layout.from_tensors`.

Writes a PNG of both loss curves and a JSON summary, and prints tokens/s for each. Needs a CUDA GPU.
The curves are judged by `omnigen.bench.smoothed_gap`: their 20-step means over the second half within the
step-to-step noise, or (--flex-runs 2) within the gap between two FlexAttention runs from the same seed, since
both backwards add in fp32 atomically and a run drifts from its own repeat about as far (H200: 0.023-0.046).

    PYTHONPATH=. python examples/train_transfusion.py --steps 300 --out train-out
    PYTHONPATH=. python examples/train_transfusion.py --steps 300 --flex-runs 2   # judged against flex's own drift
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import omnigen  # noqa: E402
from omnigen.bench import rules_mask_mod, smoothed_gap  # noqa: E402

RULES = omnigen.Rules.load(Path(__file__).resolve().parent / "rules" / "transfusion.yaml")
TEXT, IMAGE = RULES.modality_id("text"), RULES.modality_id("image")
VOCAB, WORD, WORDS, TOPICS, PATCH, IMAGE_TOKENS = 256, 4, 64, 8, 32, 256


# ------------------------------------------------------------------------------------------------
# synthetic data


class Data:
    """Batches of (modality ids, text tokens, clean and noisy patches), seeded; text runs of 64-512
    tokens between images of 256 patches.

    The segment lengths are drawn on the host (the layout is made there); the tokens and patches on the
    GPU, so that making a batch costs the host a few small launches whatever the backend. (Drawn on the
    host, the patches alone cost 3-25 ms of CPU per step on the H100 machine, varying with how busy its
    CPUs were: that, not attention, set the tokens/s of both backends in earlier runs of this example.)"""

    def __init__(self, batch: int, seq_len: int, seed: int, device: torch.device):
        self.B, self.S, self.device = batch, seq_len, device
        self.gen = torch.Generator().manual_seed(seed)
        self.gen_device = torch.Generator(device).manual_seed(seed)
        fixed = torch.Generator().manual_seed(1234)  # the "language": the same for every run
        self.words = torch.randint(0, VOCAB, (WORDS, WORD), generator=fixed).to(device)
        self.topic_words = torch.stack([torch.randperm(WORDS, generator=fixed)[:16] for _ in range(TOPICS)]).to(device)
        self.prototypes = torch.randn(TOPICS, PATCH, generator=fixed).to(device)
        self.position_pattern = (0.5 * torch.randn(IMAGE_TOKENS, PATCH, generator=fixed)).to(device)

    def next(self):
        B, S, g, d = self.B, self.S, self.gen, self.device
        modality = torch.empty(B, S, dtype=torch.int64)
        image_pos = torch.zeros(B, S, dtype=torch.int64)
        for b in range(B):  # a handful of segments per row
            at, text = 0, True
            while at < S:
                n = int(torch.randint(64, 513, (1,), generator=g)) if text else IMAGE_TOKENS
                n = min(n, S - at)
                modality[b, at:at + n] = TEXT if text else IMAGE
                if not text:
                    image_pos[b, at:at + n] = torch.arange(n)
                at, text = at + n, not text
        modality_d = modality.to(d, non_blocking=True)
        image_pos = image_pos.to(d, non_blocking=True)
        gd = self.gen_device
        topic = torch.randint(0, TOPICS, (B,), generator=gd, device=d)
        choice = torch.randint(0, 16, (B, S // WORD + 1), generator=gd, device=d)
        word_ids = self.topic_words[topic[:, None], choice]  # [B, S / WORD]
        tokens = self.words[word_ids].reshape(B, -1)[:, :S]
        clean = self.prototypes[topic][:, None, :] + self.position_pattern[image_pos]
        sigma = torch.rand(B, 1, 1, generator=gd, device=d) * 0.8 + 0.2
        noisy = clean + sigma * torch.randn(B, S, PATCH, generator=gd, device=d)
        return modality, tokens, clean, noisy, modality_d


# ------------------------------------------------------------------------------------------------
# the model


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x, attend, mask):
        B, S, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = attend(q, k, v, mask)  # [B, H, S, D]
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, d))
        return x + self.mlp(self.norm2(x))


class Transfusion(torch.nn.Module):
    def __init__(self, attend, seq_len: int, d: int = 512, layers: int = 4, heads: int = 8):
        super().__init__()
        self.attend = attend
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.patch_in = torch.nn.Linear(PATCH, d)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(seq_len, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, VOCAB, bias=False)
        self.patch_out = torch.nn.Linear(d, PATCH)

    def forward(self, tokens, clean, noisy, modality, mask):
        is_image = (modality == IMAGE)[..., None]
        x = torch.where(is_image, self.patch_in(noisy), self.embed(tokens)) + self.pos
        for block in self.blocks:
            x = block(x, self.attend, mask)
        h = self.norm(x)
        # text: predict the next token where the next token is text; images: the clean patch
        logits = self.lm_head(h[:, :-1]).float()
        next_is_text = (modality[:, :-1] == TEXT) & (modality[:, 1:] == TEXT)
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
        text_loss = (ce * next_is_text.reshape(-1)).sum() / next_is_text.sum().clamp(min=1)
        err = (self.patch_out(h).float() - clean).square().mean(-1)
        image_loss = (err * is_image[..., 0]).sum() / is_image.sum().clamp(min=1)
        return text_loss + image_loss


# ------------------------------------------------------------------------------------------------
# training


def train(name: str, args, device: torch.device) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if name == "omnigen":
        kernel = omnigen.build(RULES, head_dim=64, dtype=torch.bfloat16)

        def attend(q, k, v, mask):
            return kernel(q, k, v, mask)

        def make_mask(layout):
            return kernel.mask(layout)
    else:
        def attend(q, k, v, mask):
            return flex_attention(q, k, v, block_mask=mask)

        def make_mask(layout):
            tables = layout.tables(RULES, device)
            return create_block_mask(rules_mask_mod(RULES, tables), args.batch, None, args.seq_len, args.seq_len,
                                     device=device, _compile=True)  # FlexAttention's fast path for block masks

    torch.manual_seed(args.seed)  # the same initial weights for both runs
    model = Transfusion(attend, args.seq_len).to(device)
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    data = Data(args.batch, args.seq_len, args.seed, device)
    losses, start, timed_from = [], None, args.warmup

    def one_step() -> torch.Tensor:
        # the named ranges cost nothing outside the profiler; under it they split the step's host time
        with record_function("step: data"):
            modality, tokens, clean, noisy, modality_d = data.next()
        with record_function("step: mask"):
            layout = omnigen.Layout.from_tensors(modality, rules=RULES)  # a LayoutBatch of B layouts
            mask = make_mask(layout)
        with record_function("step: forward"), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(tokens, clean, noisy, modality_d, mask)
        with record_function("step: backward"):
            loss.backward()
        with record_function("step: optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first_step = time.perf_counter()
    for step in range(args.steps):
        if step == timed_from:
            torch.cuda.synchronize()
            start = time.perf_counter()
        losses.append(one_step())
        if step == 0:
            torch.cuda.synchronize()
            print(f"{name}: first step (compile{', kernel build' if name == 'omnigen' else ''}) "
                  f"{time.perf_counter() - first_step:.1f} s", flush=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = (args.steps - timed_from) * args.batch * args.seq_len / seconds
    values = [float(x) for x in torch.stack(losses).cpu()]
    print(f"{name}: {args.steps} steps, final loss {sum(values[-20:]) / 20:.4f} (mean of the last 20), "
          f"{tokens_per_s:,.0f} tokens/s over steps {timed_from}-{args.steps} (masks made per batch included)",
          flush=True)
    result = {"losses": values, "tokens_per_s": tokens_per_s, "seconds": seconds,
              "total_seconds": time.perf_counter() - first_step,
              "compiled_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])}
    if args.profile_steps:
        result["profile"] = profile(name, one_step, args.profile_steps, 1e3 * seconds / (args.steps - timed_from))
    return result


# what the profiler calls each attention's kernels (see benchmarks/train_step.py for the full classification)
ATTENTION_KERNELS = {"omnigen": r"\b(forward_kernel|hopper_dkdv_kernel|dkdv_kernel|dq_kernel|delta_kernel)\b",
                     "flex": r"flex_attention"}


def profile(name: str, one_step, steps: int, wall_ms: float) -> dict:
    """Where a step's time goes: GPU kernel time per step (attention and the rest) against the step's wall
    time, and the host operations that took the most CPU time. A step whose GPU time is well below its
    wall time is host-bound: the GPU waits for Python, the dispatcher or the mask's planning."""
    import re

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    events = prof.events()
    # kernels only: the named ranges (and Inductor's "## Call CompiledFxGraph" ones) also appear on the GPU's
    # timeline, as user annotations spanning the kernels they contain
    gpu = [(e.name, e.time_range.elapsed_us()) for e in events
           if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
           and not e.name.startswith(("step: ", "## "))]
    gpu_ms = sum(us for _, us in gpu) / steps / 1e3
    attention_ms = sum(us for n, us in gpu if re.search(ATTENTION_KERNELS[name], n)) / steps / 1e3
    host, parts = {}, {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if e.name.startswith("step: "):
            parts[e.name[6:]] = parts.get(e.name[6:], 0.0) + e.cpu_time_total
        else:
            host[e.name] = host.get(e.name, 0.0) + e.self_cpu_time_total
    top_host = sorted(host.items(), key=lambda kv: -kv[1])[:6]
    out = {"wall_ms_per_step": round(wall_ms, 2), "gpu_kernel_ms_per_step": round(gpu_ms, 2),
           "attention_kernel_ms_per_step": round(attention_ms, 2),
           "gpu_busy_fraction": round(gpu_ms / wall_ms, 3),
           "host_ms_per_step": {n: round(us / steps / 1e3, 3) for n, us in parts.items()},
           "top_host_ops_ms_per_step": {n[:80]: round(us / steps / 1e3, 3) for n, us in top_host}}
    print(f"{name}: profile over {steps} steps: wall {wall_ms:.2f} ms/step (timed loop), GPU kernels "
          f"{gpu_ms:.2f} ms/step ({100 * gpu_ms / wall_ms:.0f}% busy), attention kernels {attention_ms:.2f} ms/step; "
          "host ms/step: " + ", ".join(f"{n} {ms:.2f}" for n, ms in out["host_ms_per_step"].items()), flush=True)
    for n, ms in out["top_host_ops_ms_per_step"].items():
        print(f"    host op {ms:8.3f} ms/step (self)  {n}", flush=True)
    return out


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no PNG written", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        ax.plot(r["losses"], label=f"{name} ({r['tokens_per_s'] / 1e3:,.0f}K tokens/s)", alpha=0.8, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (text cross-entropy + image MSE)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Transfusion-style model, 4 x 512, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="steps not timed (compilation, kernel build)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("train-transfusion-out"))
    parser.add_argument("--only", choices=("omnigen", "flex"), help="run one of the two")
    parser.add_argument("--flex-runs", type=int, choices=(1, 2), default=1,
                        help="2: train with FlexAttention a second time from the same seed and judge omnigen's curve "
                             "against how far FlexAttention's two runs drift apart too (one more run's time)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed steps, this many more under the PyTorch profiler: GPU time per step "
                             "against wall time (host-bound or not) and the costliest host operations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("train_transfusion.py needs a CUDA GPU (omnigen's kernels and FlexAttention run on one); none is visible")
    if args.steps <= args.warmup:
        sys.exit(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in (args.only,) if args.only else ("omnigen", "flex"):
        results[name] = train(name, args, device)
        torch._dynamo.reset()
    flex_again = None
    if args.flex_runs == 2 and "flex" in results:
        flex_again = train("flex", args, device)["losses"]
        torch._dynamo.reset()
    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps,
               "batch": args.batch, "seq_len": args.seq_len,
               **{f"{n}_tokens_per_s": round(r["tokens_per_s"]) for n, r in results.items()},
               **{f"{n}_final_loss": sum(r["losses"][-20:]) / 20 for n, r in results.items()}}
    if len(results) == 2:
        summary["comparison"] = smoothed_gap(results["omnigen"]["losses"], results["flex"]["losses"],
                                             ref_again=flex_again)
        summary["speedup_vs_flex"] = round(results["omnigen"]["tokens_per_s"] / results["flex"]["tokens_per_s"], 3)
        c = summary["comparison"]
        print(f"loss curves: max gap of the {c['window']}-step means over the second half {c['max_smoothed_gap']:.4f} "
              f"({100 * c['max_smoothed_gap_relative']:.2f}%), step-to-step noise {c['step_to_step_noise']:.4f}"
              + (f", FlexAttention's two runs {c['reference_spread']:.4f} apart" if "reference_spread" in c else "")
              + f": {'within' if c['within_noise'] else 'NOT within'} noise", flush=True)
        print(f"tokens/s: omnigen {results['omnigen']['tokens_per_s']:,.0f}, flex {results['flex']['tokens_per_s']:,.0f} "
              f"({summary['speedup_vs_flex']:.2f}x)", flush=True)
    losses = {n: r["losses"] for n, r in results.items()}
    if flex_again is not None:
        losses["flex_again"] = flex_again
    (args.out / "train_transfusion.json").write_text(json.dumps({**summary, "losses": losses}))
    png = plot(results, args.out / "train_transfusion.png")
    if png:
        print(f"wrote {png}", flush=True)
    if not all(math.isfinite(r["losses"][-1]) for r in results.values()):
        sys.exit("a loss is not finite")


if __name__ == "__main__":
    main()
