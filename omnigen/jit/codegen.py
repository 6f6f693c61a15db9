"""Code generation: (rules, kernel config) -> CUDA / C++ sources, as text. Pure: no writes, no subprocesses.

Every variant renders these files from the Jinja templates in ``omnigen/kernels/`` (a family's own templates, then the
shared ones):

    <rules>_mask.cuh                     the rules as constants and the partial-tile predicate
    <rules>_<dtype>_d<D>_<tile>_<arch>_shared.cuh   what the variant's two kernel files share (both include it)
    <rules>_<dtype>_d<D>_<tile>_<arch>.cu           the forward kernel and its launcher (one object file)
    <rules>_<dtype>_d<D>_<tile>_<arch>_backward.cu  the backward kernels (dK/dV, dQ, Delta) and their launchers
                                                    (another object file, compiled beside the forward's); a
                                                    forward-only variant's launchers only, saying there are none
    <rules>_<dtype>_d<D>_<tile>_<arch>_binding.cpp  the pybind11 module (no CUDA or torch headers)

The Python module is called ``<rules>_<dtype>_d<D>_<tile>_<arch>_<hash>``, the hash covering the
canonical rules, the config, every template file and the omnigen version; so two spellings of the
same rules give the same module, and any template change gives a new one.

The sources for the example rules are checked in under ``generated/`` (``omnigen.jit.regenerate``).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

import jinja2

from ..version import __version__
from .. import targets as targets_table
from ..kernels import MAX_MODALITIES, arguments, check, family_of
from ..kernels.family import KERNELS_DIR, KernelFamily
from ..rules import Rules
from ..targets import ELEMENT_TYPES, KernelConfig

# The archs the default target list and generated/ use when the rules name none and no GPU decides.
DEFAULT_ARCHS = targets_table.DEFAULT_ARCHS


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
                for tile in tiles or (family_of(arch).default_tile(head_dim, dtype),):
                    out.append(KernelConfig(head_dim=head_dim, dtype=dtype, arch=arch, tile=tile))
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------------
# names and hashes


@lru_cache(maxsize=1)
def template_files() -> tuple[tuple[str, bytes], ...]:
    """(path relative to kernels/, bytes) of every template and header, sorted."""
    files = sorted(p for p in KERNELS_DIR.rglob("*") if p.is_file() and p.suffix in (".j2", ".cuh", ".h"))
    return tuple((p.relative_to(KERNELS_DIR).as_posix(), p.read_bytes()) for p in files)


def template_digest(config: KernelConfig | None = None) -> str:
    """A hash of every template and header, or (given a variant) of those its family reads: editing one
    family's templates renames the other families' modules not at all."""
    if config is None:
        return _digest(template_files(), None)
    family = family_of(config)
    folders = (*family.template_dirs, *family.include_dirs)
    roots = tuple(d.relative_to(KERNELS_DIR).as_posix() + "/" for d in folders)
    return _digest(template_files(), roots)


@lru_cache(maxsize=None)
def _digest(files: tuple[tuple[str, bytes], ...], roots: tuple[str, ...] | None) -> str:
    """Every module name and tuning stamp asks for a digest: hash the templates once per (files, family)."""
    digest = hashlib.sha256()
    for name, data in files:
        if roots is None or name.startswith(roots):
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def header_files(config: KernelConfig) -> dict[str, str]:
    """The headers a variant's sources may include: path under an include directory -> text."""
    return {
        path.relative_to(root).as_posix(): path.read_text()
        for root in family_of(config).include_dirs
        for path in sorted(root.rglob("*")) if path.is_file()
    }


def variant_stem(rules: Rules, config: KernelConfig) -> str:
    """The readable part of a module name: <rules name>_<dtype>_d<head dim>_<tile>_<arch>."""
    return f"{rules.name}_{config.label}"


def module_hash(rules: Rules, config: KernelConfig, length: int = 8) -> str:
    rules = rules.without_kernel()
    payload = json.dumps(
        {"rules": rules.to_dict(), "config": config.as_dict(), "templates": template_digest(config), "omnigen": __version__},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:length]


def module_name(rules: Rules, config: KernelConfig) -> str:
    """A valid Python identifier: the variant stem plus a short content hash."""
    name = f"{variant_stem(rules, config)}_{module_hash(rules, config)}"
    return name if name[0].isalpha() else f"omnigen_{name}"


def source_names(rules: Rules, config: KernelConfig) -> dict[str, str]:
    stem = variant_stem(rules, config)
    return {"mask": f"{rules.name}_mask.cuh", "shared": f"{stem}_shared.cuh", "kernel": f"{stem}.cu",
            "backward": f"{stem}_backward.cu", "binding": f"{stem}_binding.cpp"}


# ------------------------------------------------------------------------------------------------
# rendering


@lru_cache(maxsize=None)
def _environment(family: KernelFamily) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in family.template_dirs]),
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
        "then run `python -m omnigen.jit.regenerate` (checked-in copies) or `omnigen build`.",
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
    check(config)
    family = family_of(config)
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
        "shared_file": names["shared"],
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
        **family.render_context(config),
        **family.rules_context(rules, config),
    }
    # The binding's flags are the family's record of the variant (a forward-only variant's backward file is the
    # launchers alone, forward_only.cu.j2), so what a module says of itself is what its family states.
    traits = family.traits_of(context, config)
    context.update(backward_supported=traits.has_backward, backward_problem=traits.backward_problem or "",
                   persistent=traits.persistent_forward, partial_bits=traits.partial_bits,
                   ordered_dq=traits.ordered_dq, dq_interleaved=traits.dq_interleaved,
                   persistent_backward=traits.persistent_backward)
    context["raw_delimiter"] = _raw_delimiter(context["rules_yaml"])
    env = _environment(family)
    mask_context = dict(context, header=_header(rules, None, None), namespace=f"omnigen_rules_{rules.name}")
    # The mask header is shared by all variants of the rules, so its namespace names the rules only.
    kernel_context = dict(context, header=_header(rules, config, module), namespace=mask_context["namespace"])
    return {
        names["mask"]: env.get_template("mask.cuh.j2").render(mask_context),
        names["shared"]: env.get_template(family.sources["shared"]).render(kernel_context),
        names["kernel"]: env.get_template(family.sources["kernel"]).render(kernel_context),
        names["backward"]: env.get_template("forward_only.cu.j2" if config.forward_only else family.sources["backward"])
                                .render(kernel_context),
        names["binding"]: env.get_template("binding.cpp.j2").render(dict(
            context, header=_header(rules, config, module), args=arguments, launch_structs=arguments.STRUCTS,
            forward_struct=arguments.FORWARD, backward_struct=arguments.BACKWARD, delta_struct=arguments.DELTA,
            convert_struct=arguments.CONVERT)),
    }
