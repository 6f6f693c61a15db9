"""The `omnigen` click group and its error handling. Commands live in mask.py (show, plan), build.py
(build, inspect, cache) and bench.py (bench); the package registers them.

Every user error (bad rules file, bad layout, missing toolchain, ...) becomes one paragraph on
stderr and exit code 2 -- never a traceback. Set OMNIGEN_DEBUG=1 to see the traceback anyway.
"""

from __future__ import annotations

import functools
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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
