"""`omnigen show` and `omnigen plan`: look at a mask and its tile plan without a GPU.

The library (layouts, rules, the planner, figures) is imported when a command runs, not with this
module: `omnigen show --help` needs only click. The commands themselves need numpy but not torch: they
print a `PlanSummary` (omnigen/plan/summary.py), the plan's statistics and pictures made by the host
planner's numpy core without its schedules -- the same numbers as `omnigen.plan(...)`, in a process that
never imports torch (tests/test_cli_startup.py), so `omnigen plan` answers in a fraction of a second and
takes 4M tokens in bounded memory.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import TYPE_CHECKING, Sequence

import click

from .app import UserError, cli, user_errors

if TYPE_CHECKING:
    from ..layout import AnyLayout
    from ..plan import PlanSummary
    from ..rules import Rules

RULES_HELP = "Rules file (YAML), e.g. examples/rules/transfusion.yaml."
LAYOUT_HELP = (
    "Layout as modality:length[@document], space separated, e.g. \"text:40 image:256 text:24@1\". "
    "Give --layout several times to plan a batch (one layout per batch element, all of the same length)."
)
BLOCK_M_HELP = "Query rows per tile (a multiple of 16), e.g. --block-m 64."
BLOCK_N_HELP = "Key columns per tile (a multiple of 16), e.g. --block-n 64."


def _load(rules_path: str, layout_texts: Sequence[str], block_m: int,
          block_n: int) -> tuple[Rules, AnyLayout, PlanSummary, float]:
    """Rules, layout (or batch), the plan's summary and the seconds its tile counts and allowed pairs took;
    user mistakes become ValueErrors naming the option."""
    from ..layout import Layout
    from ..plan import PlanMemoryError, summarize
    from ..rules import Rules

    rules = Rules.load(rules_path)
    layouts = []
    for text in layout_texts:
        try:
            layout = Layout.parse(text)
            for name in sorted(layout.modalities):
                rules.modality_id(name)  # unknown modality: fail here, naming the layout
        except ValueError as exc:
            raise ValueError(f"--layout {text!r}: {exc}") from None
        layouts.append(layout)
    layout = layouts[0] if len(layouts) == 1 else Layout.batch(layouts)
    start = time.perf_counter()
    try:
        plan = summarize(rules, layout, block_m=block_m, block_n=block_n)
        plan.counts(), plan.allowed_pairs  # (what the planning time covers)
    except PlanMemoryError as exc:  # refused before allocating: the message names the sizes and the fixes
        raise UserError(str(exc)) from None
    except (MemoryError, RuntimeError) as exc:
        # A huge layout is a user's choice, not a bug: say so instead of printing a torch traceback.
        if isinstance(exc, RuntimeError) and "allocate" not in str(exc):
            raise
        raise UserError(f"not enough memory to plan {layout.seq_len:,} tokens x {layout.batch_size} "
                        f"with {block_m}x{block_n} tiles; try a shorter layout, larger tiles (--block-m 256 "
                        f"--block-n 256), or plan on a GPU (omnigen.plan(..., device='cuda'))") from None
    return rules, layout, plan, time.perf_counter() - start


def _common_options(command):  # type: ignore[no-untyped-def]
    command = click.option("--block-n", default=128, show_default=True, type=int, help=BLOCK_N_HELP)(command)
    command = click.option("--block-m", default=128, show_default=True, type=int, help=BLOCK_M_HELP)(command)
    command = click.option("--layout", "layouts", required=True, multiple=True, metavar="LAYOUT",
                           help=LAYOUT_HELP)(command)
    command = click.option("--rules", "rules_path", required=True, metavar="FILE", help=RULES_HELP)(command)
    return command


@cli.command()
@_common_options
@click.option("--png", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Also write a picture (mask, tile kinds, legend) to FILE, e.g. --png mask.png. Needs matplotlib.")
@click.option("--width", type=click.IntRange(min=40), default=None, metavar="N",
              help="Characters per line for the terminal picture (default: the terminal's width), e.g. --width 120.")
@click.option("--ascii", "ascii_only", is_flag=True, help="Draw with ASCII characters only (for logs and old terminals).")
@user_errors
def show(rules_path: str, layouts: tuple[str, ...], block_m: int, block_n: int, png: str | None,
         width: int | None, ascii_only: bool) -> None:
    """Draw the mask and its tile kinds in the terminal (and optionally as a PNG).

    \b
    Example:
      omnigen show --rules examples/rules/transfusion.yaml \\
                   --layout "text:40 image:256 text:24@1" --block-m 64 --block-n 64 --png mask.png

    The mask picture is averaged down to the terminal width (a character is all allowed, mixed or
    none over the tokens it covers); it is drawn only for S <= 8192, above which only the exact
    tile grid is shown (it never needs the S x S mask). The last line sums up the plan.
    """
    from .. import figures

    rules, layout, plan, _ = _load(rules_path, layouts, block_m, block_n)
    if width is None:
        width = shutil.get_terminal_size((100, 24)).columns
    unicode = not ascii_only and figures.can_encode_unicode(getattr(sys.stdout, "encoding", None))
    click.echo(figures.render_terminal(rules, layout, plan, width=width, unicode=unicode))
    if png:
        try:
            path = figures.save_png(rules, layout, plan, png)
        except ImportError as exc:
            raise UserError(f"--png: {exc}") from None
        click.echo(f"wrote {path}")


@cli.command(name="plan")
@_common_options
@click.option("--json", "as_json", is_flag=True, help="Print plan.stats() as JSON instead of a table.")
@user_errors
def plan_command(rules_path: str, layouts: tuple[str, ...], block_m: int, block_n: int, as_json: bool) -> None:
    """Tile statistics of a layout: tiles per kind, density, partial fraction, metadata size.

    \b
    Examples:
      omnigen plan --rules examples/rules/transfusion.yaml --layout "text:40 image:256 text:24@1"
      omnigen plan --rules examples/rules/transfusion.yaml --json \\
                   --layout "text:64 image:256" --layout "image:256 text:64"   # a batch of 2
    """
    from .. import figures

    rules, layout, plan, seconds = _load(rules_path, layouts, block_m, block_n)
    if as_json:
        click.echo(json.dumps(plan.stats(), indent=2))
    else:
        click.echo(figures.plan_table(rules, layout, plan, seconds))
