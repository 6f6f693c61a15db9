"""Cold build time of one variant and warm load time, each in a fresh process.

    PYTHONPATH=. python benchmarks/bench_build.py [--arch sm_80] [--head-dim 128] [--repeats 10] [--json out.json]

cold: an empty $OMNIGEN_CACHE_DIR, `cache.get_module(rules, config)` (render, nvcc + c++ in parallel, link,
install, import). warm: a new process each time, the same call with the entry in the cache (render, key,
fingerprint check, import), median of --repeats. `import omnigen` (torch) is not counted in either.
Targets: warm load <= 100 ms; cold build <= 20 s on a 16-core GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys, time
import omnigen
from omnigen.jit import cache
from omnigen.kernels.sm80.resources import default_tile
from omnigen.targets import KernelConfig
rules = omnigen.Rules(name="bench_build", modalities={"text": "causal", "image": "full"})
config = KernelConfig(head_dim=int(sys.argv[1]), dtype="bf16", arch=sys.argv[2], tile=default_tile(int(sys.argv[1])))
start = time.perf_counter()
module = cache.get_module(rules, config)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "module": module.MODULE_NAME}))
"""


def probe(cache_dir: str, head_dim: int, arch: str) -> dict:
    env = dict(os.environ, OMNIGEN_CACHE_DIR=cache_dir, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", PROBE, str(head_dim), arch], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"probe failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=None, help="default: the visible GPU, else sm_80")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from omnigen.jit.toolchain import describe_toolchain, find_toolchain, visible_gpu_arch

    arch = args.arch or visible_gpu_arch() or "sm_80"
    with tempfile.TemporaryDirectory(prefix="omnigen-bench-") as cache_dir:
        cold = probe(cache_dir, args.head_dim, arch)
        warm = [probe(cache_dir, args.head_dim, arch)["seconds"] for _ in range(args.repeats)]
    result = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
        "toolchain": describe_toolchain(find_toolchain()),
        "max_jobs": os.environ.get("MAX_JOBS", str(os.cpu_count())),
        "variant": f"bf16 d{args.head_dim} default tile {arch}",
        "module": cold["module"],
        "cold_build_s": round(cold["seconds"], 2),
        "warm_load_ms_median": round(1e3 * statistics.median(warm), 1),
        "warm_load_ms_min": round(1e3 * min(warm), 1),
        "warm_load_ms_max": round(1e3 * max(warm), 1),
    }
    for key, value in result.items():
        print(f"{key:>20}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
