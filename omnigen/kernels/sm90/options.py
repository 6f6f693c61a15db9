"""The sm90 family's kernel options: which code paths a Hopper module renders, as part of its KernelConfig.

Every field's default is what the defaults run (each measured on an H200 or H100 and, where it is on, tested
by the gpu suite with it on and off); the measurements are in benchmarks/RESULTS.md under the heading named
beside each field. A config with other options is another variant: its label and module name say so, so two
settings never share a module, and the tuner can list them as candidates like tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...targets import KernelOptions


@dataclass(frozen=True)
class HopperOptions(KernelOptions):
    # ---- the forward
    # A persistent grid: min(SMs, work tiles) CTAs taking work tiles from a counter the launcher zeroes, the K/V
    # ring running on across tiles ("Run: the dynamic persistent forward and the O TMA store").
    persistent: bool = True
    # A partial kv-tile's key tables always through shared memory: the producer copies the rows TMA cannot bring
    # ("The key tables from shared memory: run, and on").
    tables_always_shared: bool = True
    # Partial tiles (forward) and partial steps (backward) read their mask as bits made once per layout where the
    # mask holds them, instead of evaluating the rules per head ("Partial tiles' masks as bits made once per layout").
    partial_bits: bool = True
    # Each row's max and sum of a kv-step in this many independent chains (1, 2, 4 or 8), combined in pairs at the
    # end, instead of one chain of 32 dependent FMNMX and 32 FADD a row at block_n 128; 0: the head dim's default
    # (resources.SOFTMAX_CHAINS_BY_HEAD_DIM: 2 at d64, else 1; "The softmax's chains, timed").
    softmax_chains: int = 0
    # The consumer warpgroups take turns issuing their products (ping-pong, FlashAttention-3's schedule). Off: no gain
    # at d128, where a step's products take twice its softmax ("Hopper forward, the sm90 family (issue 13)"), and
    # 0.9..2.2% slower at d64, where the two are equal ("The forward's ping-pong, timed"); FP8 d128 +1.4% (H100, 32K).
    pingpong: bool = False
    # O leaves through shared memory: each consumer warpgroup writes its 64 rows into a staging buffer of their own by
    # stmatrix and one thread stores them by TMA, instead of 4-byte stores from every thread (Nsight at d128, 8K:
    # those stores and the waits behind their queue were 2% of the consumers' samples; cuDNN stages O this way).
    # 1: at the head dims where it was measured faster (resources.OUTPUT_BY_TMA_HEAD_DIMS: d128, FP8's too; d128
    # forward -4.3 / -6.1% at 8K, causal / Transfusion, H100, within 0.2% at 32K: "O by TMA from a staging buffer of
    # its own"; d256 in two rounds through a buffer of half its boxes, -1.6..-2.4%: "d256's O by TMA, timed"; d64
    # +0.2..+1.7%); 2: wherever a staging buffer fits beside Q and the K/V ring (d64 too; not with 3 stages at
    # d128); 0 (False): never, every thread stores its pairs of O.
    output_by_tma: int = 1
    # The tile order starts with every (head, batch) pair's first q-tiles (q-tile 0 of every pair, then 1, ...) where
    # the plan's first rows are long, at most this many, then the sections over the rest, last q-tile first; 0:
    # sections only. A row leads if it and the rows before it visit at least 4x the mean row's tiles (read in the
    # kernel from the plan, so causal and document masks keep the plain order). Why: global queries at the start
    # (Longformer's) make q-tile 0's row as long as the sequence, and each section took it last, so the last
    # section's ran alone at the end: Longformer's forward -19..-32% at 8K / 32K, d64 and d128 (H200, on paper -17% /
    # -27%). Where nothing leads, the producer's per-tile mapping cost ~1.5% of the d64 forward (within 0.5% at
    # d128); it now maps with the plain order's arithmetic then, and at d64 the default reads within -0.6..+0.9% of
    # leading_q_tiles=0, paired ("Thirtieth session: the tile-order options, run"; "Thirty-first session").
    leading_q_tiles: int = 2
    # The tile order's sections (as many pairs as keep K and V in 5/8 of L2) sized between half that and all of it so
    # that the last section holds the most pairs: 64 pairs in sections of 7 left one pair for last, whose longest rows
    # (64 kv-steps at 8K) started when little else was left and ran alone at the end. The d128 forward on the causal
    # mask -3.7% / -3.8% at 4K / 8K, Transfusion -2.1%, d64 -0.1..-1.0% (H200; on paper -3.3% / -4.1%); nothing
    # where the sections already divide the pairs ("Thirtieth session: the tile-order options, run").
    balanced_sections: bool = True
    # The persistent forward's tile boundary folded into one ordinary step: Q in two buffers (the producer loads the
    # next tile's while this one runs), the next tile's first S = Q K^T issued beside this tile's last P V and its
    # softmax under that product, and O (output_by_tma) staged in the finished tile's own Q rows, so shared memory
    # stays at today's size. At d64 and d128, 16-bit, persistent only. Off: measured neutral at d128 and 11-13%
    # slower at d64 before the fix of its step loops' code (a warp vote on the loop-carried `started` flag), which has
    # not run yet ("Built, measured, dropped: the forward's tile boundary folded into one step"; "The folded
    # forward's codegen fix").
    fold_tiles: bool = False

    # ---- the Hopper backward
    # d256's backward: the CTA's 64 keys in both consumer warpgroups, each holding dK/dV for half the head dims,
    # dQ by vector atomics ("First GPU run of the switched kernels"). Off: no backward at d256.
    split_columns: bool = True
    # With split columns, the warpgroups split S^T and dP^T too, 32 query columns each, instead of both computing the
    # whole 64 x 64 of each: P^T goes through shared memory like dS^T, and dV and dK read their A operand there. The
    # duplicated accumulators beside dK and dV (128 registers) left ptxas too few registers to keep wgmmas in flight,
    # so it serialised every one (C7512). On: the d256 backward 1.18x faster on an H100 ("d256's backward with split
    # scores, timed").
    split_scores: bool = True
    # With split scores, CTAs on kv-tiles 2i and 2i + 1 run as a cluster of two wherever their columns of the schedule
    # list the same query rows: each sends the other its dS^T of every step (8 KB, a bulk copy into the peer's shared
    # memory) and adds dQ for half the head dims over both CTAs' 128 keys, which halves dQ's atomic bytes, the bound
    # of the d256 backward (Nsight: the crossbar into L2 82% busy). Pairs whose rows differ add dQ alone. To make room
    # (the peer's K for these head dims, its dS^T twice), dO has one stage, freed as soon as the step's dV is in, and
    # P^T and dS^T share a ring of three slots ("d256: dQ in pairs of CTAs").
    paired_dq: bool = True
    # Deterministic mode on the Hopper kernel: dQ added by TMA reduce-add in kv-tile order (a per-(batch, head,
    # 64 rows) counter); off, the module has no deterministic mode ("Deterministic mode: the ordered grid in
    # sections of heads").
    ordered_dq: bool = True
    # The ordered grid in sections of this many (head, batch) pairs at head dim 128, kv-tiles slowest inside each,
    # scaled by (128 / head_dim)^2; 0: one section ("Deterministic mode: the descending walk with small sections").
    ordered_section_pairs: int = 2
    # Atomic order's grid in sections of this many pairs at head dim 128, scaled by 128 / head_dim; 0: the 3-D
    # grid, kv-tiles fastest ("Atomic order's backward grid in sections").
    atomic_section_pairs: int = 2
    # Deterministic mode walks each kind's steps last q-tile first, so the kv-tiles of a head reach a q-tile
    # together instead of a step behind one another (same heading as ordered_section_pairs).
    ordered_descending_steps: bool = True
    # The next step's S^T = K Q^T issued under this step's dQ staging ("Eighth session: the Hopper backward's step
    # structure"). Not with split columns.
    early_scores: bool = True
    # Atomic-order dQ reductions issued by a writer warp of the producer warpgroup instead of each consumer warp
    # ("The backward's dQ reductions from a writer warp").
    dq_writer: bool = True
    # At d64 and d128, each step's dQ (every head dim) computed and staged by one consumer warpgroup, the two taking
    # turns, instead of both computing half the head dims: a warpgroup's dQ product is then m64n64 (m64n128), not
    # m64n32 (m64n64), K is read once per step instead of twice, and the warpgroup without the turn goes on to its
    # next step while the other computes and stages dQ. No effect at d256 or without the writer warp ("dQ in turns
    # at d64"; "dQ in turns at d128, in cuDNN's order").
    dq_in_turns: bool = True
    # The sectioned grids (atomic and deterministic order) start with the first kv-tiles of every (head, batch) pair
    # where the plan's first columns are long, at most this many (all pairs' kv-tile 0 first, then 1), then the
    # sections over the remaining kv-tiles; 0: sections only. A column leads if it and the columns before it visit
    # at least 4x the mean column's tiles (read in the kernel from the plan). Why: a mask with global tokens at the
    # start (Longformer, a sliding window with globals, attention sinks) gives each pair one or two kv-tile columns
    # as long as the sequence among short window columns, and the last section's long columns, started last, ran
    # alone at the end: with the forward's leading q-tiles, forward+backward -11% / -13% on the sliding window with
    # globals and -11% / -15% on Longformer at 8K / 32K (H200, d128). Leading causal and Transfusion's first columns,
    # which are only twice the mean, cost +1.8..2.8% at 8K, hence the test. Lower kv-tiles of a head still start
    # before higher ones, which deterministic mode's waits rely on. No effect on the 3-D grids (section pairs 0).
    leading_kv_tiles: int = 2
    # A partial step's slot of the mask's bits handed to the consumers in the stage's row tables (the producer
    # writes it beside lse and Delta) instead of each consumer computing it from the schedule: at d128 ptxas kept
    # that schedule value on the stack and reloaded it every partial step (one LDL in the step loop); the producer
    # pays two more of its own a step instead. Off: Transfusion fwd+bwd +2.0% at 8K, -1.7% at 32K on an H200 ("A
    # partial step's bits slot in the stage's tables"; "Thirtieth session: the tile-order options, run").
    bits_slot_in_tables: bool = False
    # The backward's producer warpgroup's registers a thread (24, 32 or 40; 0: 24), the consumers taking what is left
    # in multiples of 8 (240, 232, 232). With 32 the d64 and d256 kernels have no local memory at all (the producer thread's 8 spilled
    # values, reloaded every step, 14 and 17 local accesses in all); d128's consumers need 240. Off: at d64 fwd+bwd
    # within -0.6..+0.7% on an H200, the reloads were off the critical path ("The backward producer's registers";
    # "Thirtieth session: the tile-order options, run").
    backward_producer_registers: int = 0
    # The atomic-order backward as a persistent grid (min(SMs, CTAs) CTAs taking kv-tile columns in the grid's order
    # from a counter): a CTA's launch, its loads before the first copy and the ring's fill paid once per SM rather than
    # once per column, which short columns (documents, windows, packed samples) pay often. With the writer warp (d64,
    # d128). 1: at the head dims where it was measured faster (resources.PERSISTENT_BACKWARD_HEAD_DIMS: d64, fwd+bwd
    # -0.8..-2.4% on causal documents, packed Alpaca, the windowed mask, causal and Transfusion at 8K and 32K, H200,
    # paired); 2: wherever it builds (d128 too, where ptxas moves the consumers' wgmma descriptors off the uniform
    # datapath inside any loop around the walk: +2..+4.7%); 0 (False): never ("Thirty-second session").
    persistent_backward: int = 1
    # The Q/dO ring's depth; 0: the head dim's default (resources.BACKWARD_STAGES_BY_HEAD_DIM: 4 at d64, else 2;
    # "A deeper Q/dO ring at d64, timed").
    backward_stages: int = 0

    def problems(self) -> list[str]:
        out = []
        for name in ("ordered_section_pairs", "atomic_section_pairs", "backward_stages", "leading_kv_tiles",
                     "leading_q_tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                out.append(f"option {name} must be an integer >= 0, not {value!r}")
        if self.softmax_chains not in (0, 1, 2, 4, 8) or isinstance(self.softmax_chains, bool):
            out.append(f"option softmax_chains must be 1, 2, 4 or 8 (0: the head dim's default), "
                       f"not {self.softmax_chains!r}")
        if self.persistent_backward not in (0, 1, 2):
            out.append(f"option persistent_backward must be 1 (the head dim's choice), 2 (wherever it builds) or 0 "
                       f"(never), not {self.persistent_backward!r}")
        if self.output_by_tma not in (0, 1, 2):
            out.append(f"option output_by_tma must be 1 (the head dim's choice), 2 (wherever a staging buffer fits) or "
                       f"0 (never), not {self.output_by_tma!r}")
        if self.backward_stages == 1:
            out.append("option backward_stages must be 0 (the head dim's default) or at least 2, not 1")
        if self.backward_producer_registers not in (0, 24, 32, 40) or isinstance(self.backward_producer_registers, bool):
            out.append(f"option backward_producer_registers must be 24, 32 or 40 (0: 24), not "
                       f"{self.backward_producer_registers!r}")
        return out
