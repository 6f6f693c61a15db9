"""What omnigen can build for: architectures, element types, head dims, tile shapes, variants.

One table says what an architecture is (compute capability, shared memory per block, the kernel
family that serves it, the oldest nvcc that targets it); every other module asks it rather than
keeping its own list. The layers above read these names; nothing here imports omnigen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Arch:
    """One target architecture."""

    name: str  # nvcc's spelling: sm_80, sm_90a
    capability: tuple[int, int]  # the CUDA compute capability it runs on
    shared_memory: int  # largest dynamic shared memory one block may opt into (bytes)
    family: str  # the kernel family (a folder of omnigen/kernels/) built for it by default
    other_families: tuple[str, ...]  # families that can also build for it (a fallback, or an A/B partner)
    min_nvcc: tuple[int, int]  # oldest nvcc that emits code for it
    gpus: str  # what users know it as


ARCH_TABLE: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", (8, 0), 163 * 1024, "sm80", (), (11, 0), "A100, A800"),
        Arch("sm_86", (8, 6), 99 * 1024, "sm80", (), (11, 1), "A10, A40, RTX 30xx"),
        Arch("sm_89", (8, 9), 99 * 1024, "sm80", (), (11, 8), "L4, L40, RTX 40xx"),
        Arch("sm_90", (9, 0), 227 * 1024, "sm80", (), (12, 0), "H100, H200, portable code only"),
        Arch("sm_90a", (9, 0), 227 * 1024, "sm90", ("sm80",), (12, 0), "H100, H200"),
    )
}
ARCHS = tuple(ARCH_TABLE)
# The arch a visible GPU is built for, by compute capability (sm_87, Orin, runs sm_86 code).
CAPABILITY_ARCH = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90a"}
# What the default target list and generated/ use when the rules name no arch and no GPU decides.
DEFAULT_ARCHS = ("sm_80", "sm_90a")

DTYPES = ("bf16", "fp16")  # what kernels train in: forward and backward
FP8_DTYPES = ("e4m3",)  # forward-only variants (inference): the sm90 family's FP8 forward, O in bf16
ELEMENT_TYPES = {"bf16": "__nv_bfloat16", "fp16": "__half", "e4m3": "__nv_fp8_e4m3"}  # the CUDA type of each
HEAD_DIMS = (64, 128, 256)


def arch_for_capability(capability: tuple[int, int]) -> str | None:
    """The arch to build for a GPU of this compute capability; None when omnigen has no kernels for it."""
    if capability in CAPABILITY_ARCH:
        return CAPABILITY_ARCH[capability]
    return "sm_80" if capability[0] == 8 else None


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 128
    block_n: int = 64
    warps: int = 4
    stages: int = 2

    @property
    def label(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"


DEFAULT_TILE = TileConfig(block_m=128, block_n=64, warps=4, stages=2)


@dataclass(frozen=True)
class KernelSpec:
    """The optional `kernel:` section of the rules: what `omnigen build` compiles and tunes."""

    head_dims: tuple[int, ...] = (64, 128)
    dtypes: tuple[str, ...] = ("bf16",)
    archs: tuple[str, ...] = ()  # empty: the visible GPU, else sm_80 and sm_90a
    tiles: tuple[TileConfig, ...] = ()  # empty: the tuner's default space


@dataclass(frozen=True)
class KernelOptions:
    """A kernel family's choices of code path beyond the tile shape: part of a variant as the tile is (frozen,
    compared, and where they differ from the defaults, named in the label and hashed into the module name).
    A family with choices subclasses this with its fields and their defaults (sm90:
    omnigen.kernels.sm90.options.HopperOptions); the base class has none."""

    def changed(self) -> dict[str, object]:
        """The fields that differ from the defaults (a default-constructed instance), by name, in field order."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    @property
    def label(self) -> str:
        """The changed fields as an identifier part: `persistent0_ordered_section_pairs16` ("" for the defaults)."""
        return "_".join(f"{name}{int(value)}" for name, value in self.changed().items())


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant: head dim, dtype, target arch, tile shape, and the family's options.

    What a variant *needs* (shared memory, registers, which tiles its templates accept) is its kernel
    family's business: `omnigen.kernels.problems(config)` asks the family. Options equal to their
    defaults are stored as None, so a variant has one spelling (and one module name)."""

    head_dim: int
    dtype: str
    arch: str
    tile: TileConfig = field(default=DEFAULT_TILE)
    kernel_family: str = ""  # "": the arch's own family (ARCH_TABLE); else one that also builds for the arch
    options: KernelOptions | None = None  # None: the family's defaults
    forward_only: bool = False  # a module without backward kernels (inference): a build of the forward pass alone

    def __post_init__(self) -> None:
        if self.options is not None and not self.options.changed():
            object.__setattr__(self, "options", None)

    @property
    def label(self) -> str:
        named = f"_{self.kernel_family}" if self.kernel_family and self.kernel_family != self.arch_family else ""
        options = f"_{self.options.label}" if self.options is not None else ""
        passes = "_fwd" if self.forward_only else ""
        return f"{self.dtype}_d{self.head_dim}_{self.tile.label}_{self.arch}{named}{options}{passes}"

    @property
    def threads(self) -> int:
        return 32 * self.tile.warps

    @property
    def arch_family(self) -> str:
        """The family the arch table names for this arch ("" for an arch omnigen does not know)."""
        arch = ARCH_TABLE.get(self.arch)
        return arch.family if arch else ""

    @property
    def family(self) -> str:
        """The kernel family that builds this variant."""
        return self.kernel_family or self.arch_family

    def identity_problems(self) -> list[str]:
        """What is wrong with the variant's names alone (unknown head dim, dtype or arch)."""
        out: list[str] = []
        if self.head_dim not in HEAD_DIMS:
            out.append(f"head_dim must be one of {', '.join(map(str, HEAD_DIMS))}, not {self.head_dim}")
        if self.dtype not in DTYPES + FP8_DTYPES:
            out.append(f"dtype must be one of {', '.join(DTYPES + FP8_DTYPES)}, not {self.dtype!r}")
        elif self.dtype in FP8_DTYPES and not self.forward_only:
            out.append(f"{self.dtype} variants have a forward only (no FP8 backward): build them with forward_only=True")
        if self.arch not in ARCH_TABLE:
            out.append(f"arch must be one of {', '.join(ARCHS)}, not {self.arch!r}")
        elif self.kernel_family and self.kernel_family != self.arch_family and \
                self.kernel_family not in ARCH_TABLE[self.arch].other_families:
            builds = (self.arch_family, *ARCH_TABLE[self.arch].other_families)
            out.append(f"kernel family {self.kernel_family!r} does not build for {self.arch} (families: {', '.join(builds)})")
        return out

    def as_dict(self) -> dict[str, object]:
        t = self.tile
        out: dict[str, object] = {
            "head_dim": self.head_dim, "dtype": self.dtype, "arch": self.arch,
            "block_m": t.block_m, "block_n": t.block_n, "warps": t.warps, "stages": t.stages,
        }
        if self.kernel_family and self.kernel_family != self.arch_family:
            out["family"] = self.kernel_family
        if self.options is not None:
            out["options"] = self.options.changed()
        if self.forward_only:
            out["forward_only"] = True
        return out


__all__ = ["ARCHS", "ARCH_TABLE", "Arch", "CAPABILITY_ARCH", "DEFAULT_ARCHS", "DEFAULT_TILE", "DTYPES",
           "ELEMENT_TYPES", "FP8_DTYPES", "HEAD_DIMS", "KernelConfig", "KernelOptions", "KernelSpec", "TileConfig", "arch_for_capability"]
