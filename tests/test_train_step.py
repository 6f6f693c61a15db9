"""benchmarks/train_step.py on the CPU: its FlexAttention mask_mod and dense mask against rules.dense_mask, its
text targets, its backends' attention wiring (omnigen's through the float64 reference), the profiler's kernel
classes, and a tiny run of its main(). The GPU figures are the benchmark's own runs; one tiny GPU run checks
that every backend trains there."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import omnigen
from omnigen.reference import attention_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
train_step = importlib.import_module("train_step")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

RULES = omnigen.Rules.load(train_step.RULES_PATH)
TEXT, IMAGE = RULES.modality_id("text"), RULES.modality_id("image")
TINY = train_step.CONFIGS["tiny"]


def _batch(index: int, seq_len: int = 300, batch: int = 2, documents=(2, 2), image_tokens: int = 64):
    return train_step.make_batch(TINY, RULES, seq_len, batch, index, seed=7, image_tokens=image_tokens,
                                 documents=documents)


def _ids(segments: list[tuple[str, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, S] modality and document ids of (modality, length, document) segments."""
    modality = torch.tensor([[RULES.modality_id(m) for m, n, _ in segments for _ in range(n)]])
    document = torch.tensor([[d for _, n, d in segments for _ in range(n)]])
    return modality, document


HAND_MADE = [
    [("image", 40, 0), ("text", 30, 0), ("image", 50, 0), ("text", 20, 1), ("image", 60, 1), ("text", 100, 1)],
    [("text", 90, 0), ("image", 64, 0), ("image", 64, 1), ("text", 82, 1)],  # an image on each side of a document cut
    [("text", 300, 0)],
]


def _cases():
    for index in range(3):
        b = _batch(index)
        yield b.modality_ids, b.document_ids
    for segments in HAND_MADE:
        yield _ids(segments)


def _reference_mask(modality: torch.Tensor, document: torch.Tensor) -> torch.Tensor:
    layout = omnigen.Layout.from_tensors(modality, document, rules=RULES)
    return RULES.dense_mask(layout)


def test_random_layouts_have_several_documents_and_both_modalities():
    for index in range(3):
        b = _batch(index)
        for row in range(2):
            assert b.document_ids[row].unique().numel() == 2
            assert set(b.modality_ids[row].unique().tolist()) <= {TEXT, IMAGE}
        assert (b.modality_ids == IMAGE).any() and (b.modality_ids == TEXT).any()
        assert (b.document_ids[:, 1:] >= b.document_ids[:, :-1]).all()


def test_flex_mask_mod_equals_the_rules_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    for modality, document in _cases():
        B, S = modality.shape
        made = create_mask(train_step.flex_mask_mod(modality, document, IMAGE), B, 1, S, S, device="cpu")
        assert torch.equal(made[:, 0], _reference_mask(modality, document))


def test_dense_mask_equals_the_rules_dense_mask():
    for modality, document in _cases():
        made = train_step.dense_mask(modality, document, IMAGE)
        assert made.shape == (modality.shape[0], 1, modality.shape[1], modality.shape[1]) and made.dtype == torch.bool
        assert torch.equal(made[:, 0], _reference_mask(modality, document))


def test_attention_pairs_count_the_mask():
    for modality, document in _cases():
        assert train_step.attention_pairs(modality, document, IMAGE) == int(_reference_mask(modality, document).sum())


def test_text_targets_predict_only_the_next_text_token_of_the_same_document():
    for index in range(3):
        b = _batch(index)
        tokens, targets, modality, document = b.tokens, b.targets, b.modality_ids, b.document_ids
        predicted = targets != train_step.IGNORE
        assert not predicted[:, -1].any()
        nxt = predicted[:, :-1]
        should = (modality[:, 1:] == TEXT) & (document[:, 1:] == document[:, :-1])
        assert torch.equal(nxt, should)
        assert torch.equal(targets[:, :-1][nxt], tokens[:, 1:][nxt])
        assert nxt.any() and (~nxt & (modality[:, 1:] == TEXT)).any()  # documents' first tokens are not predicted


def test_positions_restart_with_every_document_and_images_get_one_noise_level():
    b = _batch(0)
    for row in range(2):
        for doc in b.document_ids[row].unique():
            at = b.document_ids[row] == doc
            assert torch.equal(b.positions[row][at], torch.arange(int(at.sum())))
        segments = train_step.segment_ids(b.modality_ids, b.document_ids)[row]
        for seg in segments.unique():
            at = segments == seg
            alphas = b.alpha[row][at].unique()
            assert alphas.numel() == 1 and (0 < alphas).all() and (alphas <= 1).all()
            assert (alphas == 1).item() == (b.modality_ids[row][at][0] == TEXT).item()


def _backend(name: str, monkeypatch):
    backend = train_step.make_backend(name, RULES, TINY, torch.device("cpu"))
    if name == "omnigen":  # the op needs CUDA: the float64 reference computes what it would, from its mask
        def reference(q, k, v, mask):
            assert isinstance(mask, omnigen.Mask) and k.shape[1] == TINY.n_kv_heads < q.shape[1]
            return attention_reference(q, k, v, mask.layout, mask.rules)[0].to(q.dtype)

        monkeypatch.setattr(omnigen, "attention", reference)
    else:
        backend.prepare(compiled=False)
    return backend


def test_the_rotary_table_gives_the_angles_cos_and_sin_at_each_position():
    # The model looks RoPE's cos/sin up by position (one table per model) instead of computing them per step: the
    # same numbers as the formula, in float64, at positions that restart with every document.
    head_dim, theta = 16, 10000.0
    table = train_step.rotary_table(600, head_dim, theta)
    assert table.shape == (2, 600, head_dim // 2) and table.dtype == torch.float32
    positions = torch.tensor([[0, 1, 2, 599, 0, 3], [5, 6, 7, 8, 0, 1]])
    cos, sin = train_step.rotary(table, positions)
    assert cos.shape == sin.shape == (2, 1, 6, head_dim // 2)
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions[:, None, :, None].double() * inv_freq
    torch.testing.assert_close(cos.double(), angles.cos(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin.double(), angles.sin(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", train_step.MULTIMODAL)
def test_backends_attend_with_the_transfusion_mask(name, monkeypatch):
    batch = _batch(2)
    backend = _backend(name, monkeypatch)
    B, S = batch.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, TINY.n_heads, S, TINY.head_dim, generator=g)
    k, v = (torch.randn(B, TINY.n_kv_heads, S, TINY.head_dim, generator=g) for _ in range(2))
    expected = attention_reference(q, k, v, _reference_mask(batch.modality_ids, batch.document_ids))[0].float()
    out = backend.attend(q, k, v, backend.make_mask(batch))
    assert out.shape == q.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def _loss(name: str, batch, monkeypatch) -> float:
    """The tiny model's loss on `batch` (float32, no grad) with one backend's mask and attention."""
    backend = _backend(name, monkeypatch)
    torch.manual_seed(0)
    model = train_step.Transfusion(TINY, backend.attend)
    with torch.no_grad():
        loss, _, _ = model(batch.tokens, batch.patches, batch.noise, batch.alpha, batch.targets, batch.positions,
                           batch.modality == IMAGE, backend.make_mask(batch))
    return float(loss)


def test_backends_compute_the_same_model(monkeypatch):
    batch = _batch(1)
    dense = _loss("sdpa_dense", batch, monkeypatch)
    assert math.isfinite(dense)
    assert _loss("flex", batch, monkeypatch) == pytest.approx(dense, rel=1e-5)  # the forward runs on the CPU
    assert _loss("omnigen", batch, monkeypatch) == pytest.approx(dense, rel=1e-5)


def test_kernel_classes():
    classify = train_step.classify_kernel
    assert classify("omnigen", "void omnigen_rules_transfusion::forward_kernel<true>(TensorMaps)") == "attn_fwd"
    assert classify("omnigen", "void omnigen_rules_transfusion::hopper::hopper_dkdv_kernel<false>(...)") == "attn_bwd"
    assert classify("omnigen", "void omnigen_rules_transfusion::backward::delta_kernel(DeltaArgs)") == "attn_bwd"
    assert classify("omnigen", "void omnigen::convert_kernel<__nv_bfloat16, 128>(omnigen::ConvertArgs)") == "attn_bwd"
    assert classify("flex", "triton_tem_fused_flex_attention_0") == "attn_fwd"
    assert classify("flex", "triton_tem_fused_flex_attention_backward_zeros_1") == "attn_bwd"
    assert classify("flex", "triton_tem_fused_0") == "unclassified"
    assert classify("sdpa_dense", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(AttentionKernel<>)") == "attn_fwd"
    assert classify("sdpa_dense", "fmha_cutlassB_bf16_aligned_128x64_k128_sm80(AttentionBackwardKernel<>)") == "attn_bwd"
    assert classify("cudnn_causal", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3") == "attn_bwd"
    assert classify("cudnn_causal", "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128") == "unclassified"
    assert classify("omnigen", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "rest"
    assert classify("flex", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3") == "rest"
    kernels = [("x::forward_kernel(a)", 3000.0), ("gemm", 1000.0), ("x::dq_kernel", 500.0)]
    split = train_step.time_split("omnigen", kernels, 2)
    assert (split["attn_fwd_ms"], split["attn_bwd_ms"], split["rest_ms"], split["kernel_ms"]) == (1.5, 0.25, 0.5, 2.25)


def test_idle_gaps_counts_only_time_no_kernel_covers():
    # (start us, end us, name): b runs inside a's span, c overlaps a's end, then two gaps: 30 us and 500 us
    spans = [(0.0, 100.0, "a"), (10.0, 20.0, "b"), (90.0, 150.0, "c"), (180.0, 200.0, "d"), (700.0, 710.0, "e")]
    gaps = train_step.idle_gaps(list(reversed(spans)), steps=2)  # order of arrival does not matter
    assert gaps["idle_ms"] == 0.265  # (30 + 500) us over 2 steps
    assert [(g["us"], g["after"], g["before"]) for g in gaps["longest_gaps"]] == [(500.0, "d", "e"), (30.0, "c", "d")]
    assert train_step.idle_gaps([], steps=1) == {"idle_ms": 0.0, "longest_gaps": []}


def test_a_tiny_run_of_main_writes_every_figure(tmp_path, capsys):
    path = tmp_path / "train.json"
    result = train_step.main(["--config", "tiny", "--seq-lens", "256", "--tokens", "512", "--steps", "2", "--warmup",
                              "1", "--backends", *train_step.BACKENDS, "--no-compile", "--device", "cpu",
                              "--json", str(path)])
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"device_name", "torch", "date", "commit", "settings", "configs", "tokens"} <= set(written["info"])
    runs = {r["backend"]: r for r in written["runs"]}
    assert set(runs) == set(train_step.BACKENDS)
    dense = runs["sdpa_dense"]
    assert dense["status"] == "ok" and (dense["S"], dense["B"]) == (256, 2)
    assert {"tokens_per_s", "step_ms", "first_step_s", "final_loss", "losses", "text_losses", "image_losses",
            "timed_steps", "tflops"} <= set(dense)
    assert len(dense["losses"]) == 3 and all(math.isfinite(x) for x in dense["losses"])
    assert dense["final_loss"] == dense["losses"][-1] and dense["tokens_per_s"] > 0
    for name in ("omnigen", "cudnn_causal"):
        assert runs[name]["status"] == "skipped" and "CUDA" in runs[name]["reason"]
    assert runs["flex"]["status"] in ("ok", "skipped")  # torch 2.13 has no FlexAttention backward on the CPU
    out = capsys.readouterr().out
    assert "tokens/s" in out and "sdpa_dense" in out and "skipped" in out
    merged = train_step.main(["--from-json", str(path), str(path), "--png", str(tmp_path / "train.png")])
    assert len(merged["runs"]) == 2 * len(runs) and (tmp_path / "train.png").stat().st_size > 0


@pytest.mark.gpu
def test_a_tiny_gpu_run_trains_every_backend(tmp_path, monkeypatch):
    """Every backend on a GPU (eager model, d64 so omnigen's example kernels serve it): the same first loss from
    the same weights and data, and the profiler finds omnigen's forward and backward kernels."""
    monkeypatch.setitem(train_step.CONFIGS, "tiny", dataclasses.replace(TINY, head_dim=64))
    result = train_step.main(["--config", "tiny", "--seq-lens", "512", "--tokens", "1024", "--steps", "2", "--warmup",
                              "1", "--profile-steps", "1", "--no-compile", "--device", "cuda",
                              "--json", str(tmp_path / "gpu.json")])
    runs = {r["backend"]: r for r in result["runs"]}
    assert all(r["status"] == "ok" for r in runs.values()), [(r["backend"], r.get("error")) for r in runs.values()]
    first = runs["sdpa_dense"]["losses"][0]
    for name in ("omnigen", "flex"):
        assert runs[name]["losses"][0] == pytest.approx(first, rel=2e-2)
    assert runs["omnigen"]["attn_fwd_ms"] > 0 and runs["omnigen"]["attn_bwd_ms"] > 0
    assert runs["omnigen"]["peak_mib"] > 0 and runs["omnigen"]["vs_flex"] is not None


def test_smoothed_gap_tells_noise_from_a_drift():
    import random

    rng = random.Random(0)
    base = [10.0 * 0.99 ** i for i in range(200)]
    noisy_a = [x + rng.uniform(-0.3, 0.3) for x in base]
    noisy_b = [x + rng.uniform(-0.3, 0.3) for x in base]
    assert train_step.smoothed_gap(noisy_a, noisy_b)["within_noise"]
    drifted = [x + 0.5 + rng.uniform(-0.05, 0.05) for x in base]  # a real difference, larger than the jitter
    verdict = train_step.smoothed_gap(drifted, noisy_b)
    assert not verdict["within_noise"] and verdict["max_smoothed_gap"] > verdict["step_to_step_noise"]


def test_smoothed_gap_allows_the_references_own_run_to_run_drift():
    import random

    from omnigen.bench import smoothed_gap

    rng = random.Random(1)
    base = [10.0 * 0.99 ** i for i in range(200)]
    reference = [x + rng.uniform(-0.05, 0.05) for x in base]
    ours = [x + 0.5 + rng.uniform(-0.05, 0.05) for x in base]  # 0.5 away: past the jitter and 2% of the loss
    assert not smoothed_gap(ours, reference)["within_noise"]
    # a second reference run from the same seed that drifted as far: the difference is the backends' own noise
    drifted_reference = [x + 0.6 + rng.uniform(-0.05, 0.05) for x in base]
    verdict = smoothed_gap(ours, reference, ref_again=drifted_reference)
    assert verdict["within_noise"] and verdict["reference_spread"] > verdict["max_smoothed_gap"]
    # one that stayed with the first: no excuse
    steady_reference = [x + rng.uniform(-0.05, 0.05) for x in base]
    verdict = smoothed_gap(ours, reference, ref_again=steady_reference)
    assert not verdict["within_noise"] and verdict["reference_spread"] < verdict["max_smoothed_gap"]
