"""`omnigen bench`: the rules against FlexAttention and SDPA on this GPU, or a mask no rule says (a catalogue mask or
the user's mask_mod) against FlexAttention on the same mask_mod (the library's omnigen.bench)."""

from __future__ import annotations

import json

import click

from .. import bench as library
from ..rules import Rules
from ..tune import layouts as tune_layouts
from ..tune import timing as tune_timing
from .app import UserError, cli, user_errors
from .progress import progress


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(word) for word in text.replace(",", " ").split())
    except ValueError:
        raise UserError(f"{option} must be whole numbers separated by spaces or commas, e.g. {option} 8192,16384") from None
    if not values or min(values) < 1:
        raise UserError(f"{option} must list positive whole numbers, got {text!r}")
    return values


@cli.command(name="bench")
@click.option("--rules", "rules_path", metavar="FILE",
              help="Rules file (YAML), e.g. examples/rules/transfusion.yaml. Or time masks no rule says with --mask / "
                   "--mask-mod instead.")
@click.option("--mask", "mask_names", metavar="NAME,...",
              help="Masks of omnigen's catalogue to time against FlexAttention on the same mask_mod, or 'all': "
                   f"{', '.join(library.CATALOGUE_NAMES)}.")
@click.option("--mask-mod", "mask_mods", multiple=True, metavar="MODULE:FUNCTION",
              help="Your own mask_mod(b, h, q_idx, kv_idx) to time the same way, from an importable module or a .py "
                   "file; FUNCTION may instead be a factory (B, S, device) returning the mod. Repeatable.")
@click.option("--layouts", "layouts_path", metavar="FILE",
              help="Time these layouts (one per line, modality:length[@document]) instead of the rules' synthetic ones; "
                   "grouped by length, padded and repeated to B*S = --tokens.")
@click.option("--dims", default="64,128", show_default=True, metavar="D,...", help="Head dims to time.")
@click.option("--sizes", metavar="S,...",
              help="Sequence lengths: of the rules' synthetic layouts (default 4096,8192,16384,32768), or of the "
                   "masks (default 8192,32768).")
@click.option("--tokens", default=library.DEFAULT_TOKENS, show_default=True, type=click.IntRange(min=1),
              help="B * S per measurement.")
@click.option("--heads", default=library.DEFAULT_HEADS, show_default=True, type=click.IntRange(min=1))
@click.option("--heads-kv", default=0, type=click.IntRange(min=0), metavar="N",
              help="Key/value heads, dividing --heads: grouped-query attention (every peer on the same grouped "
                   "inputs; SDPA and FlexAttention with enable_gqa). Default: --heads.")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(sorted(library.DTYPES)),
              help="The inputs' type.")
@click.option("--peers", "peer_list", metavar="NAME,...",
              help=f"Which implementations to time: of {', '.join(library.PEERS)} with --rules (default all), of "
                   f"{', '.join(library.MASK_PEERS)} with --mask / --mask-mod (default both).")
@click.option("--rounds", default=6, show_default=True, type=click.IntRange(min=1),
              help="Round-robin rounds per shape (each runs every peer --reps times).")
@click.option("--reps", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--settle-ms", default=tune_timing.BENCH_SETTLE_MS, show_default=True, type=click.FloatRange(min=0),
              help="Untimed running of each peer before its timed runs in every round, so it is timed at the clocks "
                   "its own load settles to under the GPU's power limit (0: time it right after the previous peer).")
@click.option("--tile-cost", is_flag=True,
              help="With --mask / --mask-mod: also time each mask with every visited tile partial (read from bits) "
                   "against every visited tile full, same tiles and order: what a partial tile costs over a full one.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", metavar="FILE",
              help="Also write the rows and skips as JSON to FILE ('-': stdout). The rows timed so far are in FILE "
                   "while the run goes (\"partial\": true), so a run stopped early keeps them.")
@click.option("--png", "png_path", metavar="FILE", help="Also plot effective TFLOP/s against S to FILE. Needs matplotlib.")
@user_errors
def bench_command(rules_path: str | None, mask_names: str | None, mask_mods: tuple[str, ...],
                  layouts_path: str | None, dims: str, sizes: str | None, tokens: int, heads: int, heads_kv: int,
                  dtype: str, peer_list: str | None, rounds: int, reps: int, settle_ms: float, tile_cost: bool, seed: int,
                  json_path: str | None, png_path: str | None) -> None:
    """Time omnigen against FlexAttention, SDPA with the dense mask and the causal kernels on this GPU.

    \b
    Examples:
      omnigen bench --rules examples/rules/transfusion.yaml --dims 128 --sizes 8192,16384 --png bench.png
      omnigen bench --mask all --dims 64,128 --sizes 8192,32768 --json masks.json
      omnigen bench --mask medusa_tree,longformer --dims 128 --sizes 8192
      omnigen bench --mask random_eviction --dims 128 --sizes 8192 --tile-cost
      omnigen bench --mask-mod my_masks.py:make_mod --sizes 8192
      omnigen bench --rules examples/rules/transfusion.yaml --dims 128 --heads 16 --heads-kv 4 --dtype fp16

    With --rules: the rules' layouts through every peer. With --mask / --mask-mod (masks no rule says,
    issue 29): the same mask_mod through omnigen (mask_from_mod) and FlexAttention (create_block_mask),
    forward and forward+backward, plus the time to make each mask (make_ms), its memory (mask_mib) and
    omnigen's partial tiles; --tile-cost adds each mask's partial-over-full tile cost.
    B = --tokens // S sequences per shape.

    Every peer runs in this process on the same inputs; times are medians of CUDA-event timings after
    warm-up, interleaved round-robin, each peer timed after --settle-ms of its own load (a GPU at its
    power limit runs a burst after a lighter load faster than it sustains). Effective TFLOP/s count
    allowed pairs only (docs/measuring.md in the repository).
    A peer that cannot run a shape (FlexAttention missing, the dense mask out of memory, a backend that
    refuses the inputs) is skipped and listed with the reason.
    """
    masks = _names(mask_names) + list(mask_mods)
    if rules_path and masks:
        raise UserError("give --rules FILE or masks no rule says (--mask / --mask-mod), not both")
    if not rules_path and not masks:
        raise UserError("omnigen bench needs --rules FILE (the rules' layouts) or masks no rule says: --mask NAME,... "
                        "(the catalogue, or all) or --mask-mod MODULE:FUNCTION (see omnigen bench --help)")
    choices = library.MASK_PEERS if masks else library.PEERS
    peers = tuple(name.strip() for name in (peer_list or ",".join(choices)).split(",") if name.strip())
    unknown = sorted(set(peers) - set(choices))
    if unknown or not peers:
        raise UserError(f"--peers: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(choices)}")
    library.check_heads_and_dtype(heads, heads_kv, dtype)
    if tile_cost and not masks:
        raise UserError("--tile-cost times masks no rule says (--mask / --mask-mod); the rules kernels' tile cost is "
                        "benchmarks/bench_attention.py --tile-cost")
    if masks:
        if layouts_path:
            raise UserError("--layouts is for --rules; a mask_mod says its own mask")
        dim_list = _ints(dims, "--dims")
        size_list = _ints(sizes, "--sizes") if sizes else library.DEFAULT_MASK_SIZES
        specs = library.check_mask_specs(masks)
        _bench_masks(specs, dim_list, size_list, tokens, heads, peers, rounds, reps, settle_ms, seed, json_path,
                     png_path, tile_cost, heads_kv, dtype)
        return
    rules = Rules.load(rules_path)
    sizes = sizes or ",".join(map(str, library.DEFAULT_SIZES))
    layouts = None
    if layouts_path:
        layouts = tune_layouts.read_layouts_file(layouts_path, rules)
    dim_list, size_list = _ints(dims, "--dims"), _ints(sizes, "--sizes")
    import torch

    if not torch.cuda.is_available():
        raise UserError("omnigen bench needs a CUDA GPU to time on, and none is visible here")
    steps = library.count_steps(rules, dim_list, size_list, tokens, layouts)
    partial = _PartialJson(json_path, {"rules": rules.name})
    with progress(steps, "benchmarking") as bar:
        result = library.run(rules, dims=dim_list, sizes=size_list, tokens=tokens, heads=heads, seed=seed,
                             layouts=layouts, rounds=rounds, reps=reps, only=peers, settle_ms=settle_ms,
                             on_step=lambda label: bar.update(1, label), on_row=partial.add, heads_kv=heads_kv,
                             dtype=dtype)
    _report(result, json_path, png_path)


class _PartialJson:
    """With --json FILE, the rows timed so far written to FILE as each arrives ("partial": true), so that a run
    stopped part-way (a time limit, an out-of-memory peer) keeps what it measured; the whole result replaces it."""

    def __init__(self, json_path: str | None, info: dict) -> None:
        self.path = json_path if json_path and json_path != "-" else None
        self.info = {**info, "partial": True}
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        if self.path is None:
            return
        self.rows.append(row)
        with open(self.path, "w") as handle:
            json.dump({"info": self.info, "rows": self.rows}, handle, indent=1)


def _names(text: str | None) -> list[str]:
    """Comma- or space-separated names."""
    return [word for word in (text or "").replace(",", " ").split() if word]


def _bench_masks(specs: tuple[str, ...], dims: tuple[int, ...], sizes: tuple[int, ...], tokens: int, heads: int,
                 peers: tuple[str, ...], rounds: int, reps: int, settle_ms: float, seed: int, json_path: str | None,
                 png_path: str | None, tile_cost: bool = False, heads_kv: int = 0, dtype: str = "bf16") -> None:
    import torch

    if not torch.cuda.is_available():
        raise UserError("omnigen bench needs a CUDA GPU to time on, and none is visible here")
    steps = library.count_mask_steps(specs, dims, sizes, tile_cost)
    partial = _PartialJson(json_path, {"masks": list(specs)})
    with progress(steps, "benchmarking masks") as bar:
        result = library.run_masks(specs, dims=dims, sizes=sizes, tokens=tokens, heads=heads, seed=seed,
                                   rounds=rounds, reps=reps, only=peers, settle_ms=settle_ms,
                                   on_step=lambda label: bar.update(1, label), on_row=partial.add,
                                   tile_cost=tile_cost, heads_kv=heads_kv, dtype=dtype)
    _report(result, json_path, png_path)


def _report(result: library.Result, json_path: str | None, png_path: str | None) -> None:
    """The table (or JSON on stdout with --json -), the JSON file, the plot."""
    if json_path == "-":
        click.echo(result.to_json())
    else:
        click.echo(library.table(result))
        if json_path:
            with open(json_path, "w") as handle:
                handle.write(result.to_json())
            click.echo(f"wrote {json_path}")
    if png_path:
        try:
            library.plot(result.rows, png_path)
        except ImportError as exc:
            raise UserError(f"--png: {exc} (pip install matplotlib)") from None
        click.echo(f"wrote {png_path}", err=json_path == "-")
