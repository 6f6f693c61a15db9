"""The `omnigen` click group and its error handling. Commands live in mask.py (show, plan), build.py
(build, inspect, cache) and bench.py (bench); the group imports each module when one of its commands
is used (LAZY_COMMANDS), so that `omnigen --help` imports neither torch nor the kernel toolchain.

Every user error (bad rules file, bad layout, missing toolchain, ...) becomes one paragraph on
stderr and exit code 2 -- never a traceback. Set OMNIGEN_DEBUG=1 to see the traceback anyway.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import textwrap
from typing import Any, Callable

import click

from ..version import __version__


class UserError(Exception):
    """An error the user can fix; its message says how."""


# Exceptions that mean "the input was wrong", not "omnigen is broken".
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ValueError, TypeError, FileNotFoundError, KeyError)


def fail(message: str) -> None:
    """Print one paragraph to stderr and exit 2."""
    text = str(message).strip()
    paragraph = "\n".join(textwrap.fill(line, width=100, subsequent_indent="  ") if line else "" for line in text.splitlines())
    click.echo(f"omnigen: error: {paragraph}", err=True)
    sys.exit(2)


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for command bodies: user errors become a clean message and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as exc:
            if os.environ.get("OMNIGEN_DEBUG"):
                raise
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            fail(str(message))

    return wrapper


# Each command: the module under omnigen/cli/ that defines it, and the first paragraph of its help --
# `omnigen --help` lists the commands from these summaries without importing the modules (build and
# bench import torch). tests/test_cli_startup.py checks them against the commands' own docstrings.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("bench", "Time omnigen against FlexAttention, SDPA with the dense mask and the causal kernels on "
                       "this GPU."),
    "build": ("build", "Render, compile and cache every kernel variant the rules ask for; with --tune, pick the "
                       "fastest per shape."),
    "cache": ("build", "The kernel cache ($OMNIGEN_CACHE_DIR, default ~/.cache/omnigen)."),
    "inspect": ("build", "Where the emitted sources and the built modules of the rules are."),
    "plan": ("mask", "Tile statistics of a layout: tiles per kind, density, partial fraction, metadata size."),
    "show": ("mask", "Draw the mask and its tile kinds in the terminal (and optionally as a PNG)."),
}


class _Unloaded(click.Command):
    """Stands for a command whose module is not imported yet; it carries only the summary."""

    def __init__(self, name: str, module: str, summary: str) -> None:
        super().__init__(name, help=summary)
        self.module = module


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use: running a command or asking for its
    --help imports its module (whose decorators replace the stand-in); the group's own --help lists
    the stand-ins' summaries and imports nothing."""

    def __init__(self, *args: Any, lazy_commands: dict[str, tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listing = False
        for name, (module, summary) in lazy_commands.items():
            self.add_command(_Unloaded(name, f"{__package__}.{module}", summary))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = self.commands.get(cmd_name)
        if isinstance(command, _Unloaded) and not self._listing:
            importlib.import_module(command.module)
            command = self.commands.get(cmd_name)
            if isinstance(command, _Unloaded):
                raise RuntimeError(f"{command.module} does not define the command {cmd_name!r}")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self._listing = False


@click.group(cls=LazyGroup, lazy_commands=LAZY_COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="omnigen")
def cli() -> None:
    """omnigen: attention kernels generated from multimodal masking rules.

    \b
    Typical use:
      omnigen show  --rules rules.yaml --layout "text:40 image:256 text:24@1"
      omnigen plan  --rules rules.yaml --layout "text:40 image:256 text:24@1"
      omnigen build --rules rules.yaml --tune
      omnigen bench --rules rules.yaml --dims 128 --sizes 8192,16384

    Layouts are written modality:length[@document], e.g. "text:40 image:256 text:24@1".
    """
