"""Broken rules files and layout strings: every one gets a RulesError/ValueError that says where and what,
and the CLI turns each into one paragraph on stderr with exit code 2 (never a traceback).

The corpus lives in tests/malformed/: `*.yaml` files whose first line says what is wrong and whose
second line, `# expect: line=N [suggest=WORD]`, says what the error must report (`line=-`: no line
makes sense); `layouts.txt` holds one JSON-quoted layout string per line, then `# why`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from omnigen import Layout, Rules, RulesError
from omnigen.cli import cli

ROOT = Path(__file__).resolve().parent.parent
MALFORMED = Path(__file__).resolve().parent / "malformed"
RULES_FILES = sorted(MALFORMED.glob("*.yaml"))
VALID_RULES = ROOT / "examples" / "rules" / "transfusion.yaml"
EXPECT = re.compile(r"^# expect: line=(?P<line>\d+|-)(?: suggest=(?P<suggest>\S+))?\s*$")


def _bad_layouts() -> list[tuple[str, str]]:
    out = []
    for raw in (MALFORMED / "layouts.txt").read_text().splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        quoted, _, why = raw.partition("#")
        out.append((json.loads(quoted.strip()), why.strip()))
    return out


BAD_LAYOUTS = _bad_layouts()


def _expectation(path: Path) -> tuple[int | None, str | None]:
    lines = path.read_text().splitlines()
    match = EXPECT.match(lines[1]) if len(lines) > 1 else None
    if match is None:  # only the empty file has no expectation line
        return None, None
    line = None if match["line"] == "-" else int(match["line"])
    return line, match["suggest"]


def assert_one_paragraph(stderr: str) -> None:
    """What a user error must look like: 'omnigen: error: ...', one block of text, no traceback."""
    text = stderr.strip()
    assert text.startswith("omnigen: error: "), stderr
    assert text.count("omnigen: error:") == 1, stderr
    assert "Traceback" not in text, stderr
    assert all(line.strip() for line in text.splitlines()), f"more than one paragraph:\n{stderr}"


def _cli(*args: str):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result


# --------------------------------------------------------------------------------------------
# the corpus itself


def test_corpus_is_complete_and_self_describing():
    assert len(RULES_FILES) >= 25
    assert len(BAD_LAYOUTS) >= 15
    for path in RULES_FILES:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and len(first) > 10, f"{path.name}: first line must say what is wrong"
        if path.name != "empty.yaml":
            assert EXPECT.match(path.read_text().splitlines()[1]), f"{path.name}: second line must be '# expect: ...'"
    assert all(why for _, why in BAD_LAYOUTS), "every bad layout needs a '# why' comment"


# --------------------------------------------------------------------------------------------
# the library


@pytest.mark.parametrize("path", RULES_FILES, ids=lambda p: p.stem)
def test_rules_load_names_file_line_and_suggestion(path: Path):
    line, suggestion = _expectation(path)
    with pytest.raises(RulesError) as info:
        Rules.load(path)
    err = info.value
    message = str(err)
    assert str(path) in message, message
    assert err.line == line, message
    if line is not None:
        assert f"{path}:{line}:" in message, message
    assert err.suggestion == suggestion, message
    if suggestion:
        assert f"did you mean '{suggestion}'" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("text, why", BAD_LAYOUTS, ids=[why for _, why in BAD_LAYOUTS])
def test_bad_layouts_raise_a_clear_value_error(text: str, why: str):
    rules = Rules.load(VALID_RULES)
    with pytest.raises(ValueError) as info:
        layout = Layout.parse(text)
        layout.tables(rules)  # unknown modalities are only known once the rules are
    message = str(info.value)
    assert message and "\n" not in message
    assert "Traceback" not in message


def test_layout_typo_suggests_the_modality():
    rules = Rules.load(VALID_RULES)
    with pytest.raises(ValueError, match="did you mean 'image'"):
        Layout.parse("text:8 imagee:16").tables(rules)


# --------------------------------------------------------------------------------------------
# the command line, in process


@pytest.mark.parametrize("path", RULES_FILES, ids=lambda p: p.stem)
def test_cli_malformed_rules_exit_2_with_one_paragraph(path: Path):
    result = _cli("show", "--rules", str(path), "--layout", "text:8")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert_one_paragraph(result.stderr)
    assert path.name in result.stderr


@pytest.mark.parametrize("command", ["show", "plan"])
@pytest.mark.parametrize("text, why", BAD_LAYOUTS, ids=[why for _, why in BAD_LAYOUTS])
def test_cli_malformed_layouts_exit_2_with_one_paragraph(command: str, text: str, why: str):
    result = _cli(command, "--rules", str(VALID_RULES), "--layout", text)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert_one_paragraph(result.stderr)
    assert "--layout" in result.stderr  # says which option was wrong


def test_cli_missing_rules_file():
    result = _cli("plan", "--rules", str(MALFORMED / "no_such_file.yaml"), "--layout", "text:8")
    assert result.exit_code == 2
    assert_one_paragraph(result.stderr)
    assert "no_such_file.yaml" in result.stderr


def test_cli_batch_of_different_lengths():
    result = _cli("plan", "--rules", str(VALID_RULES), "--layout", "text:8", "--layout", "text:16")
    assert result.exit_code == 2
    assert_one_paragraph(result.stderr)
    assert "same length" in result.stderr


@pytest.mark.parametrize("option, value", [("--block-m", "100"), ("--block-n", "0")])
def test_cli_bad_tile_size(option: str, value: str):
    result = _cli("show", "--rules", str(VALID_RULES), "--layout", "text:8", option, value)
    assert result.exit_code == 2
    assert_one_paragraph(result.stderr)
    assert "multiple of 16" in result.stderr


# --------------------------------------------------------------------------------------------
# the command line, as users run it


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OMNIGEN_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "omnigen", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("name", ["unknown_top_key.yaml", "invalid_yaml_syntax.yaml", "kernel_tile_bad_warps.yaml"])
def test_subprocess_malformed_rules(name: str):
    proc = _run("show", "--rules", str(MALFORMED / name), "--layout", "text:8")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert_one_paragraph(proc.stderr)
    assert name in proc.stderr


@pytest.mark.parametrize("text", ["imagee:16", "text:4@2 image:4@1", ""])
def test_subprocess_malformed_layout(text: str):
    proc = _run("plan", "--rules", str(VALID_RULES), "--layout", text)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert_one_paragraph(proc.stderr)
