"""The masking-rules DSL: what a user declares once, in YAML or in Python.

A `Rules` object is immutable and canonical: modalities are kept sorted by name, `see`
entries that repeat the default are dropped, and optional fields carry their default value.
Two rule sets that mean the same mask therefore compare equal and share `content_hash()`,
however their YAML was written.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from .semantics import dense_mask
from .targets import ARCHS, DTYPES, HEAD_DIMS, KernelSpec, TileConfig

PAD = "pad"
_BY_KEY: "weakref.WeakValueDictionary[str, Rules]" = weakref.WeakValueDictionary()  # Rules.key -> a live Rules


def rules_for_key(key: str) -> "Rules":
    """The live Rules whose `key` this is (KeyError when none is alive in this process)."""
    found = _BY_KEY.get(key)
    if found is None:
        raise KeyError(f"no omnigen.Rules with key {key!r} in this process")
    return found
SELF_POLICIES = ("causal", "full")
SEE_POLICIES = ("earlier", "none", "all")
DOCUMENT_POLICIES = ("isolated", "shared")
MAX_WINDOW = 2**31 - 1

_NAME_RE = re.compile(r"^[a-z0-9_]+$")
_MODALITY_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_PAIR_RE = re.compile(r"^\s*([^\s>-]+)\s*->\s*([^\s>-]+)\s*$")

TOP_KEYS = ("name", "modalities", "see", "documents", "kernel")
MODALITY_KEYS = ("self", "window")
KERNEL_KEYS = ("head_dims", "dtypes", "archs", "tiles")
TILE_KEYS = ("block_m", "block_n", "warps", "stages")


class RulesError(ValueError):
    """A rule set that cannot be used, with where it came from and what to do about it."""

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        line: int | None = None,
        key: str | None = None,
        suggestion: str | None = None,
    ) -> None:
        self.message = message
        self.source = source
        self.line = line
        self.key = key
        self.suggestion = suggestion
        super().__init__(self._render())

    def _render(self) -> str:
        where = self.source or "rules"
        if self.line is not None:
            where += f":{self.line}"
        text = f"{where}: "
        if self.key:
            text += f"at '{self.key}': "
        text += self.message
        if self.suggestion:
            text += f" (did you mean '{self.suggestion}'?)"
        return text


def closest(word: object, choices: Iterable[str]) -> str | None:
    """The valid word a typo most likely meant, or None when nothing is close."""
    if not isinstance(word, str):
        return None
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return found[0] if found else None


@dataclass(frozen=True)
class Modality:
    """How tokens of one modality attend inside their own segment."""

    name: str
    self: str = "causal"  # noqa: A003 - the DSL's word
    window: int = 0  # >0: a query sees only keys with q - k < window

    @property
    def causal(self) -> bool:
        return self.self == "causal"


# --------------------------------------------------------------------------------------------
# Locating keys in YAML text: a composed node tree remembers line numbers; we keep them per path.


class _Located:
    """Plain Python data from YAML plus the 1-based line of every mapping key, by key path."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: dict[tuple[str, ...], int] = {}

    def line(self, path: tuple[str, ...]) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def error(self, message: str, path: tuple[str, ...] = (), suggestion: str | None = None) -> RulesError:
        key = ".".join(path) if path else None
        return RulesError(message, source=self.source, line=self.line(path), key=key, suggestion=suggestion)

    def convert(self, node: yaml.Node, path: tuple[str, ...] = ()) -> Any:
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self.convert(key_node, path)
                if not isinstance(key, (str, int)):
                    raise RulesError(
                        "mapping keys must be plain words",
                        source=self.source,
                        line=key_node.start_mark.line + 1,
                        key=".".join(path) or None,
                    )
                key_path = path + (str(key),)
                if key in out:
                    raise RulesError(
                        f"duplicate key '{key}'",
                        source=self.source,
                        line=key_node.start_mark.line + 1,
                        key=".".join(key_path),
                    )
                self.lines[key_path] = key_node.start_mark.line + 1
                out[key] = self.convert(value_node, key_path)
            return out
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                item_path = path + (f"[{index}]",)
                self.lines[item_path] = item.start_mark.line + 1
                items.append(self.convert(item, item_path))
            return items
        return _scalar(node)


def _scalar(node: yaml.ScalarNode) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    """A canonical, validated rule set. Build it with `Rules(...)`, `Rules.load` or `Rules.from_yaml`.

    Python construction accepts the same shapes as YAML::

        Rules(name="transfusion",
              modalities={"text": "causal", "image": {"self": "full"}},
              see={"default": "earlier", "image -> image": "none"})
    """

    name: str
    modalities: Any  # normalised in __post_init__ to tuple[Modality, ...], sorted by name
    see: Any = None  # normalised to a tuple of ((query, key), policy) pairs, sorted
    see_default: str = "earlier"
    documents: str = "isolated"
    kernel: Any = None  # KernelSpec | None
    source: str = field(default="rules", compare=False, repr=False)

    def __post_init__(self) -> None:
        located = _Located(self.source)
        raw: dict[str, Any] = {"name": self.name, "modalities": self.modalities, "documents": self.documents}
        see = self.see
        if isinstance(see, tuple) and all(isinstance(item, tuple) and len(item) == 2 for item in see):
            see = {f"{q} -> {k}": policy for (q, k), policy in see}
        see = dict(see or {})
        see.setdefault("default", self.see_default)
        raw["see"] = see
        if self.kernel is not None:
            raw["kernel"] = self.kernel
        _validate_into(self, raw, located)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, text: str, source: str = "<string>") -> "Rules":
        try:
            node = yaml.compose(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            problem = getattr(exc, "problem", None) or str(exc)
            raise RulesError(
                f"not valid YAML: {problem}", source=source, line=mark.line + 1 if mark else None
            ) from None
        if node is None:
            raise RulesError("the file is empty; it needs at least 'name' and 'modalities'", source=source)
        if not isinstance(node, yaml.MappingNode):
            raise RulesError(
                "the top level must be a mapping with 'name' and 'modalities'",
                source=source,
                line=node.start_mark.line + 1,
            )
        located = _Located(source)
        data = located.convert(node)
        return cls._from_data(data, located)

    @classmethod
    def load(cls, path: str | Path) -> "Rules":
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise RulesError(f"no rules file at {path}", source=str(path)) from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
            raise RulesError(f"cannot read the rules file: {exc}", source=str(path)) from None
        return cls.from_yaml(text, source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "rules") -> "Rules":
        return cls._from_data(dict(data), _Located(source))

    @classmethod
    def _from_data(cls, data: Any, located: _Located) -> "Rules":
        if not isinstance(data, dict):
            raise located.error("the top level must be a mapping with 'name' and 'modalities'")
        rules = object.__new__(cls)
        object.__setattr__(rules, "source", located.source)
        _validate_into(rules, data, located)
        return rules

    # -- output ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        modalities: dict[str, Any] = {}
        for m in self.modalities:
            entry: dict[str, Any] = {"self": m.self}
            if m.window:
                entry["window"] = m.window
            modalities[m.name] = entry
        see: dict[str, str] = {"default": self.see_default}
        for (q, k), policy in self.see:
            see[f"{q} -> {k}"] = policy
        out: dict[str, Any] = {"name": self.name, "modalities": modalities, "see": see, "documents": self.documents}
        if self.kernel is not None:
            spec: KernelSpec = self.kernel
            kernel: dict[str, Any] = {"head_dims": list(spec.head_dims), "dtypes": list(spec.dtypes)}
            if spec.archs:
                kernel["archs"] = list(spec.archs)
            if spec.tiles:
                kernel["tiles"] = [
                    {"block_m": t.block_m, "block_n": t.block_n, "warps": t.warps, "stages": t.stages}
                    for t in spec.tiles
                ]
            out["kernel"] = kernel
        return out

    def to_yaml(self) -> str:
        return yaml.dump(self.to_dict(), Dumper=_FlowDumper, sort_keys=False, width=100)

    @property
    def canonical(self) -> str:
        """The canonical form, as JSON: the same for every spelling of the same rules, and
        `Rules.from_dict(json.loads(rules.canonical))` builds them again."""
        return self._canonical

    def content_hash(self, length: int = 16) -> str:
        """Hash of the canonical form: the same for every spelling of the same rules."""
        return hashlib.sha256(self.canonical.encode()).hexdigest()[:length]

    def without_kernel(self) -> "Rules":
        """These rules minus the `kernel:` section: what a compiled variant depends on.

        The kernel section only says which variants to build and tune, so editing it must not
        rename or rebuild the variants that stay.
        """
        if self.kernel is None:
            return self
        stripped = self.__dict__.get("_without_kernel")  # asked on every attention() call: keep it
        if stripped is None:
            stripped = Rules.from_dict({k: v for k, v in self.to_dict().items() if k != "kernel"}, source=self.source)
            object.__setattr__(self, "_without_kernel", stripped)
        return stripped

    @property
    def key(self) -> str:
        """This rule set's identity in one process: name and content without the `kernel:` section (what a
        compiled variant depends on). `rules_for_key(rules.key)` finds it again (the custom op passes
        rules across its boundary as this string)."""
        cached = self.__dict__.get("_key")
        if cached is None:
            cached = f"{self.name}-{self.without_kernel().content_hash()}"
            object.__setattr__(self, "_key", cached)
        _BY_KEY.setdefault(cached, self)
        return cached

    def mask_hash(self, length: int = 16) -> str:
        """Hash of what decides the mask only (no `kernel:` section, no name)."""
        cached = self.__dict__.get("_mask_hash")
        if cached is None:
            data = self.to_dict()
            data.pop("kernel", None)
            data.pop("name", None)
            cached = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
            object.__setattr__(self, "_mask_hash", cached)
        return cached[:length]

    # -- semantics -------------------------------------------------------------------------

    @property
    def modality_names(self) -> tuple[str, ...]:
        """User modalities in id order; the built-in `pad` has id len(modality_names)."""
        return tuple(m.name for m in self.modalities)

    @property
    def pad_id(self) -> int:
        return len(self.modalities)

    def modality(self, name: str) -> Modality:
        for m in self.modalities:
            if m.name == name:
                return m
        raise KeyError(name)

    def modality_id(self, name: str) -> int:
        if name == PAD:
            return self.pad_id
        for index, m in enumerate(self.modalities):
            if m.name == name:
                return index
        suggestion = closest(name, self.modality_names)  # never suggest 'pad' for a typo
        hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
        known = ", ".join(self.modality_names + (PAD,))
        raise ValueError(f"modality '{name}' is not in the rules '{self.name}' (known: {known}){hint}")

    def modality_name(self, modality_id: int) -> str:
        """The name of a modality id (`pad_id` is 'pad'): the inverse of `modality_id`."""
        if isinstance(modality_id, bool) or not isinstance(modality_id, int) or not 0 <= modality_id <= self.pad_id:
            raise ValueError(f"modality id must be an integer in [0, {self.pad_id}] for the rules '{self.name}' "
                             f"({self.describe_ids()}), not {modality_id!r}")
        return PAD if modality_id == self.pad_id else self.modalities[modality_id].name

    def describe_ids(self) -> str:
        """'audio=0, image=1, text=2, pad=3': the ids token-level layouts use."""
        return ", ".join(f"{name}={index}" for index, name in enumerate(self.modality_names + (PAD,)))

    def see_policy(self, query: str, key: str) -> str:
        for pair, policy in self.see:
            if pair == (query, key):
                return policy
        return self.see_default

    def see_matrix(self) -> list[list[str]]:
        """see_matrix()[q][k] for user modality ids q, k."""
        names = self.modality_names
        return [[self.see_policy(q, k) for k in names] for q in names]

    @property
    def isolated_documents(self) -> bool:
        return self.documents == "isolated"

    @property
    def has_windows(self) -> bool:
        return any(m.window > 0 for m in self.modalities)

    def dense_mask(self, layout: Any, device: Any = None) -> Any:
        """torch.bool [S, S] for a Layout ([B, S, S] for a LayoutBatch): every allowed (query, key) pair.
        O(S^2) memory: for tests, plots and the SDPA peer, never for the kernels. A mask stands for its layout."""
        if hasattr(layout, "schedules") and hasattr(layout, "layout"):  # an omnigen mask (plan/masks.py)
            layout = layout.layout
        return dense_mask(self, layout, device=device)

    def __str__(self) -> str:
        return self.to_yaml()


class _FlowDumper(yaml.SafeDumper):
    """Block style at the top, flow style for the small per-modality and per-tile mappings."""


def _represent_dict(dumper: yaml.SafeDumper, data: dict) -> yaml.Node:
    flow = all(not isinstance(v, (dict, list)) for v in data.values()) and len(data) <= 4 and "default" not in data
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=flow)


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(v, (dict, list)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_FlowDumper.add_representer(dict, _represent_dict)
_FlowDumper.add_representer(list, _represent_list)


# --------------------------------------------------------------------------------------------
# Validation: one function for YAML and Python input, so both give the same messages.


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], path: tuple[str, ...], located: _Located, what: str) -> None:
    for key in data:
        if key not in allowed:
            raise located.error(
                f"unknown {what} key '{key}'; expected one of: {', '.join(allowed)}",
                path + (str(key),),
                suggestion=closest(str(key), allowed),
            )


def _word(value: Any, allowed: tuple[str, ...], path: tuple[str, ...], located: _Located, what: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise located.error(
            f"{what} must be one of {', '.join(allowed)}, not {value!r}",
            path,
            suggestion=closest(value, allowed) if isinstance(value, str) else None,
        )
    return value


def _positive_int(value: Any, path: tuple[str, ...], located: _Located, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise located.error(f"{what} must be an integer >= {minimum}, not {value!r}", path)
    return value


def _validate_into(rules: Rules, data: dict[str, Any], located: _Located) -> None:
    _check_keys(data, TOP_KEYS, (), located, "top-level")
    for required in ("name", "modalities"):
        if required not in data:
            raise located.error(f"missing required key '{required}'", ())
        if data[required] is None:
            raise located.error(f"'{required}' is empty; it needs a value", (required,))

    name = data["name"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise located.error(f"name must match [a-z0-9_]+ (it names the generated module), not {name!r}", ("name",))

    modalities = _validate_modalities(data["modalities"], located)
    names = tuple(m.name for m in modalities)

    see_raw = data.get("see")
    if see_raw is None:
        see_raw = {}
    if not isinstance(see_raw, dict):
        raise located.error("'see' must be a mapping of 'default' and 'query -> key' entries", ("see",))
    default = _word(see_raw.get("default", "earlier"), SEE_POLICIES, ("see", "default"), located, "see default")
    pairs: dict[tuple[str, str], str] = {}
    pair_spelling: dict[tuple[str, str], str] = {}
    for key, policy in see_raw.items():
        if key == "default":
            continue
        path = ("see", str(key))
        match = _PAIR_RE.match(str(key))
        if not match:
            raise located.error(
                f"'{key}' is not a see entry; write 'default' or 'query -> key' (e.g. 'image -> text')",
                path,
                suggestion="default" if closest(str(key), ("default",)) else None,
            )
        query, target = match.group(1), match.group(2)
        for side in (query, target):
            if side == PAD:
                raise located.error("'pad' never attends and is never attended; it cannot appear in 'see'", path)
            if side not in names:
                raise located.error(
                    f"unknown modality '{side}' (declared: {', '.join(names)})", path, suggestion=closest(side, names)
                )
        if (query, target) in pairs:
            raise located.error(
                f"duplicate see entry for {query} -> {target} (also written as '{pair_spelling[(query, target)]}')", path
            )
        pairs[(query, target)] = _word(policy, SEE_POLICIES, path, located, "a see policy")
        pair_spelling[(query, target)] = str(key)
    see = tuple(sorted((pair, policy) for pair, policy in pairs.items() if policy != default))

    documents = _word(data.get("documents", "isolated"), DOCUMENT_POLICIES, ("documents",), located, "documents")

    kernel = data.get("kernel")
    if kernel is not None and not isinstance(kernel, KernelSpec):
        kernel = _validate_kernel(kernel, located)

    object.__setattr__(rules, "name", name)
    object.__setattr__(rules, "modalities", modalities)
    object.__setattr__(rules, "see", see)
    object.__setattr__(rules, "see_default", default)
    object.__setattr__(rules, "documents", documents)
    object.__setattr__(rules, "kernel", kernel)
    # Made now, while the rules are built eagerly: a torch.compile trace reads it as a constant (op/traced_layouts.py)
    object.__setattr__(rules, "_canonical", json.dumps(rules.to_dict(), sort_keys=True, separators=(",", ":")))


def _validate_modalities(raw: Any, located: _Located) -> tuple[Modality, ...]:
    if isinstance(raw, (list, tuple)) and all(isinstance(m, Modality) for m in raw):
        raw = {m.name: {"self": m.self, "window": m.window} for m in raw}
    if not isinstance(raw, dict) or not raw:
        raise located.error("'modalities' must be a non-empty mapping like {text: {self: causal}}", ("modalities",))
    out = []
    for name, spec in raw.items():
        path = ("modalities", str(name))
        if not isinstance(name, str) or not _MODALITY_RE.match(name):
            raise located.error(f"modality name must match [a-z][a-z0-9_]*, not {name!r}", path)
        if name == PAD:
            raise located.error("'pad' is built in (it never attends and is never attended); do not declare it", path)
        if isinstance(spec, str):  # shorthand: `text: causal`
            spec = {"self": spec}
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise located.error(f"modality '{name}' must be a mapping like {{self: causal}}, not {spec!r}", path)
        _check_keys(spec, MODALITY_KEYS, path, located, "modality")
        policy = _word(spec.get("self", "causal"), SELF_POLICIES, path + ("self",), located, "self")
        window = spec.get("window", 0)
        if window is None:
            window = 0
        window = _positive_int(window, path + ("window",), located, "window", minimum=0)
        if window > MAX_WINDOW:  # kernels index positions with 32-bit integers
            raise located.error(f"window must be at most {MAX_WINDOW} (0 means no window), not {window}", path + ("window",))
        out.append(Modality(name=name, self=policy, window=window))
    return tuple(sorted(out, key=lambda m: m.name))


def _validate_kernel(raw: Any, located: _Located) -> KernelSpec:
    path = ("kernel",)
    if not isinstance(raw, dict):
        raise located.error("'kernel' must be a mapping with head_dims, dtypes, archs, tiles", path)
    _check_keys(raw, KERNEL_KEYS, path, located, "kernel")

    def word_list(key: str, allowed: tuple, default: tuple) -> tuple:
        value = raw.get(key, list(default))
        if not isinstance(value, (list, tuple)):
            value = [value]
        for index, item in enumerate(value):
            if item not in allowed:
                raise located.error(
                    f"{key} entries must be among {', '.join(map(str, allowed))}, not {item!r}",
                    path + (key, f"[{index}]"),
                    suggestion=closest(item, tuple(map(str, allowed))),  # words only: 96 -> 64 helps nobody
                )
        return tuple(dict.fromkeys(value))

    head_dims = word_list("head_dims", HEAD_DIMS, (64, 128))
    dtypes = word_list("dtypes", DTYPES, ("bf16",))
    archs = word_list("archs", ARCHS, ())
    tiles_raw = raw.get("tiles", [])
    if not isinstance(tiles_raw, (list, tuple)):
        raise located.error("tiles must be a list of {block_m, block_n, warps, stages}", path + ("tiles",))
    tiles = []
    for index, tile in enumerate(tiles_raw):
        tile_path = path + ("tiles", f"[{index}]")
        if isinstance(tile, TileConfig):
            tiles.append(tile)
            continue
        if not isinstance(tile, dict):
            raise located.error("each tile must be a mapping {block_m, block_n, warps, stages}", tile_path)
        _check_keys(tile, TILE_KEYS, tile_path, located, "tile")
        values = {}
        for key, default in (("block_m", 128), ("block_n", 64), ("warps", 4), ("stages", 2)):
            value = _positive_int(tile.get(key, default), tile_path + (key,), located, key)
            if key in ("block_m", "block_n") and (value % 16 or value > 256):
                raise located.error(f"{key} must be a multiple of 16 up to 256, not {value}", tile_path + (key,))
            if key == "warps" and value not in (1, 2, 4, 8, 12, 16):
                raise located.error(f"warps must be one of 1, 2, 4, 8, 12, 16, not {value}", tile_path + (key,))
            if key == "stages" and value > 8:
                raise located.error(f"stages must be between 1 and 8, not {value}", tile_path + (key,))
            values[key] = value
        tiles.append(TileConfig(**values))
    return KernelSpec(head_dims=head_dims, dtypes=dtypes, archs=archs, tiles=tuple(dict.fromkeys(tiles)))
