"""The sm90 grids' tile orders as the kernels compute them (SectionedIndex and LeadingSectionedIndex, rendered into a
variant's shared header), compiled by the real nvcc and run on the host, no GPU needed: every CTA index maps to one
(pair, step), every (pair, step) is taken, and a pair's steps come in rising order, which deterministic mode's waits
rely on (a kv-tile waits only for lower kv-tiles of its head, launched before it). The leading steps (the
leading_q_tiles / leading_kv_tiles options) over every section size, ragged last sections and leads past the end;
the forward's balanced section size (the balanced_sections option) against its definition; and how many lines lead
(leading_lines, the options' count decided from the plan) on causal, global-token and empty schedules.
"""

from __future__ import annotations

import subprocess

import pytest

import omnigen
from omnigen import kernels
from omnigen.jit import codegen, toolchain
from omnigen.targets import KernelConfig

from kernel_cases import SINK_LAYOUTS_4096, SINK_LAYOUTS_8192, SINKS, TRANSFUSION, leading_lines
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
  // leading_lines: the lines of the first sequence that lead, from CSR pointers (3 a line: full, causal, partial)
  auto lead_of = [](const std::vector<int>& lengths, int sequences, int most) {
    std::vector<int32_t> ptr(1, 0);
    for (int s = 0; s < sequences; ++s)
      for (int length : lengths) {  // split each line's tiles over the three kinds, as a plan does
        const int full = length / 2, causal = length / 4;
        ptr.push_back(ptr.back() + full), ptr.push_back(ptr.back() + causal), ptr.push_back(ptr.back() + length - full - causal);
      }
    const int lines = int(lengths.size());
    return leading_lines(ptr.data(), lines, sequences * lines, most);
  };
  struct LeadCase { std::vector<int> lengths; int most, expected; const char* what; };
  std::vector<int> causal, window_with_globals(32, 3), one_global(32, 3), late_global(32, 3);  // 32 lines a sequence
  for (int i = 0; i < 32; ++i) causal.push_back(32 - i);
  window_with_globals[0] = window_with_globals[1] = one_global[0] = late_global[1] = 32;
  const LeadCase lead_cases[] = {
      {causal, 2, 0, "causal: the first line twice the mean"},
      {window_with_globals, 2, 2, "two global lines"},
      {window_with_globals, 1, 1, "two global lines, at most one"},
      {window_with_globals, 0, 0, "the option off"},
      {one_global, 3, 1, "one global line"},
      {late_global, 2, 0, "a long second line behind a short first"},
      {{0, 0, 0, 0}, 2, 0, "an empty plan"},
      {{9}, 2, 0, "one line, the mean itself"},
      {{100, 1, 1, 1, 1, 1}, 8, 1, "at most more lines than a sequence has"},
      {{100, 100, 100, 100, 100, 100}, 8, 0, "every line as long as the mean"},
  };
  for (const LeadCase& c : lead_cases)
    for (int sequences = 1; sequences <= 3; ++sequences) {
      const int lead = lead_of(c.lengths, sequences, c.most);
      if (lead != c.expected) {
        std::printf("leading_lines, %s (%d sequences): %d, not %d\n", c.what, sequences, lead, c.expected);
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


@pytest.mark.parametrize("layout_texts,seq_len", [(SINK_LAYOUTS_4096, 4096), (SINK_LAYOUTS_8192, 8192)])
def test_the_gpu_tests_sink_layouts_lead_and_transfusion_does_not(layout_texts, seq_len):
    """The GPU tests of leading_q_tiles / leading_kv_tiles run these layouts to exercise a lead: two rows and two
    columns lead under the sink rules, none under Transfusion's on the tests' Transfusion layouts."""
    tiles = seq_len // 128
    layout = omnigen.Layout.batch([omnigen.Layout.parse(t) for t in layout_texts])
    plan = omnigen.plan(SINKS, layout, block_m=128, block_n=128, device="cpu")
    assert [leading_lines(plan.fwd_ptr, tiles, most) for most in (1, 2, 3)] == [1, 2, 2]
    assert [leading_lines(plan.bwd_ptr, tiles, most) for most in (1, 2, 3)] == [1, 2, 2]
    for texts in (["text:4096"], ["pad:300 text:2000 image:1024 text:1500 image:256 text:3189"]):
        layout = omnigen.Layout.parse(texts[0])
        plan = omnigen.plan(TRANSFUSION, layout, block_m=128, block_n=128, device="cpu")
        lines = -(-layout.seq_len // 128)
        assert leading_lines(plan.fwd_ptr, lines, 2) == 0 and leading_lines(plan.bwd_ptr, lines, 2) == 0
