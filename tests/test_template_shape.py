"""The shape of the kernel templates (issue 27): Jinja substitutes constants, C++ chooses the code paths, and every
device function or kernel reads in one screen. No compiler: the templates and what they render, read as text."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

import omnigen
from omnigen import kernels
from omnigen.jit import codegen
from omnigen.kernels.family import KERNELS_DIR
from omnigen.kernels.sm90.options import HopperOptions
from omnigen.targets import KernelConfig

REPO = Path(__file__).resolve().parent.parent
TEMPLATE_DIRS = ("sm80/templates", "sm90/templates", "common/templates")
HEADER_DIRS = ("common/include", "sm80/include", "sm90/include")
MAX_FUNCTION_LINES = 120

JINJA_TAG = re.compile(r"\{%.*?%\}|\{\{.*?\}\}|\{#.*?#\}", re.S)
# comments, string and character literals, preprocessor lines
CXX_NOISE = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|^[ \t]*#[^\n]*", re.S | re.M)


def _blank(match: re.Match) -> str:
    """The match as spaces, its newlines kept: offsets and line numbers stay where they were."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _cxx(text: str) -> str:
    return CXX_NOISE.sub(_blank, text)


def jinja_ifs_below_file_level(text: str) -> list[int]:
    """Lines of the `{% if %}` tags of a template that sit inside C++ braces other than a namespace's (a function,
    a struct, an initialiser) or inside a macro (whose text lands wherever it is called)."""
    tags = list(JINJA_TAG.finditer(text))
    code = _cxx(JINJA_TAG.sub(_blank, text))
    braces: list[tuple[int, bool]] = []  # (offset, is a namespace's)
    opened: list[tuple[int, int]] = []  # (offset of '{', offset of its '}')
    for at, char in enumerate(code):
        if char == "{":
            statement = re.split(r"[;{}]", code[:at])[-1]
            braces.append((at, re.fullmatch(r"\s*namespace\s*[\w:]*\s*", statement) is not None))
        elif char == "}" and braces:
            start, namespace = braces.pop()
            if not namespace:
                opened.append((start, at))
    macro_depth, out = 0, []
    for tag in tags:
        body = tag.group(0)
        if re.match(r"\{%-?\s*macro\b", body):
            macro_depth += 1
        elif re.match(r"\{%-?\s*endmacro\b", body):
            macro_depth -= 1
        elif re.match(r"\{%-?\s*if\b", body):
            if macro_depth or any(start < tag.start() < end for start, end in opened):
                out.append(text.count("\n", 0, tag.start()) + 1)
    return out


def function_lengths(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines from '{' to '}') of every __global__ or __device__ function defined in C++ text."""
    code = _cxx(text)
    out = []
    for match in re.finditer(r"\b(?:__global__|__device__)\b", code):
        at, depth = match.end(), 0
        while at < len(code) and not (depth == 0 and code[at] in "{;="):
            depth += {"(": 1, ")": -1}.get(code[at], 0)
            at += 1
        if at >= len(code) or code[at] != "{":
            continue  # a declaration or a variable
        head = code[match.end():at]
        names = [n for n in re.findall(r"(\w+)\s*(?:<[^()]*>)?\s*\(", head) if n != "__launch_bounds__"]
        start, depth = at, 0
        for at in range(start, len(code)):
            depth += {"{": 1, "}": -1}.get(code[at], 0)
            if depth == 0:
                break
        out.append((names[0] if names else "?", code.count("\n", 0, start) + 1, code.count("\n", start, at) + 1))
    return out


def _templates() -> list[Path]:
    return sorted(p for d in TEMPLATE_DIRS for p in (KERNELS_DIR / d).glob("*.j2"))


def _default_variants() -> list[KernelConfig]:
    sm90 = [KernelConfig(d, "bf16", "sm_90a", kernels.default_tile("sm_90a", d)) for d in (64, 128, 256)]
    sm80 = [KernelConfig(d, "bf16", "sm_80", kernels.default_tile("sm_80", d)) for d in (64, 128, 256)]
    return sm90 + sm80


RULES = [omnigen.Rules.load(REPO / "examples" / "rules" / f"{name}.yaml")
         for name in ("transfusion", "causal_documents", "sliding_window")]


def test_the_checks_see_what_they_look_for():
    """Each check fails on a template that breaks it: an if in a kernel body or a struct, an if in a macro, a long
    function; an if between whole definitions, or a constant substituted in a body, passes."""
    bad = "namespace x {\n__global__ void k() {\n{%- if a %}\n  f();\n{%- endif %}\n}\n}\n"
    assert jinja_ifs_below_file_level(bad) == [3]
    assert jinja_ifs_below_file_level("struct S {\n{% if a %}int x;{% endif %}\n};\n") == [2]
    assert jinja_ifs_below_file_level("{% macro m() %}{% if a %}x{% endif %}{% endmacro %}\n") == [1]
    good = "namespace x {\n{%- if a %}\nint f() { return {{ n }}; }\n{%- else %}\nint f() { return 0; }\n{%- endif %}\n}\n"
    assert jinja_ifs_below_file_level(good) == []
    long = "__device__ __forceinline__ int f(int a) {\n" + "  a += 1;  // {\n" * 130 + "  return a;\n}\n"
    assert function_lengths(long) == [("f", 1, 133)]  # the lines of "{" and "}" count
    assert function_lengths("template <bool k>\n__global__ void __launch_bounds__(384, 1) g(int x) {\n}\n") == [("g", 2, 2)]


@pytest.mark.parametrize("template", _templates(), ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_jinja_ifs_only_choose_whole_definitions(template):
    """Jinja substitutes constants only: inside a function, a struct or a macro a variant's choice is C++ (if constexpr
    on the constexpr values the template sets once, or a template parameter); an {% if %} may only pick whole
    definitions at file or namespace level (a variant without a backward kernel has none of its code)."""
    found = jinja_ifs_below_file_level(template.read_text())
    assert not found, f"{template.relative_to(REPO)}: Jinja {{% if %}} inside a C++ body at lines {found}"


@pytest.mark.parametrize("config", _default_variants(), ids=lambda c: c.label)
def test_rendered_functions_read_in_one_screen(config):
    """No device function or kernel of a default variant is longer than MAX_FUNCTION_LINES (rendered: a macro's
    expansion counts where it lands), nor any in the families' headers."""
    long = []
    for rules in RULES:
        for name, text in codegen.render(rules, config).items():
            long += [(name, *f) for f in function_lengths(text) if f[2] > MAX_FUNCTION_LINES]
    for folder in HEADER_DIRS:
        for header in sorted((KERNELS_DIR / folder).rglob("*.cuh")) + sorted((KERNELS_DIR / folder).rglob("*.h")):
            long += [(header.name, *f) for f in function_lengths(header.read_text()) if f[2] > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (file, name, line, length): {long}"


def _normalised(rules: omnigen.Rules, config: KernelConfig) -> dict[str, list[str]]:
    """The rendered kernel and backward files by role, the variant's names (module, label) replaced."""
    sources, names = codegen.render(rules, config), codegen.source_names(rules, config)
    module = codegen.module_name(rules, config)
    out = {}
    for role in ("kernel", "backward", "shared"):
        text = sources[names[role]].replace(module, "MODULE").replace(config.label, "LABEL")
        out[role] = text.splitlines()
    return out


@pytest.mark.parametrize("head_dim,options", [
    (128, dict(persistent=False, tables_always_shared=False, partial_bits=False)),
    (128, dict(ordered_dq=False, dq_writer=False, early_scores=False, ordered_descending_steps=False)),
    (64, dict(ordered_section_pairs=0, atomic_section_pairs=0, backward_stages=2, persistent_backward=0)),
    (128, dict(bits_slot_in_tables=True, leading_kv_tiles=0, persistent_backward=2)),
    (256, dict(leading_kv_tiles=1, leading_q_tiles=0)),
    (64, dict(leading_q_tiles=3, balanced_sections=False, backward_producer_registers=32)),
    (256, dict(persistent=False, partial_bits=False, early_scores=False)),
])
def test_hopper_options_change_constants_only(head_dim, options):
    """A Hopper option changes the rendered code only where a constant is declared (constexpr, or the static_assert of
    the shared memory figure), in comments and messages, and in the shapes of the wgmma helpers (their signatures and
    inline-assembly strings: dQ in turns, which dq_writer=False turns off, computes every head dim in one product):
    its code paths are C++ branches on those constants."""
    rules = RULES[0]
    default = KernelConfig(head_dim, "bf16", "sm_90a", kernels.default_tile("sm_90a", head_dim))
    changed = KernelConfig(head_dim, "bf16", "sm_90a", default.tile, options=HopperOptions(**options))
    before, after = _normalised(rules, default), _normalised(rules, changed)
    for role in before:
        diff = [line[1:] for line in difflib.unified_diff(before[role], after[role], lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        code = [line for line in diff if not line.lstrip().startswith("//")
                and "constexpr" not in line and "static_assert(sizeof(SharedStorage)" not in line
                and "snprintf(message, message_size" not in line
                and not re.match(r'\s*"', line) and not re.match(r"__device__ __forceinline__ void wgmma_\w+\(", line)]
        assert not code, f"{role}: lines other than constants differ: {code[:6]}"
