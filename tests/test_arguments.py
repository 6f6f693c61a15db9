"""The kernels' launch arguments are described once (omnigen/kernels/arguments.py): the C headers, the binding's
parameters and checks, and the Python kernels' calls all follow that description."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omnigen import Rules
from omnigen.jit import codegen
from omnigen.kernels import arguments
from omnigen.kernels.sm90 import resources
from omnigen.kernels.sm90.options import HopperOptions
from omnigen.targets import KernelConfig, TileConfig

RULES = Rules.load(Path(__file__).resolve().parents[1] / "examples" / "rules" / "transfusion.yaml")
CONFIGS = [KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128)),
           KernelConfig(64, "fp16", "sm_80", TileConfig(128, 64, 4, 2))]


def test_the_headers_are_the_descriptions():
    assert arguments.stale_headers() == [], "run: python -m omnigen.kernels.arguments --write"
    assert arguments.main([]) == 0


def test_a_changed_description_makes_the_headers_stale(monkeypatch):
    extra = arguments.Field("extra", "int", "a field the headers do not have")
    changed = arguments.LaunchStruct(arguments.DELTA.name, arguments.DELTA.function, arguments.DELTA.launch,
                                     arguments.DELTA.comment, (*arguments.DELTA.members, extra))
    monkeypatch.setattr(arguments, "DELTA", changed)
    assert arguments.stale_headers() == ["backward_args.h"]
    assert arguments.main([]) == 1


def _declared_fields(header: str, struct: str) -> list[str]:
    """The member names of `struct` in a C header, in order."""
    body = re.search(rf"struct {struct} \{{(.*?)\n\}};", header, re.S).group(1)
    names: list[str] = []
    for line in body.splitlines():
        code = line.split("//")[0].strip()
        if code:
            names += [part.strip().split()[-1].lstrip("*") for part in code.rstrip(";").split(",")]
    return names


@pytest.mark.parametrize("struct", arguments.STRUCTS, ids=lambda s: s.name)
def test_every_field_is_in_the_header_in_order(struct):
    header = "".join((arguments.INCLUDE_DIR / name).read_text() for name in arguments.headers())
    assert _declared_fields(header, struct.name) == [f.name for f in struct.fields]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.arch)
@pytest.mark.parametrize("struct", arguments.STRUCTS, ids=lambda s: s.name)
def test_the_binding_takes_what_the_python_kernels_pass(config, struct):
    """The order the binding declares (its py::arg list) is the order call_arguments produces, then the keywords,
    and every field of the struct is set."""
    binding = codegen.render(RULES, config)[codegen.source_names(RULES, config)["binding"]]
    definition = re.search(rf'm\.def\("{struct.function}", &{struct.function},(.*?)\);\n', binding, re.S).group(1)
    declared = re.findall(r'py::arg\("(\w+)"\)', definition)
    values = {f.name: f.name for f in struct.fields}
    values.update({f"{s.tensor}_strides": [f.name for f in s.fields] for s in struct.strides})
    positional = list(arguments.call_arguments(struct, values, stream="stream"))
    keywords = [f.name for f in struct.keywords] + (["partial_bits_words"] if struct.has_partial_bits else [])
    assert declared == positional + keywords
    unset = [f.name for f in struct.fields if f"args.{f.name} = " not in binding]
    assert not unset  # every field is given a value (from a parameter, or by the binding's own code)


def test_wrong_values_name_the_missing_field():
    with pytest.raises(KeyError, match="ForwardArgs: no value for 'k'"):
        arguments.call_arguments(arguments.FORWARD, {"q": 1}, stream=0)


def _binding_traits(binding: str) -> dict[str, object]:
    """The flags a rendered binding exports, as VariantTraits fields."""
    def flag(name: str) -> bool:
        return re.search(rf"constexpr bool {name} = (true|false);", binding).group(1) == "true"

    problem = re.search(r'constexpr const char\* kBackwardProblem = "(.*)";', binding).group(1)
    return {"has_backward": flag("kHasBackward"), "backward_problem": problem or None,
            "persistent_forward": flag("kPersistentForward"), "partial_bits": flag("kPartialBits"),
            "ordered_dq": flag("kOrderedDq"), "group_dkdv": flag("kGroupDkdv"),
            "dq_interleaved": flag("kDqInterleaved"), "persistent_backward": flag("kPersistentBackward")}


@pytest.mark.parametrize("rules_name, config", [
    ("transfusion", KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128))),
    ("transfusion", KernelConfig(256, "bf16", "sm_90a", resources.default_tile(256))),
    ("transfusion", KernelConfig(64, "fp16", "sm_80", TileConfig(128, 64, 4, 2))),
    ("transfusion", KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128), forward_only=True)),
    ("bits_only", KernelConfig(64, "bf16", "sm_80", TileConfig(128, 64, 4, 2))),
    ("transfusion", KernelConfig(64, "bf16", "sm_90a", resources.default_tile(64))),
    ("transfusion", KernelConfig(64, "bf16", "sm_90a", resources.default_tile(64),
                                 options=HopperOptions(persistent_backward=0))),
    ("transfusion", KernelConfig(128, "bf16", "sm_90a", resources.default_tile(128),
                                 options=HopperOptions(persistent_backward=2))),
    ("transfusion", KernelConfig(256, "bf16", "sm_90a", resources.default_tile(256),
                                 options=HopperOptions(persistent_backward=2))),
], ids=["sm90-d128", "sm90-d256", "sm80-d64", "sm90-forward-only", "sm80-bits-only", "sm90-d64",
        "sm90-d64-grid-backward", "sm90-d128-persistent-backward", "sm90-d256-persistent-backward"])
def test_the_binding_exports_the_familys_traits(rules_name, config):
    """Each family states a variant's traits once (KernelFamily.traits); the binding's flags are rendered from that
    record, and launch.capabilities reads the same fields back from a module."""
    from dataclasses import asdict

    from omnigen.kernels import family_of, launch
    from omnigen.plan.ruleless import RULELESS_RULES

    rules = RULELESS_RULES if rules_name == "bits_only" else RULES
    traits = family_of(config).traits(rules, config)
    binding = codegen.render(rules, config)[codegen.source_names(rules, config)["binding"]]
    assert _binding_traits(binding) == asdict(traits)
    module = type("Module", (), {"HAS_BACKWARD": traits.has_backward, "BACKWARD_PROBLEM": traits.backward_problem,
                                 "PERSISTENT_FORWARD": traits.persistent_forward, "PARTIAL_BITS": traits.partial_bits,
                                 "ORDERED_DQ": traits.ordered_dq, "GROUP_DKDV": traits.group_dkdv,
                                 "DQ_INTERLEAVED": traits.dq_interleaved,
                                 "PERSISTENT_BACKWARD": traits.persistent_backward})
    found = launch.capabilities(module)
    assert {name: getattr(found, name) for name in asdict(traits)} == asdict(traits)
    if config.forward_only:
        assert not traits.has_backward and "forward-only" in traits.backward_problem
    # dQ staged by stmatrix (interleaved columns) in the Hopper backward; d256's split columns add it by atomics
    assert traits.dq_interleaved == (config.arch == "sm_90a" and config.head_dim != 256 and not config.forward_only)
    # the persistent backward: where the option asks for it (1, the default: d64; 2: wherever it builds) and the
    # kernel has the writer warp (not d256's pairs)
    options = config.options if config.options is not None else HopperOptions()
    mode = getattr(options, "persistent_backward", 0) if config.arch == "sm_90a" else 0
    asked = mode == 2 or (mode == 1 and config.head_dim in resources.PERSISTENT_BACKWARD_HEAD_DIMS)
    assert traits.persistent_backward == (asked and config.head_dim != 256 and not config.forward_only)
    if rules_name == "bits_only":
        assert traits.partial_bits
