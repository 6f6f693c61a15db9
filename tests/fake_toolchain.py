"""A toolchain whose nvcc and c++ are tiny shell scripts: the whole ninja/cache path in milliseconds.

The fake compiler writes its -o output, prints a ptxas-style report, and fails with an nvcc-style
error when a source contains PLANTED_FAILURE. A source containing PLANTED_SPILL gets a report in
which its forward kernel spills 96 bytes. A backward kernel file (one object of its own) reports dkdv_kernel, any
other source forward_kernel. The built ".so" files cannot be imported: this is for
testing builds, failures, pruning and the CLI, not kernels.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

from omnigen.jit import toolchain as tools

SCRIPT = r"""#!/bin/sh
out=""
prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  prev="$a"
done
spill=0
backward=0
for a in "$@"; do
  case "$a" in
    *.cu|*.cpp)
      if grep -q PLANTED_FAILURE "$a"; then echo "$a(3): error: planted failure for the test"; exit 1; fi
      if grep -q PLANTED_SPILL "$a"; then spill=96; fi
      ;;
  esac
  case "$a" in *_backward.cu) backward=1 ;; esac
done
if [ "$backward" = 1 ]; then
cat <<EOF
ptxas info    : Function properties for _ZN4test11dkdv_kernelEv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 200 registers, used 1 barriers
EOF
else
cat <<EOF
ptxas info    : Function properties for _ZN4test14forward_kernelEv
    0 bytes stack frame, $spill bytes spill stores, $spill bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
EOF
fi
printf 'not a real extension' > "$out"
"""


def fake_toolchain(directory: Path) -> tools.Toolchain:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "fake-compiler"
    script.write_text(SCRIPT)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return tools.Toolchain(
        cuda_home=directory, nvcc=script, nvcc_version="99.0.1", cxx=str(script), cxx_version="fake c++",
        ninja=tools._find_ninja(), python_include=str(directory), pybind11_include=str(directory),
        pybind11_version="0", ext_suffix=f".fake-{sys.implementation.cache_tag}.so",
    )
