"""The README's Python blocks are programs: each runs as written, from the repository root, in a fresh interpreter.

Blocks that use CUDA (a "cuda" device, `.cuda()`, `omnigen.build`) need a GPU and run only where one is (marked
`gpu`); every other block runs everywhere, attention on CPU tensors included (issue 28).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _needs_gpu(code: str) -> bool:
    """Whether a block uses CUDA unconditionally (a block that asks `torch.cuda.is_available()` runs everywhere)."""
    statements = re.sub(r"#.*", "", code)  # comments may mention CUDA
    if "torch.cuda.is_available()" in statements:
        return False
    return any(word in statements for word in ('"cuda"', ".cuda(", "omnigen.build("))


def _cases():
    for index, code in enumerate(BLOCKS):
        first = code.strip().splitlines()[0][:60]
        marks = [pytest.mark.gpu] if _needs_gpu(code) else []
        yield pytest.param(code, id=f"block{index}: {first}", marks=marks)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("code", _cases())
def test_a_readme_block_runs_as_written(code, tmp_path):
    if _needs_gpu(code) and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # A private cache: a block may tune, and the tuning database of a shared cache steers other tests' kernels.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMNIGEN_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"this README block failed:\n{code}\n--- its output:\n{result.stderr[-3000:]}"
