"""`omnigen build`, `omnigen inspect`, `omnigen cache list|clear`: thin wrappers over codegen, build and cache."""

from __future__ import annotations

import time
from pathlib import Path

import click

from . import cache, codegen
from .toolchain import BuildError, ToolchainError, check_arch, default_archs, describe_toolchain, find_toolchain, visible_gpu_arch
from .cli import UserError, cli, user_errors
from .codegen import KernelConfig
from .rules import Rules


def _human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
    return "\n".join(lines)


def _targets(rules: Rules, archs: tuple[str, ...]) -> list[KernelConfig]:
    """--arch wins; then the rules' own archs; then the visible GPU / OMNIGEN_ARCH_LIST / both defaults."""
    try:
        if archs:
            chosen: tuple[str, ...] | None = tuple(dict.fromkeys(check_arch(a) for a in archs))
        elif rules.kernel is not None and rules.kernel.archs:
            chosen = None
        else:
            chosen = default_archs()
    except ToolchainError as exc:
        raise UserError(str(exc)) from None
    configs = codegen.targets(rules, chosen)
    # A tile candidate that does not fit one (head dim, arch) is skipped there, not an error: the
    # candidates are for the tuner, and the other combinations still build.
    usable = [c for c in configs if not c.problems()]
    for c in configs:
        if c.problems():
            click.echo(f"skipping {c.label}: {'; '.join(c.problems())}", err=True)
    if not usable:
        raise UserError("no variant in the rules' kernel: section can be built (see above); "
                        "change its head_dims, tiles or archs")
    return usable


def _ptxas_cells(meta: dict) -> list[str]:
    ptxas = meta.get("ptxas") or {}
    spills = ptxas.get("spill_store_bytes", 0) + ptxas.get("spill_load_bytes", 0)
    return [str(ptxas.get("registers", "?")), f"{spills} B" if ptxas else "?"]


@cli.command()
@click.option("--rules", "rules_path", required=True, type=click.Path(dir_okay=False), help="rules YAML file")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="also write the emitted sources to DIR/<rules name>/ for reading")
@click.option("--arch", "archs", multiple=True,
              help="target arch, e.g. sm_90a (repeatable). Default: the rules' archs, else the visible GPU, "
                   "else $OMNIGEN_ARCH_LIST, else sm_80 and sm_90a")
@click.option("--tune", is_flag=True, help="benchmark the tile candidates on the visible GPU and keep the winners")
@click.option("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: $MAX_JOBS or the CPU count)")
@user_errors
def build(rules_path: str, out: str | None, archs: tuple[str, ...], tune: bool, jobs: int | None) -> None:
    """Render, compile and cache every kernel variant the rules ask for."""
    rules = Rules.load(rules_path)
    configs = _targets(rules, archs)
    try:
        toolchain = find_toolchain()
    except ToolchainError as exc:
        raise UserError(str(exc)) from None
    variants = [cache.variant(rules, config, toolchain) for config in configs]
    click.echo(f"{rules.name}: {len(variants)} variant(s) with {describe_toolchain(toolchain)}")
    click.echo(f"cache: {cache.cache_dir()}")

    if out:
        directory = Path(out) / rules.name
        directory.mkdir(parents=True, exist_ok=True)
        for v in variants:
            for name, text in v.sources.items():
                (directory / name).write_text(text)
        click.echo(f"sources written to {directory}")

    missing = [v for v in variants if cache.entry_problem(v.entry, v.key) is not None]
    started = time.perf_counter()
    try:
        if missing:
            # Three compile/link steps per variant; ninja reports finished steps of the whole graph.
            with click.progressbar(length=3 * len(missing), label=f"building {len(missing)} variant(s)",
                                   show_pos=True) as bar:
                done = [0]

                def progress(finished: int, total: int, _description: str) -> None:
                    bar.update(max(0, finished - done[0]))
                    done[0] = finished

                results = cache.build_variants(variants, jobs=jobs, on_progress=progress)
        else:
            results = cache.build_variants(variants, jobs=jobs)
    except BuildError as exc:
        raise UserError(str(exc)) from None
    elapsed = time.perf_counter() - started

    rows = []
    for result in results:
        v, meta = result.variant, result.meta
        size = meta.get("extension_bytes", 0)
        rows.append([v.config.label, "built" if result.built else "cached", *_ptxas_cells(meta),
                     _human_bytes(size), v.module])
    click.echo(_table(["variant", "status", "regs", "spills", "size", "module"], rows))
    built = sum(r.built for r in results)
    click.echo(f"{built} built, {len(results) - built} from the cache, {elapsed:.1f} s")

    if tune:
        arch = visible_gpu_arch()
        if arch is None:
            click.echo("tuning skipped: no CUDA GPU is visible here (torch.cuda.is_available() is False). "
                       "The variants are built; run `omnigen build --tune` on a GPU machine to pick tiles.")
        else:
            click.echo(f"tuning skipped: the tuner is not part of this version yet; the default tile is used on {arch}.")


@cli.command()
@click.option("--rules", "rules_path", required=True, type=click.Path(dir_okay=False), help="rules YAML file")
@click.option("--arch", "archs", multiple=True, help="target arch (repeatable); default as for `omnigen build`")
@user_errors
def inspect(rules_path: str, archs: tuple[str, ...]) -> None:
    """Where the emitted sources and the built modules of the rules are."""
    rules = Rules.load(rules_path)
    configs = _targets(rules, archs)
    click.echo(f"rules {rules.name}: content hash {rules.content_hash()}, mask hash {rules.mask_hash()}")
    checked_in = codegen.GENERATED_DIR / rules.name
    if checked_in.is_dir():
        click.echo(f"checked-in sources: {checked_in}")
    try:
        toolchain = find_toolchain()
    except ToolchainError as exc:
        toolchain = None
        click.echo(f"cache state unknown: {exc}")
    click.echo(f"cache: {cache.cache_dir()}")
    for config in configs:
        names = codegen.source_names(rules, config)
        click.echo("")
        click.echo(f"{config.label}  ->  module {codegen.module_name(rules, config)}")
        click.echo(f"  sources:   {names['kernel']}, {names['binding']}, {names['mask']}")
        if toolchain is None:
            continue
        v = cache.variant(rules, config, toolchain)
        problem = cache.entry_problem(v.entry, v.key)
        if problem is None:
            meta = cache.read_meta(v.entry) or {}
            ptxas = meta.get("ptxas", {})
            click.echo(f"  built:     {v.entry / v.extension_file}")
            click.echo(f"  emitted:   {v.entry}/ ({', '.join(meta.get('sources', []))})")
            click.echo(f"  ptxas:     {ptxas.get('registers', '?')} registers, {ptxas.get('spill_store_bytes', '?')} B spill "
                       f"stores, {ptxas.get('stack_bytes', '?')} B stack; {config.shared_memory_bytes} B shared memory")
            click.echo(f"  built at:  {meta.get('built_at', '?')} in {meta.get('build_seconds', '?')} s")
        else:
            click.echo(f"  not in the cache ({problem}): would be {v.entry}")


@cli.group(name="cache")
def cache_group() -> None:
    """The kernel cache ($OMNIGEN_CACHE_DIR, default ~/.cache/omnigen)."""


@cache_group.command(name="list")
@user_errors
def cache_list() -> None:
    """What is built, and how much disk it takes."""
    found = cache.entries()
    click.echo(f"cache: {cache.cache_dir()}")
    if not found:
        click.echo("empty")
        return
    rows = []
    for info in found:
        meta = info.meta or {}
        config = meta.get("config", {})
        label = (f"{config.get('dtype', '?')} d{config.get('head_dim', '?')} "
                 f"m{config.get('block_m', '?')}n{config.get('block_n', '?')} {config.get('arch', '?')}")
        rows.append([meta.get("rules_name", "?"), label, _human_bytes(info.bytes), meta.get("built_at", "?"),
                     "ok" if info.problem is None else f"broken: {info.problem}", info.path.name])
    click.echo(_table(["rules", "variant", "size", "built", "state", "entry"], rows))
    click.echo(f"{len(found)} module(s), {_human_bytes(sum(i.bytes for i in found))}")


@cache_group.command(name="clear")
@user_errors
def cache_clear() -> None:
    """Remove every built module."""
    removed, freed = cache.clear()
    click.echo(f"removed {removed} module(s), {_human_bytes(freed)} from {cache.cache_dir()}")
