"""scripts/simulate_backward_grid.py: the grid orders it plays (the kernels' sectioned orders, with leading tiles),
the makespan, the forward's balanced section size (forward.cu.j2's rule, mirrored) and the columns it reads from real
plans, on small cases worked by hand."""

from __future__ import annotations

from script_modules import load_script




def test_the_orders_place_every_tile_once_and_the_lead_first():
    sim = load_script("simulate_backward_grid")
    columns = [[10, 20, 30], [40, 50, 60]]  # two batch elements, three kv-tiles each (distinct lengths)
    plain = sim.grid_order(columns, heads=2, section=2)
    # pairs (head fastest): (h0,b0), (h1,b0) form the first section, (h0,b1), (h1,b1) the second; kv-tiles slowest
    assert plain == [10, 10, 20, 20, 30, 30, 40, 40, 50, 50, 60, 60]
    led = sim.grid_order(columns, heads=2, section=2, leading=1)
    assert led[:4] == [10, 10, 40, 40] and sorted(led) == sorted(plain)
    assert sim.grid_order(columns, heads=2, section=2, leading=5)[:6] == [10, 10, 40, 40, 20, 20]
    rows = [[1, 2, 3]]
    assert sim.forward_order(rows, heads=1, section=1) == [3, 2, 1]  # last q-tile first
    assert sim.forward_order(rows, heads=1, section=1, leading=1) == [1, 3, 2]


def test_makespans():
    sim = load_script("simulate_backward_grid")
    assert sim.next_free([4, 1, 1, 1, 1], sms=2) == 4
    assert sim.next_free([1, 1, 1, 1, 4], sms=2) == 6  # the long tile started last runs alone
    assert sim.round_robin([4, 1, 1, 1, 1], sms=2) == 6


def test_persistent_makespans():
    """The counter-fed persistent grid: a CTA's first tile pays the launch's fixed cost, later ones the persistent one;
    chunks: each CTA walks consecutive tiles. Worked by hand with 2 SMs, 1 us a step."""
    sim = load_script("simulate_backward_grid")
    # tiles of 4, 1, 1, 1 steps; first tiles fixed 2, later 1: SM0 takes 4 (6), SM1 1 (3), then 1 (+2 = 5), then 1 (7)
    assert sim.persistent_counter([4, 1, 1, 1], sms=2, first_us=2, later_us=1, per_step_us=1) == 7
    assert sim.persistent_counter([4, 0, 1], sms=2, first_us=2, later_us=1, per_step_us=1) == 6  # empty: no cost
    assert sim.persistent_counter([], sms=2, first_us=2, later_us=1, per_step_us=1) == 0
    # chunks of 2: CTA costs 2 + 4 + 1 + 1 = 8 and 2 + 1 + 1 + 1 = 5 on two SMs
    assert sim.chunked([4, 1, 1, 1], sms=2, chunk=2, first_us=2, later_us=1, per_step_us=1) == 8
    assert sim.chunked([4, 1, 1, 1], sms=1, chunk=2, first_us=2, later_us=1, per_step_us=1) == 13


def test_balanced_section_keeps_the_last_section_large():
    sim = load_script("simulate_backward_grid")
    assert sim.balanced_section(64, 7) == 6  # 7 leaves 1 pair for last; 6, 5 and 4 leave 4: the larger, 6
    assert sim.balanced_section(64, 9) == 8  # 8 divides 64
    assert sim.balanced_section(64, 14) == 13  # 14 leaves 8, 13 leaves 12
    assert sim.balanced_section(16, 1) == 1 and sim.balanced_section(5, 5) == 5
    assert sim.balanced_section(64, 28, 4) == 24  # whole GQA groups of 4: 28 leaves 8, 24 leaves 16, 20 leaves 4


def test_columns_of_the_causal_mask():
    """At S = 512 (four 128-key kv-tiles) kv-tile j's backward column holds q-tiles j..3, two 64-row steps each; the
    forward's rows hold kv-tiles 0..i."""
    sim = load_script("simulate_backward_grid")
    assert sim.mask_columns("causal", 1, 512) == [[8, 6, 4, 2]]
    assert sim.mask_columns("causal", 1, 512, forward=True) == [[1, 2, 3, 4]]
    assert sim.mask_columns("causal", 1, 512, block_n=64) == [[8, 8, 6, 6, 4, 4, 2, 2]]
