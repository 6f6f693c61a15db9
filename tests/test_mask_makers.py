"""Masks no rule says (issue 29): mask_from_dense, mask_from_mod, mask_from_intervals (omnigen.plan.ruleless).

Tile kinds exact against the dense definition (hypothesis, random block structure), the mask rebuilt from the
schedules and bits of both passes equal to the input, the three inputs giving identical schedules and bits for the
same mask, the bits equal to what the rules-based maker computes for masks rules can say, capacities, errors."""

import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen.plan import bits as rule_bits
from omnigen.plan.masks import PER_SHAPE
from omnigen.plan.ruleless import RULELESS_RULES, is_ruleless
from omnigen.mask_catalogue import NAMES, catalogue_mask
from omnigen.plan.tile_bits import pack, unpack
from omnigen.reference import attention_reference, attention_reference_grads, tile_kinds_from_mask
from omnigen.semantics import CAUSAL, FULL, PARTIAL

TILES = [(16, 16), (32, 48), (64, 32)]


def _tensors(mask, block_m, block_n):
    """The eight schedule tensors of one tile shape."""
    shapes = list(mask.tiles)
    index = shapes.index((block_m, block_n))
    return mask.schedules[PER_SHAPE * index : PER_SHAPE * (index + 1)]


def _rebuilt(mask, block_m, block_n, transposed=False):
    """The dense [B, S, S] mask a kernel sees walking one schedule: full tiles all, causal tiles k <= q, partial tiles
    their bits (every partial entry must have a slot below the capacity), nothing else."""
    fwd_ptr, fwd_kv, bwd_ptr, bwd_q, slot, words, slot_bwd, words_bwd = _tensors(mask, block_m, block_n)
    ptr, index = (bwd_ptr, bwd_q) if transposed else (fwd_ptr, fwd_kv)
    starts, words = (slot_bwd, words_bwd) if transposed else (slot, words)
    B, S = mask.batch_size, mask.seq_len
    nq, nk = -(-S // block_m), -(-S // block_n)
    per_row = nk if transposed else nq
    tiles = unpack(words, block_m, block_n, transposed)
    out = torch.zeros(B, nq * block_m, nk * block_n, dtype=torch.bool)
    positions_q = torch.arange(nq * block_m)
    positions_k = torch.arange(nk * block_n)
    for row in range(B * per_row):
        b, r = divmod(row, per_row)
        bounds = ptr[3 * row : 3 * row + 4].tolist()
        for group, kind in enumerate((FULL, CAUSAL, PARTIAL)):
            for n, other in enumerate(index[bounds[group] : bounds[group + 1]].tolist()):
                i, j = (other, r) if transposed else (r, other)
                qs, ks = slice(i * block_m, (i + 1) * block_m), slice(j * block_n, (j + 1) * block_n)
                if kind == FULL:
                    out[b, qs, ks] = True
                elif kind == CAUSAL:
                    out[b, qs, ks] = positions_k[None, ks] <= positions_q[qs, None]
                else:
                    s = int(starts[row]) + n
                    assert s < tiles.shape[0], "a partial tile without bits"
                    out[b, qs, ks] = tiles[s]
    return out[:, :S, :S]


def _check_mask(made, dense):
    """Kinds exact, pairs exact, and both schedules with their bits give back the dense mask."""
    dense = dense if dense.dim() == 3 else dense[None]
    assert made.ruleless and is_ruleless(made.rules) and made.rules_key == RULELESS_RULES.key
    for block_m, block_n in made.tiles:
        plan = made.plan(block_m, block_n)
        kinds = plan.kinds if plan.kinds.dim() == 3 else plan.kinds[None]
        for b in range(dense.shape[0]):
            assert torch.equal(kinds[b], tile_kinds_from_mask(dense[b], block_m, block_n)), (b, block_m, block_n)
        assert plan.allowed_pairs == int(dense.sum())
        for transposed in (False, True):
            assert torch.equal(_rebuilt(made, block_m, block_n, transposed), dense), (block_m, block_n, transposed)
    # the tables are all pad: a path that evaluated the rules instead of the bits would allow nothing
    assert bool((made.token_modality == RULELESS_RULES.pad_id).all())


def _same(a, b):
    assert a.tiles == b.tiles
    for x, y in zip(a.schedules, b.schedules):
        assert torch.equal(x, y)
    for shape in a.tiles:
        assert a.plan(*shape).allowed_pairs == b.plan(*shape).allowed_pairs


# ---- random masks of random block structure --------------------------------------------------------------------


@st.composite
def block_masks(draw):
    """[B, S, S] masks cut into random blocks (edges anywhere, not on tiles), each all, none, causal or random."""
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 160))
    out = torch.zeros(B, S, S, dtype=torch.bool)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    for b in range(B):
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, S - 1)), max_size=5))) | {0, S})
        for qa, qb in zip(cuts, cuts[1:]):
            for ka, kb in zip(cuts, cuts[1:]):
                kind = draw(st.sampled_from(["all", "none", "none", "causal", "random"]))
                q = torch.arange(qa, qb)[:, None]
                k = torch.arange(ka, kb)[None, :]
                if kind == "all":
                    out[b, qa:qb, ka:kb] = True
                elif kind == "causal":
                    out[b, qa:qb, ka:kb] = k <= q
                elif kind == "random":
                    out[b, qa:qb, ka:kb] = torch.rand(qb - qa, kb - ka, generator=gen) < 0.5
    return out


@settings(max_examples=40, deadline=None)
@given(block_masks(), st.sampled_from([16, 32, 64]), st.sampled_from([16, 32, 48, 64]))
def test_dense_kinds_and_bits_are_exact(dense, block_m, block_n):
    made = omnigen.mask_from_dense(dense, tiles=[(block_m, block_n)])
    _check_mask(made, dense)


@settings(max_examples=25, deadline=None)
@given(block_masks(), st.sampled_from([(16, 32), (32, 16)]))
def test_mod_of_a_dense_mask_plans_the_same(dense, tile):
    B, S = dense.shape[0], dense.shape[-1]
    from_mod = omnigen.mask_from_mod(lambda b, h, q, k: dense[b, q, k], B, S, device="cpu", tiles=[tile])
    _same(from_mod, omnigen.mask_from_dense(dense, tiles=[tile]))


@st.composite
def intervals(draw):
    """FlashMask vectors [B, S]: random intervals (some empty), causal mode or both intervals."""
    B, S = draw(st.integers(1, 2)), draw(st.integers(1, 150))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))

    def pair():
        a, b = torch.randint(0, S + 1, (B, S), generator=gen), torch.randint(0, S + 1, (B, S), generator=gen)
        if draw(st.booleans()):  # runs of equal values, as real masks have (documents, windows)
            a, b = a[:, :1].expand(B, S).clone(), b[:, :1].expand(B, S).clone()
        return torch.minimum(a, b), torch.maximum(a, b)

    lts, lte = pair()
    uts, ute = pair() if draw(st.booleans()) else (None, None)
    return lts, lte, uts, ute


def _intervals_dense(lts, lte, uts=None, ute=None):
    S = lts.shape[-1]
    q, j = torch.arange(S)[None, :, None], torch.arange(S)[None, None, :]
    hidden = (lts[:, None, :] <= q) & (q < lte[:, None, :])
    hidden |= (q < j) if uts is None else (uts[:, None, :] <= q) & (q < ute[:, None, :])
    return ~hidden


@settings(max_examples=40, deadline=None)
@given(intervals(), st.sampled_from([(16, 16), (32, 48), (64, 32)]))
def test_intervals_are_exact(vectors, tile):
    dense = _intervals_dense(*vectors)
    made = omnigen.mask_from_intervals(*vectors, tiles=[tile])
    _check_mask(made, dense)
    _same(made, omnigen.mask_from_dense(dense, tiles=[tile]))


# ---- the acceptance catalogue (omnigen.mask_catalogue): three inputs, one plan, one output -------------------

S_CATALOGUE = 200


def _inputs(made, **kwargs):
    """source -> the catalogue mask made from it (intervals only where FlashMask can say the mask)."""
    sources = ("dense", "mod", "intervals") if made.intervals is not None else ("dense", "mod")
    return {source: made.mask(source, **kwargs) for source in sources}


@pytest.mark.parametrize("name", NAMES)
def test_three_inputs_give_one_mask(name):
    made = catalogue_mask(name, 2, S_CATALOGUE, seed=3)
    dense = made.dense()
    if made.intervals is not None:  # the catalogue's vectors say the same mask as its mod
        assert torch.equal(_intervals_dense(*made.intervals), dense)
    masks = _inputs(made, tiles=TILES)
    _check_mask(masks["dense"], dense)
    for mask in masks.values():
        _same(mask, masks["dense"])
    assert masks["dense"].plan(32, 48).counts()["partial"] > 0
    assert made.intervals is not None or name == "medusa_tree"  # only the breadth-first tree lacks intervals


def test_catalogue_is_reproducible_and_scales():
    a, b = catalogue_mask("causal_documents", 2, 300, seed=1), catalogue_mask("causal_documents", 2, 300, seed=1)
    assert torch.equal(a.dense(), b.dense())
    assert not torch.equal(a.dense(), catalogue_mask("causal_documents", 2, 300, seed=2).dense())
    assert not torch.equal(a.dense()[0], a.dense()[1])  # batch elements differ where the mask is random
    with pytest.raises(ValueError, match="no catalogue mask named 'medusa'.*medusa_tree"):
        catalogue_mask("medusa", 1, 64)
    with pytest.raises(ValueError, match="no FlashMask intervals"):
        catalogue_mask("medusa_tree", 1, 64).mask("intervals")


def _qkv(B, Hq, Hkv, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("name", NAMES)
def test_cpu_attention_of_the_catalogue_matches_the_float64_reference(name):
    """Forward and backward through the CPU path (partial tiles from the mask's bits) against float64 on the dense
    mask, for every input the mask has; the inputs give identical outputs; rows with no key give zeros."""
    B, Hq, Hkv, S, D = 2, 4, 2, 160, 16
    made = catalogue_mask(name, B, S, seed=5)
    dense = made.dense()
    q, k, v, d_out = _qkv(B, Hq, Hkv, S, D, seed=7)
    want, want_lse = attention_reference(q.detach(), k.detach(), v.detach(), dense)
    want_grads = attention_reference_grads(q, k, v, dense, d_out)
    results = {}
    for source, mask in _inputs(made, tiles=[(32, 48), (16, 32)]).items():
        out, lse = omnigen.attention(q, k, v, mask, return_lse=True)
        results[source] = (out, lse, *torch.autograd.grad(out, (q, k, v), d_out))
    out, lse, *grads = results["dense"]
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-5, rtol=1e-6)  # lse is float32
    for label, got, expected in zip("qkv", grads, want_grads):
        # the backward reads the float32 lse: float32-sized errors
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{label}: {m}")
    empty = ~dense.any(-1)  # [B, S]
    assert bool(empty.any()) == (name in ("qk_sparse", "packed_alpaca"))
    rows = empty[:, None].expand(B, Hq, S)
    assert not out[rows].any() and torch.isneginf(lse[rows]).all() and not grads[0][rows].any()
    for source, other in results.items():
        for x, y in zip(other, results["dense"]):
            assert torch.equal(x, y), source


def test_cpu_attention_walks_the_partial_tiles_bits_not_the_rules(monkeypatch):
    """A mask made from data masks its partial tiles from bits: corrupting one slot's bits changes the output
    exactly on that tile's rows (the rules' tables are all pad, so any other source would give zero rows)."""
    from omnigen.op import cpu

    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 1)  # one kv-tile per span: slots are looked up tile by tile
    pos = torch.arange(96)
    dense = (pos[:, None] >= pos[None, :]) & ((pos[None, :] % 7 != 3) | (pos[:, None] < 40))
    mask = omnigen.mask_from_dense(dense, tiles=[(32, 32)])
    q, k, v, _ = _qkv(1, 2, 2, 96, 16, seed=1)
    want, _ = attention_reference(q.detach(), k.detach(), v.detach(), dense)
    out = omnigen.attention(q, k, v, mask)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    words = mask.schedules[5]
    words[: rule_bits.slot_words(32, 32)] = -1  # slot 0: the first partial tile of the forward schedule
    changed = (omnigen.attention(q, k, v, mask) - out).abs().amax((0, 1, 3)) > 0
    plan = mask.plan(32, 32)
    first_row = next(i for i in range(3) if plan.forward_tiles(i)["partial"])
    assert changed[first_row * 32 : (first_row + 1) * 32].any() and not changed[: first_row * 32].any()
    assert not changed[(first_row + 1) * 32 :].any()


def test_rules_entry_points_refuse_a_mask_made_from_data():
    """Planning a mask made from data with rules would read its all-pad stand-in layout: refused, naming the fix."""
    from omnigen.plan import summarize

    mask = catalogue_mask("causal_documents", 1, 64).mask("dense", tiles=[(32, 32)])
    rules = omnigen.Rules.from_yaml("name: cd\nmodalities: {text: {self: causal}}")
    for call in (lambda: omnigen.plan(rules, mask), lambda: omnigen.mask(rules, mask, device="cpu"),
                 lambda: summarize(rules, mask)):
        with pytest.raises(ValueError, match=r"made from data .* mask\.plan\(block_m, block_n\)"):
            call()
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match="differ from the mask's"):
        omnigen.attention(q, q, q, mask, rules)


@pytest.mark.parametrize("rules_text,segments", [
    ("name: cd\nmodalities: {text: {self: causal}}", [("text", 37, 0), ("text", 64, 1), ("text", 50, 2), ("text", 49, 3)]),
    ("name: plm\nmodalities: {prefix: {self: full}, text: {self: causal}}",
     [("prefix", 20, 0), ("text", 50, 0), ("prefix", 20, 1), ("text", 60, 1), ("prefix", 20, 2), ("text", 30, 2)]),
])
def test_bits_equal_the_rules_bits(rules_text, segments):
    """For a mask rules can say, the schedules equal the rules planner's and the bits equal plan.bits' (the layout
    the Hopper kernels read), for both schedules."""
    rules = omnigen.Rules.from_yaml(rules_text)
    layout = omnigen.Layout.from_segments(segments)
    dense = rules.dense_mask(layout)
    made = omnigen.mask_from_dense(dense, tiles=TILES)
    for block_m, block_n in TILES:
        p = omnigen.plan(rules, layout, block_m, block_n)
        fwd_ptr, fwd_kv, bwd_ptr, bwd_q, *slots = _tensors(made, block_m, block_n)
        for mine, theirs in zip((fwd_ptr, fwd_kv, bwd_ptr, bwd_q), (p.fwd_ptr, p.fwd_kv, p.bwd_ptr, p.bwd_q)):
            # the mask keeps fwd_kv / bwd_q in buffers of one entry per tile (fixed sizes), zeros past the plan
            assert torch.equal(mine[: theirs.numel()], theirs) and not mine[theirs.numel():].any()
        partial = p.counts()["partial"]
        for transposed, (starts, words) in ((False, slots[:2]), (True, slots[2:])):
            ptr, index = (p.bwd_ptr, p.bwd_q) if transposed else (p.fwd_ptr, p.fwd_kv)
            want = rule_bits.partial_bits_reference(rules, p.tables, ptr, index, block_m, block_n, partial, transposed)
            assert torch.equal(starts, want[0]) and torch.equal(words, want[1])


def test_pack_unpack_round_trip():
    gen = torch.Generator().manual_seed(3)
    for block_m, block_n in ((16, 16), (64, 176), (128, 128), (32, 256)):
        tiles = torch.rand(5, block_m, block_n, generator=gen) < 0.5
        for transposed in (False, True):
            words = pack(tiles, transposed)
            assert words.numel() == 5 * rule_bits.slot_words(block_m, block_n, transposed)
            assert torch.equal(unpack(words, block_m, block_n, transposed), tiles)


# ---- capacities, batches ---------------------------------------------------------------------------------------


def test_fixed_capacity_keeps_shapes_and_copies():
    S = 130
    pos = torch.arange(S)
    causal = pos[:, None] >= pos[None, :]
    a = omnigen.mask_from_dense(causal & (pos[:, None] - pos[None, :] < 40), tiles=[(32, 32)], partial_bits=64)
    b = omnigen.mask_from_dense(causal, tiles=[(32, 32)], partial_bits=64)
    assert a.fixed and [t.shape for t in a.schedules] == [t.shape for t in b.schedules]
    a.copy_(b)
    _check_mask(a, causal)
    exact = omnigen.mask_from_dense(causal, tiles=[(32, 32)])
    assert exact.schedules[5].numel() == exact.plan(32, 32).counts()["partial"] * rule_bits.slot_words(32, 32)
    with pytest.raises(ValueError, match="partial_bits >= "):
        omnigen.mask_from_dense(causal & (pos[:, None] % 3 == 0), tiles=[(32, 32)], partial_bits=2)
    for bad in ("auto", "none", -1, 1.5):
        with pytest.raises(ValueError, match="partial_bits"):
            omnigen.mask_from_dense(causal, tiles=[(32, 32)], partial_bits=bad)


def test_square_mask_repeated_over_a_batch():
    pos = torch.arange(70)
    dense = (pos[:, None] >= pos[None, :]) & (pos[None, :] % 5 != 1)
    made = omnigen.mask_from_dense(dense, batch=3, tiles=[(16, 32)])
    assert made.batch_size == 3
    _check_mask(made, dense[None].expand(3, -1, -1))


def test_default_tiles_are_the_kernels():
    pos = torch.arange(64)
    made = omnigen.mask_from_dense(pos[:, None] >= pos[None, :], head_dim=128, dtype=torch.bfloat16)
    from omnigen.op import candidate_tile_shapes

    assert list(made.tiles) == candidate_tile_shapes(RULELESS_RULES, 64, torch.device("cpu"), 128, torch.bfloat16)


# ---- errors ----------------------------------------------------------------------------------------------------


def _raises(match, fn, *args, problems=1, **kwargs):
    """The call raises one InputError holding `problems` messages, one of which matches."""
    with pytest.raises(omnigen.InputError, match=match) as info:
        fn(*args, **kwargs)
    assert len(info.value.problems) == problems, info.value.problems
    return info.value


def test_dense_errors():
    _raises("must be torch.bool", omnigen.mask_from_dense, torch.zeros(8, 8))
    _raises("2 or 3 dimensions", omnigen.mask_from_dense, torch.zeros(1, 1, 8, 8, dtype=torch.bool))
    _raises("square", omnigen.mask_from_dense, torch.zeros(8, 9, dtype=torch.bool))
    _raises("torch.from_numpy", omnigen.mask_from_dense, __import__("numpy").ones((4, 4), dtype=bool))
    _raises("batch=2, but", omnigen.mask_from_dense, torch.ones(3, 8, 8, dtype=torch.bool), batch=2)
    with pytest.raises(ValueError, match="multiple of 16"):
        omnigen.mask_from_dense(torch.ones(8, 8, dtype=torch.bool), tiles=[(10, 16)])


def test_mod_errors():
    def branchy(b, h, q, k):
        return True if q >= k else False  # Python control flow on a tensor

    error = _raises("mask_mod failed on index tensors.*torch.where", omnigen.mask_from_mod, branchy, 1, 40, "cpu")
    assert len(error.problems) == 1
    _raises("depends on the head h", omnigen.mask_from_mod, lambda b, h, q, k: (q >= k) & (h == 0), 1, 40, "cpu")
    _raises("must return a bool tensor", omnigen.mask_from_mod, lambda b, h, q, k: q - k, 1, 40, "cpu")
    _raises("kv_len=50.*square", omnigen.mask_from_mod, lambda b, h, q, k: q >= k, 1, 40, "cpu", kv_len=50)
    _raises("B must be a positive integer", omnigen.mask_from_mod, lambda b, h, q, k: q >= k, 0, 40, "cpu")
    _raises("must be a function", omnigen.mask_from_mod, "causal", 1, 40, "cpu")
    # a mod of another signature is named with its own parameters, before anything calls it
    _raises(r"four positional arguments \(b, h, q_idx, kv_idx\).*<lambda>\(q, k\)", omnigen.mask_from_mod,
            lambda q, k: q >= k, 1, 40, "cpu")
    star = omnigen.mask_from_mod(lambda *idx: idx[2] >= idx[3], 1, 40, "cpu", tiles=[(16, 16)])  # *args binds
    assert star.allowed_pairs == 40 * 41 // 2
    _raises("returned shape", omnigen.mask_from_mod, lambda b, h, q, k: (q >= k)[..., :1, :1].expand(2, 3, 5),
            1, 40, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cpu'"):
            omnigen.mask_from_mod(lambda b, h, q, k: q >= k, 1, 40)  # the default is "cuda"
    full = omnigen.mask_from_mod(lambda b, h, q, k: True, 2, 40, "cpu", tiles=[(16, 16)])
    assert full.plan(16, 16).counts()["partial"] == 0 and full.allowed_pairs == 2 * 40 * 40


def test_compiled_mod_gives_the_eager_mask_and_falls_back_with_a_warning(monkeypatch):
    """compile_mod=True sends the slabs and the head sample through torch.compile; on the CPU here with Dynamo's eager
    backend (the GPU tests run Inductor's kernels). A mod that fails to compile is evaluated eagerly, with a warning,
    and gives the same mask."""
    from omnigen.plan import from_mod

    compiled_calls = []
    real_compile = torch.compile

    compiled_kinds = []

    def counting_compile(fn, **kwargs):
        compiled_kinds.append(kwargs)
        inner = real_compile(fn, backend="eager")

        def call(mod, *index):
            compiled_calls.append(tuple(torch.broadcast_shapes(*(a.shape for a in index))))
            return inner(mod, *index)
        return call

    monkeypatch.setattr(from_mod, "_COMPILED", {})  # evaluators made with this test's compile stay with it
    monkeypatch.setattr(from_mod, "_NOT_COMPILED", set())
    monkeypatch.setattr(torch, "compile", counting_compile)
    for name in ("causal_documents", "medusa_tree", "random_eviction"):
        made = catalogue_mask(name, 2, 300, seed=5)
        eager = omnigen.mask_from_mod(made.mask_mod, 2, 300, "cpu", tiles=TILES, compile_mod=False)
        assert not compiled_calls
        compiled = omnigen.mask_from_mod(made.mask_mod, 2, 300, "cpu", tiles=TILES, compile_mod=True)
        assert any(shape[-1] == 300 for shape in compiled_calls)  # slabs: every key
        # the head sample, once for each of two heads, at one shape whatever S
        assert compiled_calls.count((2, from_mod.HEAD_SAMPLE, from_mod.HEAD_SAMPLE)) == 2
        compiled_calls.clear()
        _same(compiled, eager)
    # one evaluator per mod code and shape of the index tensors: closures remade per call share them
    evaluators = dict(from_mod._COMPILED)
    assert {code for code, _ in evaluators} == {catalogue_mask(name, 2, 300).mask_mod.__code__
                                                for name in ("causal_documents", "medusa_tree", "random_eviction")}
    assert all(shapes[1][1] >= 1 and shapes[2][-1] <= 300 for _, shapes in evaluators)  # (b, q, kv) shapes
    omnigen.mask_from_mod(catalogue_mask("medusa_tree", 2, 300, seed=6).mask_mod, 2, 300, "cpu", tiles=TILES,
                          compile_mod=True)
    assert from_mod._COMPILED == evaluators
    # static kernels (a dynamic one divides by run-time sizes per element), until one code has STATIC_SHAPES of them;
    # then one dynamic copy takes every further shape (S changing from step to step)
    assert compiled_kinds == [{"dynamic": False}] * len(evaluators)
    monkeypatch.setattr(from_mod, "STATIC_SHAPES", 2)
    compiled_kinds.clear()
    for S in (40, 56, 72, 88, 104):
        made = catalogue_mask("qk_sparse", 1, S, seed=1)
        _same(omnigen.mask_from_mod(made.mask_mod, 1, S, "cpu", tiles=TILES, compile_mod=True),
              omnigen.mask_from_mod(made.mask_mod, 1, S, "cpu", tiles=TILES, compile_mod=False))
    assert compiled_kinds == [{"dynamic": False}] * 2 + [{"dynamic": True}]
    qk_code = catalogue_mask("qk_sparse", 1, 40).mask_mod.__code__
    assert sorted(shapes is None for code, shapes in from_mod._COMPILED if code == qk_code) == [False, False, True]

    # compiled, the head sample still finds a mod that depends on h (and below HEAD_SAMPLE tokens)
    for S in (40, 300):
        _raises("depends on the head h", omnigen.mask_from_mod, lambda b, h, q, k: (q >= k) & (h == 0), 2, S, "cpu",
                tiles=TILES, compile_mod=True)

    attempts = []

    def failing_compile(fn, **kwargs):
        def call(*args):
            attempts.append(1)
            raise RuntimeError("backend said no\nsecond line")
        return call

    monkeypatch.setattr(torch, "compile", failing_compile)
    made = catalogue_mask("share_question", 2, 300, seed=5)
    with pytest.warns(UserWarning, match="could not be compiled \\(RuntimeError: backend said no\\); evaluating it eagerly"):
        fallen_back = omnigen.mask_from_mod(made.mask_mod, 2, 300, "cpu", tiles=TILES, compile_mod=True)
    _same(fallen_back, omnigen.mask_from_mod(made.mask_mod, 2, 300, "cpu", tiles=TILES))
    again = omnigen.mask_from_mod(made.mask_mod, 2, 300, "cpu", tiles=TILES, compile_mod=True)  # eager, no new try
    assert len(attempts) == 1
    _same(again, fallen_back)
    # a mod that cannot work on tensors gets the eager call's message, and no word of compiling
    monkeypatch.setattr(torch, "compile", counting_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        error = _raises("mask_mod failed on index tensors", omnigen.mask_from_mod,
                        lambda b, h, q, k: True if q >= k else False, 1, 40, "cpu", compile_mod=True)
    assert len(error.problems) == 1
    _raises("compile_mod must be True, False or None", omnigen.mask_from_mod, lambda b, h, q, k: q >= k, 1, 40,
            "cpu", compile_mod="yes")


def test_interval_errors():
    S = 10
    lts, lte = torch.full((1, S), 5), torch.full((1, S), S)
    _raises("in \\[0, S\\] = \\[0, 10\\]", omnigen.mask_from_intervals, lts, lte + 1)
    _raises("lts must be <= lte", omnigen.mask_from_intervals, lte, lts)
    _raises("uts is given without ute", omnigen.mask_from_intervals, lts, lte, uts=lts)
    _raises("integer row indices", omnigen.mask_from_intervals, lts.float(), lte)
    _raises("one shape", omnigen.mask_from_intervals, lts, lte[:, :5])
    _raises("\\[B, S\\]", omnigen.mask_from_intervals, lts[None, None], lte[None, None], problems=2)  # both vectors
    _raises("must be an integer torch.Tensor.*torch.as_tensor\\(lte\\)", omnigen.mask_from_intervals, lts,
            lte[0].tolist())
    _raises("integer row indices.*lts.long", omnigen.mask_from_intervals, lts.bool(), lte)
    _raises("lts is empty", omnigen.mask_from_intervals, lts[:, :0], lte[:, :0], problems=2)
    _raises("2 problems", omnigen.mask_from_intervals, lts, lte, uts=lts.float(), problems=2)


@pytest.mark.parametrize("source,fix", [
    ("mod", r"omnigen\.mask_from_mod\(mask_mod, {B}, {S}\)"),
    ("dense", r"omnigen\.mask_from_dense\(mask\) with a bool mask of shape \[{B}, {S}, {S}\] \(or \[{S}, {S}\] "
              r"with batch={B}\)"),
    ("intervals", r"omnigen\.mask_from_intervals\(lts, lte\[, uts, ute\]\) with vectors of shape \[{B}, {S}\]"),
])
def test_a_mask_from_data_of_another_size_names_its_maker_and_the_fix(source, fix):
    """q/k/v of another batch or length than a mask made from data: the message says what the mask was made for and
    how to make it again with that maker -- not the layouts' 'layout has N tokens' / omnigen.mask(..., batch=B)."""
    mask = catalogue_mask("causal_documents", 1, 64).mask(source, tiles=[(32, 32)])
    for B, S in ((2, 64), (1, 48), (3, 80)):
        q = torch.randn(B, 2, S, 16)
        with pytest.raises(ValueError) as info:
            omnigen.attention(q, q, q, mask)
        message = str(info.value)
        assert f"made by omnigen.mask_from_{source} for B=1, S=64" in message and f"have B={B}, S={S}" in message
        assert re.search(fix.format(B=B, S=S), message), message
        assert "layout has" not in message and "omnigen.mask(" not in message
    q = torch.randn(1, 2, 64, 16)
    assert omnigen.attention(q, q, q, mask).shape == q.shape  # the size it was made for passes


def test_a_mask_from_data_of_unknown_maker_names_all_three():
    """A mask from data whose maker is not recorded (e.g. made by omnigen.plan.ruleless directly): the three makers."""
    mask = omnigen.mask_from_dense(torch.ones(64, 64, dtype=torch.bool).tril(), tiles=[(32, 32)])
    mask.made_by = None
    q = torch.randn(2, 2, 64, 16)
    with pytest.raises(ValueError, match=r"made from data for B=1, S=64 .*mask_from_mod\(mask_mod, 2, 64\) or "
                                         r".*mask_from_dense.* or .*mask_from_intervals"):
        omnigen.attention(q, q, q, mask)


def test_the_slab_budget_changes_the_time_not_the_mask():
    """scripts/bench_mask_making.py --slab-elements: each budget makes the bit-identical mask (fewer, larger slabs
    are only fewer calls), and the makers' budgets are restored afterwards."""
    from script_modules import load_script

    from omnigen.plan import from_mod, ruleless

    bench = load_script("bench_mask_making")
    before = (ruleless.SLAB_ELEMENTS, from_mod.CPU_EVAL_ELEMENTS)
    made = catalogue_mask("random_eviction", 2, 700, seed=3)
    make = lambda: omnigen.mask_from_mod(made.mask_mod, 2, 700, "cpu", tiles=TILES)  # noqa: E731
    times, same = bench.by_slab_budget(make, torch.device("cpu"), runs=1, budgets=[16, 18, 22], rounds=1)
    assert same and set(times) == {"2^16", "2^18", "2^22"} and all(t > 0 for t in times.values())
    assert (ruleless.SLAB_ELEMENTS, from_mod.CPU_EVAL_ELEMENTS) == before
    # a planted difference is caught: the digest tells two masks apart
    other = omnigen.mask_from_mod(catalogue_mask("random_eviction", 2, 700, seed=4).mask_mod, 2, 700, "cpu", tiles=TILES)
    assert bench.digest(other) != bench.digest(make())
