"""Which kernel family builds which architecture: the one line a new family adds is here."""

from __future__ import annotations

from dataclasses import replace

from ..targets import ARCH_TABLE, KernelConfig
from .family import KernelFamily
from .sm80 import FAMILY as SM80
from .sm90 import FAMILY as SM90

FAMILIES: dict[str, KernelFamily] = {family.name: family for family in (SM80, SM90)}


def family_of(config: KernelConfig | str) -> KernelFamily:
    """The family that builds a variant (or, for an arch name, the arch's own family)."""
    arch = config if isinstance(config, str) else config.arch
    if arch not in ARCH_TABLE:
        raise ValueError(f"arch must be one of {', '.join(ARCH_TABLE)}, not {arch!r}")
    named = "" if isinstance(config, str) else config.kernel_family
    return FAMILIES[named or ARCH_TABLE[arch].family]


def problems(config: KernelConfig) -> list[str]:
    """Why this variant cannot be built (empty when it can): its names first, then its family's limits."""
    return config.identity_problems() or family_of(config).problems(config)


def backward_problems(config: KernelConfig) -> list[str]:
    return config.identity_problems() or family_of(config).backward_problems(config)


def check(config: KernelConfig) -> None:
    """Raise ValueError naming every problem of a variant that cannot be built."""
    found = problems(config)
    if found:
        raise ValueError(f"kernel variant {config.label} cannot be built: " + "; ".join(found))


def default_tile(arch: str, head_dim: int, dtype: str = "bf16"):
    return family_of(arch).default_tile(head_dim, dtype)


def default_backward(config: KernelConfig) -> KernelConfig:
    """The variant an untuned kernel whose forward is `config` runs its backward with: its family's choice, else
    the default variant of another family that builds for the arch (sm_90a: sm80's, a module of its own) where that
    one has a backward; else `config` itself (which then has none)."""
    if config.forward_only:  # its module has no backward: the full variant's choice, where there is a full variant
        chosen = default_backward(replace(config, forward_only=False))
        return config if problems(chosen) else chosen  # (FP8 variants exist forward-only alone)
    family = family_of(config)
    chosen = family.default_backward(config)
    if chosen is not None:
        return chosen
    arch = ARCH_TABLE[config.arch]
    for name in (arch.family, *arch.other_families):
        if name == family.name:
            continue
        other = FAMILIES[name]
        fallback = KernelConfig(config.head_dim, config.dtype, config.arch,
                                other.default_tile(config.head_dim, config.dtype),
                                kernel_family="" if name == arch.family else name)
        if problems(fallback):
            continue
        chosen = other.default_backward(fallback)
        if chosen is not None and not problems(chosen):
            return chosen
    return config


def describe_backward(config: KernelConfig) -> str:
    """One line for `omnigen inspect`: which kernels run this variant's backward, in both dQ modes (and, where its
    module has none, which variant an untuned kernel trains with)."""
    text = family_of(config).describe_backward(config)
    if backward_problems(config):
        other = default_backward(config)
        if other != config:
            text += f"; an untuned kernel trains with {other.label}'s"
    return text
