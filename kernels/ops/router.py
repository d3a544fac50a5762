"""The MoE router in one launch: logits = h @ W_g.T (bf16 in, fp32 accumulation and out), sigmoid,
top-k of s + bias (selection only), weights renormalised over the unbiased scores, and the routing
grouped by expert for the expert kernels (kernels/ops/moe_experts.py). The latent down-projection
z = h @ W_down.T (bf16 out) runs alongside, in the same launch: both read h, and the down CTAs
keep the SMs streaming while phase 2 (the stream design's selector CTA, or the last router CTA)
selects and groups.

Two designs, chosen at build time from the batch (both deterministic, same phase 2):
  * batch <= `stream_max_batch` (default 2), "stream" (kernels/ops/stream.py, as the batch-1
    gemv): one grid of short CTAs over the rows of W_g then of W_down (the router CTAs first, so
    they are dispatched first), each owning whole rows (`stream_cta_kib` KiB of weights, at
    least one row, `stream_threads` threads; by default, at k3's hidden 7168, 2 rows of 128
    threads each). By default (`stream_w_regs` 1, round 10) every thread loads its weight
    vectors into registers by plain 16-byte loads, all issued before `griddepcontrol.wait`
    (read-only loads were moved below it by ptxas), and copies h (`cp.async`, `.ca`) into
    shared memory after it; with `stream_w_regs` 0 it copies its weight rows (`.cg`) and h
    into shared memory, every copy before one wait. Then fp32 FMAs and the warp-order
    reduction of stream.py. The default's 64 registers (with the generic grouping) hold four
    CTAs per SM: with five, the deeper memory queues put phase 2's chain of dependent round
    trips past the streaming (evidence_reports/moe_block/round10/). Router CTAs store fp32 logits and arrive (below); down
    CTAs store bf16 z. Phase 2 reuses the streaming buffers of the CTA that runs it, so a CTA
    costs only what it streams and more fit per SM. Why it is fast: the memory system sees one
    stream of 64 MB with every byte of a CTA in flight at once, and the router's 896 rows are
    the first CTAs of the grid, so phase 2 selects and groups while the down CTAs still stream.
    That hides it only if phase 2 is short: one warp's 16 selection rounds on an SM shared
    with streaming CTAs took ~6 us at batch 1 (plus ~3 us for the scores), past the down
    CTAs' end, so the stream design selects with the whole CTA: the threshold selection by
    default (`stream_topk` 3, round 10), or the radix select (2, round 8); see below. With `pdl` 1
    (the default; stream design only) the launcher sets programmatic stream serialization: each CTA copies
    its weights (static) before `griddepcontrol.wait`, h and every store after it, and lets the
    next launch start (`launch_dependents`) once its copies are issued; the counter's atomic
    comes after the wait, so a launch never arrives before the previous one has reset it.
    The stream design's arrival (`arrive`, default 3, round 11): tagged logits. Each router
    thread that stores a logit also stores it into the counter buffer (B * n_experts words,
    the host zeroes them once) as its bits inverted, by a relaxed gpu-scope store: the word
    is its own flag (0: not in yet; the one float whose inverse is 0, a NaN, goes in as another
    NaN). No barrier, fence or atomic follows, so a router CTA leaves as soon as its stores are
    issued. An extra CTA 0 runs phase 2: it copies the bias (static) before
    `griddepcontrol.wait`, then every thread polls its words (relaxed gpu-scope loads, a
    round's loads all issued before any is tested; `poll_sleep` 2: a 2 us nanosleep before each
    round, since back-to-back polls cost the launch ~0.3 us of its overlap with the next launch
    under pdl) until none is 0, decodes them into shared memory and resets them to 0 for the
    next launch (each thread the words it polled: a word reset before its poller saw it would
    never be written again). Phase 2 has every logit one round trip
    after the last one lands, with no release, counter or staging between (round 10's scheme
    had four dependent round trips; evidence_reports/moe_block/round11/). The static audit
    knows the protocol: the counter's tensor spec says "tagged" at these variants, and the
    audit then requires every access to it to be a strong, gpu-scope load or store
    (validation/race/rules.py, tagged-weak-access) and counts no write to it as a release of
    other data. `arrive` 2 (round 8-10): CTA 0 spins (thread 0, gpu-scope acquire loads, after
    its own `launch_dependents` and `griddepcontrol.wait`) until every router CTA has added a
    release `red` to the counter, resets it (release), hands the acquire on by a CTA barrier
    and stages the logits. Neither spin can deadlock: only CTA 0 waits, on CTAs that wait on
    nothing of this grid, and the next launch's CTAs pass their `griddepcontrol.wait` (or, without
    pdl, start) only after this grid completed, so they never store a tagged word or add to
    the counter before it is reset. `arrive` 1 is the last-arrival scheme below; `arrive` 0
    skips arrival and phase 2: a timing bound for the explorer, not an op.
  * larger batches, "mma": CTAs 0 .. n_experts/(8 * row_tiles)-1 are router CTAs (phase 1, then
    the arrival); the others are down CTAs, 8 * `down_row_tiles` rows of W_down each (16 by
    default), same mma scheme, no arrival. Every CTA reads all of h (from L2): T / rows bytes
    of h per weight byte, so wider CTAs cut that traffic at large batches.

Phase 1 of the mma design, every router CTA: `8 * row_tiles` router rows for every token on
the tensor cores (the decode mma scheme of kernels/ops/decode_mma.py; W_g through the read-only
path), partials summed in warp order in shared memory, fp32 logits stored.

Arrival (the mma design; the stream design with `arrive` 1): after a CTA barrier that follows
its logit stores, thread 0 of each router CTA adds 1 to a gpu-scope counter with acq_rel
semantics (the split-K pattern of kernels/ops/splitk_gemv.py): the CTA that arrives last resets the counter (release store; the
host zeroes it once) and alone runs phase 2 over everybody's logits.

Phase 2, in the last router CTA (or the stream design's CTA 0), the selection as `topk` (mma design) or
`stream_topk` (stream design) says (TOPK_DESIGNS; the same ids, order and weights in all three):
  * 0 "shuffle", one warp per token: each lane holds n_experts/32 biased scores s + b in
    registers; top_k rounds of a warp argmax (butterfly over (score, index): greater score wins,
    equal scores go to the LOWER expert index, exactly the reference's stable descending sort);
    the winner's lane retires it.
  * 1 "redux", one warp per token: the scores as order-preserving int32 keys; each lane keeps
    its best (key, lowest index); a round is two redux.sync reductions (the greatest key, then
    the lowest index holding it) and the winner's lane alone retires it and rescans.
  * 3 "thresh" (stream design), the whole CTA per token (`_topk_thresh`): each warp's first
    ceil(top_k / warps) experts by redux.sync rounds, the last of the warps' last firsts bounds
    the candidates (P and every expert before it), each candidate ranked by a count.
  * 2 "radix", the whole CTA per token (`_topk_cta`): every thread scores n_experts/threads
    experts (uint32 keys), a 4-pass 8-bit radix select over shared histograms finds the k-th
    greatest key T, the experts above T (and those at T, the lowest indices first when a tie
    straddles the k-th place) are gathered and ranked by (key, then lower index).
  Then one lane (thread) per selection recomputes its unbiased score (sigmoid of the same
    logit: bitwise the score ranked), and weights w_k = s_k / (sum of the selected s, in
    selection order, + 1e-20) * scale. Token t's bit is set in each chosen expert's token mask
    (shared memory, one 32-bit word per 32 tokens).
Grouping by expert, a counting sort, deterministic: warp 0 scans the experts' token counts
    (population counts of the masks) and group flags across its lanes, so expert e's slots start
    at start[e] = #slots of lower experts and its group index is the number of lower experts
    chosen; slot p = t * top_k + j of expert e goes to sorted position start[e] + #tokens below t
    that chose e (a masked population count), so every expert's slots are contiguous and in
    token order. Outputs: n_groups, group_expert[u] (ascending expert id), group_start[u] (group
    u = sorted positions group_start[u] .. group_start[u+1]-1; the entry at n_groups is T*top_k)
    and sorted_slots[pos] = p. Entries past n_groups are left as they were. O(T*top_k +
    n_experts) work (the first version counted in O((T*top_k)^2): ~400 us at batch 64).
"""

from __future__ import annotations

from kernels import reference
from kernels.ops.parts import stream
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, ceil_div, cute, cutlass
from kernels.ops.parts.decode_mma import (
    BATCH_PER_TILE,
    ROWS_PER_TILE,
    MmaPlan,
    accumulate,
    new_accumulators,
    padded_batch,
    partials_layout,
    sigmoid,
    store_partials,
    sum_partials,
    vector_view,
    x_row_slots,
)
from kernels.ops.parts.stream import StreamPlan

MAX_BATCH = 64
WEIGHT_EPS = 1e-20  # kernels.reference.router
LOAD_GROUP_VECTORS = 16  # 16-byte vectors per lane per load group (two groups live with prefetch)

# Host-side tunables; must equal the manifest's defaults ([kernels.router]). warps_per_cta,
# row_tiles, down_row_tiles, k_unroll, topk: the mma design; stream_*, pdl, arrive: the stream
# design (batch <= stream_max_batch); timeline: explorer instrumentation (both designs).
DEFAULT_TUNABLES = {"warps_per_cta": 8, "row_tiles": 1, "k_unroll": 8, "stream_max_batch": 2,
                    "stream_threads": 256, "stream_cta_kib": 32, "pdl": 1, "down_row_tiles": 2,
                    "topk": 0, "stream_topk": 3, "timeline": 0, "arrive": 3,
                    "stream_w_regs": 1, "group_one": 0, "stream_ctas_per_sm": 0, "poll_sleep": 2}
TOPK_CHAINS = 4  # independent compare chains per lane in each top-k round (instruction-level parallelism)
# `topk`: how phase 2 selects a token's top_k. 0 "shuffle": a warp per token, top_k rounds of a
# butterfly argmax over (score, index); 1 "redux": a warp per token, each round two redux.sync
# reductions (the greatest key, then the lowest index holding it), only the winner's lane
# rescans; 2 "radix": the whole CTA per token (`_topk_cta`), a 4-pass 8-bit radix select of the
# k-th greatest key, then the selected experts ranked. Same selection and weights in all three.
TOPK_DESIGNS = ("shuffle", "redux", "radix", "thresh")  # "thresh": `stream_topk` 3, the stream design only
RADIX_BITS = 8  # `_topk_cta` assumes 8: 4 passes, 256 bins scanned as 8 per lane of warp 0
assert RADIX_BITS == 8
INT32_MIN = -(1 << 31)  # the redux selection's key of a retired (or absent) expert
# `timeline` 1 (explorer instrumentation, never a shipped variant): the counter buffer grows to
# TIMELINE_WORDS int32 words (the host zeroes them): %globaltimer_lo stamps (ns) and phase 2's
# %clock stamps (SM cycles) at TIMELINE_SLOTS. Plain stores by one CTA each, except the two
# maxima over CTAs (unsigned reductions), each in a 128-byte line of its own, away from the
# arrival counter (word 0), so that the stamps do not queue the arrivals behind them.
TIMELINE_WORDS = 128
TIMELINE_SLOTS = {
    "first_start": 32, "router_first_arrival": 33, "router_cta_last_arrival": 34, "p2_cta_start": 35,
    "p2_arrived": 36, "p2_staged": 37, "p2_selected": 38, "p2_grouped": 39, "first_down_start": 40,
    "last_cta_start": 41,
    "p2_arrived_clk": 48, "p2_staged_clk": 49, "p2_vals_clk": 50, "p2_rounds_clk": 51, "p2_selected_clk": 52,
    "p2_grouped_clk": 53, "p2_radix_clk": 54,
    "last_down_end": 64,  # max over the down CTAs
    "last_router_arrival": 96,  # max over the router CTAs
}


# `arrive` 3: a tagged logit word is the logit's bits inverted (0: not in yet); the NaN whose
# inverse would be 0 (0xffffffff) goes in as this word, the inverse of the NaN 0xffc00000
TAG_NAN_WORD = 0x003FFFFF

SMEM_RESERVED_PER_CTA = 1024  # sm_90 reserves 1 KB of shared memory per CTA
SM90_SMEM_PER_SM = 228 * 1024  # the largest shared-memory carveout of an H100/H200 SM
def _nanosleep(ns: int) -> None:
    """Trace-time: `nanosleep.u32 ns` (the warp sleeps about that long, at most 1 ms; sm_70+)."""
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [], f"nanosleep.u32 {int(ns)};", "", has_side_effects=True)


def _load_row_regs(P, gW, row, kv0):
    """`stream_w_regs` 1: this thread's weight vectors of `row` into registers by plain 16-byte
    loads (weak, default caching), all issued here (an empty volatile asm ties each to this
    point: the compiler would otherwise sink each load to its first use). Plain loads, not the
    read-only path, although the weights are static: ptxas moved read-only (`ld.global.nc`)
    weight loads below `griddepcontrol.wait` (round 9), so no weight was fetched while the
    previous launch drained; plain loads stay ahead of it (tests/test_router.py pins the SASS)."""
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    bf16 = cutlass.BFloat16
    flat = cute.make_layout((BF16_PER_VECTOR,))
    atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), bf16, num_bits_per_copy=128,
                               load_cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS)
    wv = []
    for j in range(P.vectors):
        t = cute.make_rmem_tensor(flat, bf16)
        src = gW[(None, (row, kv0 + j * P.row_threads))]
        cute.copy(atom, cute.make_tensor(src.iterator, flat), t)
        wv.append(t)
    u32 = cutlass.Uint32
    for t in wv:
        words = cute.recast_tensor(t, u32)
        n = cute.size(words)
        res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * n), [words[i].ir_value() for i in range(n)],
                              "", ",".join(["=r"] * n + [str(i) for i in range(n)]), has_side_effects=True)
        for i in range(n):
            words[i] = u32(llvm.extractvalue(T.i32(), res, [i]))
    return wv


def routing_groups_ref(ids, n_experts: int):
    """The grouping phase 2 computes, in torch: {n_groups [1], group_expert [G], group_start [G+1],
    sorted_slots [T*k]} (int32; G = min(T*k, n_experts); entries past n_groups are -1 / T*k)."""
    import torch

    T, k = ids.shape
    flat = ids.reshape(-1).long().cpu()
    order = torch.sort(flat, stable=True).indices  # by expert, then slot (token order)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    G = min(T * k, n_experts)
    n = experts.numel()
    group_expert = torch.full((G,), -1, dtype=torch.int32)
    group_expert[:n] = experts.to(torch.int32)
    group_start = torch.full((G + 1,), T * k, dtype=torch.int32)
    group_start[:n] = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    dev = ids.device
    return {
        "n_groups": torch.tensor([n], dtype=torch.int32).to(dev),
        "group_expert": group_expert.to(dev),
        "group_start": group_start.to(dev),
        "sorted_slots": order.to(torch.int32).to(dev),
    }


def _token_count(sMask, e, E: int, words: int):
    """How many tokens chose expert e: the population count of its token mask."""
    c = cute.arch.popc(sMask[e])
    for w in range(1, words):
        c = c + cute.arch.popc(sMask[w * E + e])
    return c


class RouterOp(OpBase):
    """One variant of the router: shape {"batch", "n_experts", "hidden", "top_k", "latent"} plus
    tunables; `scale` (routed_scale) is baked in (default 1.0). `stream` says which design."""

    kernel_name = "router"
    topk = 0  # the selection (TOPK_DESIGNS); router_select keeps the shuffles
    timeline = 0
    _tl = None
    arrive = 3
    tagged = False
    tag_base = 0

    def __init__(self, shape: dict, **tunables):
        unknown = set(tunables) - set(DEFAULT_TUNABLES)
        if unknown:
            raise ValueError(f"router: unknown tunables {sorted(unknown)}; known: {sorted(DEFAULT_TUNABLES)}")
        super().__init__(shape, **{**DEFAULT_TUNABLES, **tunables})
        try:
            self.latent = int(shape["latent"])
            self.hidden = int(shape["hidden"])
        except KeyError as e:
            raise ValueError(f"router: shape needs batch, n_experts, hidden, top_k and latent; missing {e}") from None
        self._routing_shape(shape)
        self.pdl = int(self.tunables["pdl"])
        self.timeline = int(self.tunables["timeline"])
        self.arrive = int(self.tunables["arrive"])
        for name, top in (("pdl", 1), ("topk", 2), ("stream_topk", 3), ("timeline", 1), ("arrive", 3),
                          ("stream_w_regs", 1), ("group_one", 1)):
            if not 0 <= int(self.tunables[name]) <= top:
                raise ValueError(f"router: {name} must be one of 0..{top}")
        if not 0 <= int(self.tunables["poll_sleep"]) <= 1000:  # nanosleep sleeps at most 1 ms
            raise ValueError("router: poll_sleep must be 0..1000 (microseconds)")
        self.stream = self.batch <= int(self.tunables["stream_max_batch"])
        # the selection of phase 2 (TOPK_DESIGNS), each design its own default
        self.topk = int(self.tunables["stream_topk" if self.stream else "topk"])
        if self.stream:
            self._plan_stream()
        else:
            self._plan_mma()
        # the counter buffer: the arrival counter (word 0), or with `arrive` 3 (stream design) the
        # tagged logits (B * n_experts words); the timeline's stamps come first when `timeline` 1
        self.tagged = self.stream and self.arrive == 3
        self.tag_base = TIMELINE_WORDS if self.timeline else 0
        self.counter_words = (self.tag_base + ceil_div(self.batch * self.n_experts, 4) * 4 if self.tagged
                              else TIMELINE_WORDS if self.timeline else 1)

    def _routing_shape(self, shape: dict) -> None:
        """The selection's sizes from `shape` (batch, n_experts, top_k, optional scale), checked;
        a ValueError names what is missing or out of range."""
        name = self.kernel_name
        try:
            self.batch = int(shape["batch"])
            self.n_experts = int(shape["n_experts"])
            self.top_k = int(shape["top_k"])
        except KeyError as e:
            raise ValueError(f"{name}: shape needs batch, n_experts and top_k; missing {e}") from None
        self.scale = float(shape.get("scale", 1.0))
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"{name}: batch {self.batch} outside 1..{MAX_BATCH}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"{name}: top_k {self.top_k} outside 1..n_experts ({self.n_experts})")
        self.slots = self.batch * self.top_k
        self.groups = min(self.slots, self.n_experts)
        self.per_lane = ceil_div(self.n_experts, WARP)
        self.mask_words = ceil_div(self.batch, WARP)  # per expert: a bit per token

    def _plan_mma(self) -> None:
        """Larger batches: router CTAs of `8 * row_tiles` rows, down CTAs of `8 *
        down_row_tiles` rows, on the tensor cores (kernels/ops/decode_mma.py)."""
        self.warps = int(self.tunables["warps_per_cta"])
        self.row_tiles = int(self.tunables["row_tiles"])
        self.down_row_tiles = int(self.tunables["down_row_tiles"])
        if min(self.row_tiles, self.down_row_tiles) < 1:
            raise ValueError("router: row_tiles and down_row_tiles must be positive")
        self.rows_per_cta = ROWS_PER_TILE * self.row_tiles
        if self.n_experts % self.rows_per_cta:
            raise ValueError(f"router: n_experts {self.n_experts} is not a multiple of {self.rows_per_cta} rows per CTA")
        if self.batch > self.warps * WARP:
            raise ValueError("router: more tokens than threads")
        self.batch_tiles = ceil_div(self.batch, BATCH_PER_TILE)
        x_vectors = sum(1 for mb in range(self.batch_tiles) for h in range(2)
                        if mb * BATCH_PER_TILE + h * 8 < self.batch)
        k_unroll = max(1, min(int(self.tunables["k_unroll"]), LOAD_GROUP_VECTORS // (self.row_tiles + x_vectors)))
        self.plan = MmaPlan(warps=self.warps, row_tiles=self.row_tiles, batch_tiles=self.batch_tiles,
                            k=self.hidden, k_unroll=k_unroll)
        self.ctas = self.n_experts // self.rows_per_cta
        self.down_rows_per_cta = ROWS_PER_TILE * self.down_row_tiles
        if self.latent % self.down_rows_per_cta:
            raise ValueError(f"router: latent {self.latent} is not a multiple of {self.down_rows_per_cta}")
        self.down_ctas = self.latent // self.down_rows_per_cta
        du = max(1, min(int(self.tunables["k_unroll"]), LOAD_GROUP_VECTORS // (self.down_row_tiles + x_vectors)))
        self.down_plan = MmaPlan(warps=self.warps, row_tiles=self.down_row_tiles, batch_tiles=self.batch_tiles,
                                 k=self.hidden, k_unroll=du)
        self.partial_rows = max(self.rows_per_cta, self.down_rows_per_cta)
        self.threads = self.warps * WARP
        self.pb = padded_batch(self.batch)
        self.smem_bytes = (self.partial_rows * self.pb * self.warps * 4 + 16
                           + 2 * ceil_div(self.slots * 4, 16) * 16
                           + ceil_div(self.mask_words * self.n_experts * 4, 16) * 16
                           + ceil_div(self.n_experts * 4, 16) * 16 + 64
                           + sum(ceil_div(w * 4, 16) * 16 for _, w in self._radix_words()))

    def _radix_words(self) -> tuple:
        """(name, int32 words) of the radix selection's shared scratch (`topk` 2, else none):
        two histograms, control words, the candidates' keys and ids, every expert's key."""
        if self.topk == 3:  # `_topk_thresh`: control words, the warps' m-th bests, every candidate
            return (("ctl", 4), ("wb_key", self.warps), ("wb_id", self.warps), ("cand_key", self.n_experts),
                    ("cand_id", self.n_experts))
        if self.topk != 2:
            return ()
        return (("hist", 2 << RADIX_BITS), ("ctl", 4), ("cand_key", self.top_k), ("cand_id", self.top_k),
                ("key", self.n_experts))

    def _plan_stream(self) -> None:
        """Smallest batches (kernels/ops/stream.py): the router's rows and W_down's as one grid
        of short whole-row CTAs of the same thread count; shared memory holds a CTA's weight
        rows and h, or, in the CTA that runs phase 2 (the selector CTA; with `arrive` 1 the last
        router CTA, after its own rows), phase 2's arrays."""
        t = self.tunables
        threads, cta_bytes = int(t["stream_threads"]), int(t["stream_cta_kib"]) * 1024
        self.plan = StreamPlan(n=self.n_experts, k=self.hidden, threads=threads, cta_bytes=cta_bytes)
        self.down_plan = StreamPlan(n=self.latent, k=self.hidden, threads=threads, cta_bytes=cta_bytes)
        if self.plan.threads != self.down_plan.threads:
            raise ValueError(f"router: the stream plans of W_g ({self.plan.threads} threads) and W_down "
                             f"({self.down_plan.threads}) need the same CTA size; change stream_cta_kib")
        self.threads = self.plan.threads
        self.warps = self.plan.warps
        self.rows_per_cta = self.plan.rows
        self.down_rows_per_cta = self.down_plan.rows
        self.ctas = self.plan.ctas
        self.down_ctas = self.down_plan.ctas
        # bf16 elements of the union: (weight rows + h rows) of either plan, or phase 2's arrays
        B, k = self.batch, self.hidden
        self.phase2_offsets = {}
        off = 0
        if self.n_experts % 4:
            raise ValueError(f"router: n_experts {self.n_experts} is not a multiple of 4 (16-byte logit copies)")
        for name, words in (("logits", B * self.n_experts), ("bias", self.n_experts),
                            ("mask", self.mask_words * self.n_experts), ("start", self.n_experts),
                            ("ids", self.slots), ("sel", self.slots)) + self._radix_words():
            self.phase2_offsets[name] = off
            off += ceil_div(words, 4) * 4  # 16-byte aligned int32 / fp32 arrays
        self.union_elems = max((self.plan.rows + B) * k, (self.down_plan.rows + B) * k, 2 * off)
        self.w_regs = int(self.tunables["stream_w_regs"])
        if self.w_regs:  # shared memory holds only h (and phase 2's arrays)
            self.union_elems = max(B * k, 2 * off)
        self.smem_bytes = self.union_elems * 2 + ceil_div(B * self.warps, 4) * 16 + 16 + 64
        # stream_ctas_per_sm n > 0: the preferred shared-memory carveout that holds n CTAs (and
        # not n + 1) per SM; L1 keeps the rest of the SM's 256 KB (a carveout of shared memory
        # padding to the same occupancy leaves L1 a quarter of it, and the weights of
        # `stream_w_regs` 1 and h's copies go through L1)
        n = int(self.tunables["stream_ctas_per_sm"])
        self.carveout = 0
        if n:
            per_cta = self.smem_bytes + SMEM_RESERVED_PER_CTA
            self.carveout = min(100, -(-100 * n * per_cta // SM90_SMEM_PER_SM))

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, E, H, K = self.batch, self.n_experts, self.hidden, self.top_k
        return {
            "h": TensorSpec((T, H), "bfloat16"),
            "w_gate": TensorSpec((E, H), "bfloat16"),
            "bias": TensorSpec((E,), "float32"),
            "logits": TensorSpec((T, E), "float32"),
            "ids": TensorSpec((T, K), "int32"),
            "weights": TensorSpec((T, K), "float32"),
            "n_groups": TensorSpec((1,), "int32"),
            "group_expert": TensorSpec((self.groups,), "int32"),
            "group_start": TensorSpec((self.groups + 1,), "int32"),
            "sorted_slots": TensorSpec((self.slots,), "int32"),
            "counter": TensorSpec((self.counter_words,), "int32", protocol="tagged" if self.tagged else None),
            "w_down": TensorSpec((self.latent, H), "bfloat16"),
            "z": TensorSpec((T, self.latent), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        selector = 1 if self.stream and self.arrive in (2, 3) else 0
        return LaunchConfig(grid=(selector + self.ctas + self.down_ctas, 1, 1), block=(self.threads, 1, 1),
                            smem_bytes=self.smem_bytes, pdl=bool(self.stream and self.pdl),
                            smem_carveout=getattr(self, "carveout", 0) or None)  # the stream design's

    def reference(self, *, h, w_gate, bias, w_down, compute_dtype=None, **_outputs):
        """Expected logits/ids/weights (kernels.reference.router), the grouping of those ids, and z."""
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        r = reference.router(h, w_gate, bias, self.top_k, scale=self.scale, **kwargs)
        return {"logits": r.logits, "ids": r.ids, "weights": r.weights,
                **routing_groups_ref(r.ids, self.n_experts), "z": reference.linear(h, w_down, **kwargs)}

    # -- device code ------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mLogits: cute.Tensor,
                 mIds: cute.Tensor, mWeights: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor,
                 mGroupStart: cute.Tensor, mSorted: cute.Tensor, mCounter: cute.Tensor, mWd: cute.Tensor,
                 mZ: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mH, mW, mBias, mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted,
                    mCounter, mWd, mZ).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mLogits: cute.Tensor,
               mIds: cute.Tensor, mWeights: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor,
               mGroupStart: cute.Tensor, mSorted: cute.Tensor, mCounter: cute.Tensor, mWd: cute.Tensor,
               mZ: cute.Tensor):
        outs = (mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted)
        self._tl = mCounter if self.timeline else None  # trace time: where `_stamp` writes
        if cutlass.const_expr(self.stream):
            self._stream_body(mH, mW, mBias, outs, mCounter, mWd, mZ)
        else:
            self._mma_body(mH, mW, mBias, outs, mCounter, mWd, mZ)

    @cute.jit
    def _mma_body(self, mH, mW, mBias, outs, mCounter, mWd, mZ):
        """Trace-time body of the mma design (larger batches)."""
        T = self.batch
        E = self.n_experts
        TK = self.slots
        R = self.rows_per_cta
        W = self.warps
        NT = self.row_tiles
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        mLogits = outs[0]

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        g = lane // 4
        q = lane % 4
        row0 = bidx * R

        smem = cutlass.memory.SmemAllocator()
        sP = smem.allocate_tensor(f32, partials_layout(self.partial_rows, self.pb, W), byte_alignment=16)
        sLast = smem.allocate_tensor(i32, cute.make_layout(1), byte_alignment=16)
        sIds = smem.allocate_tensor(i32, cute.make_layout(TK), byte_alignment=16)
        sSel = smem.allocate_tensor(f32, cute.make_layout(TK), byte_alignment=16)
        sMask = smem.allocate_tensor(i32, cute.make_layout(self.mask_words * E), byte_alignment=16)
        sStart = smem.allocate_tensor(i32, cute.make_layout(E), byte_alignment=16)
        radix = None
        if cutlass.const_expr(self.topk == 2):
            words = [ceil_div(w, 4) * 4 for _, w in self._radix_words()]
            sR = smem.allocate_tensor(i32, cute.make_layout(sum(words)), byte_alignment=16)
            radix = self._radix_views(sR.iterator, {n: sum(words[:j]) for j, (n, _) in enumerate(self._radix_words())})

        if bidx < self.ctas:
            # --- phase 1: this CTA's logits ------------------------------------------------------
            gW = vector_view(mW)
            gX = vector_view(mH)
            acc = new_accumulators(self.plan)
            x_rows = x_row_slots(self.batch_tiles, T, g, lambda i: i)
            w_tiles = [(gW, row0 + nt * ROWS_PER_TILE) for nt in range(NT)]
            accumulate(self.plan, acc, w_tiles, gX, x_rows, warp, g, q)
            store_partials(self.plan, sP, acc, warp, g, q, T)
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(ceil_div(R * T, self.threads)):
                idx = tidx + j * self.threads
                if idx < R * T:
                    b = idx // R
                    r = idx % R
                    mLogits[b, row0 + r] = sum_partials(sP, r, b, W)
            # --- arrival: the last CTA runs phase 2 ----------------------------------------------
            self._arrive(mCounter, sLast, tidx)
            if sLast[0] == 1:
                self._select_and_group(mLogits, mBias, outs, sMask, sStart, sIds, sSel, tidx, radix)
        else:
            # --- down CTAs: z = h @ W_down.T for 8 * down_row_tiles rows ------------------------
            RD = self.down_rows_per_cta
            d0 = (bidx - self.ctas) * RD
            gWd = vector_view(mWd)
            accd = new_accumulators(self.down_plan)
            accumulate(self.down_plan, accd, [(gWd, d0 + nt * ROWS_PER_TILE) for nt in range(self.down_row_tiles)],
                       vector_view(mH), x_row_slots(self.batch_tiles, T, g, lambda i: i), warp, g, q)
            store_partials(self.down_plan, sP, accd, warp, g, q, T)
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(ceil_div(RD * T, self.threads)):
                idx = tidx + j * self.threads
                if idx < RD * T:
                    b = idx // RD
                    r = idx % RD
                    mZ[b, d0 + r] = sum_partials(sP, r, b, W).to(cutlass.BFloat16)

    @cute.jit
    def _stream_body(self, mH, mW, mBias, outs, mCounter, mWd, mZ):
        """Trace-time body of the stream design (see `_plan_stream` and kernels/ops/stream.py)."""
        B = self.batch
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        i32 = cutlass.Int32

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()

        smem = cutlass.memory.SmemAllocator()
        sU = smem.allocate_tensor(bf16, cute.make_layout((self.union_elems,)), byte_alignment=16)
        sP = smem.allocate_tensor(f32, cute.make_layout((B, self.warps)), byte_alignment=16)
        sLast = smem.allocate_tensor(i32, cute.make_layout(1), byte_alignment=16)
        vU = cute.zipped_divide(sU, (BF16_PER_VECTOR,))  # ((8), vectors)

        t_start = self._stamp_start(tidx, bidx)
        if cutlass.const_expr(self.arrive in (2, 3)):
            # CTA 0 selects (3: once every tagged logit is in; 2: once every router CTA has
            # released its logits); the router CTAs are 1 .. ctas, the down CTAs follow
            if bidx == 0:
                if cutlass.const_expr(self.arrive == 3):
                    self._phase2_tagged(mCounter, sU, outs, mBias, tidx)
                else:
                    self._select_when_arrived(mCounter, tidx)
                    self._stamp("p2_arrived", tidx)
                    self._stamp("p2_cta_start", tidx, value=t_start)
                    self._phase2_stream(sU, outs, mBias, tidx)
            else:
                self._stream_cta(bidx - 1, mH, mW, mBias, outs, mCounter, mWd, mZ, sU, vU, sP, sLast, tidx, t_start)
        else:
            self._stream_cta(bidx, mH, mW, mBias, outs, mCounter, mWd, mZ, sU, vU, sP, sLast, tidx, t_start)

    @cute.jit
    def _stream_cta(self, c, mH, mW, mBias, outs, mCounter, mWd, mZ, sU, vU, sP, sLast, tidx, t_start):
        """Trace-time: streaming CTA c of the stream design (router CTAs 0 .. ctas-1, then the
        down CTAs) and its arrival as `arrive` says: 2, a release `red` for the selector CTA;
        1, the acq_rel arrival and, in the last router CTA, phase 2; 0, none."""
        i32 = cutlass.Int32
        if c < self.ctas:
            self._stream_rows(self.plan, mW, mH, outs[0], c, vU, sP, tidx,
                              tag=mCounter if cutlass.const_expr(self.tagged) else None)
            if cutlass.const_expr(self.arrive == 2):
                cute.arch.sync_threads()  # every logit of this CTA stored
                if tidx == 0:
                    cute.arch.red(mCounter.iterator, i32(1), op="add", dtype=i32, sem="release", scope="gpu")
            elif cutlass.const_expr(self.arrive == 1):
                self._arrive(mCounter, sLast, tidx)
            self._stamp("last_router_arrival", tidx, op="max")
            self._stamp("router_first_arrival", tidx, when=c == 0)
            self._stamp("router_cta_last_arrival", tidx, when=c == self.ctas - 1)
            if cutlass.const_expr(self.arrive == 1):
                if sLast[0] == 1:
                    self._stamp("p2_arrived", tidx)
                    self._stamp("p2_cta_start", tidx, value=t_start)
                    # the streaming buffers are dead (every thread passed the arrival's barriers)
                    self._phase2_stream(sU, outs, mBias, tidx)
        else:
            self._stream_rows(self.down_plan, mWd, mH, mZ, c - self.ctas, vU, sP, tidx)
            self._stamp("last_down_end", tidx, op="max", sync=True)

    @cute.jit
    def _select_when_arrived(self, mCounter, tidx):
        """Trace-time, `arrive` 2, CTA 0 of the stream design: let the next launch start, wait
        for the previous one (pdl), then thread 0 spins on the counter (gpu-scope acquire loads)
        until every router CTA has added its release (`red`), resets it for the next launch
        (release, as the arrival's reset; the next launch's router CTAs add only after this grid
        completed, past their `griddepcontrol.wait`, or behind it in stream order without pdl),
        and a CTA barrier
        hands the acquire on to every thread."""
        i32 = cutlass.Int32
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        if tidx == 0:
            seen = cute.arch.load(mCounter.iterator, i32, sem="acquire", scope="gpu")
            while seen < self.ctas:
                seen = cute.arch.load(mCounter.iterator, i32, sem="acquire", scope="gpu")
            cute.arch.store(mCounter.iterator, i32(0), sem="release", scope="gpu")
        cute.arch.sync_threads()

    @cute.jit
    def _phase2_stream(self, sU, outs, mBias, tidx):
        """Trace-time, stream design: phase 2 in the CTA that runs it, over its streaming
        buffers (dead by now): every logit and the bias staged, the selection and the grouping."""
        v = self._phase2_views(sU)
        self._stage_scores(outs[0], mBias, v["logits"], v["bias"], tidx)
        self._stamp("p2_staged", tidx)
        self._select_and_group(v["logits"], v["bias"], outs, v["mask"], v["start"], v["ids"], v["sel"], tidx,
                               v["radix"])
        self._stamp("p2_grouped", tidx, sync=True)

    def _phase2_views(self, sU) -> dict:
        """Trace-time: phase 2's shared arrays over the streaming buffer sU (`phase2_offsets`):
        logits [B, E] and bias (fp32), the token masks, starts, ids and selections, `words` (the
        logits as int32 words), `radix` (the CTA-wide selection's scratch, or None)."""
        B, E = self.batch, self.n_experts
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        base = cute.recast_ptr(sU.iterator, dtype=i32)
        o = self.phase2_offsets
        return {"logits": cute.make_tensor(cute.recast_ptr(base + o["logits"], dtype=f32),
                                           cute.make_layout((B, E), stride=(E, 1))),
                "words": cute.make_tensor(base + o["logits"], cute.make_layout(B * E)),
                "bias": cute.make_tensor(cute.recast_ptr(base + o["bias"], dtype=f32), cute.make_layout(E)),
                "mask": cute.make_tensor(base + o["mask"], cute.make_layout(self.mask_words * E)),
                "start": cute.make_tensor(base + o["start"], cute.make_layout(E)),
                "ids": cute.make_tensor(base + o["ids"], cute.make_layout(self.slots)),
                "sel": cute.make_tensor(cute.recast_ptr(base + o["sel"], dtype=f32), cute.make_layout(self.slots)),
                "radix": self._radix_views(base, o) if self.topk in (2, 3) else None}

    def _stamp_start(self, tidx, bidx):
        """Trace-time, `timeline` 1 only: this CTA's start (%globaltimer_lo, thread 0), stored
        by the first CTA, the first down CTA and the last CTA; returned (None without timeline)."""
        if cutlass.const_expr(self._tl is None):
            return None
        now = cute.arch.globaltimer_lo()
        self._stamp("first_start", tidx, when=bidx == 0, value=now)
        first_down = self.ctas + (1 if self.arrive in (2, 3) else 0)
        self._stamp("first_down_start", tidx, when=bidx == first_down, value=now)
        self._stamp("last_cta_start", tidx, when=bidx == first_down + self.down_ctas - 1, value=now)
        return now

    def _stamp(self, name: str, tidx, *, op: str | None = None, sync: bool = False, when=None, value=None):
        """Trace-time, `timeline` 1 only (else nothing): after a CTA barrier if `sync`, thread 0
        (of the CTAs where `when` holds) writes `value` (default %globaltimer_lo now) to the
        timeline slot `name` (op "max": an unsigned atomic reduction over CTAs; None: a store)
        and, where the slot `name`_clk exists, %clock to it."""
        if cutlass.const_expr(self._tl is None):
            return
        if cutlass.const_expr(sync):
            cute.arch.sync_threads()
        cond = tidx == 0 if when is None else cutlass.and_(tidx == 0, when)
        self._stamp_now(TIMELINE_SLOTS.get(name), TIMELINE_SLOTS.get(name + "_clk"), cond, op, value)

    @cute.jit
    def _stamp_now(self, slot, clk_slot, cond, op, value):
        u32 = cutlass.Uint32
        if cond:
            if cutlass.const_expr(slot is not None):
                now = cute.arch.globaltimer_lo() if value is None else value
                ptr = self._tl.iterator + slot
                if cutlass.const_expr(op is None):
                    cute.arch.store(ptr, cutlass.Int32(now), sem="relaxed", scope="gpu")
                else:
                    cute.arch.red(ptr, u32(now), op="u" + op, dtype=u32, sem="relaxed", scope="gpu")
            if cutlass.const_expr(clk_slot is not None):
                cute.arch.store(self._tl.iterator + clk_slot, cutlass.Int32(cute.arch.clock()), sem="relaxed",
                                scope="gpu")

    @cute.jit
    def _stream_rows(self, P, mW, mX, mY, blk, vU, sP, tidx, tag=None):
        """Trace-time: CTA `blk` of plan `P` computes its rows of y = x @ W.T (stream.py): all
        its weight copies, then (after the pdl wait) x's, one wait, fp32 dots, stored in y's
        dtype in fixed order. Weight rows fill vU from vector 0, x rows follow them."""
        B = self.batch
        bf16 = cutlass.BFloat16
        r = tidx // P.row_threads
        kv0 = tidx % P.row_threads
        x_base = 0 if self.w_regs else P.rows * P.kv
        gW = cute.zipped_divide(mW, (1, BF16_PER_VECTOR))
        if cutlass.const_expr(self.w_regs):
            wv = _load_row_regs(P, gW, blk * P.rows + r, kv0)
        else:
            stream.copy_row(P, stream.weight_copy_atom(bf16), gW, blk * P.rows + r, vU, r * P.kv, kv0)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # only static weights are read before it
        if r == 0:  # row 0's threads copy x for every row of the CTA
            gX = cute.zipped_divide(mX, (1, BF16_PER_VECTOR))
            for b in cutlass.range_constexpr(B):
                stream.copy_row(P, stream.activation_copy_atom(bf16), gX, b, vU, x_base + b * P.kv, kv0)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # x was copied by row 0's threads

        if cutlass.const_expr(self.w_regs):
            acc = stream.dot(P, None, None, vU, [x_base + b * P.kv for b in range(B)], kv0, w_regs=wv)
        else:
            acc = stream.dot(P, vU, r * P.kv, vU, [x_base + b * P.kv for b in range(B)], kv0)
        stream.publish_partials(acc, sP, tidx // WARP, tidx % WARP)
        cute.arch.sync_threads()
        if tidx < P.rows * B:  # one thread per (row, token), indices computed: no switch over them
            rr = tidx // B
            bb = tidx % B
            total = stream.row_total(P, sP, rr, bb)
            mY[bb, blk * P.rows + rr] = total.to(mY.element_type)
            if cutlass.const_expr(tag is not None):
                self._publish_tagged(tag, bb * self.n_experts + blk * P.rows + rr, total)

    @cute.jit
    def _publish_tagged(self, mCounter, i, value):
        """Trace-time, `arrive` 3, a router thread: logit `value` into tagged word i of the
        counter buffer as its bits inverted (never 0: the one float whose inverse is 0, the NaN
        0xffffffff, goes in as another NaN), by a relaxed gpu-scope store, single-copy atomic:
        the word is its own flag, nothing else is ordered by it, so no fence, barrier or
        atomic follows and the CTA does not wait for the store to land."""
        i32 = cutlass.Int32
        v = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Float32)
        v[0] = value
        w = cute.recast_tensor(v, i32)[0] ^ i32(-1)
        w = cutlass.select_(w == i32(0), i32(TAG_NAN_WORD), w)
        cute.arch.store(mCounter.iterator + self.tag_base + i, w, sem="relaxed", scope="gpu")

    @cute.jit
    def _phase2_tagged(self, mCounter, sU, outs, mBias, tidx):
        """Trace-time, `arrive` 3, CTA 0 of the stream design: phase 2 once every tagged logit
        is in. The bias (static) is copied before `griddepcontrol.wait`; after it every thread
        polls its words of the tagged logits (relaxed gpu-scope loads, all of a round issued
        before any is tested) until none is 0, decodes them into shared memory and resets them
        to 0 for the next launch (whose router CTAs store only past their own wait, after this
        grid completed). One round trip after the last logit lands, phase 2 has every logit:
        no release, no counter, no separate staging."""
        B, E, NTH = self.batch, self.n_experts, self.threads
        i32 = cutlass.Int32
        v = self._phase2_views(sU)
        sBias, sW = v["bias"], v["words"]
        self._stage_f32(((mBias.iterator, sBias.iterator, E // 4, None),), tidx, wait=False)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        tag = mCounter.iterator + self.tag_base
        n = B * E
        J = ceil_div(n, NTH)
        missing = i32(1)
        sleep = int(self.tunables["poll_sleep"])
        while missing != i32(0):
            if cutlass.const_expr(sleep > 0):  # the warp sleeps before each round (the first too)
                _nanosleep(sleep * 1000)
            missing = i32(0)
            for j in cutlass.range_constexpr(J):
                i = tidx + j * NTH
                if cutlass.const_expr((j + 1) * NTH <= n):
                    w = cute.arch.load(tag + i, i32, sem="relaxed", scope="gpu")
                    sW[i] = w ^ i32(-1)
                    missing = missing | cutlass.select_(w == i32(0), i32(1), i32(0))
                else:
                    if i < n:
                        w = cute.arch.load(tag + i, i32, sem="relaxed", scope="gpu")
                        sW[i] = w ^ i32(-1)
                        missing = missing | cutlass.select_(w == i32(0), i32(1), i32(0))
        for j in cutlass.range_constexpr(J):
            i = tidx + j * NTH
            if cutlass.const_expr((j + 1) * NTH <= n):
                cute.arch.store(tag + i, i32(0), sem="relaxed", scope="gpu")
            else:
                if i < n:
                    cute.arch.store(tag + i, i32(0), sem="relaxed", scope="gpu")
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self._stamp("p2_arrived", tidx)
        self._stamp("p2_staged", tidx)
        self._select_and_group(v["logits"], sBias, outs, v["mask"], v["start"], v["ids"], v["sel"], tidx,
                               v["radix"])
        self._stamp("p2_grouped", tidx, sync=True)

    @cute.jit
    def _arrive(self, mCounter, sLast, tidx):
        """Trace-time: after this CTA's logit stores (a CTA barrier first), thread 0 adds 1 to
        the counter (gpu scope, acq_rel); the last of the `ctas` router CTAs resets it (release)
        and sLast[0] says, after a second barrier, whether this CTA runs phase 2."""
        i32 = cutlass.Int32
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(mCounter.iterator, i32(1), sem="acq_rel", scope="gpu")
            last = i32(0)
            if old == self.ctas - 1:
                last = i32(1)
                # Every CTA has arrived: nothing reads the counter again this launch.
                cute.arch.store(mCounter.iterator, i32(0), sem="release", scope="gpu")
            sLast[0] = last
        cute.arch.sync_threads()

    @cute.jit
    def _stage_scores(self, mLogits, mBias, sLg, sBias, tidx):
        """Trace-time, stream design, the CTA that runs phase 2: every logit and bias value into shared
        memory by 16-byte cp.async through L2 (`.cg`: where the other CTAs' released logits
        are), all issued before one wait. (Plain loads here were sunk to their first use by
        ptxas: one L2 round trip per 32 experts, serial, several microseconds.)"""
        T, E = self.batch, self.n_experts
        self._stage_f32(((mLogits.iterator, sLg.iterator, T * E // 4, None),
                         (mBias.iterator, sBias.iterator, E // 4, None)), tidx)

    @cute.jit
    def _stage_f32(self, srcs, tidx, wait: bool = True):
        """Trace-time: for each (global pointer, shared pointer, n, bound) of `srcs`, the first
        `bound` (None: all n; else a run-time count up to n) of the n 16-byte fp32 vectors from
        global into shared memory by L2-only cp.async, every copy issued before one wait; then a
        CTA barrier. With `wait` False the copies are only issued and committed: the caller waits."""
        atom = stream.weight_copy_atom(cutlass.Float32)
        flat = cute.make_layout((4,))
        for g_ptr, s_ptr, n, bound in srcs:
            gv = cute.zipped_divide(cute.make_tensor(g_ptr, cute.make_layout(n * 4)), (4,))
            sv = cute.zipped_divide(cute.make_tensor(s_ptr, cute.make_layout(n * 4)), (4,))
            for j in cutlass.range_constexpr(ceil_div(n, self.threads)):
                v = tidx + j * self.threads
                if v < (n if bound is None else bound):
                    cute.copy(atom, cute.make_tensor(gv[(None, v)].iterator, flat), sv[(None, v)])
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(wait):
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

    def _radix_views(self, base, offsets):
        """Trace-time: the radix selection's shared tensors from an int32 pointer and the word
        offsets of `_radix_words` (keys as uint32: their order is the scores' order)."""
        u32 = cutlass.Uint32
        K, E = self.top_k, self.n_experts
        H = 1 << RADIX_BITS
        if self.topk == 3:
            W = self.warps
            return {"ctl": cute.make_tensor(base + offsets["ctl"], cute.make_layout(4)),
                    "wb_key": cute.make_tensor(base + offsets["wb_key"], cute.make_layout(W)),
                    "wb_id": cute.make_tensor(base + offsets["wb_id"], cute.make_layout(W)),
                    "cand_key": cute.make_tensor(base + offsets["cand_key"], cute.make_layout(E)),
                    "cand_id": cute.make_tensor(base + offsets["cand_id"], cute.make_layout(E))}
        return {"hist": cute.make_tensor(base + offsets["hist"], cute.make_layout((H, 2), stride=(1, H))),
                "ctl": cute.make_tensor(base + offsets["ctl"], cute.make_layout(4)),
                "ctl_u": cute.make_tensor(cute.recast_ptr(base + offsets["ctl"], dtype=u32), cute.make_layout(4)),
                "cand_key": cute.make_tensor(cute.recast_ptr(base + offsets["cand_key"], dtype=u32),
                                             cute.make_layout(K)),
                "cand_id": cute.make_tensor(base + offsets["cand_id"], cute.make_layout(K)),
                "key": cute.make_tensor(cute.recast_ptr(base + offsets["key"], dtype=u32), cute.make_layout(E))}

    @cute.jit
    def _select_and_group(self, lg, bias, outs, sMask, sStart, sIds, sSel, tidx, radix=None):
        """Trace-time phase 2 (module docstring; the last router CTA, or the stream design's
        selector CTA): top-k per token, the
        weights, then the grouping by expert (counting sort over per-expert token masks).
        `lg` [T, E] and `bias` [E] are the logits and bias, in global or shared memory."""
        mIds, mWeights = outs[1], outs[2]
        T = self.batch
        E = self.n_experts
        W = self.warps
        NTH = self.threads
        MW = self.mask_words
        i32 = cutlass.Int32
        warp = tidx // WARP
        lane = tidx % WARP

        for i in cutlass.range(tidx, MW * E, NTH, unroll=1):
            sMask[i] = i32(0)
        cute.arch.sync_threads()
        if cutlass.const_expr(self.topk == 3):
            # --- top-k: the whole CTA per token, a threshold and ranks -----------------------------
            for t in cutlass.range(0, T, unroll=1):
                self._topk_thresh(lg, bias, t, mIds, mWeights, sIds, sSel, sMask, radix, tidx)
        elif cutlass.const_expr(self.topk == 2):
            # --- top-k: the whole CTA per token ---------------------------------------------------
            for t in cutlass.range(0, T, unroll=1):
                self._topk_cta(lg, bias, t, mIds, mWeights, sIds, sSel, sMask, radix, tidx)
        else:
            # --- top-k: one warp per token --------------------------------------------------------
            for t in cutlass.range(warp, T, W, unroll=1):
                self._topk_one(lg, bias, t, t, mIds, mWeights, sIds, sSel, sMask, lane)
        cute.arch.sync_threads()
        self._stamp("p2_selected", tidx)
        if cutlass.const_expr(self.batch == 1 and self.top_k <= WARP and self.tunables["group_one"] == 1):
            self._group_one(outs, sIds, tidx)
        else:
            self._group(outs, sMask, sStart, sIds, tidx)

    @cute.jit
    def _topk_one(self, lg, bias, lt, t, mIds, mWeights, sIds, sSel, sMask, lane):
        """Trace-time, one warp: token t's top-k of sigmoid(lg[lt]) + bias (ties to the lower
        expert), its ids and renormalised weights stored; its selections at sIds / sSel from
        lt * top_k; with `sMask` (not None) t's bit set in each chosen expert's token mask."""
        E = self.n_experts
        K = self.top_k
        V = self.per_lane
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        neg_inf = f32(float("-inf"))
        vals = cute.make_rmem_tensor(cute.make_layout(V), f32)
        for i in cutlass.range_constexpr(V):
            if cutlass.const_expr((i + 1) * WARP <= E):  # no guard (nor branch) where all lanes hold one
                vals[i] = sigmoid(lg[lt, lane + i * WARP]) + bias[lane + i * WARP]
            else:
                vals[i] = neg_inf
                if lane + i * WARP < E:
                    vals[i] = sigmoid(lg[lt, lane + i * WARP]) + bias[lane + i * WARP]
        self._stamp("p2_vals", lane)  # timeline only: lane 0 of the warp of token 0 is thread 0 at batch 1
        # selection j is kept by lane j % 32 (register j // 32) and written after the rounds,
        # so no round waits on a store or a branch
        mine = [i32(E)] * ceil_div(K, WARP)
        if cutlass.const_expr(self.topk == 1):
            # Each lane keeps its best (key, index); a round is two warp reductions (redux.sync:
            # the greatest key, then the lowest index holding it) and only the winner's lane
            # retires it and rescans its values. Keys: the scores' bits as order-preserving
            # int32 (+0 for -0, so equal scores have equal keys).
            keys = cute.recast_tensor(vals, i32)
            for i in cutlass.range_constexpr(V):
                vals[i] = cutlass.select_(vals[i] == f32(0.0), f32(0.0), vals[i])
                keys[i] = cutlass.select_(keys[i] < 0, keys[i] ^ i32(0x7FFFFFFF), keys[i])
                if cutlass.const_expr((i + 1) * WARP > E):
                    if lane + i * WARP >= E:
                        keys[i] = i32(INT32_MIN)
            lk, li = self._lane_best(keys, lane)
            for j in cutlass.range_constexpr(K):
                m = cute.arch.warp_redux_sync(lk, "max")
                w = cute.arch.warp_redux_sync(cutlass.select_(lk == m, li, i32(E)), "min")
                mine[j // WARP] = cutlass.select_(lane == j % WARP, w, mine[j // WARP])
                if cutlass.const_expr(j + 1 < K):
                    if lane == w % WARP:
                        r = w // WARP
                        for i in cutlass.range_constexpr(V):
                            keys[i] = cutlass.select_(r == i, i32(INT32_MIN), keys[i])
                        lk, li = self._lane_best(keys, lane)
        else:
            for j in cutlass.range_constexpr(K):
                # This lane's best (greatest score, then lowest index) as TOPK_CHAINS independent
                # chains over its values (value i in chain i % TOPK_CHAINS, ascending index: strict
                # > keeps the lowest), merged after: one 28-deep dependent chain per round made the
                # selection ~10 us at batch 1, longer than the down CTAs' streaming it hides behind.
                nch = min(TOPK_CHAINS, V)
                cv = [neg_inf] * nch
                ci = [i32(E)] * nch
                for i in cutlass.range_constexpr(V):
                    c = i % nch
                    take = vals[i] > cv[c]
                    cv[c] = cutlass.select_(take, vals[i], cv[c])
                    ci[c] = cutlass.select_(take, lane + i * WARP, ci[c])
                bv = cv[0]
                bi = ci[0]
                for c in cutlass.range_constexpr(1, nch):
                    take = cutlass.or_(cv[c] > bv, cutlass.and_(cv[c] == bv, ci[c] < bi))
                    bv = cutlass.select_(take, cv[c], bv)
                    bi = cutlass.select_(take, ci[c], bi)
                for sh in cutlass.range_constexpr(5):
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=16 >> sh)
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> sh)
                    if cutlass.or_(ov > bv, cutlass.and_(ov == bv, oi < bi)):
                        bv = ov
                        bi = oi
                for i in cutlass.range_constexpr(V):
                    if lane + i * WARP == bi:
                        vals[i] = neg_inf
                mine[j // WARP] = cutlass.select_(lane == j % WARP, bi, mine[j // WARP])
        self._stamp("p2_rounds", lane)
        for q in cutlass.range_constexpr(len(mine)):
            if q * WARP + lane < K:
                mIds[t, q * WARP + lane] = mine[q]
                sIds[lt * K + q * WARP + lane] = mine[q]
                if cutlass.const_expr(sMask is not None):
                    # token t's bit in the chosen expert's token mask (a token's experts are distinct)
                    cute.arch.atomic_or(sMask.iterator + (t // WARP) * E + mine[q], i32(1) << (t % WARP))
        # The selected unbiased scores again (same input, same function: bitwise the
        # ones ranked), one lane per selection so the loads overlap, rather than
        # carrying every lane's scores in registers through the rounds.
        cute.arch.sync_warp()
        for j0 in cutlass.range_constexpr(0, K, WARP):
            if j0 + lane < K:
                sSel[lt * K + j0 + lane] = sigmoid(lg[lt, sIds[lt * K + j0 + lane]])
        cute.arch.sync_warp()
        if lane == 0:
            total = sSel[lt * K]
            for j in cutlass.range_constexpr(1, K):
                total = total + sSel[lt * K + j]
            total = total + f32(WEIGHT_EPS)
            for j in cutlass.range_constexpr(K):
                mWeights[t, j] = sSel[lt * K + j] / total * f32(self.scale)

    @cute.jit
    def _topk_cta(self, lg, bias, t, mIds, mWeights, sIds, sSel, sMask, radix, tidx):
        """Trace-time, the whole CTA (after a CTA barrier; ends with one): token t's top-k, the
        same selection, ids order and weights as `_topk_one`, in few dependent steps spread
        over every thread (one warp's rounds were the serial tail of phase 2 at batch 1).

        Keys: each thread takes experts tidx, tidx + threads, ...: s = sigmoid(logit) + bias
        (-0 made +0), its bits as an order-preserving uint32 key. Radix select: 32 / RADIX_BITS
        passes from the top digit; in each, the keys that match the digits chosen so far count
        into a shared histogram of the next digit (shared atomics), then warp 0 finds the digit
        holding the `need`-th greatest key (lane l holds digits 255 - 8l .. 248 - 8l, summed,
        scanned across lanes) and keeps `need` minus the keys above it. After the last pass the
        prefix is T, the k-th greatest key; `need` keys equal to T are taken, of the ctl[2] that exist.
        Candidates: every key > T, and the keys equal to T when all of them are taken, claim a
        slot by a shared atomic counter (slot order is arbitrary); else (a tie straddling the
        k-th place) warp 0 takes the `need` lowest experts with key T, in index order (ballots).
        Ranks: candidate p's rank is the number of candidates with a greater key, or an equal
        key and a lower expert index: the order of `_topk_one`'s rounds. Rank r's expert goes
        to ids[t, r], its unbiased score to sSel, and the weights follow as in `_topk_one`."""
        E = self.n_experts
        K = self.top_k
        NTH = self.threads
        J = ceil_div(E, NTH)
        H = 1 << RADIX_BITS
        D = H // WARP  # digits per lane in the scan
        i32 = cutlass.Int32
        u32 = cutlass.Uint32
        warp = tidx // WARP
        lane = tidx % WARP
        hist, ctl, ctl_u = radix["hist"], radix["ctl"], radix["ctl_u"]
        cand_key, cand_id, skey = radix["cand_key"], radix["cand_id"], radix["key"]

        for i in cutlass.range_constexpr(ceil_div(2 * H, NTH)):
            if tidx + i * NTH < 2 * H:
                hist[tidx + i * NTH] = i32(0)
        if tidx == 0:
            ctl_u[0] = u32(0)  # the digits chosen so far
            ctl[1] = i32(K)  # keys still to take at or below them
            ctl[3] = i32(0)  # candidate slots claimed
        keys = self._score_keys(lg, bias, t, tidx, signed=False, skey=skey)
        cute.arch.sync_threads()
        self._stamp("p2_vals", tidx)
        for p in cutlass.range_constexpr(32 // RADIX_BITS):
            shift = 32 - RADIX_BITS * (p + 1)
            cur = p % 2
            prefix = ctl_u[0]
            for j in cutlass.range_constexpr(J):
                e = tidx + j * NTH
                d = i32((keys[j] >> shift) & u32(H - 1))
                if cutlass.const_expr(p == 0 and (j + 1) * NTH <= E):
                    cute.arch.atomic_add(hist.iterator + cur * H + d, i32(1))
                else:
                    ok = e < E
                    if cutlass.const_expr(p > 0):
                        ok = cutlass.and_(ok, (keys[j] >> (shift + RADIX_BITS)) == prefix)
                    if ok:
                        cute.arch.atomic_add(hist.iterator + cur * H + d, i32(1))
            for i in cutlass.range_constexpr(ceil_div(H, NTH)):  # the next pass's bins
                if tidx + i * NTH < H:
                    hist[tidx + i * NTH, 1 - cur] = i32(0)
            cute.arch.sync_threads()
            if warp == 0:
                need = ctl[1]
                c = [hist[H - 1 - D * lane - m, cur] for m in range(D)]
                here = c[0]
                for m in cutlass.range_constexpr(1, D):
                    here = here + c[m]
                incl = here
                for sh in cutlass.range_constexpr(5):
                    o = cute.arch.shuffle_sync_up(incl, offset=1 << sh)
                    if lane >= (1 << sh):
                        incl = incl + o
                run = incl - here  # keys in the greater digits of the lower lanes
                cute.arch.sync_warp()  # every lane has read `need` before the winner rewrites it
                if cutlass.and_(run < need, need <= incl):  # exactly one lane
                    digit = i32(0)
                    above = i32(0)
                    at = i32(0)
                    found = lane < 0  # false
                    for m in cutlass.range_constexpr(D):
                        hit = cutlass.and_(run + c[m] >= need, cutlass.not_(found))
                        digit = cutlass.select_(hit, H - 1 - D * lane - m, digit)
                        above = cutlass.select_(hit, run, above)
                        at = cutlass.select_(hit, c[m], at)
                        found = cutlass.or_(found, hit)
                        run = run + c[m]
                    ctl_u[0] = (prefix << RADIX_BITS) | u32(digit)
                    ctl[1] = need - above
                    ctl[2] = at  # after the last pass: how many keys equal T
            cute.arch.sync_threads()
        self._stamp("p2_radix", tidx)
        kth = ctl_u[0]
        need = ctl[1]
        all_eq = ctl[2] == need
        for j in cutlass.range_constexpr(J):
            e = tidx + j * NTH
            take = cutlass.or_(keys[j] > kth, cutlass.and_(keys[j] == kth, all_eq))
            if cutlass.const_expr((j + 1) * NTH > E):
                take = cutlass.and_(take, e < E)
            if take:
                slot = cute.arch.atomic_add(ctl.iterator + 3, i32(1))
                cand_key[slot] = keys[j]
                cand_id[slot] = e
        cute.arch.sync_threads()
        if cutlass.not_(all_eq):  # a tie across the k-th place: the lowest experts of key T
            if warp == 0:
                taken = i32(0)
                base = i32(K) - need
                for c0 in cutlass.range(0, E, WARP, unroll=1):
                    e = c0 + lane
                    eq = cutlass.and_(e < E, skey[cutlass.min(e, E - 1)] == kth)
                    m = u32(cute.arch.vote_ballot_sync(eq))
                    r = taken + i32(cute.arch.popc(m & ((u32(1) << u32(lane)) - u32(1))))
                    if cutlass.and_(eq, r < need):
                        cand_key[base + r] = kth
                        cand_id[base + r] = e
                    taken = taken + i32(cute.arch.popc(m))
            cute.arch.sync_threads()
        for p in cutlass.range(tidx, K, NTH, unroll=1):
            # the uint32 keys as int32 with the top bit flipped (signed order = the keys' order):
            # compared as loaded, the generated code compared them signed, which misordered
            # scores of opposite signs (round 10's "mixed" check)
            kp = i32(cand_key[p]) ^ i32(INT32_MIN)
            ip = cand_id[p]
            rank = i32(0)
            for q in cutlass.range_constexpr(K):
                kq = i32(cand_key[q]) ^ i32(INT32_MIN)
                rank = rank + cutlass.select_(cutlass.or_(kq > kp, cutlass.and_(kq == kp, cand_id[q] < ip)),
                                              i32(1), i32(0))
            self._place_ranked(lg, t, rank, ip, mIds, sIds, sSel, sMask)
        cute.arch.sync_threads()
        self._stamp("p2_rounds", tidx)
        self._weights_cta(t, mWeights, sSel, tidx)

    @cute.jit
    def _score_keys(self, lg, bias, t, tidx, signed: bool, skey=None):
        """Trace-time, the CTA-wide selections: this thread's experts tidx, tidx + threads, ...
        scored s = sigmoid(logit) + bias (-0 made +0; absent experts 0) as order-preserving
        keys in a register tensor: uint32 (negative scores' bits inverted, the others' top bit
        set), or with `signed` int32 (negative scores' bits ^ 0x7fffffff): either way the keys'
        order is the scores' order. With `skey` (shared, one per expert) each key is also
        stored there as it is made."""
        E = self.n_experts
        NTH = self.threads
        J = ceil_div(E, NTH)
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        u32 = cutlass.Uint32
        vals = cute.make_rmem_tensor(cute.make_layout(J), f32)
        keys = cute.recast_tensor(vals, i32 if signed else u32)
        for j in cutlass.range_constexpr(J):
            e = tidx + j * NTH
            if cutlass.const_expr((j + 1) * NTH <= E):
                vals[j] = sigmoid(lg[t, e]) + bias[e]
            else:
                vals[j] = f32(0.0)
                if e < E:
                    vals[j] = sigmoid(lg[t, e]) + bias[e]
            vals[j] = cutlass.select_(vals[j] == f32(0.0), f32(0.0), vals[j])
            if cutlass.const_expr(signed):
                keys[j] = keys[j] ^ cutlass.select_(keys[j] < i32(0), i32(0x7FFFFFFF), i32(0))
            else:
                keys[j] = keys[j] ^ cutlass.select_((keys[j] >> 31) == u32(1), u32(0xFFFFFFFF), u32(0x80000000))
            if cutlass.const_expr(skey is not None):
                if cutlass.const_expr((j + 1) * NTH <= E):
                    skey[e] = keys[j]
                else:
                    if e < E:
                        skey[e] = keys[j]
        return keys

    @cute.jit
    def _topk_thresh(self, lg, bias, t, mIds, mWeights, sIds, sSel, sMask, sc, tidx):
        """Trace-time, the whole CTA (after a CTA barrier; ends with one), `stream_topk` 3: token
        t's top-k, the same selection, ids order and weights as `_topk_one`, by a threshold and
        ranks instead of radix passes (few barriers, no shared histogram).

        Order: expert a precedes b when its key is greater, or equal with a lower index. Keys are
        signed int32 here (the float's bits b, negative ones as b ^ 0x7fffffff: signed order is
        the scores' order), and every comparison is signed: a uint32 key loaded back from shared
        memory or passed through a select compared as signed in the generated code, which put
        the scores of opposite signs in the wrong order. Each warp finds its m
        first experts in that order (m = ceil(top_k / warps); per round two redux.sync, the
        greatest key, then the lowest index holding it; the winner's lane retires it). The
        warps' m-th experts and everything before them are warps * m >= top_k distinct experts,
        so the last of the m-th experts, P, precedes or is the top_k-th expert: every expert of
        the top k is P or precedes it. Those candidates (P and every expert before it) claim
        slots by a shared atomic counter, and each candidate's rank is the number of candidates
        before it; ranks below top_k are the selection. The candidates number at least top_k and
        at most every expert, typically a few dozen (the ranking loop is linear in them)."""
        E = self.n_experts
        K = self.top_k
        NTH = self.threads
        W = self.warps
        J = ceil_div(E, NTH)
        M = ceil_div(K, W)
        i32 = cutlass.Int32
        u32 = cutlass.Uint32
        warp = tidx // WARP
        lane = tidx % WARP
        ctl, wb_key, wb_id, cand_key, cand_id = sc["ctl"], sc["wb_key"], sc["wb_id"], sc["cand_key"], sc["cand_id"]
        if tidx == 0:
            ctl[3] = i32(0)  # candidate slots claimed
        keys = self._score_keys(lg, bias, t, tidx, signed=True)
        self._stamp("p2_vals", tidx)
        # this warp's M first experts: per round the lane's first unretired expert (its values are
        # experts tidx + j * NTH, ascending), the warp's greatest key, the lowest index holding it
        retired = u32(0)  # bit j: value j retired
        wk = i32(INT32_MIN)
        wi = i32(0)
        for _ in cutlass.range_constexpr(M):
            bk = i32(INT32_MIN)
            bi = i32(E)
            for j in cutlass.range_constexpr(J):
                e = tidx + j * NTH
                live = ((retired >> u32(j)) & u32(1)) == u32(0)
                if cutlass.const_expr((j + 1) * NTH > E):
                    live = cutlass.and_(live, e < E)
                better = cutlass.and_(live, cutlass.or_(keys[j] > bk, bi == i32(E)))
                bk = cutlass.select_(better, keys[j], bk)
                bi = cutlass.select_(better, e, bi)
            wk = i32(cute.arch.warp_redux_sync(bk, "max"))
            wi = i32(cute.arch.warp_redux_sync(cutlass.select_(cutlass.and_(bk == wk, bi < i32(E)), bi, i32(E)),
                                               "min"))
            for j in cutlass.range_constexpr(J):
                if tidx + j * NTH == wi:
                    retired = retired | (u32(1) << u32(j))
        if lane == 0:
            wb_key[warp] = wk
            wb_id[warp] = wi
        cute.arch.sync_threads()
        # P: the last, in the order, of the warps' M-th experts
        pk = wb_key[0]
        pi = wb_id[0]
        for w in cutlass.range_constexpr(1, W):
            k2 = wb_key[w]
            i2 = wb_id[w]
            later = cutlass.or_(k2 < pk, cutlass.and_(k2 == pk, i2 > pi))
            pk = cutlass.select_(later, k2, pk)
            pi = cutlass.select_(later, i2, pi)
        for j in cutlass.range_constexpr(J):
            e = tidx + j * NTH
            take = cutlass.or_(keys[j] > pk, cutlass.and_(keys[j] == pk, e <= pi))
            if cutlass.const_expr((j + 1) * NTH > E):
                take = cutlass.and_(take, e < E)
            if take:
                slot = cute.arch.atomic_add(ctl.iterator + 3, i32(1))
                cand_key[slot] = keys[j]
                cand_id[slot] = e
        cute.arch.sync_threads()
        self._stamp("p2_radix", tidx)
        n = ctl[3]
        for p in cutlass.range(tidx, n, NTH, unroll=1):
            kp = cand_key[p]
            ip = cand_id[p]
            rank = i32(0)
            for q in cutlass.range(0, n, unroll=4):
                kq = cand_key[q]
                rank = rank + cutlass.select_(cutlass.or_(kq > kp, cutlass.and_(kq == kp, cand_id[q] < ip)),
                                              i32(1), i32(0))
            if rank < K:
                self._place_ranked(lg, t, rank, ip, mIds, sIds, sSel, sMask)
        cute.arch.sync_threads()
        self._stamp("p2_rounds", tidx)
        self._weights_cta(t, mWeights, sSel, tidx)

    def _place_ranked(self, lg, t, rank, ip, mIds, sIds, sSel, sMask):
        """Trace-time, the CTA-wide selections: expert ip as token t's selection `rank`: its id
        (global and shared), its unbiased score (sigmoid of its logit) and t's bit in its token
        mask (a shared atomic OR)."""
        K, E = self.top_k, self.n_experts
        i32 = cutlass.Int32
        mIds[t, rank] = ip
        sIds[t * K + rank] = ip
        sSel[t * K + rank] = sigmoid(lg[t, ip])
        cute.arch.atomic_or(sMask.iterator + (t // WARP) * E + ip, i32(1) << (t % WARP))

    @cute.jit
    def _weights_cta(self, t, mWeights, sSel, tidx):
        """Trace-time, the whole CTA selections (after a CTA barrier that follows sSel; ends with
        one): token t's weights, each selection's unbiased score over their sum (in selection
        order) + 1e-20, times the scale, one thread per selection."""
        K = self.top_k
        f32 = cutlass.Float32
        for p in cutlass.range(tidx, K, self.threads, unroll=1):
            total = sSel[t * K]
            for j in cutlass.range_constexpr(1, K):
                total = total + sSel[t * K + j]
            total = total + f32(WEIGHT_EPS)
            mWeights[t, p] = sSel[t * K + p] / total * f32(self.scale)
        cute.arch.sync_threads()

    def _lane_best(self, keys, lane):
        """Trace-time: this lane's greatest int32 key and the lowest expert index holding it
        (value i is expert lane + 32 i), as TOPK_CHAINS independent chains merged after."""
        E = self.n_experts
        V = self.per_lane
        i32 = cutlass.Int32
        nch = min(TOPK_CHAINS, V)
        cv = [i32(INT32_MIN)] * nch
        ci = [i32(E)] * nch
        for i in range(V):
            c = i % nch
            take = keys[i] > cv[c]
            cv[c] = cutlass.select_(take, keys[i], cv[c])
            ci[c] = cutlass.select_(take, lane + i * WARP, ci[c])
        bv, bi = cv[0], ci[0]
        for c in range(1, nch):
            take = cutlass.or_(cv[c] > bv, cutlass.and_(cv[c] == bv, ci[c] < bi))
            bv = cutlass.select_(take, cv[c], bv)
            bi = cutlass.select_(take, ci[c], bi)
        return bv, bi

    @cute.jit
    def _group_one(self, outs, sIds, tidx):
        """Trace-time, batch 1 (`group_one` 1), after a CTA barrier that follows sIds: the same
        grouping as `_group` for one token, whose top_k experts are distinct: one group per
        expert in ascending id, group u holding sorted position u. Lane j of warp 0 takes
        selection j (slot j): its position is the number of selected experts below it."""
        mNGroups, mGroupExpert, mGroupStart, mSorted = outs[3:]
        K = self.top_k
        i32 = cutlass.Int32
        if tidx < K:
            e = sIds[tidx]
            pos = i32(0)
            for j in cutlass.range_constexpr(K):
                pos = pos + cutlass.select_(sIds[j] < e, i32(1), i32(0))
            mGroupExpert[pos] = e
            mGroupStart[pos] = pos
            mSorted[pos] = tidx
            if tidx == 0:
                mNGroups[0] = i32(K)
                mGroupStart[K] = i32(K)

    @cute.jit
    def _group(self, outs, sMask, sStart, sIds, tidx):
        """Trace-time, after a CTA barrier that follows every token's mask bits and sIds: the
        grouping by expert (module docstring), a counting sort over the token masks."""
        mNGroups, mGroupExpert, mGroupStart, mSorted = outs[3:]
        E = self.n_experts
        K = self.top_k
        NTH = self.threads
        TK = self.slots
        MW = self.mask_words
        CH = self.per_lane
        i32 = cutlass.Int32
        warp = tidx // WARP
        lane = tidx % WARP
        # --- grouping by expert: a counting sort over the token masks ----------------------------
        # Warp 0: each lane takes CH consecutive experts; counts and group flags are
        # scanned across the lanes, so expert e's slots start at sStart[e] and its group
        # index is the number of lower experts chosen.
        if warp == 0:
            slots_here = i32(0)
            groups_here = i32(0)
            for i in cutlass.range_constexpr(CH):
                e = lane * CH + i
                if e < E:
                    c = _token_count(sMask, e, E, MW)
                    slots_here = slots_here + c
                    if c > 0:
                        groups_here = groups_here + 1
            slots_incl = slots_here
            groups_incl = groups_here
            for sh in cutlass.range_constexpr(5):
                os_ = cute.arch.shuffle_sync_up(slots_incl, offset=1 << sh)
                og = cute.arch.shuffle_sync_up(groups_incl, offset=1 << sh)
                if lane >= (1 << sh):
                    slots_incl = slots_incl + os_
                    groups_incl = groups_incl + og
            pos = slots_incl - slots_here
            u = groups_incl - groups_here
            for i in cutlass.range_constexpr(CH):
                e = lane * CH + i
                if e < E:
                    c = _token_count(sMask, e, E, MW)
                    sStart[e] = pos
                    if c > 0:
                        mGroupExpert[u] = e
                        mGroupStart[u] = pos
                        u = u + 1
                    pos = pos + c
            if lane == WARP - 1:
                mNGroups[0] = u
                mGroupStart[u] = i32(TK)
        cute.arch.sync_threads()
        # each slot's sorted position: its expert's start plus the earlier tokens of it
        for p in cutlass.range(tidx, TK, NTH, unroll=1):
            e = sIds[p]
            t = p // K
            rank = i32(0)
            for w in cutlass.range_constexpr(MW):
                m = sMask[w * E + e]
                if t >= (w + 1) * WARP:
                    rank = rank + cute.arch.popc(m)
                elif t > w * WARP:
                    rank = rank + cute.arch.popc(m & ((i32(1) << (t - w * WARP)) - 1))
            mSorted[sStart[e] + rank] = p


# Host-side tunables of router_select; must equal the manifest's defaults ([kernels.router_select]).
SELECT_TUNABLES = {"warps_per_cta": 4}


class RouterSelectOp(RouterOp):
    """router_select: the router's phase 2 alone, from fp32 logits another launch computed (the
    foundation GEMM, at the batches of kernels/block.py GEMV_ROUTER): top-k of sigmoid(logits) +
    bias, the renormalised weights and the grouping by expert, with the same rules and
    tie-breaking as the router (kernels.reference.route_logits). Shape {"batch", "n_experts",
    "top_k"}.

    One warp per token and `warps_per_cta` tokens per CTA, so the top-k runs on
    batch / warps_per_cta SMs at once (in the router's own phase 2, one CTA takes every token:
    at batch 64, 4 tokens per warp one after the other). Each CTA first copies its tokens' logits
    and the bias into shared memory by 16-byte cp.async, all issued before one wait (the
    router's `_stage_scores`: plain loads were sunk to their first use, a serial L2 round trip
    per 32 experts). Then the router's per-token selection (`_topk_one`), ids and weights stored;
    then the router's arrival (`_arrive`: gpu-scope acq_rel counter, reset by the last CTA); the
    last CTA reads every token's ids back (plain loads after the acquire and a CTA barrier), sets
    the token masks and runs the router's grouping (`_group`)."""

    kernel_name = "router_select"

    def __init__(self, shape: dict, **tunables):
        unknown = set(tunables) - set(SELECT_TUNABLES)
        if unknown:
            raise ValueError(f"router_select: unknown tunables {sorted(unknown)}; known: {sorted(SELECT_TUNABLES)}")
        OpBase.__init__(self, shape, **{**SELECT_TUNABLES, **tunables})
        self._routing_shape(shape)
        if self.n_experts % 4:
            raise ValueError(f"router_select: n_experts {self.n_experts} is not a multiple of 4 (16-byte copies)")
        self.warps = int(self.tunables["warps_per_cta"])
        if self.warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"router_select: warps_per_cta {self.warps} is not a power of two up to 32")
        self.threads = self.warps * WARP
        self.tokens_per_cta = self.warps
        self.ctas = ceil_div(self.batch, self.tokens_per_cta)

        def words(n):  # 16-byte aligned int32 / fp32 arrays
            return ceil_div(n, 4) * 4

        E = self.n_experts
        self.smem_words = {"logits": words(self.tokens_per_cta * E), "bias": words(E), "ids": words(self.slots),
                           "sel": words(self.tokens_per_cta * self.top_k), "mask": words(self.mask_words * E),
                           "start": words(E), "last": 4}
        self.smem_bytes = 4 * sum(self.smem_words.values()) + 64

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, E, K = self.batch, self.n_experts, self.top_k
        return {
            "logits": TensorSpec((T, E), "float32"),
            "bias": TensorSpec((E,), "float32"),
            "ids": TensorSpec((T, K), "int32"),
            "weights": TensorSpec((T, K), "float32"),
            "n_groups": TensorSpec((1,), "int32"),
            "group_expert": TensorSpec((self.groups,), "int32"),
            "group_start": TensorSpec((self.groups + 1,), "int32"),
            "sorted_slots": TensorSpec((self.slots,), "int32"),
            "counter": TensorSpec((1,), "int32"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.ctas, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes)

    def reference(self, *, logits, bias, compute_dtype=None, **_outputs):
        """Expected ids/weights (kernels.reference.route_logits) and the grouping of those ids."""
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        r = reference.route_logits(logits, bias, self.top_k, scale=self.scale, **kwargs)
        return {"ids": r.ids, "weights": r.weights, **routing_groups_ref(r.ids, self.n_experts)}

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor,
                 mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor,
                 mCounter: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mLogits, mBias, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted,
                    mCounter).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor,
               mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor,
               mCounter: cute.Tensor):
        T, E, K = self.batch, self.n_experts, self.top_k
        TPC = self.tokens_per_cta
        NTH = self.threads
        TK = self.slots
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        outs = (mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted)

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        t0 = bidx * TPC

        smem = cutlass.memory.SmemAllocator()
        nw = self.smem_words
        sLg = smem.allocate_tensor(f32, cute.make_layout((TPC, E), stride=(E, 1)), byte_alignment=16)
        sBias = smem.allocate_tensor(f32, cute.make_layout(nw["bias"]), byte_alignment=16)
        sIds = smem.allocate_tensor(i32, cute.make_layout(nw["ids"]), byte_alignment=16)
        sSel = smem.allocate_tensor(f32, cute.make_layout(nw["sel"]), byte_alignment=16)
        sMask = smem.allocate_tensor(i32, cute.make_layout(nw["mask"]), byte_alignment=16)
        sStart = smem.allocate_tensor(i32, cute.make_layout(nw["start"]), byte_alignment=16)
        sLast = smem.allocate_tensor(i32, cute.make_layout(4), byte_alignment=16)

        # --- this CTA's tokens' logits and the bias into shared memory, one wait --------------------
        rows = cutlass.min(T - t0, TPC)
        first = cute.assume(t0 * E, divby=4)  # E % 4 == 0: the row keeps the tensor's 16 bytes
        self._stage_f32(((mLogits.iterator + first, sLg.iterator, TPC * E // 4, rows * (E // 4)),
                         (mBias.iterator, sBias.iterator, E // 4, None)), tidx)

        # --- top-k: one warp per token ------------------------------------------------------------
        if warp < rows:
            self._topk_one(sLg, sBias, warp, t0 + warp, mIds, mWeights, sIds, sSel, None, lane)
        # --- arrival: the last CTA groups every token's selection --------------------------------
        self._arrive(mCounter, sLast, tidx)
        if sLast[0] == 1:
            for i in cutlass.range(tidx, self.mask_words * E, NTH, unroll=1):
                sMask[i] = i32(0)
            cute.arch.sync_threads()
            for p in cutlass.range(tidx, TK, NTH, unroll=1):
                t = p // K
                e = mIds[t, p % K]
                sIds[p] = e
                cute.arch.atomic_or(sMask.iterator + (t // WARP) * E + e, i32(1) << (t % WARP))
            cute.arch.sync_threads()
            self._group(outs, sMask, sStart, sIds, tidx)
