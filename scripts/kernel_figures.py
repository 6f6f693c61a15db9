"""Registers, spills, shared memory and SASS instruction counts per kernel, per variant, for the current tree.

Renders each variant with omnigen.jit.codegen.render, compiles its kernel file to a cubin with the build's nvcc
flags (omnigen.jit.toolchain.nvcc_flags, minus the host-only ones), and prints ptxas's figures per kernel. With
--sass it also counts SASS instructions per kernel (cuobjdump; `pip install nvidia-cuda-cuobjdump`), in total
and for the classes that matter for speed (HMMA, LDSM, LDGSTS, BAR, LDS, STS, LDL/STL, BRA).

Use it to check that a template refactor leaves the compiled code as it was:

    python scripts/kernel_figures.py --json before.json            # on the old tree
    python scripts/kernel_figures.py --json after.json --compare before.json

Variants: --preset tune (default) is the tuner's DEFAULT_SPACE for head dims 64 and 128 plus the d256
default, bf16, sm_80 and sm_90a, on the transfusion rules; --preset hot is bf16 d64/d128 m128n64w4s2 on
sm_90a with --sass; --variant RULES:DTYPE:D:MxNxWxS:ARCH[:FAMILY] adds single ones (rules: a name under
examples/rules/ or a path).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omnigen.jit import codegen, toolchain  # noqa: E402
from omnigen.kernels import family_of, problems  # noqa: E402
from omnigen.kernels.sm80.resources import DEFAULT_TILE_D256  # noqa: E402
from omnigen.kernels.sm80.space import DEFAULT_SPACE  # noqa: E402
from omnigen.rules import Rules  # noqa: E402
from omnigen.targets import DEFAULT_TILE, KernelConfig, TileConfig  # noqa: E402

SASS_CLASSES = ("HMMA", "LDSM", "LDGSTS", "BAR", "LDS", "STS", "LDL", "STL", "BRA", "MUFU", "SHFL")
SHORT_KERNEL = re.compile(r"(forward_kernel|dkdv_kernel|dq_kernel|delta_kernel)")


def parse_variant(text: str) -> tuple[str, KernelConfig]:
    rules, dtype, head_dim, tile, arch, *family = text.split(":")
    m, n, w, s = (int(x) for x in tile.lower().split("x"))
    return rules, KernelConfig(int(head_dim), dtype, arch, TileConfig(m, n, w, s), kernel_family="".join(family))


def preset(name: str) -> list[tuple[str, KernelConfig]]:
    """The sm80 family's variants (on sm_90a too, where sm90 is the default family)."""
    out: list[tuple[str, KernelConfig]] = []
    if name == "tune":
        for arch in ("sm_80", "sm_90a"):
            for head_dim in (64, 128):
                for tile in DEFAULT_SPACE[head_dim]:
                    out.append(("transfusion", KernelConfig(head_dim, "bf16", arch, tile, kernel_family="sm80")))
            out.append(("transfusion", KernelConfig(256, "bf16", arch, DEFAULT_TILE_D256, kernel_family="sm80")))
        # the other template branches: fp16, isolated documents without images, sliding windows
        out.append(("transfusion", KernelConfig(128, "fp16", "sm_90a", DEFAULT_TILE, kernel_family="sm80")))
        out.append(("causal_documents", KernelConfig(128, "bf16", "sm_90a", DEFAULT_TILE, kernel_family="sm80")))
        out.append(("sliding_window", KernelConfig(64, "fp16", "sm_80", DEFAULT_TILE, kernel_family="sm80")))
    elif name == "hot":
        for head_dim in (64, 128):
            out.append(("transfusion", KernelConfig(head_dim, "bf16", "sm_90a", DEFAULT_TILE, kernel_family="sm80")))
    return out


def load_rules(name: str) -> Rules:
    path = Path(name)
    if not path.is_file():
        path = ROOT / "examples" / "rules" / f"{name}.yaml"
    return Rules.load(path)


def cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13  # type: ignore

        candidate = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump"
        return str(candidate) if candidate.is_file() else None
    except ImportError:
        return None


def sass_counts(cubin: Path) -> dict[str, dict[str, int]]:
    tool = cuobjdump()
    if tool is None:
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    text = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"\s*Function : (\S+)", line)
        if match:
            short = SHORT_KERNEL.search(match.group(1))
            current = short.group(1) if short else match.group(1)
            out[current] = {"total": 0, **{c: 0 for c in SASS_CLASSES}}
            continue
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match and current is not None:
            opcode = match.group(1)
            if opcode == "NOP":
                continue
            out[current]["total"] += 1
            base = opcode.split(".")[0]
            for c in SASS_CLASSES:
                if base == c:
                    out[current][c] += 1
    return out


def compile_variant(rules_name: str, config: KernelConfig, sass: bool, keep: Path | None) -> dict:
    rules = load_rules(rules_name)
    sources = codegen.render(rules, config)
    names = codegen.source_names(rules, config)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, text in sources.items():
            (work / name).write_text(text)
        flags = [f for f in toolchain.nvcc_flags(config) if not f.startswith("-Xcompiler")]
        flags = [f.replace("-Xptxas=-v,-warn-spills,-warn-lmem-usage", "-Xptxas=-v") for f in flags]
        output = ""
        cubins = []
        for role in ("kernel", "backward"):  # one translation unit per pass
            cubin = work / f"{role}.cubin"
            command = ["nvcc", *flags, "-cubin", "-o", str(cubin), *("-I" + str(d) for d in family_of(config).include_dirs),
                       "-I" + str(work), str(work / names[role])]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{rules_name} {config.label}:\n{result.stdout}{result.stderr}")
            output += result.stdout + result.stderr
            cubins.append(cubin)
        report = toolchain.ptxas_report(output)
        kernels = {}
        for name, figures in report.get("kernels", {}).items():
            short = SHORT_KERNEL.search(name)
            kernels[short.group(1) if short else name] = figures
        context = family_of(config).render_context(config)  # the family's shared-memory figures, as rendered
        entry = {"rules": rules_name, "label": config.label, "kernels": kernels,
                 "smem": {"forward_kernel": context.get("shared_bytes"), "dkdv_kernel": context.get("bwd_shared_bytes"),
                          "dq_kernel": context.get("dq_shared_bytes")}}
        if sass:
            entry["sass"] = {kernel: counts for cubin in cubins for kernel, counts in sass_counts(cubin).items()}
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for cubin in cubins:
                shutil.copy(cubin, keep / f"{rules_name}_{config.label}_{cubin.stem}.cubin")
        return entry


def key(entry: dict) -> str:
    # Labels name the sm80 family only where it is not the arch's own (sm_90a): the baseline predates sm90.
    return f"{entry['rules']}:{entry['label'].removesuffix('_sm80')}"


def fmt_figures(f: dict | None) -> str:
    if not f:
        return "-"
    return f"{f.get('registers', '?')}r {f.get('spill_store_bytes', 0)}/{f.get('spill_load_bytes', 0)}B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tune", "hot", "none"), default="tune")
    parser.add_argument("--variant", action="append", default=[], help="RULES:DTYPE:D:MxNxWxS:ARCH[:FAMILY]")
    parser.add_argument("--sass", action="store_true", help="count SASS instructions too (hot preset: always)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--compare", type=Path, help="print differences against this earlier --json output")
    parser.add_argument("--keep-cubins", type=Path, help="copy each cubin into this folder")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    variants = preset(args.preset) + [parse_variant(v) for v in args.variant]
    for rules_name, config in variants:  # the tuner prunes these before compiling (tune_space.prune)
        if problems(config):
            print(f"skipped {rules_name}:{config.label}: {'; '.join(problems(config))}")
    variants = [(r, c) for r, c in variants if not problems(c)]
    sass = args.sass or args.preset == "hot"
    with ThreadPoolExecutor(args.jobs) as pool:
        entries = list(pool.map(lambda v: compile_variant(v[0], v[1], sass, args.keep_cubins), variants))
    kernels = ("forward_kernel", "dkdv_kernel", "dq_kernel", "delta_kernel")
    print(f"{'variant':58s} " + " ".join(f"{k:>16s}" for k in kernels) + "  smem fwd/dkdv/dq")
    for entry in entries:
        smem = entry["smem"]
        print(f"{key(entry):58s} " + " ".join(f"{fmt_figures(entry['kernels'].get(k)):>16s}" for k in kernels) +
              f"  {smem['forward_kernel']}/{smem['dkdv_kernel']}/{smem['dq_kernel']}")
    if sass:
        print()
        print(f"{'variant / kernel':58s} " + " ".join(f"{c:>6s}" for c in ("total",) + SASS_CLASSES))
        for entry in entries:
            for kernel, counts in entry.get("sass", {}).items():
                print(f"{key(entry) + ' ' + kernel:58s} " + " ".join(f"{counts[c]:>6d}" for c in ("total",) + SASS_CLASSES))
    if args.json:
        args.json.write_text(json.dumps(entries, indent=1))
    if args.compare:
        before = {key(e): e for e in json.loads(args.compare.read_text())}
        differences = 0
        print("\ndifferences against", args.compare)
        for entry in entries:
            old = before.get(key(entry))
            if old is None:
                print(f"  {key(entry)}: not in {args.compare}")
                continue
            for kernel in kernels:
                a, b = old["kernels"].get(kernel), entry["kernels"].get(kernel)
                if a != b:
                    differences += 1
                    print(f"  {key(entry)} {kernel}: {fmt_figures(a)} -> {fmt_figures(b)} (stack "
                          f"{(a or {}).get('stack_bytes')} -> {(b or {}).get('stack_bytes')})")
            for kernel, counts in entry.get("sass", {}).items():
                old_counts = old.get("sass", {}).get(kernel)
                if old_counts and old_counts != counts:
                    differences += 1
                    delta = {c: counts[c] - old_counts[c] for c in counts if counts[c] != old_counts[c]}
                    print(f"  {key(entry)} {kernel} SASS: {delta}")
        print(f"  {differences} difference(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
