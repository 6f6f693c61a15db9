"""Code generation: (rules, kernel config) -> CUDA / C++ sources, as text. Pure: no writes, no subprocesses.

Every variant renders three files from the Jinja templates in ``omnigen/kernels/`` (a family's own templates, then the shared ones):

    <rules>_mask.cuh                     the rules as constants and the partial-tile predicate
    <rules>_<dtype>_d<D>_<tile>_<arch>.cu           the forward kernel and its launcher
    <rules>_<dtype>_d<D>_<tile>_<arch>_backward.cu  the backward kernels (dK/dV, dQ, Delta) and their launcher;
                                                    the forward file includes it (one nvcc run per variant)
    <rules>_<dtype>_d<D>_<tile>_<arch>_binding.cpp  the pybind11 module (no CUDA or torch headers)

The Python module is called ``<rules>_<dtype>_d<D>_<tile>_<arch>_<hash>``, the hash covering the
canonical rules, the config, every template file and the omnigen version; so two spellings of the
same rules give the same module, and any template change gives a new one.

The sources for the example rules are checked in under ``generated/``. Regenerate them with::

    python -m omnigen.codegen --regenerate          # rewrite generated/ from examples/rules/*.yaml
    python -m omnigen.codegen --check               # exit 1 if generated/ is out of date
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jinja2

from . import __version__
from .rules import ARCHS, DTYPES, HEAD_DIMS, Rules, TileConfig

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
# Jinja looks in the family's templates first, then in the ones every family shares.
TEMPLATE_DIRS = (KERNELS_DIR / "sm80" / "templates", KERNELS_DIR / "common" / "templates")
INCLUDE_DIRS = (KERNELS_DIR / "common" / "include", KERNELS_DIR / "sm80" / "include")

# The archs the default target list and generated/ use when the rules name none and no GPU decides.
DEFAULT_ARCHS = ("sm_80", "sm_90a")
DEFAULT_TILE = TileConfig(block_m=128, block_n=64, warps=4, stages=2)
# head_dim 256 needs half the rows per warp to keep the fp32 output accumulators in registers.
DEFAULT_TILE_D256 = TileConfig(block_m=64, block_n=32, warps=4, stages=2)

ELEMENT_TYPES = {"bf16": "__nv_bfloat16", "fp16": "__half"}
# Largest dynamic shared memory one block may opt into, per arch (bytes).
SHARED_MEMORY_LIMIT = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_90a": 227 * 1024,
}
# fp32 output accumulators one thread may hold (rows per warp / 16 * head_dim / 2) before the
# scores, fragments and addresses no longer fit beside them in 255 registers.
MAX_OUTPUT_ACCUMULATORS = 128
MAX_MODALITIES = 31  # modality bit masks are 32-bit, and pad takes an id
# Bytes of spill stores (and, separately, loads) ptxas may report for a kernel before it counts as not
# fitting its registers. The forward's partial path keeps every key column's tables in registers across
# the rows (3x fewer shared loads; partial tiles 2.2x -> 1.4x a full tile at d128), which moves one or
# two per-kv-tile values to the stack, outside the step loops (SASS in benchmarks/RESULTS.md). A spill
# inside the step loops is larger: 64-key steps at d128 spilled 36-92 bytes there.
# The dK/dV kernel's 2-D warp layouts hold 128 fp32 dK/dV accumulators per thread at d128 beside 32
# scores, so ptxas parks step-invariant addresses and bounds on the stack: none on the full path, a few
# loads per step (not per mma) on the causal and partial paths (76-136 bytes; up to 340 with one P^T/dS^T
# buffer on sm_90a). Measured against the spill-free one-warp-per-16-keys layout it replaced: 5-11%
# faster on every tile (RESULTS.md). Beyond these figures a config has outgrown its registers.
SPILL_ALLOWANCE_BYTES = {"forward_kernel": 16, "dkdv_kernel": 384}


def spill_allowance(kernel_name: str) -> int:
    """The spill bytes (stores or loads) tolerated in the kernel whose (mangled) name is given."""
    return next((limit for kernel, limit in SPILL_ALLOWANCE_BYTES.items() if kernel in kernel_name), 0)


def excess_spill_bytes(kernel_name: str, figures: dict) -> int:
    """Spilled bytes (stores + loads) of one kernel's ptxas figures, or 0 when within its allowance."""
    stores, loads = figures.get("spill_store_bytes", 0), figures.get("spill_load_bytes", 0)
    return 0 if max(stores, loads) <= spill_allowance(kernel_name) else stores + loads


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant: head dim, dtype, target arch and tile shape."""

    head_dim: int
    dtype: str
    arch: str
    tile: TileConfig = field(default=DEFAULT_TILE)

    @property
    def label(self) -> str:
        return f"{self.dtype}_d{self.head_dim}_{self.tile.label}_{self.arch}"

    @property
    def threads(self) -> int:
        return 32 * self.tile.warps

    @property
    def shared_memory_bytes(self) -> int:
        """sizeof(SharedStorage) in the kernel: Q tile, stages x (K tile, V tile, 3 int32 key tables),
        3 int32 query tables."""
        element = 2
        t = self.tile
        stage = 2 * t.block_n * self.head_dim * element + 12 * t.block_n
        return t.block_m * self.head_dim * element + t.stages * stage + 12 * t.block_m

    @property
    def keys_per_step(self) -> int:
        """Keys the kernel scores per online-softmax step: the whole kv-tile, unless its fp32 scores
        would not fit in registers beside the output accumulators (then 32 at a time)."""
        row_blocks = max(self.tile.block_m // self.tile.warps // 16, 1)
        if row_blocks * self.head_dim >= 256 and self.tile.block_n > 32 and self.tile.block_n % 32 == 0:
            return 32
        return self.tile.block_n

    def as_dict(self) -> dict[str, object]:
        t = self.tile
        return {
            "head_dim": self.head_dim, "dtype": self.dtype, "arch": self.arch,
            "block_m": t.block_m, "block_n": t.block_n, "warps": t.warps, "stages": t.stages,
        }

    # ---- the backward (templates/backward.cu.j2). It plans with the forward's tile (one Plan serves
    # both passes); its thread counts follow from the tile: a warp per 16 keys in the dK/dV kernel,
    # 16 query rows per warp in the deterministic dQ kernel.

    BACKWARD_STEP_ROWS = 64  # query rows per pipeline step of the dK/dV kernel

    @property
    def backward_step_tiles(self) -> int:
        """Buffers for a step's P^T and dS^T in the dK/dV kernel: 2 (side by side), or 1 (dS^T over P^T
        once every warp has used it: two more barriers per step). Tiles of up to 64 keys take one, so that
        two CTAs share an SM (their registers allow it; at d128 two buffers would not fit twice)."""
        return 1 if self.tile.block_n <= 64 else 2

    @property
    def backward_warps(self) -> int:
        return self.tile.block_n // 16

    @property
    def dq_warps(self) -> int:
        return self.tile.block_m // 16

    @property
    def backward_shared_bytes(self) -> int:
        """sizeof(DkdvShared): K and V tiles, P^T and dS^T [block_n][64] (backward_step_tiles buffers), 2
        stages of (64 rows of Q and dO, their lse, Delta and 3 int32 token tables), 3 int32 key tables."""
        n, d, rows = self.tile.block_n, self.head_dim, self.BACKWARD_STEP_ROWS
        stage = 2 * rows * d * 2 + 2 * 4 * rows + 12 * rows
        return 2 * n * d * 2 + self.backward_step_tiles * n * rows * 2 + 2 * stage + 12 * n

    @property
    def dq_shared_bytes(self) -> int:
        """sizeof(DqShared): Q and dO tiles, 2 stages of (K, V tiles and 3 int32 key tables), 3 int32 query tables."""
        m, n, d = self.tile.block_m, self.tile.block_n, self.head_dim
        return 2 * m * d * 2 + 2 * (2 * n * d * 2 + 12 * n) + 12 * m

    def backward_problems(self) -> list[str]:
        """Why this variant's module has no backward (empty when it has one). The forward is unaffected."""
        t = self.tile
        out: list[str] = []
        if self.head_dim > 128:
            out.append(f"the backward holds dK and dV of 16 keys x head_dim in registers per warp: head_dim {self.head_dim} "
                       "needs 256 fp32 registers per thread for them (at most 128 fit)")
        if t.block_m % self.BACKWARD_STEP_ROWS:
            out.append(f"the backward walks q-tiles {self.BACKWARD_STEP_ROWS} rows at a time: block_m ({t.block_m}) "
                       f"must be a multiple of {self.BACKWARD_STEP_ROWS}")
        warps = self.backward_warps
        if t.block_n % 16 or not (warps % 4 == 0 or 4 % warps == 0) or warps > 32:
            out.append(f"the backward runs a warp per 16 keys: block_n ({t.block_n}) must be 16, 32 or a multiple of 64 up to 512")
        if t.block_n > 64 and t.block_n % 64:
            out.append(f"the deterministic dQ kernel scores 64 keys per step: block_n ({t.block_n}) must be <= 64 or a multiple of 64")
        if self.dq_warps > 32:
            out.append(f"the dQ kernel gives each warp 16 query rows: block_m ({t.block_m}) must be at most 512")
        chunks = self.head_dim // 8
        bwd_threads, dq_threads = 32 * warps, 32 * self.dq_warps
        if warps and ((self.BACKWARD_STEP_ROWS * chunks) % bwd_threads or (t.block_n * chunks) % bwd_threads
                      or bwd_threads % chunks):
            out.append(f"the dK/dV kernel's {bwd_threads} threads cannot split the copies of {chunks} chunks per row evenly")
        if (t.block_n * chunks) % dq_threads or (t.block_m * chunks) % dq_threads or dq_threads % chunks:
            out.append(f"the dQ kernel's {dq_threads} threads cannot split the copies of {chunks} chunks per row evenly")
        if not out:
            limit = SHARED_MEMORY_LIMIT[self.arch]
            needed = max(self.backward_shared_bytes, self.dq_shared_bytes)
            if needed > limit:
                out.append(f"the backward needs {needed} bytes of shared memory, {self.arch} allows {limit}: "
                           "lower block_m or block_n")
        return out

    def problems(self) -> list[str]:
        """Why this variant cannot be built (empty when it can)."""
        out: list[str] = []
        t = self.tile
        if self.head_dim not in HEAD_DIMS:
            out.append(f"head_dim must be one of {', '.join(map(str, HEAD_DIMS))}, not {self.head_dim}")
        if self.dtype not in DTYPES:
            out.append(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.arch not in ARCHS:
            out.append(f"arch must be one of {', '.join(ARCHS)}, not {self.arch!r}")
        if out:
            return out
        if t.block_m % (16 * t.warps):
            out.append(f"block_m ({t.block_m}) must be a multiple of 16 x warps ({16 * t.warps}): each warp owns whole 16-row blocks")
        if t.block_n % 16:
            out.append(f"block_n ({t.block_n}) must be a multiple of 16")
        chunks = self.head_dim // 8
        if (t.block_m * chunks) % self.threads or (t.block_n * chunks) % self.threads:
            out.append(f"block_m and block_n times head_dim/8 ({chunks}) must be multiples of the thread count ({self.threads})")
        rows_per_thread_blocks = max(t.block_m // t.warps // 16, 1)
        accumulators = rows_per_thread_blocks * self.head_dim // 2
        if accumulators > MAX_OUTPUT_ACCUMULATORS:
            suggestion = 16 * t.warps * max(1, MAX_OUTPUT_ACCUMULATORS * 2 // self.head_dim)
            out.append(
                f"head_dim {self.head_dim} with {t.block_m // t.warps} rows per warp needs {accumulators} fp32 output "
                f"registers per thread (at most {MAX_OUTPUT_ACCUMULATORS} fit): use block_m <= {suggestion} "
                f"or more warps"
            )
        limit = SHARED_MEMORY_LIMIT[self.arch]
        if self.shared_memory_bytes > limit:
            out.append(
                f"the tile needs {self.shared_memory_bytes} bytes of shared memory, {self.arch} allows {limit}: "
                f"lower block_m, block_n or stages"
            )
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"kernel variant {self.label} cannot be built: " + "; ".join(problems))


def default_tile(head_dim: int) -> TileConfig:
    return DEFAULT_TILE_D256 if head_dim > 128 else DEFAULT_TILE


def targets(rules: Rules, archs: tuple[str, ...] | list[str] | None = None) -> list[KernelConfig]:
    """Every (head_dim x dtype x arch x tile) the rules' `kernel:` section asks for.

    `archs` overrides the rules' archs (the CLI's --arch, or the visible GPU); with neither,
    DEFAULT_ARCHS. With no tiles, the default tile for each head dim.
    """
    spec = rules.kernel
    head_dims = spec.head_dims if spec else (64, 128)
    dtypes = spec.dtypes if spec else ("bf16",)
    chosen_archs = tuple(archs) if archs else (spec.archs if spec and spec.archs else DEFAULT_ARCHS)
    tiles = spec.tiles if spec and spec.tiles else ()
    out = []
    for head_dim in head_dims:
        for dtype in dtypes:
            for arch in chosen_archs:
                for tile in tiles or (default_tile(head_dim),):
                    out.append(KernelConfig(head_dim=head_dim, dtype=dtype, arch=arch, tile=tile))
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------------
# names and hashes


@lru_cache(maxsize=1)
def template_files() -> tuple[tuple[str, bytes], ...]:
    """(path relative to kernels/, bytes) of every template and header, sorted."""
    files = sorted(p for p in KERNELS_DIR.rglob("*") if p.is_file() and p.suffix in (".j2", ".cuh", ".h"))
    return tuple((p.relative_to(KERNELS_DIR).as_posix(), p.read_bytes()) for p in files)


def template_digest() -> str:
    digest = hashlib.sha256()
    for name, data in template_files():
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def header_files() -> dict[str, str]:
    """The primitives every variant includes: path under an include directory -> text."""
    return {
        path.relative_to(root).as_posix(): path.read_text()
        for root in INCLUDE_DIRS
        for path in sorted(root.rglob("*")) if path.is_file()
    }


def variant_stem(rules: Rules, config: KernelConfig) -> str:
    """The readable part of a module name: <rules name>_<dtype>_d<head dim>_<tile>_<arch>."""
    return f"{rules.name}_{config.label}"


def module_hash(rules: Rules, config: KernelConfig, length: int = 8) -> str:
    rules = rules.without_kernel()
    payload = json.dumps(
        {"rules": rules.to_dict(), "config": config.as_dict(), "templates": template_digest(), "omnigen": __version__},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:length]


def module_name(rules: Rules, config: KernelConfig) -> str:
    """A valid Python identifier: the variant stem plus a short content hash."""
    name = f"{variant_stem(rules, config)}_{module_hash(rules, config)}"
    return name if name[0].isalpha() else f"omnigen_{name}"


def source_names(rules: Rules, config: KernelConfig) -> dict[str, str]:
    stem = variant_stem(rules, config)
    return {"mask": f"{rules.name}_mask.cuh", "kernel": f"{stem}.cu", "backward": f"{stem}_backward.cu",
            "binding": f"{stem}_binding.cpp"}


# ------------------------------------------------------------------------------------------------
# rendering


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in TEMPLATE_DIRS]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _enum_names(names: tuple[str, ...]) -> list[str]:
    """`image_patch` -> `kImagePatch`; made unique if two spellings collide."""
    out: list[str] = []
    for index, name in enumerate(names):
        enum = "k" + "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)
        if enum in out or enum == "kPad":
            enum = f"{enum}{index}"
        out.append(enum)
    return out


def _comment_block(lines: list[str]) -> str:
    return "\n".join(("// " + line).rstrip() for line in lines)


def _header(rules: Rules, config: KernelConfig | None, module: str | None) -> str:
    lines = [
        f"Generated by omnigen {__version__} from omnigen/kernels/. Do not edit: edit the rules or the templates,",
        "then run `python -m omnigen.codegen --regenerate` (checked-in copies) or `omnigen build`.",
        "",
    ]
    if module is not None and config is not None:
        lines.append(f"module: {module}")
        lines.append("config: " + " ".join(f"{k}={v}" for k, v in config.as_dict().items()))
    lines.append(f"rules:  {rules.name} (content hash {rules.content_hash()}, mask hash {rules.mask_hash()})")
    lines.extend("  " + line for line in rules.to_yaml().rstrip("\n").splitlines())
    return _comment_block(lines)


def _raw_delimiter(text: str) -> str:
    delimiter = "omnigen_yaml"
    while f"){delimiter}\"" in text:
        delimiter += "_"
    return delimiter


def render(rules: Rules, config: KernelConfig) -> dict[str, str]:
    """The sources of one variant: file name -> text. Raises ValueError for a variant that cannot be built."""
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be omnigen.Rules, not {type(rules).__name__}")
    config.check()
    rules = rules.without_kernel()  # the `kernel:` section picks variants; it is not part of one
    if len(rules.modalities) > MAX_MODALITIES:
        raise ValueError(f"rules '{rules.name}' declare {len(rules.modalities)} modalities; kernels support at most {MAX_MODALITIES}")
    module = module_name(rules, config)
    names = source_names(rules, config)
    enums = _enum_names(rules.modality_names)
    policy_enum = {"none": "See::kNone", "earlier": "See::kEarlier", "all": "See::kAll"}
    see = rules.see_matrix()
    # The see table as aligned rows, with the key modalities named over its columns.
    label_width = max(len(name) for name in rules.modality_names)
    cell_width = max(max(len(policy_enum[p]) for p in policy_enum), *(len(name) for name in rules.modality_names)) + 1
    see_rows = [
        {"query": m.name.ljust(label_width), "cells": [(policy_enum[p]).ljust(cell_width - 1) for p in see[i]]}
        for i, m in enumerate(rules.modalities)
    ]
    prefix = len("/*  -> */ { ") + label_width
    see_heading = ("// key:".ljust(prefix) + "".join(n.ljust(cell_width + 1) for n in rules.modality_names)).rstrip()
    modalities = [
        {"name": m.name, "enum": enums[i], "id": i, "self": m.self, "window": m.window}
        for i, m in enumerate(rules.modalities)
    ]
    context = {
        "rules_name": rules.name,
        "rules_hash": rules.content_hash(),
        "mask_hash": rules.mask_hash(),
        "rules_yaml": rules.to_yaml(),
        "omnigen_version": __version__,
        "module_name": module,
        "namespace": module,
        "kernel_file": names["kernel"],
        "backward_file": names["backward"],
        "mask_header": names["mask"],
        "modalities": modalities,
        "pad_id": rules.pad_id,
        "see_default": rules.see_default,
        "see_rows": see_rows,
        "see_heading": see_heading,
        "documents": rules.documents,
        "isolated_documents": rules.isolated_documents,
        "has_windows": rules.has_windows,
        "dtype": config.dtype,
        "element_type": ELEMENT_TYPES[config.dtype],
        "head_dim": config.head_dim,
        "arch": config.arch,
        "arch_capability": f"{config.arch[3]}.{config.arch[4]}",
        "tile_label": config.tile.label,
        "block_m": config.tile.block_m,
        "block_n": config.tile.block_n,
        "warps": config.tile.warps,
        "stages": config.tile.stages,
        "shared_bytes": config.shared_memory_bytes,
        "keys_per_step": config.keys_per_step,
        "keys_per_step_reason": (
            "The whole kv-tile at once." if config.keys_per_step == config.tile.block_n else
            f"Half-tiles: {config.tile.block_n} keys of fp32 scores would not fit in registers beside "
            f"{config.tile.block_m // config.tile.warps} rows x {config.head_dim} outputs per warp (ptxas spills)."
        ),
    }
    backward_problems = config.backward_problems()
    context.update({
        "backward_supported": not backward_problems,
        "backward_problem": (
            (f"this variant ({config.label}) has no backward kernel: " + "; ".join(backward_problems)).replace('"', "'")
            if backward_problems else ""
        ),
        "step_rows": KernelConfig.BACKWARD_STEP_ROWS,
        "bwd_warps": config.backward_warps,
        "bwd_step_tiles": config.backward_step_tiles,
        "bwd_step_tiles_reason": (
            "P^T and dS^T side by side: one barrier between the score and gradient layouts per step."
            if config.backward_step_tiles == 2 else
            f"P^T, then dS^T in one buffer: two more barriers per step, {config.tile.block_n * 128 // 1024} KB less "
            "shared memory, so that two CTAs share an SM."
        ),
        "bwd_threads": 32 * config.backward_warps,
        "bwd_shared_bytes": config.backward_shared_bytes,
        "dq_warps": config.dq_warps,
        "dq_threads": 32 * config.dq_warps,
        "dq_shared_bytes": config.dq_shared_bytes,
    })
    context["raw_delimiter"] = _raw_delimiter(context["rules_yaml"])
    env = _environment()
    mask_context = dict(context, header=_header(rules, None, None), namespace=f"omnigen_rules_{rules.name}")
    # The mask header is shared by all variants of the rules, so its namespace names the rules only.
    kernel_context = dict(context, header=_header(rules, config, module), namespace=mask_context["namespace"])
    return {
        names["mask"]: env.get_template("mask.cuh.j2").render(mask_context),
        names["kernel"]: env.get_template("forward.cu.j2").render(kernel_context),
        names["backward"]: env.get_template("backward.cu.j2").render(kernel_context),
        names["binding"]: env.get_template("binding.cpp.j2").render(dict(context, header=_header(rules, config, module))),
    }


# ------------------------------------------------------------------------------------------------
# generated/ : the checked-in sources of the example rules

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO_ROOT / "examples" / "rules"
GENERATED_DIR = REPO_ROOT / "generated"


def example_rules_files(examples_dir: Path = EXAMPLES_DIR) -> list[Path]:
    return sorted(p for p in examples_dir.glob("*.y*ml") if p.suffix in (".yaml", ".yml"))


def generated_tree(examples_dir: Path = EXAMPLES_DIR) -> dict[str, str]:
    """What generated/ must hold: relative path -> text, for every example rules file.

    Archs are DEFAULT_ARCHS unless the rules name theirs, never the visible GPU, so the tree is
    the same on every machine.
    """
    tree: dict[str, str] = {}
    for path in example_rules_files(examples_dir):
        rules = Rules.load(path)
        for config in targets(rules):
            if config.problems():
                continue
            for name, text in render(rules, config).items():
                tree[f"{rules.name}/{name}"] = text
    return tree


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnigen.codegen", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--regenerate", action="store_true", help="rewrite generated/ from examples/rules/")
    action.add_argument("--check", action="store_true", help="exit 1 when generated/ is out of date")
    parser.add_argument("--examples", type=Path, default=EXAMPLES_DIR)
    parser.add_argument("--out", type=Path, default=GENERATED_DIR)
    args = parser.parse_args(argv)
    tree = generated_tree(args.examples)
    existing = {p.relative_to(args.out).as_posix() for p in args.out.rglob("*") if p.is_file()} if args.out.exists() else set()
    stale = sorted(existing - set(tree))
    changed = sorted(name for name, text in tree.items() if not (args.out / name).is_file() or (args.out / name).read_text() != text)
    if args.check:
        for name in changed:
            print(f"out of date: {args.out / name}")
        for name in stale:
            print(f"not generated by any example: {args.out / name}")
        if changed or stale:
            print("run: python -m omnigen.codegen --regenerate", file=sys.stderr)
            return 1
        print(f"{args.out}: {len(tree)} files up to date")
        return 0
    # Writing files is the CLI's job, not render()'s: codegen's functions stay pure.
    for name in changed:
        target = args.out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(tree[name])
    for name in stale:
        (args.out / name).unlink()
    for directory in sorted((p for p in args.out.rglob("*") if p.is_dir()), reverse=True) if args.out.exists() else []:
        if not any(directory.iterdir()):
            directory.rmdir()
    print(f"{args.out}: {len(changed)} written, {len(stale)} removed, {len(tree) - len(changed)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
