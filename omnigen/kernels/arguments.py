"""The kernels' launch arguments, described once.

Four C structs carry a launch's arguments into the generated kernel files: ForwardArgs, BackwardArgs, DeltaArgs
and ConvertArgs (`omnigen/forward_args.h`, `omnigen/backward_args.h` under kernels/common/include). Everything that
names their fields is made from the descriptions below:

- the headers themselves (`python -m omnigen.kernels.arguments --write` rewrites them; tests/test_arguments.py
  fails when they differ from the descriptions),
- the Python binding of every module (common/templates/binding.cpp.j2): each launch's parameters, their order,
  the checks of their addresses and strides, and the copy into the struct,
- the Python kernels' calls (`call_arguments`, used by kernels/launch.py), which pass values by name.

The op shim (op/native/ops.cpp) fills the same structs by field name in C++, so the compiler checks it against
the headers. A field's `binding` says how the binding takes it: a parameter (the default), a keyword with a
default of 0 (optional inputs), or not at all (`derived`: the binding computes it from other parameters).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

INCLUDE_DIR = Path(__file__).resolve().parent / "common" / "include" / "omnigen"

# How the binding takes a field of each C type (a Python int or float): addresses as integers.
_BINDING_TYPES = {"int64_t": "int64_t", "int": "int", "float": "double"}


@dataclass(frozen=True)
class Field:
    """One member of a launch struct."""

    name: str
    ctype: str
    comment: str = ""
    align: int = 0  # an address: the byte alignment the binding checks (0: not an address)
    nullable: bool = False  # an address the binding lets be 0 (an empty table, an input read only sometimes)
    binding: str = "parameter"  # "parameter", "keyword" (default 0) or "derived" (set by the binding itself)
    binding_type: str = ""  # the binding's C++ type when it is not the field's own (e.g. bool for a 0/1 int)
    set_by_binding: bool = True  # False: the binding sets it after its own checks (a mask's partial bits)

    @property
    def is_address(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def parameter_type(self) -> str:
        if self.binding_type:
            return self.binding_type
        return "uintptr_t" if self.is_address else _BINDING_TYPES[self.ctype]

    def cast(self) -> str:
        """The binding's expression that turns its parameter into the field's value."""
        if self.is_address:
            return f"reinterpret_cast<{self.ctype}>({self.name})"
        if self.ctype == "float":
            return f"static_cast<float>({self.name})"
        return f"{self.ctype}({self.name})" if self.binding_type else self.name


@dataclass(frozen=True)
class Strides:
    """The batch, head and sequence strides (in elements) of one [B, H, S, D] tensor: three int64_t fields."""

    tensor: str
    multiple: int = 8  # the binding checks each is a multiple of this (16-byte rows): 0 leaves the check to the template

    @property
    def fields(self) -> tuple[Field, ...]:
        return tuple(Field(f"{self.tensor}_stride_{axis}", "int64_t") for axis in "bhs")


@dataclass(frozen=True)
class Comment:
    """A comment line (or lines) between fields of the header."""

    text: str


Member = Field | Strides | Comment


@dataclass(frozen=True)
class LaunchStruct:
    """A launch's struct: its C name, the binding's function that fills it, and its members in order."""

    name: str
    function: str  # the module's Python function (module.forward, module.backward, module.backward_delta)
    launch: str  # the kernel file's C++ launch function that takes it
    comment: str
    members: tuple[Member, ...]

    @property
    def fields(self) -> tuple[Field, ...]:
        out: list[Field] = []
        for member in self.members:
            if isinstance(member, Strides):
                out.extend(member.fields)
            elif isinstance(member, Field):
                out.append(member)
        return tuple(out)

    @property
    def strides(self) -> tuple[Strides, ...]:
        return tuple(m for m in self.members if isinstance(m, Strides))

    @property
    def parameters(self) -> tuple[Field, ...]:
        """The binding's positional parameters, in order (then `stream`, then the keywords)."""
        return tuple(f for f in self.fields if f.binding == "parameter")

    @property
    def keywords(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.binding == "keyword")

    @cached_property
    def call_keys(self) -> tuple[tuple[str, bool], ...]:
        """The values `call_arguments` reads, in the binding's positional order: (key, True) for a tensor's three
        strides (`<tensor>_strides`), (name, False) for a parameter field."""
        return tuple((f"{m.tensor}_strides", True) if isinstance(m, Strides) else (m.name, False)
                     for m in self.members
                     if isinstance(m, Strides) or (isinstance(m, Field) and m.binding == "parameter"))

    @property
    def has_partial_bits(self) -> bool:
        """The binding takes the bits' length in words (partial_bits_words) and sets partial_slots from it."""
        return any(f.name == "partial_slots" for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}")


def _tensor(name: str, ctype: str, comment: str, align: int = 16, **kw: Any) -> Field:
    return Field(name, ctype, comment, align=align, **kw)


def _table(name: str, comment: str, ctype: str = "const int32_t*", **kw: Any) -> Field:
    return Field(name, ctype, comment, align=4, **kw)


_QKV = (
    _tensor("q", "const void*", "[batch, heads_q, seq_len, head_dim], bf16/fp16 (or e4m3: forward), last dim contiguous"),
    _tensor("k", "const void*", "[batch, heads_kv, seq_len, head_dim]"),
    _tensor("v", "const void*", "[batch, heads_kv, seq_len, head_dim]"),
)
_SIZES = (Field("batch", "int"), Field("heads_q", "int"), Field("heads_kv", "int"), Field("seq_len", "int"))
_TOKENS = (
    _table("token_segment", "LayoutTables.token_segment [batch, seq_len]"),
    _table("token_modality", "LayoutTables.token_modality [batch, seq_len]"),
    _table("token_doc", "LayoutTables.token_doc [batch, seq_len]"),
)
# The bits of partial tiles: the binding takes their length in words (partial_bits_words) and sets the slot count.
_PARTIAL_BITS = (
    _table("partial_slot", "", binding="keyword", nullable=True, set_by_binding=False),
    _table("partial_bits", "", ctype="const uint32_t*", binding="keyword", nullable=True, set_by_binding=False),
    Field("partial_slots", "int", binding="derived"),
)

FORWARD = LaunchStruct(
    name="ForwardArgs", function="forward", launch="forward_launch",
    comment="What one forward launch reads and writes.",
    members=(
        *_QKV,
        _tensor("o", "void*", "[batch, heads_q, seq_len, head_dim]"),
        _tensor("lse", "float*", "[batch, heads_q, seq_len], float32, contiguous", align=4),
        Strides("q"), Strides("k"), Strides("v"), Strides("o"),
        *_SIZES,
        Field("scale", "float", "softmax scale, usually 1/sqrt(head_dim)"),
        _table("fwd_ptr", "omnigen.Plan.fwd_ptr: [batch * num_q_tiles * 3 + 1]"),
        _table("fwd_kv", "omnigen.Plan.fwd_kv (empty, address 0, when the plan visits no tile)", nullable=True),
        *_TOKENS,
        _table("tile_counter", "the persistent sm90 forward's work-tile counter: one int32, zeroed by the launch; "
               "else null", ctype="int32_t*", binding="keyword", nullable=True),
        Comment("Partial tiles' masks made once per layout (omnigen.plan.bits; the sm90 forward): the slot of each "
                "q-tile row's\nfirst partial entry [batch * num_q_tiles + 1], and `partial_slots` slots of bits. "
                "0 slots: none (null pointers)."),
        *_PARTIAL_BITS,
        Field("value_scale", "float", "FP8 (e4m3) variants: V's descale, multiplied into O; other variants ignore it",
              binding="keyword"),
        _table("descale", "FP8 (e4m3) variants: null, or (dq, dk, dv) in float32 on the device, read in place of "
               "the host's", ctype="const float*", binding="keyword", nullable=True),
    ),
)

BACKWARD = LaunchStruct(
    name="BackwardArgs", function="backward", launch="backward_launch",
    comment="What one backward launch (the dK/dV kernel, and the dQ kernel where separate) reads and writes.",
    members=(
        *_QKV,
        _tensor("d_o", "const void*", "upstream gradient of the output, [batch, heads_q, seq_len, head_dim]"),
        _tensor("lse", "const float*", "the forward's log-sum-exp, [batch, heads_q, seq_len], float32, contiguous",
                align=4),
        _tensor("delta", "const float*", "rowsum(dO * O), [batch, heads_q, seq_len], float32, contiguous", align=4),
        _tensor("dq_accum", "float*", "dQ, [batch, heads_q, seq_len, head_dim], float32, contiguous (zeroed by the "
                "caller)"),
        Comment("dK and dV of every *query* head: [batch, heads_q, seq_len, head_dim]. The element type of q/k/v "
                "when\nheads_q == heads_kv (then they are the real dk/dv); float32 partials the caller sums over "
                "each group\nof heads_q / heads_kv query heads when they differ."),
        _tensor("dk", "void*", ""),
        _tensor("dv", "void*", ""),
        Strides("q"), Strides("k"), Strides("v"), Strides("d_o"),
        Strides("dk", multiple=0), Strides("dv", multiple=0),  # 8 for the element type, 4 for float32 partials
        *_SIZES,
        Field("scale", "float", "the forward's softmax scale"),
        _table("fwd_ptr", "omnigen.Plan.fwd_ptr (read by the deterministic dQ kernel only)", nullable=True),
        _table("fwd_kv", "omnigen.Plan.fwd_kv", nullable=True),
        _table("bwd_ptr", "omnigen.Plan.bwd_ptr: [batch * num_kv_tiles * 3 + 1]"),
        _table("bwd_q", "omnigen.Plan.bwd_q (empty, address 0, when the plan visits no tile)", nullable=True),
        *_TOKENS,
        Field("deterministic", "int", "0: dQ by atomicAdd from the dK/dV kernel; 1: a second kernel per q-tile, "
              "no atomics", binding_type="bool"),
        Comment("Deterministic mode of modules whose Hopper backward orders its dQ additions (ORDERED_DQ): each\n"
                "backward-schedule entry's rank among its q-tile's kv-tiles (omnigen.Plan.dq_ranks, parallel to "
                "bwd_q) and\none zeroed counter per (batch, query head, 64-row block of dQ); in atomic mode the "
                "persistent backward's\nkv-tile counter, one zeroed int32 (PERSISTENT_BACKWARD). Null otherwise. The "
                "Delta pass zeroes them (zero_ints)."),
        _table("dq_rank", "", binding="keyword", nullable=True),
        _table("dq_semaphore", "", ctype="int32_t*", binding="keyword", nullable=True),
        Comment("GQA's dK/dV: 0 or 1, float32 per query head (the caller sums each group); heads_q / heads_kv (a "
                "power of two):\nadded by the Hopper backward into float32 [batch, heads_kv, seq_len, head_dim] "
                "(GROUP_DKDV modules, atomic mode)."),
        Field("dkdv_group", "int", "", binding="keyword"),
        Comment("The Hopper backward's partial steps: the mask's bits of the backward schedule (omnigen.plan.bits, "
                "transposed\ntiles), the slot of each kv-tile column's first partial entry "
                "[batch * num_kv_tiles + 1]. 0 slots: none."),
        *_PARTIAL_BITS,
    ),
)

DELTA = LaunchStruct(
    name="DeltaArgs", function="backward_delta", launch="backward_delta_launch",
    comment="rowsum(dO * O) per query row, the Delta the backward reads; and the fp32 dQ zeroed in the same pass.",
    members=(
        _tensor("o", "const void*", "[batch, heads_q, seq_len, head_dim]"),
        _tensor("d_o", "const void*", "[batch, heads_q, seq_len, head_dim]"),
        _tensor("delta", "float*", "[batch, heads_q, seq_len], float32, contiguous", align=4),
        Strides("o"), Strides("d_o"),
        Field("batch", "int"), Field("heads_q", "int"), Field("seq_len", "int"),
        _tensor("dq_accum", "float*", "null, or the backward's [batch, heads_q, seq_len, head_dim] float32 to zero",
                nullable=True, binding="keyword"),
        _table("zero_ints", "null, or int32 counters the backward takes zeroed (BackwardArgs.dq_semaphore), zeroed "
               "here too", ctype="int32_t*", binding="keyword", nullable=True),
        Field("zero_int_count", "int64_t", "how many: at most batch * heads_q * seq_len", binding="keyword"),
    ),
)

CONVERT = LaunchStruct(
    name="ConvertArgs", function="backward_convert", launch="backward_convert_launch",
    comment="A gradient accumulated in float32 (dQ, GQA's grouped dK/dV) written out in the element type.",
    members=(
        _tensor("source", "const float*", "[batch, heads, seq_len, head_dim], float32, contiguous"),
        _tensor("destination", "void*", "[batch, heads, seq_len, head_dim], the element type, last dim contiguous"),
        Strides("destination"),
        Field("batch", "int"), Field("heads", "int"), Field("seq_len", "int"),
        Field("interleaved", "int", "1: each 8-column group of the source holds columns 0, 2, 4, 6, 1, 3, 5, 7 (dQ "
              "of a module whose DQ_INTERLEAVED is set); 0: in order", binding="keyword", binding_type="bool"),
    ),
)

STRUCTS = (FORWARD, BACKWARD, DELTA, CONVERT)


def call_arguments(struct: LaunchStruct, values: Mapping[str, Any], stream: int) -> tuple[Any, ...]:
    """The binding's positional arguments of a launch, from values by field name (strides by tensor name:
    `values["q_strides"]` = q.stride()): every parameter in the description's order, then the stream.
    Keywords are passed by name by the caller."""
    out: list[Any] = []
    try:
        for key, strides in struct.call_keys:
            if strides:
                out.extend(values[key][:3])
            else:
                out.append(values[key])
    except KeyError as missing:
        raise KeyError(f"{struct.name}: no value for {missing.args[0]!r}") from None
    out.append(stream)
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# the binding's side of a struct (common/templates/binding.cpp.j2 places these blocks)


def _packed(items: list[str], first: str, indent: str, last: str, width: int = 118) -> str:
    """`first` + items joined by ", " + `last`, wrapped before `width` columns with `indent` on later lines."""
    lines, line = [], first
    for i, item in enumerate(items):
        piece = item + (", " if i + 1 < len(items) else last)
        if len(line) + len(piece.rstrip()) > width and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += piece
    lines.append(line)
    return "\n".join(lines)


def binding_signature(struct: LaunchStruct) -> str:
    """The binding function's C++ signature (without the body's brace)."""
    items = [f"{f.parameter_type} {f.name}" for f in struct.parameters] + ["uintptr_t stream"]
    items += [f"{f.parameter_type} {f.name}" for f in struct.keywords]
    if struct.has_partial_bits:
        items.append("int64_t partial_bits_words")
    first = f"void {struct.function}("
    return _packed(items, first, " " * len(first), ")")


def binding_checks(struct: LaunchStruct) -> str:
    """The checks every call needs: the addresses the binding copies into the struct, parameters and keywords (nullable
    ones when given), and 16-byte rows."""
    lines = []
    for f in struct.parameters + tuple(k for k in struct.keywords if k.set_by_binding):
        if f.align:
            check = f'require_address({f.name}, "{f.name}", {f.align});'
            lines.append(f"  if ({f.name} != 0) {check}" if f.nullable else f"  {check}")
    for s in struct.strides:
        if s.multiple:
            lines.append(f'  require_strides({s.tensor}_stride_b, {s.tensor}_stride_h, {s.tensor}_stride_s, "{s.tensor}");')
    return "\n".join(lines)


def binding_fill(struct: LaunchStruct, name: str = "args") -> str:
    """The struct, declared and filled from the parameters (derived fields and the partial bits are left to the
    binding's own code)."""
    lines = [f"  omnigen::{struct.name} {name}{{}};"]
    for member in struct.members:
        if isinstance(member, Strides):
            lines.append("  " + ", ".join(f"{name}.{f.name} = {f.name}" for f in member.fields) + ";")
        elif isinstance(member, Field) and member.binding != "derived" and member.set_by_binding:
            lines.append(f"  {name}.{member.name} = {member.cast()};")
    return "\n".join(lines)


def binding_arguments(struct: LaunchStruct) -> str:
    """The py::arg list of the binding's m.def, in the signature's order."""
    items = [f'py::arg("{f.name}")' for f in struct.parameters] + ['py::arg("stream")']
    items += [f'py::arg("{f.name}") = 0' for f in struct.keywords]
    if struct.has_partial_bits:
        items.append('py::arg("partial_bits_words") = 0')
    return _packed(items, " " * 8, " " * 8, "")


def binding_call_comment(struct: LaunchStruct) -> str:
    """One comment line (wrapped) naming the call's arguments in order, strides by tensor."""
    items: list[str] = []
    for member in struct.members:
        if isinstance(member, Strides):
            items.append(f"{member.tensor}_stride_b/_h/_s")
        elif isinstance(member, Field) and member.binding == "parameter":
            items.append(member.name)
    items.append("stream")
    items += [f"{f.name}=0" for f in struct.keywords]
    if struct.has_partial_bits:
        items.append("partial_bits_words=0")
    first = f"//   {struct.function}("
    return _packed(items, first, "//" + " " * (len(first) - 2), ")")


# ------------------------------------------------------------------------------------------------
# the headers


def _field_line(f: Field, width: int) -> str:
    declaration = f"  {f.ctype} {f.name};"
    return f"{declaration.ljust(width)}  // {f.comment}" if f.comment else declaration


def _struct_text(struct: LaunchStruct) -> list[str]:
    lines = [f"// {struct.comment}", f"struct {struct.name} {{"]
    width = max(len(f"  {f.ctype} {f.name};") for f in struct.fields if f.comment)
    grouped: list[Field] = []  # consecutive plain int fields print on one line, as the sizes do

    def flush() -> None:
        if grouped:
            lines.append(f"  {grouped[0].ctype} " + ", ".join(g.name for g in grouped) + ";")
            grouped.clear()

    for member in struct.members:
        if isinstance(member, Strides):
            flush()
            lines.append("  int64_t " + ", ".join(f.name for f in member.fields) + ";")
        elif isinstance(member, Comment):
            flush()
            lines.extend(f"  // {line}" for line in member.text.split("\n"))
        elif member.ctype == "int" and not member.comment and member.binding == "parameter":
            grouped.append(member)
        else:
            flush()
            lines.append(_field_line(member, width))
    flush()
    lines.append("};")
    return lines


_HEADER_TOP = """\
// omnigen: {what}, shared by the generated binding (host C++, no CUDA headers), the generated
// kernel files and the op shim. Pointers are device addresses; strides count elements.
// Generated from omnigen/kernels/arguments.py (python -m omnigen.kernels.arguments --write): edit that, not this.
#pragma once
#include <cstdint>

namespace omnigen {{
"""

_FORWARD_TAIL = """
// Implemented by the generated kernel file. Each returns 0 or a CUDA error code, and fills `message`
// (at most `message_size` bytes, NUL-terminated) with a sentence for the user when it fails.
int forward_launch(const ForwardArgs& args, uintptr_t stream, char* message, int message_size);
int device_check(char* message, int message_size);

}  // namespace omnigen
"""

_BACKWARD_TAIL = """
// Implemented by the generated backward kernel file; same conventions as forward_launch.
int backward_launch(const BackwardArgs& args, uintptr_t stream, char* message, int message_size);
int backward_delta_launch(const DeltaArgs& args, uintptr_t stream, char* message, int message_size);
int backward_convert_launch(const ConvertArgs& args, uintptr_t stream, char* message, int message_size);

}  // namespace omnigen
"""


def headers() -> dict[str, str]:
    """File name (under kernels/common/include/omnigen) -> the header text the descriptions give."""
    forward = "\n".join([_HEADER_TOP.format(what="the forward kernel's arguments"), *_struct_text(FORWARD)])
    backward = "\n".join([_HEADER_TOP.format(what="the backward kernels' arguments"), *_struct_text(BACKWARD), "",
                          *_struct_text(DELTA), "", *_struct_text(CONVERT)])
    return {"forward_args.h": forward + "\n" + _FORWARD_TAIL, "backward_args.h": backward + "\n" + _BACKWARD_TAIL}


def stale_headers() -> list[str]:
    """The headers on disk that differ from the descriptions (empty when all match)."""
    return [name for name, text in headers().items()
            if not (INCLUDE_DIR / name).is_file() or (INCLUDE_DIR / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnigen.kernels.arguments",
                                     description="Check (default) or rewrite the launch-argument headers that "
                                                 "kernels/arguments.py describes.")
    parser.add_argument("--write", action="store_true", help="rewrite the headers from the descriptions")
    args = parser.parse_args(argv)
    stale = stale_headers()
    if args.write:
        for name, text in headers().items():
            (INCLUDE_DIR / name).write_text(text)
        print(f"wrote {', '.join(headers())} under {INCLUDE_DIR}" if stale else "headers already up to date")
        return 0
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m omnigen.kernels.arguments --write")
        return 1
    print("headers match the descriptions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
