"""The command line starts without importing what it does not use (issue 28): `omnigen --help`,
`show --help` and `plan --help` import no torch and no numpy; `show` and `plan` (also `show --png`,
batches and `--json`) import numpy but not torch -- they print a plan summary made by the host planner's
numpy core (omnigen/plan/summary.py) -- nor triton, jinja2 or omnigen.op. Checked on `sys.modules` of a
fresh interpreter, not by timing (benchmarks/cli_startup.py times it). Also: the lazy `omnigen` package
keeps its public names, and the group's command summaries match the commands."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = str(ROOT / "examples" / "rules" / "transfusion.yaml")
COMPILER_STACK = ("torch._dynamo", "torch._inductor", "triton", "jinja2", "omnigen.op")

CHILD = r"""
import json, sys
from click.testing import CliRunner
from omnigen.cli import cli

report = {"after_import": sorted(sys.modules)}
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, (args, result.output)
report["after_commands"] = sorted(sys.modules)
print(json.dumps(report))
"""


def _modules_after(*commands: list[str]) -> dict[str, set[str]]:
    """sys.modules of a fresh interpreter after `from omnigen.cli import cli` and after the commands."""
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(commands)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {key: set(value) for key, value in report.items()}


def _loaded(modules: set[str], prefix: str) -> list[str]:
    return sorted(m for m in modules if m == prefix or m.startswith(prefix + "."))


def test_help_imports_no_torch():
    modules = _modules_after(["--help"], ["show", "--help"], ["plan", "--help"], ["--version"])
    for key in ("after_import", "after_commands"):
        assert _loaded(modules[key], "torch") == [], key
        for name in COMPILER_STACK + ("numpy", "omnigen.layout", "omnigen.rules"):
            assert _loaded(modules[key], name) == [], (key, name)


def test_show_and_plan_import_no_torch(tmp_path):
    commands = [["show", "--rules", RULES, "--layout", "text:40 image:256 text:24@1"],
                ["plan", "--rules", RULES, "--layout", "text:4000 image:1024 text:3000"],
                ["plan", "--rules", RULES, "--layout", "text:64 image:256", "--json"],
                ["show", "--rules", RULES, "--layout", "text:64 image:256", "--layout", "image:256 text:64@1",
                 "--block-m", "64", "--block-n", "64", "--ascii"]]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        commands.append(["show", "--rules", RULES, "--layout", "text:100 image:256", "--png", str(tmp_path / "m.png")])
    modules = _modules_after(*commands)
    assert "numpy" in modules["after_commands"] and "omnigen.plan.host" in modules["after_commands"]
    for name in ("torch",) + COMPILER_STACK + ("omnigen.plan.schedule", "omnigen.plan.masks"):
        assert _loaded(modules["after_commands"], name) == [], name


def test_import_omnigen_is_lazy_and_keeps_every_public_name():
    """In a fresh interpreter: `import omnigen` imports no torch; every name of __all__ is importable,
    listed by dir(), and the same object as in its defining module; `omnigen.plan` stays the
    function even when the subpackage omnigen.plan is imported first."""
    code = r"""
import sys, types
import omnigen
assert "torch" not in sys.modules, "import omnigen imported torch"
import omnigen.plan.schedule                      # the subpackage first: the attribute stays the function
assert isinstance(omnigen.plan, types.FunctionType), omnigen.plan
import omnigen.plan as imported
assert imported is omnigen.plan
from omnigen import plan, mask, attention, build, Kernel, Layout, Rules
import omnigen.layout, omnigen.op, omnigen.rules, omnigen.targets, omnigen.errors
assert plan is sys.modules["omnigen.plan"].plan and mask is omnigen.op.mask and attention is omnigen.op.attention
assert build is omnigen.op.build and Kernel is omnigen.op.Kernel
assert Layout is omnigen.layout.Layout and Rules is omnigen.rules.Rules
namespace = {}
exec("from omnigen import *", namespace)
missing = [name for name in omnigen.__all__ if name not in namespace or name not in dir(omnigen)]
assert not missing, missing
for name in ("jit", "kernels", "tune", "reference", "semantics", "figures"):  # submodules as attributes
    assert isinstance(getattr(omnigen, name), types.ModuleType), name
assert not hasattr(omnigen, "no_such_name")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_lazy_command_summaries_match_the_commands():
    """app.LAZY_COMMANDS lists every command with its module and the first paragraph of its help
    (what `omnigen --help` shows without importing the modules)."""
    from omnigen.cli.app import LAZY_COMMANDS, _Unloaded, cli

    ctx = click.Context(cli)
    for name, (module, summary) in LAZY_COMMANDS.items():
        command = cli.get_command(ctx, name)
        assert command is not None and not isinstance(command, _Unloaded), name
        assert command.callback.__module__ == f"omnigen.cli.{module}", name
        first = inspect.cleandoc(command.help or "").split("\n\n")[0]
        assert " ".join(first.split()) == " ".join(summary.split()), (
            f"update LAZY_COMMANDS[{name!r}] in omnigen/cli/app.py to the command's first help paragraph")
    assert sorted(cli.commands) == sorted(LAZY_COMMANDS), "a command missing from omnigen/cli/app.py LAZY_COMMANDS"


@pytest.mark.parametrize("args", [["--help"], ["shwo"], ["cache", "--help"]])
def test_group_output_is_the_same_lazy_or_loaded(args):
    """The listing from the summaries, and the did-you-mean of a mistyped command, are what the
    loaded commands give."""
    code = ("import sys; from click.testing import CliRunner; from omnigen.cli import cli; "
            "r = CliRunner().invoke(cli, sys.argv[1:]); print(r.exit_code); print(r.output, end='')")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from click.testing import CliRunner

    from omnigen.cli.app import LAZY_COMMANDS, cli

    import omnigen.cli.bench, omnigen.cli.build, omnigen.cli.mask  # noqa: E401,F401  (every command loaded)

    assert sorted(cli.commands) == sorted(LAZY_COMMANDS)
    loaded = CliRunner().invoke(cli, args)
    assert done.stdout == f"{loaded.exit_code}\n{loaded.output}"
