"""scripts/sass_compare.py's counts of local memory and of R2UR in step loops, on a hand-written listing (one
instruction a line from address 0, 16 bytes each, as the script normalises cuobjdump's SASS)."""

from __future__ import annotations

from script_modules import load_script




LISTING = [
    "STL [R1], R2",                              # 0: set-up spill, before any loop
    "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ",  # 1: outer loop (work tiles) starts here
    "LDL R3, [R1]",                              # 2: in the outer loop, not in a step loop
    "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24",  # 3: step loop starts here
    "LDL R4, [R1+0x4]",                          # 4: inside the step loop
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6], R5",  # 5
    "@!P0 BRA 0xb0",                             # 6: to the slow path (forward)
    "@P1 BRA 0x30",                              # 7: the step loop's back edge (to 3)
    "@P2 BRA 0x10",                              # 8: the outer loop's back edge (to 1)
    "EXIT",                                      # 9
    "STL [R1+0x8], R6",                          # 10: after the end
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6], R5",  # 11: slow path of the wait at 5
    "@!P0 BRA 0xb0",                             # 12: its own retry (a loop without products)
    "BRA 0x70",                                  # 13: back into the body (to 7): not a loop, the range holds EXIT
]


def test_only_local_memory_in_innermost_loops_with_products_counts():
    total, in_step_loops = load_script("sass_compare").step_loop_local_memory(LISTING)
    assert (total, in_step_loops) == (4, 1)


def test_register_moves_count_per_step_loop_only():
    listing = ["R2UR UR4, R2"] + LISTING[:3] + ["R2UR UR4, R8", "R2UR UR5, R9"] + LISTING[3:]
    # one instruction in front and two before the step loop: its targets move (1 -> 2, 3 -> 6, 11 -> 14; the last
    # branch's, into a range holding EXIT either way, stays)
    shifted = [line.replace("0xb0", "0xe0").replace("0x30", "0x60").replace("0x10", "0x20") if "BRA" in line else line
               for line in listing]
    script = load_script("sass_compare")
    assert script.step_loops(shifted) == [(6, 10)]
    shifted.insert(8, "R2UR UR6, R10")  # one more inside the step loop (its back edge moves one down)
    assert script.step_loop_register_moves(shifted) == [(1, 1)]


def test_a_listing_without_loops_has_no_step_loop_local_memory():
    assert load_script("sass_compare").step_loop_local_memory(["LDL R1, [R1]", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", "EXIT"]) == (1, 0)


def test_a_variant_may_name_the_familys_options():
    """`--variant RULES:DTYPE:D:MxNxWxS:ARCH[:FAMILY][:NAME=VALUE,...]`: options as the family's dataclass types them
    (0/1 for booleans); an unknown name stops with the fields the family has."""
    import pytest

    from omnigen import kernels
    from omnigen.jit import codegen, toolchain
    from omnigen import rules as rules_module

    script = load_script("sass_compare")
    modules = (codegen, toolchain, kernels, rules_module)
    chosen = script.variants(modules, "none", ["transfusion:bf16:128:128x128x12x2:sm_90a:leading_kv_tiles=1,"
                                               "bits_slot_in_tables=1", "transfusion:bf16:64:128x64x4x2:sm_80"])
    (_, hopper), (_, ampere) = chosen
    assert hopper.options.leading_kv_tiles == 1 and hopper.options.bits_slot_in_tables is True
    assert hopper.label.endswith("leading_kv_tiles1_bits_slot_in_tables1") and ampere.options is None
    with pytest.raises(SystemExit, match="HopperOptions fields"):
        script.variants(modules, "none", ["transfusion:bf16:128:128x128x12x2:sm_90a:no_such_option=1"])
