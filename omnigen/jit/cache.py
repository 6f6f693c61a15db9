"""The kernel cache: build each variant once, install it atomically, load it in milliseconds.

Layout under $OMNIGEN_CACHE_DIR (default ~/.cache/omnigen):

    modules/<module>-<key12>/     one installed variant: <module><EXT_SUFFIX>, meta.json, its sources
    locks/<module>-<key12>.lock   flock targets (the kernel drops a lock when its holder dies, so a
                                  file left behind by a killed build never blocks anyone)
    tuning.json                   the tuning database (omnigen/tune/db.py says what is in it); written
                                  whole under locks/tuning.lock, through a temp file and os.replace
    tmp/                          builds in progress (<entry>.<pid>.<random>/), moved into modules/
                                  with os.replace once complete; leftovers of dead processes are removed

The key hashes what goes into the binary: the rendered sources, the primitive headers, the flags,
the toolchain versions (nvcc, c++, pybind11, Python ABI) and the arch. meta.json, written last,
fingerprints the .so (size and sha256); an entry whose meta.json is missing or unreadable, or whose
.so does not match it (a half-written or truncated file), is rebuilt. Only this module writes here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Iterator

from ..version import __version__
from .toolchain import (
    BuildError, Toolchain, find_toolchain, find_torch_build, flags_fingerprint, host_library_flags,
    host_library_link_flags, host_library_ninja, kernel_log_text, module_ninja, ptxas_report, run_ninja, top_ninja,
)
from ..rules import Rules
from ..targets import KernelConfig
from .codegen import header_files, module_name, render, variant_stem

META_FILE = "meta.json"
META_FORMAT = 1


class CacheDirError(ValueError):
    """The cache directory cannot be used (a file, or not writable); the message says how to fix it."""


def _cache_dir_source() -> tuple[Path, str]:
    configured = os.environ.get("OMNIGEN_CACHE_DIR", "").strip()
    if configured:
        return Path(configured).expanduser(), f"OMNIGEN_CACHE_DIR is {configured}"
    path = Path.home() / ".cache" / "omnigen"
    return path, f"the cache directory {path}"


_FIX = "Fix: point OMNIGEN_CACHE_DIR at a directory you can write (it is made if missing), or unset it"


def cache_dir() -> Path:
    """$OMNIGEN_CACHE_DIR, default ~/.cache/omnigen. CacheDirError when it (or a parent) is a file."""
    path, named = _cache_dir_source()
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "which is a file" if part == path else f"but {part} is a file"
                raise CacheDirError(f"{named}, {what}, not a directory. {_FIX} (default ~/.cache/omnigen).")
            break
    return path


def writable_cache_dir() -> Path:
    """cache_dir(), made if missing; CacheDirError when it cannot be made or written."""
    path = cache_dir()
    named = _cache_dir_source()[1]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(f"{named}, which cannot be created ({exc.strerror}). {_FIX}.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheDirError(f"{named}, which this user cannot write. {_FIX}.")
    return path


@dataclass
class Variant:
    """One (rules, config) ready to build or load: its module name, sources and cache key."""

    rules: Rules
    config: KernelConfig
    module: str
    sources: dict[str, str]
    key: str
    toolchain: Toolchain = field(repr=False)

    @property
    def stem(self) -> str:
        return variant_stem(self.rules, self.config)

    @property
    def entry_name(self) -> str:
        return f"{self.module}-{self.key[:12]}"

    @property
    def entry(self) -> Path:
        return cache_dir() / "modules" / self.entry_name

    @property
    def extension_file(self) -> str:
        return f"{self.module}{self.toolchain.ext_suffix}"


def cache_key(sources: dict[str, str], headers: dict[str, str], flags: dict, toolchain: dict, arch: str) -> str:
    digest = hashlib.sha256()
    payload = {
        "sources": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(sources.items())},
        "headers": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(headers.items())},
        "flags": flags,
        "toolchain": toolchain,
        "arch": arch,
    }
    digest.update(json.dumps(payload, sort_keys=True).encode())
    return digest.hexdigest()


def variant(rules: Rules, config: KernelConfig, toolchain: Toolchain | None = None) -> Variant:
    toolchain = toolchain or find_toolchain()
    sources = render(rules, config)
    key = cache_key(sources, header_files(config), flags_fingerprint(config), toolchain.fingerprint(), config.arch)
    return Variant(rules=rules, config=config, module=module_name(rules, config), sources=sources, key=key,
                   toolchain=toolchain)


# ------------------------------------------------------------------------------------------------
# locking and checking entries


@contextlib.contextmanager
def module_lock(entry_name: str) -> Iterator[None]:
    """An exclusive flock per module. Python opens files close-on-exec, so ninja and the compilers
    never inherit the lock: it is released the moment this process dies, however it dies."""
    directory = writable_cache_dir() / "locks"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(f"{directory} cannot be created ({exc.strerror}). {_FIX}.") from None
    with open(directory / f"{entry_name}.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_meta(entry: Path) -> dict | None:
    try:
        meta = json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == META_FORMAT else None


def entry_problem(entry: Path, key: str | None = None) -> str | None:
    """Why an installed entry cannot be used (None when it is sound)."""
    if not entry.is_dir():
        return "not built"
    meta = read_meta(entry)
    if meta is None:
        return "meta.json is missing or unreadable"
    if key is not None and meta.get("key") != key:
        return "meta.json belongs to another build"
    extension = entry / str(meta.get("extension", ""))
    try:
        size = extension.stat().st_size
    except OSError:
        return f"{extension.name} is missing"
    if size != meta.get("extension_bytes"):
        return f"{extension.name} has {size} bytes, meta.json says {meta.get('extension_bytes')} (truncated?)"
    if _sha256(extension) != meta.get("extension_sha256"):
        return f"{extension.name} does not match its sha256 in meta.json"
    return None


_loaded: dict[str, ModuleType] = {}


def import_extension(path: Path, module: str) -> ModuleType:
    """Import a built extension by file path (once per process: an extension cannot be loaded twice)."""
    if module in _loaded:
        return _loaded[module]
    loader = importlib.machinery.ExtensionFileLoader(module, str(path))
    spec = importlib.util.spec_from_file_location(module, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {path}")
    extension = importlib.util.module_from_spec(spec)
    loader.exec_module(extension)
    _loaded[module] = extension
    return extension


def _load_entry(v: Variant) -> ModuleType:
    extension = import_extension(v.entry / v.extension_file, v.module)
    if getattr(extension, "MODULE_NAME", None) != v.module:
        raise ImportError(f"{v.entry} holds {getattr(extension, 'MODULE_NAME', '?')}, expected {v.module}")
    return extension


def load(v: Variant) -> ModuleType | None:
    """The installed module if its entry is sound, else None (no lock: entries only appear whole)."""
    if v.module in _loaded:
        return _loaded[v.module]
    if entry_problem(v.entry, v.key) is not None:
        return None
    try:
        return _load_entry(v)
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------------
# building


@dataclass
class BuildResult:
    variant: Variant
    built: bool  # False: it was already in the cache
    seconds: float
    meta: dict
    error: str | None = None  # keep-going builds only: why this variant did not build (nothing installed)


def _remove_dead_builds() -> None:
    """Drop tmp/ leftovers of processes that no longer exist (e.g. killed with SIGKILL mid-build)."""
    tmp = cache_dir() / "tmp"
    if not tmp.is_dir():
        return
    for path in tmp.iterdir():
        parts = path.name.rsplit(".", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _write_build_dir(v: Variant, build_dir: Path) -> Path:
    build_dir.mkdir(parents=True)
    for name, text in v.sources.items():
        (build_dir / name).write_text(text)
    ninja_file = build_dir / "build.ninja"
    ninja_file.write_text(module_ninja(build_dir, v.module, v.rules.name, v.config, v.toolchain, v.stem))
    return ninja_file


def _install(v: Variant, build_dir: Path, seconds: float) -> dict:
    """Fingerprint the built extension, write meta.json last, and move the directory into place."""
    extension = build_dir / v.extension_file
    log = kernel_log_text(build_dir, v.stem)
    meta = {
        "format": META_FORMAT,
        "key": v.key,
        "module": v.module,
        "extension": v.extension_file,
        "extension_bytes": extension.stat().st_size,
        "extension_sha256": _sha256(extension),
        "rules_name": v.rules.name,
        "rules_hash": v.rules.without_kernel().content_hash(),
        "mask_hash": v.rules.mask_hash(),
        "config": v.config.as_dict(),
        "sources": sorted(v.sources),
        "omnigen_version": __version__,
        "toolchain": v.toolchain.fingerprint(),
        "flags": flags_fingerprint(v.config),
        "ptxas": ptxas_report(log) if log else {},
        "build_seconds": round(seconds, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _place_entry(build_dir, v.entry, meta)
    return meta


def _place_entry(build_dir: Path, target: Path, meta: dict) -> None:
    """Drop the build's leftovers, write meta.json last, and move the directory into place as `target`."""
    for leftover in list(build_dir.glob("*.o")) + [build_dir / ".ninja_log", build_dir / ".ninja_deps"]:
        leftover.unlink(missing_ok=True)
    (build_dir / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a corrupt entry: move it aside first (os.replace will not replace a full directory)
        trash = cache_dir() / "tmp" / f"{target.name}.{os.getpid()}.{secrets.token_hex(4)}-stale"
        os.replace(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(build_dir, target)


def build_variants(
    variants: list[Variant],
    jobs: int | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    keep_going: bool = False,
) -> list[BuildResult]:
    """Make sure every variant is installed: build the missing ones as one parallel ninja graph.

    Holds every missing variant's lock (in a fixed order, so two such calls never deadlock) while
    it rechecks, builds and installs; a variant someone else finished meanwhile is just loaded.
    A failed compile raises BuildError; with `keep_going` the others still build and install, and
    the failed ones come back with `error` set (the tuner scores them infinity and goes on).
    """
    results: dict[str, BuildResult] = {}
    missing: list[Variant] = []
    for v in variants:
        if entry_problem(v.entry, v.key) is None:
            results[v.entry_name] = BuildResult(v, False, 0.0, read_meta(v.entry) or {})
        elif v.entry_name not in {m.entry_name for m in missing}:
            missing.append(v)
    if missing:
        with contextlib.ExitStack() as stack:
            for v in sorted(missing, key=lambda m: m.entry_name):
                stack.enter_context(module_lock(v.entry_name))
            still_missing = []
            for v in missing:
                if entry_problem(v.entry, v.key) is None:  # built by another process while we waited
                    results[v.entry_name] = BuildResult(v, False, 0.0, read_meta(v.entry) or {})
                else:
                    still_missing.append(v)
            if still_missing:
                results.update(_build_locked(still_missing, jobs, on_progress, keep_going))
    return [results[v.entry_name] for v in variants]


def _failure_summary(build_dir: Path, output: str) -> str:
    """The compiler's first error line for one variant (its per-object logs), else ninja's FAILED line."""
    for log in sorted(build_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "error" in line.lower():
                return line.strip()[:300]
    for line in output.splitlines():
        if line.startswith("FAILED:") and str(build_dir) in line:
            return line.strip()[:300]
    return "the compile or link step failed (no compiler message)"


def _build_locked(variants: list[Variant], jobs: int | None,
                  on_progress: Callable[[int, int, str], None] | None,
                  keep_going: bool = False) -> dict[str, BuildResult]:
    _remove_dead_builds()
    tmp = cache_dir() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    root = tmp / f"build.{os.getpid()}.{secrets.token_hex(4)}"
    root.mkdir()
    try:
        module_files = []
        build_dirs = {}
        for v in variants:
            build_dir = root / v.entry_name
            module_files.append(_write_build_dir(v, build_dir))
            build_dirs[v.entry_name] = build_dir
        (root / "build.ninja").write_text(top_ninja(module_files))
        started = time.perf_counter()
        output = run_ninja(root, variants[0].toolchain, jobs=jobs, on_progress=on_progress, keep_going=keep_going)
        seconds = time.perf_counter() - started
        out = {}
        for v in variants:
            build_dir = build_dirs[v.entry_name]
            if keep_going and not (build_dir / v.extension_file).is_file():
                out[v.entry_name] = BuildResult(v, False, seconds, {}, error=_failure_summary(build_dir, output))
                continue
            meta = _install(v, build_dir, seconds)
            out[v.entry_name] = BuildResult(v, True, seconds, meta)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def get_module(rules: Rules, config: KernelConfig, toolchain: Toolchain | None = None) -> ModuleType:
    """The compiled module of one variant: from the cache, else built now (then cached)."""
    v = variant(rules, config, toolchain)
    module = load(v)
    if module is not None:
        return module
    build_variants([v])
    try:
        return _load_entry(v)
    except ImportError as exc:
        raise BuildError(f"{v.entry} was built but does not import: {exc}", str(exc)) from exc


# ------------------------------------------------------------------------------------------------
# host libraries: C++ built against this process's torch (the op shim), once per torch and source


def get_host_library(name: str, sources: dict[str, str], include_dirs: Iterable[Path], description: str) -> Path:
    """The shared library built from `sources` (file name -> C++ text) against this process's torch: from the
    cache, else compiled now under the entry's lock and installed whole. Its key hashes the sources, every header
    under `include_dirs`, the flags, the C++ compiler and the torch build."""
    toolchain, torch_build = find_toolchain(), find_torch_build()
    include_dirs = [Path(d) for d in include_dirs]
    headers = {f"{d.name}/{p.relative_to(d).as_posix()}": p.read_text()
               for d in include_dirs for p in sorted(d.rglob("*")) if p.is_file()}
    flags = {"cxx": host_library_flags(torch_build), "link": host_library_link_flags(torch_build)}
    key = cache_key(sources, headers, flags, {**toolchain.fingerprint(), **torch_build.fingerprint()}, "host")
    library = f"{name}.so"
    entry = cache_dir() / "modules" / f"{name}-{key[:12]}"
    if entry_problem(entry, key) is None:
        return entry / library
    with module_lock(entry.name):
        if entry_problem(entry, key) is None:  # built by another process while we waited
            return entry / library
        _remove_dead_builds()
        (cache_dir() / "tmp").mkdir(parents=True, exist_ok=True)
        build_dir = cache_dir() / "tmp" / f"{entry.name}.{os.getpid()}.{secrets.token_hex(4)}"
        build_dir.mkdir()
        try:
            for file_name, text in sources.items():
                (build_dir / file_name).write_text(text)
            (build_dir / "build.ninja").write_text(host_library_ninja(
                build_dir, [build_dir / n for n in sources], build_dir / library, include_dirs, toolchain,
                torch_build))
            started = time.perf_counter()
            run_ninja(build_dir, toolchain, jobs=1)
            meta = {
                "format": META_FORMAT, "key": key, "module": name, "rules_name": "-", "description": description,
                "extension": library, "extension_bytes": (build_dir / library).stat().st_size,
                "extension_sha256": _sha256(build_dir / library), "sources": sorted(sources),
                "omnigen_version": __version__, "toolchain": {**toolchain.fingerprint(), **torch_build.fingerprint()},
                "flags": flags,
                "build_seconds": round(time.perf_counter() - started, 2),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            _place_entry(build_dir, entry, meta)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return entry / library


# ------------------------------------------------------------------------------------------------
# the tuning database: one JSON file, {"format": N, "entries": {key: entry}}; omnigen/tune/db.py owns the
# meaning of keys and entries, this module only reads and writes the file.

TUNING_FILE = "tuning.json"


def tuning_db_path() -> Path:
    return cache_dir() / TUNING_FILE


def read_tuning_db() -> dict[str, dict]:
    """Every entry of the tuning database (empty when there is none, or it is unreadable: tuning
    results are an optimisation, never a reason to fail)."""
    try:
        data = json.loads(tuning_db_path().read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}


def update_tuning_db(new_entries: dict[str, dict], remove: Iterable[str] = ()) -> Path:
    """Merge entries into the database: read, update, write a temp file, os.replace -- all under one
    flock, so two processes tuning different shapes both keep their results."""
    path = tuning_db_path()
    with module_lock("tuning"):
        entries = read_tuning_db()
        for key in remove:
            entries.pop(key, None)
        entries.update(new_entries)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        temporary.write_text(json.dumps({"format": 1, "entries": entries}, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, path)
    return path


# ------------------------------------------------------------------------------------------------
# listing and clearing


@dataclass
class EntryInfo:
    path: Path
    meta: dict | None
    bytes: int
    problem: str | None


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def entries() -> list[EntryInfo]:
    modules = cache_dir() / "modules"
    if not modules.is_dir():
        return []
    out = []
    for path in sorted(modules.iterdir()):
        if path.is_dir():
            out.append(EntryInfo(path, read_meta(path), _tree_bytes(path), entry_problem(path)))
    return out


def clear() -> tuple[int, int]:
    """Remove every installed module, leftover build and the tuning database; returns (entries
    removed, bytes freed) for the modules.

    An entry being rebuilt right now keeps its lock; removing the directory under it is safe
    because the builder installs with os.replace afterwards.
    """
    root = cache_dir()
    removed, freed = 0, 0
    for info in entries():
        freed += info.bytes
        shutil.rmtree(info.path, ignore_errors=True)
        removed += 1
    tmp = root / "tmp"
    if tmp.is_dir():
        _remove_dead_builds()
    with module_lock("tuning"):
        tuning_db_path().unlink(missing_ok=True)
    return removed, freed


__all__ = [
    "BuildResult", "EntryInfo", "Variant", "build_variants", "cache_dir", "cache_key", "clear", "entries",
    "entry_problem", "get_host_library", "get_module", "import_extension", "load", "module_lock", "read_meta",
    "read_tuning_db", "tuning_db_path", "update_tuning_db", "variant",
]
