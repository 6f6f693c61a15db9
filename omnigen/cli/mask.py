"""`omnigen show` and `omnigen plan`: look at a mask and its tile plan without a GPU.

The library (layouts, rules, the planner, figures) is imported when a command runs, not with this
module: `omnigen show --help` needs only click. The commands themselves need numpy but not torch: they
print a `PlanSummary` (omnigen/plan/summary.py), the plan's statistics and pictures made by the host
planner's numpy core without its schedules -- the same numbers as `omnigen.plan(...)`, in a process that
never imports torch (tests/test_cli_startup.py), so `omnigen plan` answers in a fraction of a second and
takes 4M tokens in bounded memory.

`omnigen show` also draws masks made from data (issue 29: a catalogue mask, a user's mask_mod, a saved dense mask or
FlashMask intervals): those are made with torch on the CPU by the library's makers and drawn from what the kernels
read (the plan's kinds and the partial tiles' bits), so torch is imported only when one of those options is used.
"""

from __future__ import annotations

import functools
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


def _common_options(command, required: bool = True):  # type: ignore[no-untyped-def]
    command = click.option("--block-n", default=128, show_default=True, type=int, help=BLOCK_N_HELP)(command)
    command = click.option("--block-m", default=128, show_default=True, type=int, help=BLOCK_M_HELP)(command)
    command = click.option("--layout", "layouts", required=required, multiple=True, metavar="LAYOUT",
                           help=LAYOUT_HELP)(command)
    command = click.option("--rules", "rules_path", required=required, metavar="FILE", help=RULES_HELP)(command)
    return command


# Masks made from data (omnigen.mask_catalogue, omnigen.mask_from_*): the options `show` takes instead of
# --rules/--layout.
DATA_SOURCES = ("--mask", "--mask-mod", "--dense", "--intervals")


def _data_options(command):  # type: ignore[no-untyped-def]
    options = [
        click.option("--mask", "catalogue_name", metavar="NAME",
                     help="A mask no rule says, from omnigen's catalogue (causal_documents, share_question, "
                          "global_sliding_window, prefix_lm_documents, qk_sparse, random_eviction, medusa_tree, "
                          "packed_alpaca, longformer), made for --seq-len tokens. Instead of --rules/--layout."),
        click.option("--mask-mod", "mask_mod", metavar="MODULE:FUNCTION",
                     help="A FlexAttention-style mask_mod(b, h, q_idx, kv_idx) (or a factory FUNCTION(B, S, device) "
                          "returning one) from an importable module or a .py file, evaluated for --seq-len tokens "
                          "on the CPU, e.g. --mask-mod my_masks.py:causal --seq-len 4096."),
        click.option("--dense", "dense_path", metavar="FILE",
                     help="A dense bool mask [S, S] or [B, S, S] saved with torch.save (True = may attend)."),
        click.option("--intervals", "intervals_path", metavar="FILE",
                     help="FlashMask column intervals saved with torch.save as a dict {'lts': ..., 'lte': ...} "
                          "(optionally 'uts', 'ute'), [B, S] integer tensors each."),
        click.option("--seq-len", type=click.IntRange(min=1), metavar="S",
                     help="Sequence length for --mask and --mask-mod, e.g. --seq-len 2048."),
        click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Batch elements for --mask and --mask-mod (the first 4 are drawn; the summary covers all)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of a --mask's random structure."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _data_mask(sources: dict[str, str | None], seq_len: int | None, batch: int, seed: int, block_m: int,
               block_n: int):  # type: ignore[no-untyped-def]
    """(mask, what it was made from) for the one data source given; user mistakes become ValueErrors naming the
    option."""
    import omnigen
    from .. import mask_catalogue

    (option, value), = ((o, v) for o, v in sources.items() if v is not None)
    tiles = [(block_m, block_n)]
    if option in ("--mask", "--mask-mod") and seq_len is None:
        raise UserError(f"{option} needs --seq-len, the number of tokens to make the mask for, e.g. --seq-len 2048")
    if option == "--mask":
        made = mask_catalogue.catalogue_mask(value, batch, seq_len, "cpu", seed)
        return made.mask("mod", tiles=tiles), f"catalogue mask '{value}' ({made.description}), seed {seed}"
    if option == "--mask-mod":
        mod = mask_catalogue.load_mask_mod(value, batch, seq_len, "cpu")
        return omnigen.mask_from_mod(mod, batch, seq_len, "cpu", tiles=tiles), f"mask_mod {value}"
    if option == "--dense":
        return omnigen.mask_from_dense(mask_catalogue.read_dense(value), tiles=tiles), f"dense mask {value}"
    return omnigen.mask_from_intervals(**mask_catalogue.read_intervals(value), tiles=tiles), f"intervals {value}"


def _show_data_mask(mask, source: str, block_m: int, block_n: int, png: str | None, width: int,
                    unicode: bool) -> None:  # type: ignore[no-untyped-def]
    """Draw a mask made from data: the mask the kernels see (kinds and bits), its tiles, its memory."""
    from .. import figures
    from ..layout import Layout, LayoutBatch
    from ..plan.ruleless import RULELESS_RULES, dense_from_bits

    plan = mask.plan(block_m, block_n)
    # Pictures label token positions by segment; a mask without rules has one stretch of tokens per element.
    element = Layout.from_segments([("tokens", mask.seq_len)])
    layout = LayoutBatch([element] * mask.batch_size) if mask.batch_size > 1 else element

    def dense(b: int):  # type: ignore[no-untyped-def]
        return dense_from_bits(mask, block_m, block_n, b).numpy()

    click.echo(f"mask made from {source}")
    click.echo(figures.render_terminal(RULELESS_RULES, layout, plan, width=width, unicode=unicode, dense=dense))
    click.echo(f"mask memory: {mask.nbytes():,} bytes (per-token tables, schedules and the partial tiles' bits for "
               f"both passes: O(S + partial tiles))")
    if png:
        try:
            path = figures.save_png(RULELESS_RULES, layout, plan, png, dense=dense,
                                    title=f"mask made from {source}")
        except ImportError as exc:
            raise UserError(f"--png: {exc}") from None
        click.echo(f"wrote {path}")


@cli.command()
@functools.partial(_common_options, required=False)
@_data_options
@click.option("--png", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Also write a picture (mask, tile kinds, legend) to FILE, e.g. --png mask.png. Needs matplotlib.")
@click.option("--width", type=click.IntRange(min=40), default=None, metavar="N",
              help="Characters per line for the terminal picture (default: the terminal's width), e.g. --width 120.")
@click.option("--ascii", "ascii_only", is_flag=True, help="Draw with ASCII characters only (for logs and old terminals).")
@user_errors
def show(rules_path: str | None, layouts: tuple[str, ...], catalogue_name: str | None, mask_mod: str | None,
         dense_path: str | None, intervals_path: str | None, seq_len: int | None, batch: int, seed: int,
         block_m: int, block_n: int, png: str | None, width: int | None, ascii_only: bool) -> None:
    """Draw the mask and its tile kinds in the terminal (and optionally as a PNG).

    \b
    Examples:
      omnigen show --rules examples/rules/transfusion.yaml \\
                   --layout "text:40 image:256 text:24@1" --block-m 64 --block-n 64 --png mask.png
      omnigen show --mask medusa_tree --seq-len 1024 --block-m 64 --block-n 64
      omnigen show --mask-mod my_masks.py:causal_documents --seq-len 4096 --batch 2
      omnigen show --dense mask.pt --png mask.png          # torch.save(bool_mask, "mask.pt")
      omnigen show --intervals flashmask.pt                 # torch.save({"lts": lts, "lte": lte}, ...)

    Give either --rules with --layout, or one mask made from data (--mask, --mask-mod, --dense,
    --intervals; made on the CPU, drawn from the plan's tile kinds and the partial tiles' bits, which
    is what the kernels read). The mask picture is averaged down to the terminal width (a character
    is all allowed, mixed or none over the tokens it covers); it is drawn only for S <= 8192, above
    which only the exact tile grid is shown. The last lines sum up the plan.
    """
    from .. import figures

    sources = dict(zip(DATA_SOURCES, (catalogue_name, mask_mod, dense_path, intervals_path)))
    given = [option for option, value in sources.items() if value is not None]
    if len(given) > 1 or (given and (rules_path or layouts)):
        raise UserError(f"give one mask: --rules with --layout, or one of {', '.join(DATA_SOURCES)}; got "
                        f"{', '.join((['--rules/--layout'] if rules_path or layouts else []) + given)}")
    if not given and not (rules_path and layouts):
        missing = "--layout" if rules_path else "--rules" if layouts else "--rules and --layout"
        raise UserError(f"missing {missing}: give --rules FILE --layout LAYOUT, or a mask made from data with one of "
                        f"{', '.join(DATA_SOURCES)} (see omnigen show --help)")
    if not given and (seq_len is not None or batch != 1):
        raise UserError("--seq-len and --batch are for --mask and --mask-mod; a layout says its own length")
    if width is None:
        width = shutil.get_terminal_size((100, 24)).columns
    unicode = not ascii_only and figures.can_encode_unicode(getattr(sys.stdout, "encoding", None))
    if given:
        mask, source = _data_mask(sources, seq_len, batch, seed, block_m, block_n)
        _show_data_mask(mask, source, block_m, block_n, png, width, unicode)
        return
    rules, layout, plan, _ = _load(rules_path, layouts, block_m, block_n)
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
