"""The `omnigen` command line: `app` is the click group, `mask`, `build` and `bench` add their commands to it."""

from __future__ import annotations

from . import bench, build, mask  # noqa: F401  (registers bench; build, inspect, cache; show, plan)
from .app import UserError, cli


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="omnigen")


__all__ = ["UserError", "cli", "main"]
