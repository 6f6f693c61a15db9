"""The `omnigen` command line: `app` is the click group, `mask`, `build` and `bench` add their commands to it
(each imported when one of its commands is used: app.LAZY_COMMANDS)."""

from __future__ import annotations

from .app import UserError, cli


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="omnigen")


__all__ = ["UserError", "cli", "main"]
