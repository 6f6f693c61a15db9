"""Hypothesis strategies: random rule sets and layouts that exercise every corner of the mask's definition
(docs/semantics.md)."""

from __future__ import annotations

from hypothesis import strategies as st

import omnigen

MODALITY_NAMES = ("text", "image", "audio")


@st.composite
def rules(draw, max_modalities: int = 3) -> omnigen.Rules:
    count = draw(st.integers(1, max_modalities))
    names = MODALITY_NAMES[:count]
    modalities = {}
    for name in names:
        window = draw(st.one_of(st.just(0), st.integers(1, 40)))
        modalities[name] = {"self": draw(st.sampled_from(("causal", "full"))), "window": window}
    see = {"default": draw(st.sampled_from(("earlier", "none", "all")))}
    for q in names:
        for k in names:
            if draw(st.booleans()):
                see[f"{q} -> {k}"] = draw(st.sampled_from(("earlier", "none", "all")))
    documents = draw(st.sampled_from(("isolated", "shared")))
    return omnigen.Rules(name="random", modalities=modalities, see=see, documents=documents)


@st.composite
def layouts(draw, rule_set: omnigen.Rules, max_segments: int = 8, max_length: int = 40) -> omnigen.Layout:
    names = list(rule_set.modality_names) + ["pad"]
    count = draw(st.integers(1, max_segments))
    doc = 0
    segments = []
    for _ in range(count):
        if draw(st.integers(0, 4)) == 0:
            doc += draw(st.integers(1, 2))
        # short segments are common on purpose: 1-token segments and boundaries inside tiles
        length = draw(st.one_of(st.integers(1, 3), st.integers(1, max_length)))
        modality = draw(st.sampled_from(names)) if draw(st.integers(0, 5)) else "pad"
        segments.append((modality, length, doc))
    return omnigen.Layout.from_segments(segments)


block_sizes = st.sampled_from((16, 32, 48, 64))
