"""Does a source refactor leave the machine code as it was? SASS of representative default variants, per kernel.

Renders each variant with the tree's omnigen.jit.codegen, compiles every translation unit it renders (a `.cu`
file no other rendered file includes) to a cubin with the build's nvcc flags, and writes per kernel its SASS with
addresses, encodings and names normalised away (cuobjdump --dump-sass), plus its resource usage (registers,
stack, shared memory: cuobjdump --dump-resource-usage). Kernels are keyed by their short name and template
arguments (forward_kernel, hopper_dkdv_kernel<true>, dkdv_kernel, dq_kernel, delta_kernel), so moving a kernel
into another namespace or translation unit changes nothing here.

    python scripts/sass_compare.py --tree /tmp/base --out /tmp/sass-before    # an older tree (git worktree)
    python scripts/sass_compare.py --out /tmp/sass-after --against /tmp/sass-before
    python scripts/sass_compare.py --out /tmp/sass-after --against /tmp/sass-before \
        --shift forward_kernel@sm_90a:0x440:-0x80

Each kernel's line also counts its local-memory instructions (LDL/STL) and, of those, the ones inside its step loops
(`step_loop_local_memory`): issue 30 asks for none there. And per step loop, its R2UR against its tensor products
(`step_loop_register_moves`): a change that moves the wgmma descriptors off the uniform datapath shows there as
several R2UR a product, before any GPU time is spent on it.

--shift KERNEL[@VARIANT]:FROM:DELTA compares that kernel (of the variants whose name contains VARIANT) as if its
earlier parameters at c[0x0][FROM] and above had moved by DELTA bytes (a kernel parameter that grew or shrank;
its CONSTANT[0] size too): the rest must match exactly.

Variants (--preset default): the transfusion and causal_documents rules of examples/rules, head dims 64, 128,
256, bf16, sm_90a, each family default tile (forward and backward); plus sm_80 d64 / d128 transfusion.
--variant RULES:DTYPE:D:MxNxWxS:ARCH[:FAMILY] adds single ones (e4m3: forward-only). Needs nvcc and cuobjdump
(`pip install nvidia-cuda-cuobjdump`; found on PATH or under site-packages/nvidia/cu13/bin).
"""

from __future__ import annotations

import argparse
import difflib
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
KERNEL_NAME = re.compile(r"(hopper_dkdv_kernel|forward_kernel|dkdv_kernel|dq_kernel|delta_kernel|convert_kernel)")
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*(/\*\s*0x[0-9a-f]+\s*\*/)?\s*$")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13  # type: ignore

        candidate = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump==13.2.51")


def kernel_key(mangled: str) -> str:
    """forward_kernel, hopper_dkdv_kernel<true>, ...: the short name plus bool template arguments."""
    match = KERNEL_NAME.search(mangled)
    name = match.group(1) if match else mangled
    rest = mangled[match.end():] if match else ""
    template = re.match(r"I((?:Lb[01]E)+)E", rest)
    if template:
        name += "<" + ",".join("true" if b == "1" else "false" for b in re.findall(r"Lb([01])E", template.group(1))) + ">"
    return name


def normalised_sass(text: str) -> dict[str, list[str]]:
    """Per kernel, its instructions without addresses and encodings."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = re.match(r"\s*Function : (\S+)", line)
        if match:
            current = out.setdefault(kernel_key(match.group(1)), [])
            continue
        match = INSTRUCTION.match(line)
        if match and current is not None:
            current.append(re.sub(r"\s+", " ", match.group(1)).strip())
    return out


TENSOR_OP = re.compile(r"\b(HGMMA|HMMA|QGMMA)\b")
LOCAL_MEMORY = re.compile(r"\b(LDL|STL)\b")
UNIFORM_MOVE = re.compile(r"\bR2UR\b")


def step_loops(lines: list[str]) -> list[tuple[int, int]]:
    """The step loops of a normalised kernel, as (first, last) instruction indices: instruction i sits at address 16 i.
    A loop is a branch back to an earlier address whose range holds no unpredicated EXIT (ptxas puts slow paths, such
    as an mbarrier wait's retry, after the kernel's end and branches back from there: not loops); a step loop is an
    innermost loop that issues tensor products (a persistent grid's loop over work tiles is not, it holds them)."""
    loops = []
    for i, line in enumerate(lines):
        match = re.search(r"\bBRA (0x[0-9a-f]+)", line)
        if match and int(match.group(1), 16) // 16 <= i:
            loops.append((int(match.group(1), 16) // 16, i))
    exits = [i for i, line in enumerate(lines) if line == "EXIT"]
    products = [i for i, line in enumerate(lines) if TENSOR_OP.search(line)]
    loops = [(a, b) for a, b in loops if not any(a <= e <= b for e in exits) and any(a <= p <= b for p in products)]
    return [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]


def step_loop_local_memory(lines: list[str]) -> tuple[int, int]:
    """(local-memory instructions, those inside a step loop) of a normalised kernel."""
    innermost = step_loops(lines)
    local = [i for i, line in enumerate(lines) if LOCAL_MEMORY.search(line)]
    return len(local), sum(1 for i in local if any(a <= i <= b for a, b in innermost))


def step_loop_register_moves(lines: list[str]) -> list[tuple[int, int]]:
    """(R2UR, tensor products) of each step loop, in address order. R2UR moves a vector register into a uniform one;
    wgmma takes its descriptors from uniform registers, so where ptxas keeps a step's descriptor arithmetic on the
    uniform datapath a loop holds a few per step, and where it lost it, one or two per descriptor: 4 a product (the
    folded forward at d64 went from 8 to 32 per loop of 12 products and was 11-13% slower). A sign to look at before
    timing, not a cost model: the backward's descriptors forced uniform (half the R2UR) measured 1-4% slower
    (RESULTS.md, "Warp-uniform wgmma descriptors, tried and dropped")."""
    return [(sum(1 for line in lines[a:b + 1] if UNIFORM_MOVE.search(line)),
             sum(1 for line in lines[a:b + 1] if TENSOR_OP.search(line))) for a, b in step_loops(lines)]


def resource_usage(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"\s*Function (\S+):", line)
        if match:
            current = kernel_key(match.group(1))
            continue
        if current is not None and "REG:" in line:
            out[current] = re.sub(r"\s+", " ", line.strip())
            current = None
    return out


def load_rules(omnigen_rules, name: str):
    path = Path(name)
    if not path.is_file():
        path = ROOT / "examples" / "rules" / f"{name}.yaml"
    return omnigen_rules.Rules.load(path)


def translation_units(sources: dict[str, str]) -> list[str]:
    included = {name for name in sources for text in sources.values() if f'#include "{name}"' in text}
    return sorted(name for name in sources if name.endswith(".cu") and name not in included)


def compile_variant(modules, rules_name: str, config) -> dict:
    codegen, toolchain, kernels, rules_module = modules
    rules = load_rules(rules_module, rules_name)
    sources = codegen.render(rules, config)
    flags = [f for f in toolchain.nvcc_flags(config) if not f.startswith(("-Xcompiler", "-Xptxas"))]
    includes = ["-I" + str(d) for d in kernels.family_of(config).include_dirs]
    sass: dict[str, list[str]] = {}
    usage: dict[str, str] = {}
    tool = cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, text in sources.items():
            (work / name).write_text(text)
        for unit in translation_units(sources):
            cubin = work / (unit + ".cubin")
            command = ["nvcc", *flags, "-cubin", "-o", str(cubin), *includes, "-I" + str(work), str(work / unit)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{rules_name} {config.label} {unit}:\n{result.stdout}{result.stderr}")
            dumped = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
            for kernel, lines in normalised_sass(dumped).items():
                if kernel in sass:
                    raise RuntimeError(f"{rules_name} {config.label}: {kernel} in two translation units")
                sass[kernel] = lines
            dumped = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                                    check=True).stdout
            usage.update(resource_usage(dumped))
    return {"variant": f"{rules_name}:{config.label}", "sass": sass, "usage": usage}


def shifted(lines: list[str], start: int, delta: int) -> list[str]:
    """Kernel-parameter reads c[0x0][X] with X >= start moved by delta."""
    def move(match: re.Match) -> str:
        offset = int(match.group(1), 16)
        return f"c[0x0][{hex(offset + delta if offset >= start else offset)}]"
    return [re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", move, line) for line in lines]


def variants(modules, preset: str, extra: list[str]) -> list[tuple[str, object]]:
    _, _, kernels, _ = modules
    from omnigen import targets
    from omnigen.targets import KernelConfig, TileConfig

    fp8_dtypes = getattr(targets, "FP8_DTYPES", ())  # (older trees have none)

    out = []
    if preset == "default":
        for rules_name in ("transfusion", "causal_documents"):
            for head_dim in (64, 128, 256):
                out.append((rules_name, KernelConfig(head_dim, "bf16", "sm_90a", kernels.default_tile("sm_90a", head_dim))))
        for head_dim in (64, 128):
            out.append(("transfusion", KernelConfig(head_dim, "bf16", "sm_80", kernels.default_tile("sm_80", head_dim))))
    for text in extra:
        rules_name, dtype, head_dim, tile, arch, *rest = text.split(":")
        options = [part for part in rest if "=" in part]  # NAME=VALUE,...: the family's kernel options
        family = "".join(part for part in rest if "=" not in part)
        m, n, w, s = (int(x) for x in tile.lower().split("x"))
        config = KernelConfig(int(head_dim), dtype, arch, TileConfig(m, n, w, s), kernel_family=family,
                              forward_only=dtype in fp8_dtypes)
        if options:
            config = with_options(kernels, config, ",".join(options))
        out.append((rules_name, config))
    return out


def with_options(kernels, config, text: str):
    """`config` with the family's options NAME=VALUE,... (integers; booleans as 0/1)."""
    import dataclasses

    options_type = kernels.family_of(config).options_type
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--variant option {name!r}: the {options_type.__name__} fields are {', '.join(fields)}")
        values[name] = bool(int(value)) if fields[name].type in (bool, "bool") else int(value)
    return dataclasses.replace(config, options=options_type(**values))


def file_name(variant: str, kernel: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", variant) + "__" + re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel) + ".sass"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the source tree whose omnigen renders (default: this one)")
    parser.add_argument("--preset", choices=("default", "none"), default="default")
    parser.add_argument("--variant", action="append", default=[],
                        help="RULES:DTYPE:D:MxNxWxS:ARCH[:FAMILY][:NAME=VALUE,...] (the family's kernel options)")
    parser.add_argument("--out", type=Path, required=True, help="write <variant>__<kernel>.sass and usage.json here")
    parser.add_argument("--against", type=Path, help="compare with an earlier --out folder")
    parser.add_argument("--shift", action="append", default=[],
                        help="KERNEL[@VARIANT]:FROM:DELTA (hex): parameters that moved")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.tree.resolve()))
    from omnigen import kernels, rules as rules_module
    from omnigen.jit import codegen, toolchain

    modules = (codegen, toolchain, kernels, rules_module)
    chosen = variants(modules, args.preset, args.variant)
    with ThreadPoolExecutor(args.jobs) as pool:
        entries = list(pool.map(lambda v: compile_variant(modules, *v), chosen))
    args.out.mkdir(parents=True, exist_ok=True)
    usage = {}
    for entry in entries:
        for kernel, lines in entry["sass"].items():
            (args.out / file_name(entry["variant"], kernel)).write_text("\n".join(lines) + "\n")
        usage[entry["variant"]] = entry["usage"]
        print(f"{entry['variant']:60s} " + ", ".join(f"{k} {len(v)}" for k, v in sorted(entry["sass"].items())))
        local = {k: step_loop_local_memory(v) for k, v in sorted(entry["sass"].items())}
        if any(total for total, _ in local.values()):
            print(f"{'':60s} local memory (in step loops): " +
                  ", ".join(f"{k} {total} ({inside})" for k, (total, inside) in local.items() if total))
        moves = {k: step_loop_register_moves(v) for k, v in sorted(entry["sass"].items())}
        if any(moves.values()):
            print(f"{'':60s} R2UR / products per step loop: " +
                  ", ".join(f"{k} " + " ".join(f"{r}/{p}" for r, p in loops) for k, loops in moves.items() if loops))
    (args.out / "usage.json").write_text(json.dumps(usage, indent=1, sort_keys=True))
    if args.against is None:
        return 0
    before_usage = json.loads((args.against / "usage.json").read_text())
    shift_specs = []
    for text in args.shift:
        kernel, start, delta = text.rsplit(":", 2)  # (VARIANT may hold colons)
        kernel, _, where = kernel.partition("@")
        shift_specs.append((re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel), where, int(start, 16), int(delta, 16)))
    differences = 0
    print(f"\nagainst {args.against}:")
    for entry in entries:
        variant = entry["variant"]
        shifts = {kernel: (start, delta) for kernel, where, start, delta in shift_specs if where in variant}
        prefix = re.sub(r"[^A-Za-z0-9_.-]+", "_", variant) + "__"
        old_kernels = {p.name for p in args.against.glob(prefix + "*.sass")}
        new_kernels = {file_name(variant, k) for k in entry["sass"]}
        for name in sorted(old_kernels | new_kernels):
            old = (args.against / name).read_text().splitlines() if name in old_kernels else None
            kernel = name[len(prefix):-len(".sass")]
            if old is not None and kernel in shifts:
                old = shifted(old, *shifts[kernel])
            new = (args.out / name).read_text().splitlines() if name in new_kernels else None
            if old == new:
                continue
            differences += 1
            if old is None or new is None:
                print(f"  {name}: {'new' if old is None else 'gone'}")
                continue
            diff = list(difflib.unified_diff(old, new, lineterm="", n=0))
            print(f"  {name}: {len(old)} -> {len(new)} instructions, {sum(1 for d in diff if d[:1] in '+-') - 2} lines differ")
        old_usage = dict(before_usage.get(variant, {}))
        for kernel in list(old_usage):
            delta = shifts.get(re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel), (0, 0))[1]
            if delta:
                old_usage[kernel] = re.sub(r"CONSTANT\[0\]:(\d+)", lambda m: f"CONSTANT[0]:{int(m.group(1)) + delta}",
                                           old_usage[kernel])
        changed = {k: (old_usage.get(k), v) for k, v in entry["usage"].items() if old_usage.get(k) != v}
        if changed:  # (kernels gone or new are reported above)
            differences += 1
            print(f"  {variant} resource usage (before, after): {changed}")
    print(f"  {differences} difference(s)")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
