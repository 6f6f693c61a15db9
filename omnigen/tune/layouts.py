"""The layouts the tuner times on: a synthetic generator derived from the rules, or the user's own file.

Synthetic (per rules file, deterministic for a seed): each sequence alternates the rules' modalities
in their declared order with realistic lengths -- a causal modality (text-like) 16-512 tokens, a
full one (image-like) 256 or 1024 tokens -- inside one document, the Transfusion-style workload of
docs/measuring.md. Rules with a single modality describe document masking (several documents packed
in a sequence), so there each segment is its own document of 256-4096 tokens. Every sequence is
cut to exactly the bucket's length, and a batch holds tokens // S sequences (B*S about 32K tokens,
so every bucket costs about the same to time).

User layouts (`omnigen build --tune --layouts FILE`): one layout per line in the usual syntax
(`text:40 image:256 text:24@1`), `#` comments and blank lines ignored. They are grouped by
sequence bucket; inside a bucket shorter ones are padded at the end to the longest, and the list is
repeated to fill the token budget. A line that does not parse names the file, the line and what
was expected.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..layout import Layout
from ..rules import Rules
from .db import seq_bucket

DEFAULT_TOKENS = 32768
CAUSAL_LENGTHS = (16, 512)
FULL_LENGTHS = (256, 1024)
DOCUMENT_LENGTHS = (256, 4096)
LAYOUT_SYNTAX = "one layout per line, segments written modality:length[@document], e.g. 'text:40 image:256 text:24@1'"


class LayoutsFileError(ValueError):
    """A --layouts file that cannot be used; the message names the file and line."""


def synthetic_layout(rules: Rules, seq_len: int, rng: random.Random) -> Layout:
    """One sequence of exactly seq_len tokens for these rules (see the module docstring)."""
    modalities = rules.modalities
    segments: list[tuple[str, int, int]] = []
    used, index, document = 0, 0, 0
    while used < seq_len:
        modality = modalities[index % len(modalities)]
        if len(modalities) == 1:
            length = rng.randint(*DOCUMENT_LENGTHS)
        elif modality.causal:
            length = rng.randint(*CAUSAL_LENGTHS)
        else:
            length = rng.choice(FULL_LENGTHS)
        length = min(length, seq_len - used)
        segments.append((modality.name, length, document))
        used += length
        index += 1
        if len(modalities) == 1:
            document += 1
    return Layout.from_segments(segments)


def batch_size(seq_len: int, tokens: int = DEFAULT_TOKENS) -> int:
    return max(1, tokens // seq_len)


def synthetic_batch(rules: Rules, seq_len: int, tokens: int = DEFAULT_TOKENS, seed: int = 0) -> list[Layout]:
    """B = tokens // seq_len synthetic layouts of seq_len tokens each."""
    rng = random.Random(f"{rules.name}:{seq_len}:{seed}")
    return [synthetic_layout(rules, seq_len, rng) for _ in range(batch_size(seq_len, tokens))]


def read_layouts_file(path: str | Path, rules: Rules) -> list[Layout]:
    """The layouts of a --layouts file, checked against the rules (file:line in every error)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise LayoutsFileError(f"{path}: cannot read the layouts file ({exc.strerror or exc})") from None
    declared = set(rules.modality_names) | {"pad"}
    layouts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            layout = Layout.parse(line)
        except ValueError as exc:
            raise LayoutsFileError(f"{path}:{number}: {exc}. Expected {LAYOUT_SYNTAX}") from None
        unknown = sorted(layout.modalities - declared)
        if unknown:
            raise LayoutsFileError(
                f"{path}:{number}: modality {', '.join(repr(u) for u in unknown)} is not declared by the rules "
                f"'{rules.name}' (declared: {', '.join(rules.modality_names)}, and pad)"
            )
        layouts.append(layout)
    if not layouts:
        raise LayoutsFileError(f"{path}: no layouts found. Expected {LAYOUT_SYNTAX}")
    return layouts


def bucket_user_layouts(layouts: list[Layout], tokens: int = DEFAULT_TOKENS) -> dict[int, list[Layout]]:
    """Group layouts by sequence bucket: each group padded to its longest and repeated to B*S ~ tokens."""
    groups: dict[int, list[Layout]] = {}
    for layout in layouts:
        groups.setdefault(seq_bucket(layout.seq_len), []).append(layout)
    out: dict[int, list[Layout]] = {}
    for bucket, group in sorted(groups.items()):
        longest = max(layout.seq_len for layout in group)
        padded = [layout.pad_end(longest) for layout in group]
        out[bucket] = [padded[i % len(padded)] for i in range(batch_size(longest, tokens))]
    return out


__all__ = ["LayoutsFileError", "batch_size", "bucket_user_layouts", "read_layouts_file", "synthetic_batch",
           "synthetic_layout"]
