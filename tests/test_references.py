"""No reference in the repository to a file that is not in it (issue 28, item 5).

Every tracked text file (`git ls-files`) is read for
- paths under the repository's top-level folders (`omnigen/...`, `docs/...`, `benchmarks/...`,
  `examples/...`, `scripts/...`, `tests/...`) that do not exist -- a path in a C++ include resolves
  through the kernels' include folders, as the compiler sees it;
- citations of the design document that was never checked in ("DESIGN §1", "DESIGN section 7",
  "DESIGN.md"): the mask's meaning is docs/semantics.md, the measurement method docs/measuring.md.

A path with a placeholder or a glob in it (`<rules>_mask.cuh`, `examples/rules/*.yaml`, `{a,b}`) names
no single file and is left alone.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
FOLDERS = ("omnigen", "docs", "benchmarks", "examples", "scripts", "tests")
PATH_RE = re.compile(r"(?<![\w./~$-])((?:" + "|".join(FOLDERS) + r")/[\w./*<>{}-]*[\w/*>}])")
DESIGN_RE = re.compile(r"\bDESIGN(?:\.md\b|\s*§\s*\d*|\s+section\s*\d*)")
TEMPLATE_CHARS = set("*<>{}")


def _tracked_text_files() -> dict[str, str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"needs a git checkout to list the tracked files ({exc})")
    out = {}
    for name in listed.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or name == THIS or not path.is_file():  # (a file deleted in the work tree is not read)
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        try:
            out[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def _exists(reference: str, include_dirs: list[Path]) -> bool:
    reference = reference.rstrip("/")
    return (ROOT / reference).exists() or any((folder / reference).exists() for folder in include_dirs)


def _missing_references() -> list[tuple[str, int, str]]:
    """(file, line, reference) for every reference to a path that is not there and every DESIGN citation."""
    include_dirs = sorted((ROOT / "omnigen" / "kernels").glob("*/include"))
    found = []
    for name, text in sorted(_tracked_text_files().items()):
        for number, line in enumerate(text.splitlines(), 1):
            for match in PATH_RE.finditer(line):
                reference = match.group(1)
                if not TEMPLATE_CHARS & set(reference) and not _exists(reference, include_dirs):
                    found.append((name, number, reference))
            for match in DESIGN_RE.finditer(line):
                found.append((name, number, " ".join(match.group(0).split())))
    return found


def test_every_referenced_file_is_in_the_repository():
    missing = _missing_references()
    assert not missing, (
        "references to files that are not in the repository (cite docs/semantics.md for the mask's meaning, "
        "docs/measuring.md for how numbers are measured, or the file's current path):\n"
        + "\n".join(f"  {name}:{line}: {reference}" for name, line, reference in missing)
    )


def test_the_scan_finds_what_it_should():
    """The patterns themselves: a missing path and a DESIGN citation are found, placeholders are not."""
    line = ("see omnigen/tune_space.py, DESIGN §1, DESIGN section 7 and DESIGN.md; not ~/.cache/omnigen/x.json, "
            "generated/omnigen/x.h, examples/rules/*.yaml or <rules>_mask.cuh")
    paths = [m.group(1) for m in PATH_RE.finditer(line)]
    assert paths == ["omnigen/tune_space.py", "examples/rules/*.yaml"]
    assert not _exists("omnigen/tune_space.py", []) and _exists("omnigen/tune/space.py", [])
    assert _exists("omnigen/mask_rules.cuh", sorted((ROOT / "omnigen" / "kernels").glob("*/include")))
    assert [" ".join(m.group(0).split()) for m in DESIGN_RE.finditer(line)] == [
        "DESIGN §1", "DESIGN section 7", "DESIGN.md"]
