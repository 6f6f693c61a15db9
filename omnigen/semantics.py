"""The mask's meaning as tensor arithmetic: tile kinds, rule encodings, the per-token predicate.

`tile_predicate` is the mask's definition (docs/semantics.md) evaluated on the per-token tables a
layout makes (segment, modality and document of every token): the same arithmetic the generated
kernels run on partial tiles, and what `Rules.dense_mask` fills an S x S picture with. Nothing here imports the rest of
omnigen: rules and layout tables arrive as arguments (anything with their attributes).

torch is imported by the functions that return tensors, not with the module: the command line's `show` and
`plan` read the constants, `rule_arrays` and `dense_mask_host` (numpy) and never pay torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

EMPTY, FULL, CAUSAL, PARTIAL = 0, 1, 2, 3
KIND_NAMES = {EMPTY: "empty", FULL: "full", CAUSAL: "causal", PARTIAL: "partial"}
# The schedules list each tile row's kv-tiles in this order of kinds (and by index inside a kind).
SCHEDULE_KINDS = (FULL, CAUSAL, PARTIAL)

# see policies as codes, for tensors
SEE_NONE, SEE_EARLIER, SEE_ALL = 0, 1, 2
SEE_CODES = {"none": SEE_NONE, "earlier": SEE_EARLIER, "all": SEE_ALL}


_RULE_ARRAYS: dict[Any, dict[str, np.ndarray]] = {}
_RULE_TENSORS: dict[tuple[Any, str], dict[str, torch.Tensor]] = {}


def rule_arrays(rules: Any) -> dict[str, np.ndarray]:
    """The rules as small numpy arrays indexed by modality id (pad = the last id): `see` int64 [M + 1, M + 1]
    (SEE_* codes), `causal` bool [M + 1], `window` int64 [M + 1]. Cached; read-only (shared by every caller)."""
    cached = _RULE_ARRAYS.get(rules)
    if cached is None:
        see = [[SEE_CODES[policy] for policy in row] + [SEE_NONE] for row in rules.see_matrix()]
        see.append([SEE_NONE] * (len(rules.modalities) + 1))
        cached = {
            "see": np.array(see, dtype=np.int64).reshape(len(see), len(see)),
            "causal": np.array([m.causal for m in rules.modalities] + [False], dtype=np.bool_),
            "window": np.array([m.window for m in rules.modalities] + [0], dtype=np.int64),
        }
        for array in cached.values():
            array.flags.writeable = False
        _RULE_ARRAYS[rules] = cached
    return cached


def rule_tensors(rules: Any, device: torch.device | str) -> dict[str, torch.Tensor]:
    """`rule_arrays` as tensors on `device`; cached per device."""
    key = (rules, str(device))
    cached = _RULE_TENSORS.get(key)
    if cached is None:
        import torch

        # torch.tensor copies: the tensors own writable memory, as they always did.
        cached = {name: torch.tensor(array, device=device) for name, array in rule_arrays(rules).items()}
        _RULE_TENSORS[key] = cached
    return cached


def tile_predicate(
    rules: Any, tables: Any, batch: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
    rule_t: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """allowed[q_pos x k_pos] for batch element `batch`, from the per-token tables only."""
    return pair_predicate(rules, tables, batch, q_pos[:, None], k_pos[None, :], rule_t)


def pair_predicate(
    rules: Any, tables: Any, batch: int | torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
    rule_t: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """allowed for every (batch, q_pos, k_pos) of the three broadcast together (any shapes). Positions at or past
    the sequence's end are allowed nothing (a key there does not exist; a query there is padding)."""
    import torch

    rule_t = rule_t or rule_tensors(rules, q_pos.device)
    S = tables.token_segment.shape[1]
    inside = (q_pos < S) & (k_pos < S)
    qp, kp = q_pos.clamp(max=S - 1), k_pos.clamp(max=S - 1)
    seg_q, seg_k = tables.token_segment[batch, qp].long(), tables.token_segment[batch, kp].long()
    mod_q, mod_k = tables.token_modality[batch, qp].long(), tables.token_modality[batch, kp].long()
    pad = rules.pad_id
    allowed = inside & (mod_q != pad) & (mod_k != pad)
    if rules.isolated_documents:
        allowed &= tables.token_doc[batch, qp] == tables.token_doc[batch, kp]
    see = rule_t["see"][mod_q, mod_k]
    own = torch.where(rule_t["causal"][mod_q], kp <= qp, torch.ones_like(allowed))
    other = torch.where(seg_k < seg_q, see >= SEE_EARLIER, see == SEE_ALL)
    allowed &= torch.where(seg_q == seg_k, own, other)
    window = rule_t["window"][mod_q]
    allowed &= (window == 0) | (qp - kp < window)
    return allowed


def dense_mask(rules: Any, layout: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """The whole mask, torch.bool [S, S] (or [B, S, S] for a batch). O(S^2): for tests and plots.

    `layout` is an omnigen.Layout or LayoutBatch (anything with `tables(rules, device)` and `batch_size`)."""
    import torch

    tables = layout.tables(rules, device)
    positions = torch.arange(tables.seq_len, device=tables.token_segment.device)
    rule_t = rule_tensors(rules, positions.device)
    masks = torch.stack([tile_predicate(rules, tables, b, positions, positions, rule_t) for b in range(tables.batch_size)])
    return masks[0] if hasattr(layout, "segments") else masks  # one Layout: [S, S]


def dense_mask_host(rules: Any, layout: Any) -> np.ndarray:
    """`dense_mask` as a numpy bool array [S, S] (or [B, S, S] for a batch), without torch: what the command
    line draws. The same definition as `pair_predicate`, term for term (tests/test_host_path.py compares
    the two); O(S^2), so only for small S.

    `layout` is an omnigen.Layout or LayoutBatch (anything with `host_tables(rules)` and `layouts`)."""
    tables = layout.host_tables(rules)
    rule = rule_arrays(rules)
    segment, modality, doc = tables.token_segment, tables.token_modality, tables.token_doc
    masks = np.empty((tables.batch_size, tables.seq_len, tables.seq_len), dtype=np.bool_)
    position = np.arange(tables.seq_len)
    q, k = position[:, None], position[None, :]
    for b in range(tables.batch_size):
        seg_q, seg_k = segment[b][:, None], segment[b][None, :]
        mod_q, mod_k = modality[b][:, None], modality[b][None, :]
        allowed = (mod_q != rules.pad_id) & (mod_k != rules.pad_id)
        if rules.isolated_documents:
            allowed &= doc[b][:, None] == doc[b][None, :]
        see = rule["see"][mod_q, mod_k]
        own = np.where(rule["causal"][mod_q], k <= q, True)
        other = np.where(seg_k < seg_q, see >= SEE_EARLIER, see == SEE_ALL)
        allowed &= np.where(seg_q == seg_k, own, other)
        window = rule["window"][mod_q]
        allowed &= (window == 0) | (q - k < window)
        masks[b] = allowed
    return masks[0] if hasattr(layout, "segments") else masks  # one Layout: [S, S]
