"""Rule sets shared by the forward and backward GPU tests, so both files use the same built modules."""

import torch

import omnigen

TRANSFUSION = omnigen.Rules(
    name="gpu_transfusion",
    modalities={"text": {"self": "causal"}, "image": {"self": "full"}},
    see={"default": "earlier"},
)
# Windows, a see override in each direction, shared documents: the other branches of the predicate.
MIXED = omnigen.Rules(
    name="gpu_mixed",
    modalities={"text": {"self": "causal", "window": 96}, "image": {"self": "full"}, "audio": {"self": "full", "window": 40}},
    see={"default": "earlier", "image -> image": "none", "text -> audio": "all"},
    documents="shared",
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
