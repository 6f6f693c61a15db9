"""`omnigen build`, `omnigen inspect`, `omnigen cache list|clear`: thin wrappers over codegen, build and cache."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import click

from ..jit import cache, codegen, regenerate
from ..jit.toolchain import (
    BuildError, ToolchainError, check_arch, default_archs, describe_toolchain, find_toolchain, max_jobs,
    visible_gpu_arch,
)
from ..kernels import family_of, problems
from ..kernels.registry import describe_backward
from ..rules import Rules
from ..targets import KernelConfig, KernelSpec
from .app import UserError, cli, user_errors
from .progress import progress


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
    usable = [c for c in configs if not problems(c)]
    for c in configs:
        if problems(c):
            click.echo(f"skipping {c.label}: {'; '.join(problems(c))}", err=True)
    if not usable:
        raise UserError("no variant in the rules' kernel: section can be built (see above); "
                        "change its head_dims, tiles or archs")
    return usable


TOLERATED_SPILL_NOTE = ("* spills within the kernel family's allowance (kernels/<family>/resources.py): per-tile values of "
                        "the forward's partial path and per-step addresses of the backward's, none inside their mma loops")


def spill_text(ptxas: dict) -> str:
    """ptxas's spill figures as `build` and `inspect` both print them: "stores/loads B" (bytes, all kernels)."""
    return f"{ptxas.get('spill_store_bytes', '?')}/{ptxas.get('spill_load_bytes', '?')} B"


def _ptxas_cells(config: KernelConfig, meta: dict) -> list[str]:
    """(registers, spill stores/loads) for the build table; spills the allowance tolerates are marked '*'."""
    ptxas = meta.get("ptxas") or {}
    if not ptxas:
        return ["?", "?"]
    spills = ptxas.get("spill_store_bytes", 0) + ptxas.get("spill_load_bytes", 0)
    kernels = ptxas.get("kernels") or {}
    tolerated = spills > 0 and kernels and not any(family_of(config).excess_spill_bytes(n, k) for n, k in kernels.items())
    return [str(ptxas.get("registers", "?")), spill_text(ptxas) + ("*" if tolerated else "")]


def _parse_seq_lens(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        values = tuple(int(word) for word in text.replace(",", " ").split())
    except ValueError:
        raise UserError(f"--seq-lens must be whole numbers separated by commas, e.g. 4096,8192, not {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"--seq-lens must be positive sequence lengths, not {text!r}")
    return values


def _tuning_job(rules: Rules, layouts_file: str | None, seq_lens: tuple[int, ...] | None):
    """(job, None) when tuning can run here, else (None, why not). A bad --layouts file is an error either way."""
    from .. import tune
    from ..tune import db as tune_db
    from ..tune import layouts as tune_layouts

    arch = visible_gpu_arch()
    if arch is None:
        if layouts_file:
            tune_layouts.read_layouts_file(layouts_file, rules)  # still report a malformed file
        return None, "no CUDA GPU is visible here (torch.cuda.is_available() is False)"
    spec = rules.kernel or KernelSpec()
    job = tune.prepare(rules, spec.head_dims, spec.dtypes, arch, tune_db.Device.current(), seq_lens, layouts_file)
    return job, None


def _build_all(variants: list, jobs: int | None, keep_going: bool) -> list[cache.BuildResult]:
    missing = [v for v in variants if cache.entry_problem(v.entry, v.key) is not None]
    if not missing:
        return cache.build_variants(variants, jobs=jobs)
    # About three compile/link steps per variant (more with a backward file); ninja reports finished steps of the
    # whole graph and its total, which the bar takes once it is known.
    with progress(3 * len(missing), f"building {len(missing)} variant(s)") as bar:
        done = [0]

        def advance(finished: int, total: int, description: str) -> None:
            bar.grow(total)
            bar.update(max(0, finished - done[0]), description)
            done[0] = finished

        return cache.build_variants(variants, jobs=jobs, on_progress=advance, keep_going=keep_going)


@cli.command()
@click.option("--rules", "rules_path", required=True, type=click.Path(dir_okay=False), help="rules YAML file")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="also write the emitted sources to DIR/<rules name>/ for reading")
@click.option("--arch", "archs", multiple=True,
              help="target arch, e.g. sm_90a (repeatable). Default: the rules' archs, else the visible GPU, "
                   "else $OMNIGEN_ARCH_LIST, else sm_80 and sm_90a")
@click.option("--tune", is_flag=True, help="also build the candidate tiles, time them on the visible GPU and keep "
                                           "the fastest per shape in the tuning database")
@click.option("--layouts", "layouts_file", type=click.Path(dir_okay=False), default=None,
              help="with --tune: time on these layouts (one per line, e.g. 'text:40 image:256 text:24@1') instead "
                   "of synthetic ones derived from the rules")
@click.option("--seq-lens", default=None, help="with --tune: sequence lengths to tune (rounded to powers of two; "
                                               "default 1024,2048,...,32768)")
@click.option("--rounds", type=click.IntRange(1, 1000), default=None,
              help="with --tune: round-robin timing rounds per shape (default 8, 3 runs each)")
@click.option("--retune", is_flag=True, help="with --tune: time again even where the database has the results")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="parallel compile jobs (default: $MAX_JOBS or the CPU count)")
@click.option("--forward-only", is_flag=True,
              help="build the forward kernels alone, for inference (no backward kernels: a smaller module); "
                   "load them with omnigen.build(rules, ..., forward_only=True)")
@user_errors
def build(rules_path: str, out: str | None, archs: tuple[str, ...], tune: bool, layouts_file: str | None,
          seq_lens: str | None, rounds: int | None, retune: bool, jobs: int | None, forward_only: bool) -> None:
    """Render, compile and cache every kernel variant the rules ask for; with --tune, pick the fastest per shape."""
    if forward_only and tune:
        raise UserError("--forward-only and --tune: the tuner times forward and backward together. Tune the full "
                        f"variants (omnigen build --rules {rules_path} --tune); omnigen.build(rules, ..., "
                        "forward_only=True) then runs the tuned tiles' forward-only builds")
    if not tune:
        given = [flag for flag, value in (("--layouts", layouts_file), ("--seq-lens", seq_lens),
                                          ("--rounds", rounds), ("--retune", retune)) if value]
        if given:
            raise UserError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with --tune: add "
                            f"--tune (omnigen build --rules {rules_path} --tune {' '.join(given)} ...), or drop "
                            f"{'it' if len(given) == 1 else 'them'}")
    if jobs is None:
        try:
            max_jobs()  # a bad $MAX_JOBS is reported now, not as a traceback once the build starts
        except ToolchainError:
            raise UserError(f"MAX_JOBS={os.environ.get('MAX_JOBS', '').strip()!r} is not a whole number: "
                            "set e.g. MAX_JOBS=8, unset it, or pass --jobs N") from None
    rules = Rules.load(rules_path)
    configs = _targets(rules, archs)
    if forward_only:
        configs = list(dict.fromkeys(replace(c, forward_only=True) for c in configs))
    lengths = _parse_seq_lens(seq_lens)
    job, skipped = _tuning_job(rules, layouts_file, lengths) if tune else (None, None)
    try:
        toolchain = find_toolchain()
    except ToolchainError as exc:
        raise UserError(str(exc)) from None
    if job is not None:  # the candidates join the build: one ninja graph for everything
        for space in job.spaces:
            for config, reason in space.pruned:
                click.echo(f"pruned before compiling: {config.label}: {reason}")
        configs = list(dict.fromkeys(configs + job.configs))
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

    started = time.perf_counter()
    try:
        # While tuning, a candidate that fails to compile scores infinity; the rest still builds.
        results = _build_all(variants, jobs, keep_going=job is not None)
    except BuildError as exc:
        raise UserError(str(exc)) from None
    elapsed = time.perf_counter() - started

    rows = []
    for result in results:
        v, meta = result.variant, result.meta
        if result.error is not None:
            rows.append([v.config.label, "FAILED", "-", "-", "-", v.module])
            continue
        size = meta.get("extension_bytes", 0)
        rows.append([v.config.label, "built" if result.built else "cached", *_ptxas_cells(v.config, meta),
                     _human_bytes(size), v.module])
    click.echo(_table(["variant", "status", "regs", "spills st/ld", "size", "module"], rows))
    if any(row[3].endswith("*") for row in rows):
        click.echo(TOLERATED_SPILL_NOTE)
    built = sum(r.built for r in results)
    failed = [r for r in results if r.error is not None]
    click.echo(f"{built} built, {len(results) - built - len(failed)} from the cache"
               + (f", {len(failed)} failed" if failed else "") + f", {elapsed:.1f} s")
    for result in failed:
        click.echo(f"FAILED to compile {result.variant.config.label} (scores infinity, tuning goes on): {result.error}")

    if not tune:
        return
    if job is None:
        click.echo(f"tuning skipped: {skipped}. The variants are built; run `omnigen build --rules {rules_path} --tune` "
                   "on a GPU machine to time the candidates and pick tiles.")
        return
    _tune(job, results, rounds, retune)


def _tune(job, results: list[cache.BuildResult], rounds: int | None, retune: bool) -> None:
    from .. import tune as tuner
    from ..tune import timing as tune_timing

    # The build above already holds every candidate: failures and ptxas pruning go into the job.
    for note in tuner.apply_builds(job, results):
        click.echo(f"pruned after compiling: {note}")
    for space in job.spaces:
        if not any(c.forward for c in space.candidates):
            raise UserError(f"no candidate of {space.dtype} d{space.head_dim} built and fits (see above): nothing to tune")

    started = time.perf_counter()
    entries = {} if retune else tuner.reusable(job)
    if entries:
        click.echo(f"tuning: reusing {len(entries)} tuned shape(s) from {cache.tuning_db_path()} (same GPU, nvcc, "
                   "rules, candidates and layouts); pass --retune to time again")
    else:
        rounds = rounds or tune_timing.DEFAULT_ROUNDS
        click.echo(f"tuning on {job.device.gpu} (sm {job.device.capability}, nvcc {job.device.nvcc}): "
                   f"{sum(len(s.candidates) for s in job.spaces)} candidate(s), {len(job.layouts)} sequence bucket(s), "
                   f"{job.workload['layouts']} layouts, {rounds} rounds x {tune_timing.DEFAULT_REPS} runs")
        with progress(tuner.count_steps(job, rounds), "timing candidates") as bar:
            entries = tuner.measure(job, rounds=rounds, on_step=bar.update)
    for key in sorted(entries, key=lambda k: (entries[k]["dtype"], entries[k]["head_dim"], entries[k]["seq_bucket"])):
        click.echo("")
        click.echo(_tuning_table(entries[key]))
    click.echo("")
    click.echo(f"tuning results: {cache.tuning_db_path()} ({len(entries)} shape(s); "
               f"{time.perf_counter() - started:.1f} s). `omnigen cache list` shows them; omnigen.attention and "
               "omnigen.build use them on this GPU.")


def _ms(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def _speedup(default_ms, best_ms) -> str:
    if not isinstance(default_ms, (int, float)) or not isinstance(best_ms, (int, float)) or best_ms <= 0:
        return "-"
    return f"{default_ms / best_ms:.2f}x"


def _tuning_table(entry: dict) -> str:
    """One shape bucket: every candidate's times and the winners."""
    work = entry.get("workload", {})
    title = (f"{entry['dtype']} d{entry['head_dim']}, S bucket {entry['seq_bucket']} "
             f"(B={work.get('batch', '?')} x S={work.get('seq_len', '?')}, H={work.get('heads', '?')}, "
             f"density {work.get('density', '?')}, {work.get('layouts', '?')} layouts)")
    rows = []
    for c in entry.get("candidates", []):
        name = c["tile"] + (" (default)" if c.get("default") else "")
        note = "" if c.get("status") == "ok" else c.get("status", "")
        rows.append([name, _ms(c.get("fwd_ms")), _ms(c.get("bwd_ms")), _ms(c.get("fwd_tflops"), 1),
                     _ms(c.get("bwd_tflops"), 1), c.get("winner") or "", note[:100]])
    table = _table(["candidate", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s", "winner", "note"], rows)
    default = entry.get("default", {})
    forward, backward = entry.get("forward") or {}, entry.get("backward") or {}
    from ..tune.db import describe

    names = describe(entry)
    summary = (f"-> forward {names['forward']} ({_speedup(default.get('fwd_ms'), forward.get('ms'))} vs default), "
               f"backward {names['backward']} ({_speedup(default.get('bwd_ms'), backward.get('ms'))} vs default)")
    return f"{title}\n{table}\n{summary}"


@cli.command()
@click.option("--rules", "rules_path", required=True, type=click.Path(dir_okay=False), help="rules YAML file")
@click.option("--arch", "archs", multiple=True, help="target arch (repeatable); default as for `omnigen build`")
@user_errors
def inspect(rules_path: str, archs: tuple[str, ...]) -> None:
    """Where the emitted sources and the built modules of the rules are."""
    rules = Rules.load(rules_path)
    configs = _targets(rules, archs)
    click.echo(f"rules {rules.name}: content hash {rules.content_hash()}, mask hash {rules.mask_hash()}")
    checked_in = regenerate.GENERATED_DIR / rules.name
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
        click.echo(f"  sources:   {', '.join(names[role] for role in ('kernel', 'backward', 'binding', 'mask'))}")
        click.echo(f"  backward:  {describe_backward(config)}")
        if toolchain is None:
            continue
        v = cache.variant(rules, config, toolchain)
        problem = cache.entry_problem(v.entry, v.key)
        if problem is None:
            meta = cache.read_meta(v.entry) or {}
            ptxas = meta.get("ptxas", {})
            click.echo(f"  built:     {v.entry / v.extension_file}")
            click.echo(f"  emitted:   {v.entry}/ ({', '.join(meta.get('sources', []))})")
            click.echo(f"  ptxas:     {ptxas.get('registers', '?')} registers, spills st/ld {spill_text(ptxas)} "
                       f"(as in `omnigen build`), {ptxas.get('stack_bytes', '?')} B stack; "
                       f"{family_of(config).describe_resources(config)}")
            click.echo(f"  built at:  {meta.get('built_at', '?')} in {meta.get('build_seconds', '?')} s")
        else:
            click.echo(f"  not in the cache ({problem}): would be {v.entry}")


@cli.group(name="cache")
def cache_group() -> None:
    """The kernel cache ($OMNIGEN_CACHE_DIR, default ~/.cache/omnigen)."""


@cache_group.command(name="list")
@user_errors
def cache_list() -> None:
    """What is tuned and built, and how much disk it takes."""
    found = cache.entries()
    click.echo(f"cache: {cache.cache_dir()}")
    _list_tuned()
    if not found:
        click.echo("empty")
        return
    rows = []
    for info in found:
        meta = info.meta or {}
        config = meta.get("config", {})
        label = meta.get("description") or (
            f"{config.get('dtype', '?')} d{config.get('head_dim', '?')} "
            f"m{config.get('block_m', '?')}n{config.get('block_n', '?')} {config.get('arch', '?')}")
        rows.append([meta.get("rules_name", "?"), label, _human_bytes(info.bytes), meta.get("built_at", "?"),
                     "ok" if info.problem is None else f"broken: {info.problem}", info.path.name])
    click.echo(_table(["rules", "variant", "size", "built", "state", "entry"], rows))
    click.echo(f"{len(found)} module(s), {_human_bytes(sum(i.bytes for i in found))}")


def _list_tuned() -> None:
    """The tuning database: one row per tuned shape, with what won and whether it still applies."""
    from ..tune.db import describe, staleness, stamp

    db = cache.read_tuning_db()
    if not db:
        return
    current = stamp()
    rows = []
    for key, entry in sorted(db.items(), key=lambda item: (item[1].get("rules_name", ""), item[1].get("gpu", ""),
                                                           str(item[1].get("dtype")), item[1].get("head_dim", 0),
                                                           item[1].get("seq_bucket", 0))):
        names, default = describe(entry), entry.get("default") or {}
        stale = staleness(entry, current)
        rows.append([entry.get("rules_name", "?"), f"{entry.get('gpu', '?')} (sm {entry.get('capability', '?')})",
                     f"{entry.get('dtype', '?')} d{entry.get('head_dim', '?')}", str(entry.get("seq_bucket", "?")),
                     f"{names['forward']} {names['forward_ms']} ms", f"{names['backward']} {names['backward_ms']} ms",
                     f"{_speedup(default.get('fwd_ms'), (entry.get('forward') or {}).get('ms'))} / "
                     f"{_speedup(default.get('bwd_ms'), (entry.get('backward') or {}).get('ms'))}",
                     (entry.get("meta") or {}).get("tuned_at", "?"), "ok" if stale is None else f"stale: {stale}"])
    click.echo(f"tuned shapes: {cache.tuning_db_path()}")
    click.echo(_table(["rules", "gpu", "variant", "S", "forward", "backward", "vs default fwd/bwd", "tuned", "state"],
                      rows))
    fresh = sum(row[-1] == "ok" for row in rows)
    click.echo(f"{len(rows)} tuned shape(s), {fresh} current, {len(rows) - fresh} stale (ignored)")
    click.echo("")


@cache_group.command(name="clear")
@user_errors
def cache_clear() -> None:
    """Remove every built module and the tuning database."""
    tuned = len(cache.read_tuning_db())
    removed, freed = cache.clear()
    click.echo(f"removed {removed} module(s), {_human_bytes(freed)}, and {tuned} tuned shape(s) from {cache.cache_dir()}")
