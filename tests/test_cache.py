"""The kernel cache under stress: concurrent builds, a build killed mid-way, a truncated .so.

The `nvcc` tests compile one small variant three times (about a minute on 2 cores); each runs its
builders in subprocesses with a private $OMNIGEN_CACHE_DIR.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import omnigen
from omnigen.jit import cache
from omnigen.targets import KernelConfig, TileConfig

from test_toolchain import HAS_NVCC

REPO = Path(__file__).resolve().parent.parent
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")

# Built by the worker below; small tile, one arch: the quickest real compile.
WORKER = r"""
import json, sys, time
import omnigen
from omnigen.jit import cache
from omnigen.targets import KernelConfig, TileConfig
rules = omnigen.Rules(name="cachetest", modalities={"text": "causal", "image": "full"})
config = KernelConfig(head_dim=64, dtype="bf16", arch="sm_80", tile=TileConfig(64, 64, 4, 2))
v = cache.variant(rules, config)
start = time.time()
result = cache.build_variants([v])[0]
module = cache.get_module(rules, config)
print(json.dumps({"built": result.built, "module": module.MODULE_NAME, "hash": module.RULES_HASH,
                  "seconds": time.time() - start}))
"""


def _environment(cache_dir: Path) -> dict[str, str]:
    return dict(os.environ, OMNIGEN_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO), MAX_JOBS="2")


def _worker(cache_dir: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER], env=_environment(cache_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _finish(process: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"worker failed:\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def _entries(cache_dir: Path) -> list[Path]:
    modules = cache_dir / "modules"
    return sorted(modules.iterdir()) if modules.is_dir() else []


# ------------------------------------------------------------------------------------------------
# without a compiler


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("OMNIGEN_CACHE_DIR", raising=False)
    assert cache.cache_dir() == Path.home() / ".cache" / "omnigen"
    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path))
    assert cache.cache_dir() == tmp_path


def test_entry_problems(tmp_path):
    entry = tmp_path / "entry"
    assert cache.entry_problem(entry) == "not built"
    entry.mkdir()
    assert "meta.json" in cache.entry_problem(entry)
    (entry / "meta.json").write_text("{half")
    assert "meta.json" in cache.entry_problem(entry)
    (entry / "mod.so").write_bytes(b"x" * 100)
    meta = {"format": cache.META_FORMAT, "key": "k", "extension": "mod.so", "extension_bytes": 100,
            "extension_sha256": cache._sha256(entry / "mod.so")}
    (entry / "meta.json").write_text(json.dumps(meta))
    assert cache.entry_problem(entry, "k") is None
    assert "another build" in cache.entry_problem(entry, "other")
    (entry / "mod.so").write_bytes(b"x" * 50)
    assert "truncated" in cache.entry_problem(entry, "k")
    (entry / "mod.so").write_bytes(b"y" * 100)
    assert "sha256" in cache.entry_problem(entry, "k")


def test_lock_is_not_a_leftover_file(tmp_path, monkeypatch):
    """A lock file left by a dead holder blocks nobody: flock dies with its process."""
    monkeypatch.setenv("OMNIGEN_CACHE_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom omnigen.jit import cache\n"
         "with cache.module_lock('m'):\n    print('held', flush=True)\n    time.sleep(60)"],
        env=_environment(tmp_path), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert (tmp_path / "locks" / "m.lock").exists()
    started = time.time()
    with cache.module_lock("m"):
        pass
    assert time.time() - started < 5


# ------------------------------------------------------------------------------------------------
# with nvcc


@pytest.mark.nvcc
@needs_nvcc
def test_eight_concurrent_builds_compile_once(tmp_path):
    workers = [_worker(tmp_path) for _ in range(8)]
    results = [_finish(w) for w in workers]
    assert sum(r["built"] for r in results) == 1, results
    assert len({r["module"] for r in results}) == 1
    assert len(_entries(tmp_path)) == 1
    assert not list((tmp_path / "tmp").glob("build.*"))


@pytest.mark.nvcc
@needs_nvcc
def test_killed_build_then_next_build_succeeds(tmp_path):
    victim = _worker(tmp_path, start_new_session=True)
    deadline = time.time() + 120
    # Wait until the compilers are running (their logs appear), then SIGKILL the whole build.
    while time.time() < deadline and not list((tmp_path / "tmp").glob("build.*/*/*.log")):
        time.sleep(0.1)
    assert victim.poll() is None, "the build finished before it could be killed"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert _entries(tmp_path) == []
    result = _finish(_worker(tmp_path))
    assert result["built"] is True
    assert len(_entries(tmp_path)) == 1
    leftovers = [p for p in (tmp_path / "tmp").glob("build.*")]
    assert leftovers == [], leftovers  # the dead build's directory was cleaned up


@pytest.mark.nvcc
@needs_nvcc
def test_truncated_extension_is_rebuilt(tmp_path):
    first = _finish(_worker(tmp_path))
    assert first["built"] is True
    (entry,) = _entries(tmp_path)
    meta = json.loads((entry / "meta.json").read_text())
    extension = entry / meta["extension"]
    data = extension.read_bytes()
    extension.write_bytes(data[: len(data) // 2])
    assert "truncated" in cache.entry_problem(entry, meta["key"])
    again = _finish(_worker(tmp_path))
    assert again["built"] is True and again["module"] == first["module"]
    assert cache.entry_problem(entry, meta["key"]) is None
    warm = _finish(_worker(tmp_path))
    assert warm["built"] is False
