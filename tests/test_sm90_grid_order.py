"""The sm90 grids' tile orders as the kernels compute them (SectionedIndex and LeadingSectionedIndex, rendered into a
variant's shared header), compiled by the real nvcc and run on the host, no GPU needed: every CTA index maps to one
(pair, step), every (pair, step) is taken, and a pair's steps come in rising order, which deterministic mode's waits
rely on (a kv-tile waits only for lower kv-tiles of its head, launched before it). The leading steps (the
leading_q_tiles / leading_kv_tiles options) over every section size, ragged last sections and leads past the end;
and the forward's balanced section size (the balanced_sections option) against its definition.
"""

from __future__ import annotations

import subprocess

import pytest

import omnigen
from omnigen import kernels
from omnigen.jit import codegen, toolchain
from omnigen.targets import KernelConfig

from test_toolchain import HAS_NVCC

CHECK = r"""
#include <cstdio>
#include <vector>
#include "SHARED"

int main() {
  using namespace NAMESPACE;
  long cases = 0;
  for (int pairs = 1; pairs <= 13; ++pairs)
    for (int steps = 1; steps <= 21; ++steps)
      for (int section = 1; section <= pairs + 1; ++section)
        for (int leading = 0; leading <= steps + 1; ++leading) {
          std::vector<int> seen(pairs * steps, 0), last(pairs, -1);
          for (int index = 0; index < pairs * steps; ++index) {
            const LeadingSectionedIndex at(index, leading, section, pairs, steps);
            const bool inside = at.pair >= 0 && at.pair < pairs && at.step >= 0 && at.step < steps;
            if (!inside || seen[at.pair * steps + at.step]++ || at.step <= last[at.pair]) {
              std::printf("pairs %d steps %d section %d leading %d: index %d -> pair %d step %d\n", pairs, steps,
                          section, leading, index, at.pair, at.step);
              return 1;
            }
            last[at.pair] = at.step;
            if (leading == 0) {  // no lead: the sections alone
              const SectionedIndex plain(index, section, pairs, steps);
              if (plain.pair != at.pair || plain.step != at.step) {
                std::printf("leading 0 differs from SectionedIndex at pairs %d steps %d section %d index %d\n", pairs,
                            steps, section, index);
                return 1;
              }
            }
          }
          ++cases;
        }
  // balanced_section: a multiple of `unit` from half of `most` up to `most` whose last section is the largest, the
  // larger on a tie (pairs and most are multiples of the GQA group `unit`, as the launcher's are)
  for (int unit = 1; unit <= 4; unit *= 2)
    for (int pairs = unit; pairs <= 300; pairs += unit)
      for (int most = unit; most <= pairs; most += unit) {
        const int size = balanced_section(pairs, most, unit);
        auto last = [&](int s) { return pairs % s != 0 ? pairs % s : s; };
        bool ok = size >= (most + 1) / 2 && size <= most && size % unit == 0;
        for (int s = most; ok && s >= (most + 1) / 2; s -= unit)
          ok = last(s) < last(size) || (last(s) == last(size) && s <= size);
        if (!ok) {
          std::printf("balanced_section(%d, %d, %d) = %d\n", pairs, most, unit, size);
          return 1;
        }
        ++cases;
      }
  std::printf("ok %ld\n", cases);
  return 0;
}
"""


@pytest.mark.nvcc
@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_leading_sectioned_index_is_an_ordered_bijection(tmp_path):
    rules = omnigen.Rules(name="grid_order", modalities={"text": "causal"})
    config = KernelConfig(128, "bf16", "sm_90a", kernels.default_tile("sm_90a", 128))
    sources = codegen.render(rules, config)
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    shared = next(name for name in sources if name.endswith("_shared.cuh"))
    namespace = next(line.split()[1] for line in sources[shared].splitlines() if line.startswith("namespace "))
    (tmp_path / "check.cu").write_text(CHECK.replace("SHARED", shared).replace("NAMESPACE", namespace))
    flags = [f for f in toolchain.nvcc_flags(config) if not f.startswith(("-Xcompiler", "-Xptxas"))]
    includes = [f"-I{d}" for d in kernels.family_of(config).include_dirs] + [f"-I{tmp_path}"]
    nvcc = toolchain.find_toolchain().nvcc
    built = subprocess.run([nvcc, *flags, *includes, str(tmp_path / "check.cu"), "-o", str(tmp_path / "check")],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout.startswith("ok"), ran.stdout + ran.stderr
