"""The LatentMoE block in one persistent cooperative launch: the megakernel.

`workers` CTAs (one per H200 SM) of THREADS threads each run the stages of
kernels/taskgraph.py MEGA_STAGES in order:

    norm_pre     h = RMSNorm(x) * gamma_pre          rmsnorm's tile, an item per token
    router_rows  logits = h @ W_g.T (fp32)            ring: the router's whole rows of W_g
    select       top-k, weights, grouping by expert   the router's phase 2 from logits in memory
    down         z = h @ W_down.T                     ring: the router's whole rows of W_down
    shared_gu    a_s = SiTU(h @ W_sgu.T)              ring: shared_gate_up's gate row and up row
    w13          act = SiTU(z[token] @ W13_e.T)       ring: moe_w13's gate rows and up rows, an item per (group, cols)
    w2           o = act @ W2_e.T (fp32)              ring: moe_w2's rows, an item per (group, rows)
    combine      c = bf16(sum_k w_k o_k)              an item per block of latent columns, k in order
    norm_latent  n = RMSNorm(c) * gamma_latent        rmsnorm's tile
    out          out = x + n @ W_up.T + a_s @ W_sd.T  ring: latent_out's W_up row and W_sd row

Where the bytes go (why the design is what it is): a decode step reads its weights once, 1.44 GB
at batch 1, so the step's time is how long the weights take to stream, and a worker must keep
many bytes in flight the whole time. The ring stages stream their items' weights through a
ring of shared-memory slots (kernels/ops/parts/ring.py): one thread issues item j +
`slots` - 1 by bulk copies while every thread computes item j, across stage boundaries (weights
are static, so the copies of a stage's first items are issued before its waits; activations are
never in the ring). The consumer side of an item is the op's stream design (kernels/ops/parts/
stream.py): each thread reads its 16-byte vectors of the item's rows from the slot and of the
stage's activations from shared memory, fp32 FMAs, a warp-shuffle and warp-order reduction
(bitwise deterministic), and the op's epilogue. One CTA barrier per item: the reduction's
partials alternate between two buffers, and the barrier also frees the slot for the item
`slots` ahead.

Activations are loaded by coherent copies after the stage's waits, into the stage's shared
region: h (router_rows, down, shared_gu), z (w13), n and a_s (out, with the residuals x of the
worker's items), once per stage; w2 loads
the act rows of an item's group when the group changes. The routing (n_groups, the groups'
experts, starts, sorted slots) is copied into shared memory once per worker, after
a wait on select that every worker makes at the start of shared_gu (items or not, MEGA_DEPS and
MEGA_ROUTING_AT): from there on the ring may issue routed experts' weights (their addresses are
the routing's), and the consumers read the routing without a global load per item.

The schedule is data: `task_table` of the stage's graph (kernels/taskgraph.py
`megakernel_graph`, the one declaration of stages, items, buffers and counters), int32
[workers][stages][4] = (lo, hi, step, target), read by each worker: its items of a stage are
range(lo, hi, step); `target` is the item count of the stage, what its completion counter
reaches. The ring walks the worker's items of the ring stages (RING_STAGES) in stage order.

The protocol, per worker and stage (`counters` holds one int32 per stage and an exit count):
  * wait, once, before the worker's first item of the stage, for each stage it depends on
    (MEGA_DEPS): thread 0 spins with ld.acquire.gpu until the counter reaches the producer's
    target, a CTA barrier, then every thread loads the counter with acquire itself, so each
    thread's later loads, those of all the worker's items of the stage, are ordered after the
    producers' writes. Activations are read only after it, and only by coherent paths (plain
    loads and cp.async; never ld.global.nc, which only static weights may use);
  * the items;
  * signal, once, after the worker's last item: a CTA barrier (every thread's writes of the
    items done), then thread 0 adds the worker's item count with red.release.gpu;
  * with `watchdog` 1 a wait that polls 2^24 times prints the stage and counter and traps, so a
    broken graph fails instead of hanging;
  * at exit each worker adds 1 to the exit count (acq_rel); the last resets every counter, so
    the next launch starts from zero (the host zeroes them once).
Shared memory: the ring and its mbarriers, the routing, then one region laid out per stage
(`_Region`): a stage's tensors overlap the previous stage's, which the barrier of each signal
separates.

The kernel stamps its own timeline: thread 0 of each worker writes `%globaltimer` (ns) into
`stamps[worker][stage]` when it has passed its waits for a stage, and when it has signalled
the stage (int64 [workers][stages][2]; a stage a worker runs no item of is left as the
host zeroed it). Two stores per worker and stage, always on, so the timed kernel is the one the
timeline shows (validation/timeline.py reads it).

Every buffer a stage writes is its own kernel parameter (`tensor_specs`).
"""

from __future__ import annotations

from kernels.config import ModelConfig
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec, op_tunables
from kernels.ops.latent_out import LatentOutOp, SharedGateUpOp
from kernels.ops.moe_experts import ExpertsDownOp, ExpertsUpOp
from kernels.ops.parts import ring
from kernels.ops.parts.common import BF16_PER_VECTOR, ceil_div, cute, cutlass
from kernels.ops.rmsnorm import RMSNormOp
from kernels.ops.router import ROUTER_MAX_BATCH, RouterOp
from kernels.ops.stages.combine import CombineStage
from kernels.ops.stages.out import OutStage
from kernels.ops.stages.rows import RowsStage
from kernels.ops.stages.shared_gu import SharedGuStage
from kernels.ops.stages.w13 import W13Stage
from kernels.ops.stages.w2 import W2Stage
from kernels.taskgraph import MEGA_DEPS, MEGA_ROUTING_AT, MEGA_STAGES, TASK_FIELDS, megakernel_graph, task_table

THREADS = 256
WORKERS = 132  # one CTA per H200 SM
WATCHDOG_POLLS = 1 << 24
SMEM_ALIGN = 1024
SMEM_LIMIT = 227 * 1024  # an sm_90 CTA's dynamic shared memory (the launcher opts in past 48 KB)
MAX_RING_SLOTS = 8
# The stages whose items stream their weights through the ring (kernels/ops/stages/), in stage
# order; ROUTED: those whose items' weights are the routing's experts (issued only after the
# routing is waited for).
RING_STAGES = tuple(s for s in MEGA_STAGES if s in ("router_rows", "down", "shared_gu", "w13", "w2", "out"))
ROUTED = ("w13", "w2")
COMBINE_COLS = 32  # latent columns of one combine item
MAX_BATCH = ROUTER_MAX_BATCH  # the router's one-selector phase 2; past it the router stages need gemv tiles
STAGE_INDEX = {s: i for i, s in enumerate(MEGA_STAGES)}
EXIT_COUNTER = len(MEGA_STAGES)  # counters[EXIT_COUNTER]: workers that have finished
# the buffers a stage's item is given, in order ("routing": the router's seven outputs)
BUFFERS = ("x", "gamma_pre", "w_gate", "bias", "w_down", "w_shared_gate_up", "w13", "w2", "gamma_latent", "w_up",
           "w_shared_down", "h", "routing", "z", "a_shared", "act", "o", "c", "n", "out")
ROUTING = ("logits", "ids", "weights", "n_groups", "group_expert", "group_start", "sorted_slots")
# Every tunable of the stages' ops, given here in full: the megakernel's design is declared by
# its own module and its manifest tunables (and a compile child has no manifest to read). The
# ring stages use the ops' stream designs, sized for THREADS threads: shared_gu a gate row and
# its up row per item (half the threads each), out a W_up row (64 threads) and its W_sd row.
SHARED_GU = {"warps_per_cta": THREADS // 32, "row_tiles": 2, "k_unroll": 8, "stream_max_batch": MAX_BATCH,
             "stream_rows": 1, "stream_threads": THREADS // 2}
EXPERTS = {"stream_slots": 1, "wg": 0, "wg_stages": 4, "wg_k": 128, "wg_n": 8}
LATENT_OUT = {"warps_per_cta": THREADS // 32, "row_tiles": 2, "k_unroll": 8, "stream_max_batch": MAX_BATCH,
              "stream_rows": 1, "stream_up_threads": 64, "stream_down_threads": THREADS - 64}


def shape_config(shape: dict) -> ModelConfig:
    """The model widths of a megakernel shape {"batch", "hidden", "latent", "n_experts",
    "top_k", "expert_inter", "shared_inter"} as a ModelConfig."""
    keys = ("hidden", "latent", "n_experts", "top_k", "expert_inter", "shared_inter")
    try:
        return ModelConfig(name="megakernel", **{k: int(shape[k]) for k in keys})
    except KeyError as e:
        raise ValueError(f"megakernel: shape needs batch and {', '.join(keys)}; missing {e}") from None


def _kib(nbytes: int, name: str) -> int:
    """`nbytes` in KiB, exactly (a stream plan's bytes per item)."""
    if nbytes % 1024:
        raise ValueError(f"megakernel: {name}'s item of {nbytes} bytes is not a whole number of KiB")
    return nbytes // 1024


def _words(n: int) -> int:
    """int32 words of an array of n, 16-byte aligned."""
    return ceil_div(n, 4) * 4


class MegaStages:
    """The ops whose tiles the stages run at one batch, each planned for THREADS threads and
    without programmatic dependent launch (host side; no DSL needed); the ring, the routing
    copy and every stage's shared region. `cols` gives the output columns per item of
    MEGA_COL_STAGES, for `megakernel_graph`; `workers` sizes the regions that hold a value per
    item of the worker's (out's residuals)."""

    def __init__(self, cfg: ModelConfig, batch: int, slot_kib: int, slots: int = 0, w13_cols: int = 2,
                 w2_rows: int = 4, workers: int = WORKERS):
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"megakernel: batch {batch} outside 1..{MAX_BATCH} (past it the router's stages "
                             "need the gemv tiles, not yet a stage)")
        T, H, L, E, K, I, S = (batch, cfg.hidden, cfg.latent, cfg.n_experts, cfg.top_k, cfg.expert_inter,
                               cfg.shared_inter)
        self.batch = T
        stream_t = {"stream_threads": THREADS, "stream_cta_kib": slot_kib, "pdl": 0}
        experts = {"batch": T, "n_experts": E, "latent": L, "expert_inter": I, "top_k": K}
        self.norm_pre = RMSNormOp({"batch": T, "width": H}, threads=THREADS)
        self.router = RouterOp({"batch": T, "n_experts": E, "hidden": H, "top_k": K, "latent": L},
                               **stream_t, poll_sleep=0)
        self.shared_gu = SharedGateUpOp({"batch": T, "hidden": H, "shared_inter": S}, **SHARED_GU)
        # the routed stages' items: w13_cols gate rows and as many up rows, w2_rows rows (the
        # ops' stream plans of exactly those rows)
        self.w13 = ExpertsUpOp(experts, **{**stream_t, "stream_cta_kib": _kib(2 * w13_cols * L * 2, "w13_cols")},
                               **EXPERTS)
        self.w2 = ExpertsDownOp(experts, **{**stream_t, "stream_cta_kib": _kib(w2_rows * I * 2, "w2_rows")},
                                **EXPERTS)
        if self.w13.stream_cols != w13_cols or self.w2.rows_per_cta != w2_rows:
            raise ValueError(f"megakernel: w13_cols {w13_cols} / w2_rows {w2_rows} cannot be planned at these widths "
                             f"(the stream plans give {self.w13.stream_cols} / {self.w2.rows_per_cta})")
        self.norm_latent = RMSNormOp({"batch": T, "width": L}, threads=THREADS)
        self.out = LatentOutOp({"batch": T, "hidden": H, "latent": L, "shared_inter": S}, **LATENT_OUT)
        for name in ("norm_pre", "norm_latent", "router"):
            op = getattr(self, name)
            if op.threads != THREADS:
                raise ValueError(f"megakernel: the {name} stage's op plans {op.threads} threads, not {THREADS}")
        # the ring stages' items: whole warps per row (fewer threads than the CTA's where a row's
        # vectors do not split evenly; the rest wait at the item's barrier)
        for name in ("w13", "w2", "shared_gu", "out"):
            op = getattr(self, name)
            if op.threads > THREADS:
                raise ValueError(f"megakernel: the {name} stage's items need {op.threads} threads, more "
                                 f"than {THREADS}")
        slot_bytes = slot_kib * 1024
        slot_vectors = slot_bytes // 16
        r = self.router
        self.ring_stages = {
            "router_rows": RowsStage("router_rows", r.plan, "w_gate", "logits", T, THREADS),
            "down": RowsStage("down", r.down_plan, "w_down", "z", T, THREADS),
            "shared_gu": SharedGuStage(self.shared_gu, T, THREADS, slot_vectors),
            "w13": W13Stage(self.w13, THREADS),
            "w2": W2Stage(self.w2, THREADS),
            "out": OutStage(self.out, T, THREADS, slot_vectors, workers),
        }
        self.combine = CombineStage(T, K, L, COMBINE_COLS, THREADS)
        self.cols = {s: st.cols for s, st in self.ring_stages.items()}
        self.cols["combine"] = COMBINE_COLS
        # the weight bytes of one item of each ring stage (what its slot must hold)
        self.item_bytes = {s: st.item_bytes for s, st in self.ring_stages.items()}
        over = {s: b for s, b in self.item_bytes.items() if b > slot_bytes}
        if over:
            raise ValueError(f"megakernel: items of {over} bytes do not fit a {slot_kib} KiB slot")
        # every stage's shared region, as its tensors are laid out
        self.smem = {"norm_pre": self.norm_pre.launch_config().smem_bytes, "select": self.router.smem_bytes,
                     "combine": 0, "norm_latent": self.norm_latent.launch_config().smem_bytes,
                     **{s: st.region_bytes for s, st in self.ring_stages.items()}}
        G = self.w13.groups
        # the routing's shared copy, int32 words: n_groups, group_expert, group_start, sorted_slots
        self.routing_words = {"n_groups": _words(1), "group_expert": _words(G), "group_start": _words(G + 1),
                              "sorted_slots": _words(T * K)}
        routing_bytes = 4 * sum(self.routing_words.values())
        self.region_bytes = -(-max(self.smem.values()) // 128) * 128
        fixed = routing_bytes + self.region_bytes + 2 * 128 + SMEM_ALIGN
        fit = (SMEM_LIMIT - fixed) // (slot_bytes + ring.MBARRIER_BYTES)
        if slots == 0:
            slots = min(MAX_RING_SLOTS, fit)
        if not 2 <= slots <= fit:
            raise ValueError(f"megakernel: {slots} ring slots of {slot_kib} KiB do not fit beside the "
                             f"{fixed} bytes of the stages at batch {T} (at most {fit})")
        self.ring = ring.RingPlan(slots=slots, slot_bytes=slot_bytes)
        self.routing_offset = -(-self.ring.smem_bytes // 128) * 128
        self.region_offset = -(-(self.routing_offset + routing_bytes) // 128) * 128
        self.smem_total = self.region_offset + self.region_bytes


def plan_stages(cfg: ModelConfig, batch: int, tunables: dict | None = None, workers: int = WORKERS) -> MegaStages:
    """The stages as the megakernel plans them at `batch` on `workers` with `tunables` (the
    manifest's defaults where not given): what MegakernelOp builds, and what the host-side
    counts below read."""
    t = op_tunables("megakernel", MegakernelOp.TUNABLES, tunables or {})
    return MegaStages(cfg, batch, int(t["stream_cta_kib"]), int(t["ring_slots"]), int(t["w13_cols"]),
                      int(t["w2_rows"]), workers)


def stage_cols(cfg: ModelConfig, batch: int, tunables: dict | None = None) -> dict[str, int]:
    """Output columns per item of the column-split stages, as the megakernel plans them at
    `batch` with `tunables` (the manifest's defaults where not given)."""
    return plan_stages(cfg, batch, tunables).cols


def stage_weight_bytes(cfg: ModelConfig, batch: int, n_groups: int, tunables: dict | None = None,
                       workers: int = WORKERS) -> dict[str, int]:
    """The weight bytes each stage streams in one launch whose routing made `n_groups` groups
    (distinct experts): a ring stage's items times its `item_bytes`, where a routed stage's items
    of groups past n_groups carry none (as its `issue` arms them); the stages outside the ring
    stream no weights (0). What the report's per-stage bandwidth divides by."""
    st = plan_stages(cfg, batch, tunables, workers)
    graph = megakernel_graph(cfg, batch, workers, cols=st.cols)
    groups = st.w13.groups
    if not 0 <= n_groups <= groups:
        raise ValueError(f"megakernel: {n_groups} groups at batch {batch} (at most {groups})")
    out = {}
    for s in MEGA_STAGES:
        ring_stage = st.ring_stages.get(s)
        if ring_stage is None:
            out[s] = 0
            continue
        items = len(graph.stage_tasks(s))
        if s in ROUTED:  # group-major items: items // groups per group
            items = items // groups * n_groups
        out[s] = items * ring_stage.item_bytes
    return out


class _Region:
    """Trace-time: the allocator interface the ops' `allocate_smem` use (`allocate_tensor`),
    carving one stage's tensors from the shared region at `base` (a byte pointer) from offset 0,
    so every stage's layout overlaps the others' (the region is the largest stage's, not their
    sum). `used` is the bytes laid out so far."""

    def __init__(self, base, size: int):
        self.base, self.size, self.used = base, size, 0

    def allocate_tensor(self, element_type, layout, byte_alignment: int = 1, swizzle=None):
        if swizzle is not None:
            raise ValueError("megakernel: a swizzled stage tensor (a warpgroup design) is not laid out here")
        if isinstance(layout, int):
            layout = cute.make_layout(layout)
        width = element_type.width // 8
        align = max(byte_alignment, width)
        off = -(-self.used // align) * align
        nbytes = cute.cosize(layout) * width
        if off + nbytes > self.size:
            raise ValueError(f"megakernel: a stage needs more than the {self.size} bytes of shared memory planned")
        self.used = off + nbytes
        ptr = cute.recast_ptr(self.base + off, dtype=element_type)
        return cute.make_tensor(ptr, layout)


class MegakernelOp(OpBase):
    """The megakernel at one batch (module docstring): shape {"batch", model widths} plus
    tunables `stream_cta_kib` (the ring's slot, KiB), `ring_slots` (0: as many as fit),
    `watchdog`, and the routed stages' own: `w13_cols` (act columns of a w13 item: as many gate
    rows and up rows) and `w2_rows` (rows of a w2 item)."""

    kernel_name = "megakernel"
    TUNABLES = ("stream_cta_kib", "ring_slots", "watchdog", "w13_cols", "w2_rows")

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        try:
            self.batch = int(shape["batch"])
        except KeyError:
            raise ValueError("megakernel: shape needs batch") from None
        self.workers = int(shape.get("workers", WORKERS))
        self.cfg = shape_config(shape)
        self.watchdog = int(self.tunables["watchdog"])
        if self.watchdog not in (0, 1):
            raise ValueError("megakernel: watchdog must be 0 or 1")
        self.stages = plan_stages(self.cfg, self.batch, self.tunables, self.workers)
        self.graph = megakernel_graph(self.cfg, self.batch, self.workers, cols=self.stages.cols)
        self.table = task_table(self.graph)
        self.smem_bytes = self.stages.smem_total + SMEM_ALIGN  # the allocator's alignment slack

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        c = self.cfg
        T, H, L, E, K, I, S = self.batch, c.hidden, c.latent, c.n_experts, c.top_k, c.expert_inter, c.shared_inter
        G = self.stages.router.groups
        bf16, f32, i32 = "bfloat16", "float32", "int32"
        return {
            "x": TensorSpec((T, H), bf16),
            "gamma_pre": TensorSpec((H,), bf16),
            "w_gate": TensorSpec((E, H), bf16),
            "bias": TensorSpec((E,), f32),
            "w_down": TensorSpec((L, H), bf16),
            "w_shared_gate_up": TensorSpec((2 * S, H), bf16),
            "w13": TensorSpec((E, 2 * I, L), bf16),
            "w2": TensorSpec((E, L, I), bf16),
            "gamma_latent": TensorSpec((L,), bf16),
            "w_up": TensorSpec((H, L), bf16),
            "w_shared_down": TensorSpec((H, S), bf16),
            "tasks": TensorSpec((self.workers, len(MEGA_STAGES), len(TASK_FIELDS)), i32),
            "counters": TensorSpec((len(MEGA_STAGES) + 1,), i32),
            "h": TensorSpec((T, H), bf16),
            "logits": TensorSpec((T, E), f32),
            "ids": TensorSpec((T, K), i32),
            "weights": TensorSpec((T, K), f32),
            "n_groups": TensorSpec((1,), i32),
            "group_expert": TensorSpec((G,), i32),
            "group_start": TensorSpec((G + 1,), i32),
            "sorted_slots": TensorSpec((T * K,), i32),
            "z": TensorSpec((T, L), bf16),
            "a_shared": TensorSpec((T, S), bf16),
            "act": TensorSpec((T * K, I), bf16),
            "o": TensorSpec((T * K, L), f32),
            "c": TensorSpec((T, L), bf16),
            "n": TensorSpec((T, L), bf16),
            "out": TensorSpec((T, H), bf16),
            "stamps": TensorSpec((self.workers, len(MEGA_STAGES), 2), "int64"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.workers, 1, 1), block=(THREADS, 1, 1), smem_bytes=self.smem_bytes,
                            cooperative=True)

    def host_params(self) -> dict:
        """The task table the workers read their items from (`task_table` of the stage graph)."""
        return {"tasks": self.table}

    def reference(self, *, x, gamma_pre, w_gate, bias, w_down, w_shared_gate_up, w13, w2, gamma_latent, w_up,
                  w_shared_down, compute_dtype=None, **_outputs):
        """The block's output (kernels.reference.moe_block) for these weights."""
        from types import SimpleNamespace

        from kernels import reference

        w = SimpleNamespace(gamma_pre=gamma_pre, w_gate=w_gate, bias=bias, w_down=w_down,
                            w_shared_gate_up=w_shared_gate_up, w13=w13, w2=w2, gamma_latent=gamma_latent,
                            w_up=w_up, w_shared_down=w_shared_down)
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        return {"out": reference.moe_block(x, w, self.cfg, **kwargs)}

    # -- device code ------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mX: cute.Tensor, mGammaPre: cute.Tensor, mWg: cute.Tensor, mBias: cute.Tensor,
                 mWd: cute.Tensor, mWsgu: cute.Tensor, mW13: cute.Tensor, mW2: cute.Tensor, mGammaLat: cute.Tensor,
                 mWup: cute.Tensor, mWsd: cute.Tensor, mTasks: cute.Tensor, mCounters: cute.Tensor,
                 mH: cute.Tensor, mLogits: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor,
                 mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor,
                 mZ: cute.Tensor, mAs: cute.Tensor, mAct: cute.Tensor, mO: cute.Tensor, mC: cute.Tensor,
                 mN: cute.Tensor, mOut: cute.Tensor, mStamps: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mGammaPre, mWg, mBias, mWd, mWsgu, mW13, mW2, mGammaLat, mWup, mWsd, mTasks, mCounters,
                    mH, mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mZ, mAs, mAct, mO,
                    mC, mN, mOut, mStamps).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mGammaPre: cute.Tensor, mWg: cute.Tensor, mBias: cute.Tensor,
               mWd: cute.Tensor, mWsgu: cute.Tensor, mW13: cute.Tensor, mW2: cute.Tensor, mGammaLat: cute.Tensor,
               mWup: cute.Tensor, mWsd: cute.Tensor, mTasks: cute.Tensor, mCounters: cute.Tensor,
               mH: cute.Tensor, mLogits: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor,
               mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor,
               mZ: cute.Tensor, mAs: cute.Tensor, mAct: cute.Tensor, mO: cute.Tensor, mC: cute.Tensor,
               mN: cute.Tensor, mOut: cute.Tensor, mStamps: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        worker, _, _ = cute.arch.block_idx()
        st = self.stages
        base = cutlass.memory.SmemAllocator().allocate(st.smem_total, byte_alignment=SMEM_ALIGN)
        _, bars = ring.smem_tensors(base, st.ring)
        bufs = (mX, mGammaPre, mWg, mBias, mWd, mWsgu, mW13, mW2, mGammaLat, mWup, mWsd, mH,
                (mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted), mZ, mAs, mAct, mO, mC, mN,
                mOut)
        ring.init(bars, st.ring, tidx)
        # the worker's ring items: its (lo, hi, step) of each ring stage, and where each stage's
        # items start in the ring's count (items are numbered across the ring stages in order)
        tab, starts = [], [cutlass.Int32(0)]
        for s in RING_STAGES:  # trace-time
            si = STAGE_INDEX[s]
            lo, hi, step = mTasks[worker, si, 0], mTasks[worker, si, 1], mTasks[worker, si, 2]
            tab.append((lo, hi, step))
            starts.append(starts[-1] + (hi - lo + step - 1) // step)
        rs = (base, tab, starts)  # the ring's shared tensors are made from base where used
        issued = cutlass.Int32(0)
        consumed = cutlass.Int32(0)
        for si, stage in enumerate(MEGA_STAGES):  # trace-time: the stages in order
            issued, consumed = self._stage(si, stage, worker, tidx, base + st.region_offset, mTasks, mCounters,
                                           bufs, mStamps, rs, issued, consumed)
        self._exit(mCounters, tidx)

    def _routing_smem(self, base) -> dict:
        """Trace-time: the routing's shared copy (`base`: the kernel's shared memory, a byte
        pointer), int32 arrays in `MegaStages.routing_words` order."""
        base = base + self.stages.routing_offset
        out, off = {}, 0
        for name, words in self.stages.routing_words.items():
            out[name] = cute.make_tensor(cute.recast_ptr(base + 4 * off, dtype=cutlass.Int32), cute.make_layout((words,)))
            off += words
        return out

    @cute.jit
    def _stage(self, si, stage, worker, tidx, region_base, mTasks, mCounters, bufs, mStamps, rs, issued, consumed):
        """Trace-time: this worker's items of `stage` (task-table entry si), if it has any; at
        MEGA_ROUTING_AT, first the wait on the routing and its copy, items or not. `rs` is the
        ring (its tensors and the worker's tables), `issued` and `consumed` its counts of items;
        returns the counts."""
        lo = mTasks[worker, si, 0]
        hi = mTasks[worker, si, 1]
        step = mTasks[worker, si, 2]
        if cutlass.const_expr(stage == MEGA_ROUTING_AT):
            issued = self._fill(rs, tidx, issued, consumed, False, bufs)
            self._waits(stage, si, worker, tidx, mTasks, mCounters)
            self._copy_routing(self._routing_smem(rs[0]), bufs, tidx)
        if lo < hi:  # CTA-uniform
            issued, consumed = self._run_stage(si, stage, worker, tidx, region_base, mTasks, mCounters, bufs,
                                               mStamps, rs, issued, consumed, lo, hi, step)
        return issued, consumed

    @cute.jit
    def _run_stage(self, si, stage, worker, tidx, region_base, mTasks, mCounters, bufs, mStamps, rs, issued,
                   consumed, lo, hi, step):
        """Trace-time: the waits of `stage` (done already at MEGA_ROUTING_AT), the worker's items
        range(lo, hi, step), each after a fill of the ring, then one signal of them all; the
        ring stages' items over their slots, the others over the op's shared memory with a CTA
        barrier after each. Returns the ring's counts."""
        routed = STAGE_INDEX[stage] >= STAGE_INDEX[MEGA_ROUTING_AT]  # the routing was waited for
        if cutlass.const_expr(stage != MEGA_ROUTING_AT):
            issued = self._fill(rs, tidx, issued, consumed, routed, bufs)
            self._waits(stage, si, worker, tidx, mTasks, mCounters)
        if tidx == 0:
            mStamps[worker, si, 0] = _globaltimer()
        region = _Region(region_base, self.stages.region_bytes)
        if cutlass.const_expr(stage in RING_STAGES):
            smem = {**self._ring_smem(stage, region, self._routing_smem(rs[0])), "items": (lo, hi, step)}
            self._load_acts(stage, smem, bufs, tidx)
            for item in cutlass.range(lo, hi, step, unroll=1):
                issued = self._fill(rs, tidx, issued, consumed, routed, bufs)
                slots, bars = ring.smem_tensors(rs[0], self.stages.ring)
                ring.wait(bars, self.stages.ring, consumed)
                self._item(stage, item, tidx, self._slot_smem(smem, slots, consumed), bufs)
                consumed = consumed + 1
        else:
            smem = self._plain_smem(stage, region)
            for item in cutlass.range(lo, hi, step, unroll=1):
                issued = self._fill(rs, tidx, issued, consumed, routed, bufs)
                self._item(stage, item, tidx, smem, bufs)
                cute.arch.sync_threads()  # the next item reuses this one's shared memory
        self._signal(mCounters, si, tidx, (hi - lo + step - 1) // step)
        if tidx == 0:
            mStamps[worker, si, 1] = _globaltimer()
        return issued, consumed

    def _slot_smem(self, smem, slots, j) -> dict:
        """Trace-time: a ring stage's shared memory for its ring item j: "w" the item's slot as
        16-byte vectors, "p" which partials buffer its reduction uses (j % 2)."""
        rp = self.stages.ring
        w = cute.make_tensor(ring.slot_ptr(slots, rp, j % rp.slots), cute.make_layout((rp.slot_bytes // 2,)))
        return {**smem, "w": cute.zipped_divide(w, (BF16_PER_VECTOR,)), "p": j % 2}

    # -- the ring ---------------------------------------------------------------------------
    @cute.jit
    def _fill(self, rs, tidx, issued, consumed, routed, bufs):
        """Thread 0 issues the ring items after `issued` up to `slots` past `consumed` (every
        item before `consumed` has been computed and a CTA barrier has followed it), the routed
        stages' items only where `routed` (trace-time: the routing was waited for); returns the
        new issued count (uniform: every thread computes it)."""
        _, tab, starts = rs
        limit = starts[len(RING_STAGES)] if routed else starts[RING_STAGES.index(ROUTED[0])]
        end = cutlass.min(consumed + self.stages.ring.slots, limit)
        if tidx == 0:
            for j in cutlass.range(issued, end, unroll=1):
                self._issue(j, rs, routed, bufs)
        return cutlass.max(issued, end)

    @cute.jit
    def _issue(self, j, rs, routed, bufs):
        """Thread 0: ring item j (of the worker's items across RING_STAGES) into slot j % slots."""
        base, tab, starts = rs
        slots, bars = ring.smem_tensors(base, self.stages.ring)
        rt = self._routing_smem(base)
        for k, s in enumerate(RING_STAGES):  # trace-time
            if cutlass.const_expr(routed or s not in ROUTED):
                if (starts[k] <= j) & (j < starts[k + 1]):
                    lo, _, step = tab[k]
                    self._issue_item(s, lo + (j - starts[k]) * step, j % self.stages.ring.slots, slots, bars, rt,
                                     bufs)

    @cute.jit
    def _issue_item(self, stage, item, slot, slots, bars, rt, bufs):
        """Thread 0: item `item` of ring stage `stage` into slot `slot` (the stage's `issue`)."""
        self.stages.ring_stages[stage].issue(item, ring.slot_ptr(slots, self.stages.ring, slot), bars, slot, rt,
                                             _named(bufs))

    @cute.jit
    def _copy_routing(self, rt, bufs, tidx):
        """Every thread: the routing (after the wait on select) into its shared copy, by plain
        loads, then a CTA barrier."""
        b = _named(bufs)
        T, K = self.batch, self.cfg.top_k
        G = self.stages.w13.groups
        srcs = (("n_groups", b["n_groups"], 1), ("group_expert", b["group_expert"], G),
                ("group_start", b["group_start"], G + 1), ("sorted_slots", b["sorted_slots"], T * K))
        for name, src, n in srcs:  # trace-time
            for q in cutlass.range_constexpr(ceil_div(n, THREADS)):
                i = tidx + q * THREADS
                if i < n:
                    rt[name][i] = src[i]
        cute.arch.sync_threads()

    # -- the stages' shared memory and activations ------------------------------------------
    def _plain_smem(self, stage, region) -> dict:
        """Trace-time: a stage outside the ring: its op's own layout over the region."""
        st = self.stages
        if stage in ("select",):
            return st.router.allocate_smem(region)
        if stage == "combine":
            return {}
        return getattr(st, stage).allocate_smem(region)

    def _ring_smem(self, stage, region, rt) -> dict:
        """Trace-time: a ring stage's tensors over the region (the stage's `region`), and "rt"
        the routing's shared copy."""
        return {**self.stages.ring_stages[stage].region(region), "rt": rt}

    @cute.jit
    def _load_acts(self, stage, smem, bufs, tidx):
        """Every thread, after the stage's waits: the stage's activations into its region (its
        `load`), then a CTA barrier."""
        self.stages.ring_stages[stage].load(smem, _named(bufs), tidx)
        cute.arch.sync_threads()

    # -- the items --------------------------------------------------------------------------
    @cute.jit
    def _item(self, stage, item, tidx, smem, bufs):
        """Trace-time: work item `item` of `stage`: a ring stage's over its slot `smem["w"]`
        (16-byte vectors of the item's weight rows) and its region (the stage's `item`,
        kernels/ops/stages/), else the op's tile over this stage's `smem`; `bufs` the kernel's
        buffers in BUFFERS order."""
        (mX, mGammaPre, mWg, mBias, mWd, mWsgu, mW13, mW2, mGammaLat, mWup, mWsd, mH, routing, mZ, mAs,
         mAct, mO, mC, mN, mOut) = bufs
        st = self.stages
        if cutlass.const_expr(stage == "norm_pre"):
            st.norm_pre.tile(item, tidx, smem, mX, mGammaPre, mH)
        elif cutlass.const_expr(stage == "select"):
            self._select(smem, routing, mBias, tidx)
        elif cutlass.const_expr(stage == "combine"):
            st.combine.item(item, tidx, smem, _named(bufs))
        elif cutlass.const_expr(stage == "norm_latent"):
            st.norm_latent.tile(item, tidx, smem, mC, mGammaLat, mN)
        else:
            st.ring_stages[stage].item(item, tidx, smem, _named(bufs))

    @cute.jit
    def _select(self, smem, routing, mBias, tidx):
        """The select stage's one item: the logits (after the wait on router_rows) and the bias
        into the router's phase-2 arrays by cp.async through L2, then the router's selection and
        grouping."""
        r = self.stages.router
        B, E = r.batch, r.n_experts
        v = r._phase2_views(smem["union"])
        r._stage_f32(((routing[0].iterator, v["logits"].iterator, B * E // 4, None),
                      (mBias.iterator, v["bias"].iterator, E // 4, None)), tidx)
        r._select_and_group(v["logits"], v["bias"], routing, v["mask"], v["start"], v["ids"], v["sel"], tidx,
                            v["thresh"])

    # -- the protocol -----------------------------------------------------------------------
    def _deps(self, stage: str) -> tuple[str, ...]:
        """The stages whose counters `stage` waits for (MEGA_DEPS), before its items."""
        return MEGA_DEPS[stage]

    @cute.jit
    def _waits(self, stage, si, worker, tidx, mTasks, mCounters):
        """Trace-time: the waits of `stage`, one per stage it depends on."""
        for dep in self._deps(stage):
            d = STAGE_INDEX[dep]
            self._wait(mCounters, d, mTasks[worker, d, 3], tidx, si)

    @cute.jit
    def _wait(self, mCounters, c, target, tidx, stage_index):
        """Until counters[c] >= target: thread 0 spins (ld.acquire.gpu), a CTA barrier, then every
        thread's own acquire load of the counter, which orders its later loads. With `watchdog`
        thread 0 gives up after WATCHDOG_POLLS polls; a thread whose own load then finds the
        counter short of its target traps (thread 0 first prints the stage and the counter).
        The trap is decided by the counter itself, a declared sync word, and at no thread
        index, so no barrier below it is reached by only some threads."""
        i32 = cutlass.Int32
        ptr = mCounters.iterator + c
        if tidx == 0:
            seen = cute.arch.load(ptr, i32, sem="acquire", scope="gpu")
            if cutlass.const_expr(self.watchdog):
                polls = i32(0)
                while (seen < target) & (polls < i32(WATCHDOG_POLLS)):
                    seen = cute.arch.load(ptr, i32, sem="acquire", scope="gpu")
                    polls = polls + i32(1)
            else:
                while seen < target:
                    seen = cute.arch.load(ptr, i32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()
        mine = cute.arch.load(ptr, i32, sem="acquire", scope="gpu")
        if cutlass.const_expr(self.watchdog):
            if mine < target:
                if tidx == 0:
                    cute.printf("megakernel watchdog: stage %d waits on counter %d: %d of %d\n",
                                i32(stage_index), c, mine, target)
                _trap()

    @cute.jit
    def _signal(self, mCounters, si, tidx, count):
        """After the worker's `count` items of stage si: a CTA barrier (their writes, and their
        reads of shared memory, are done), then thread 0 adds `count` to the stage's counter
        with release semantics."""
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.red(mCounters.iterator + si, cutlass.Int32(count), op="add", dtype="s32", sem="release",
                          scope="gpu")

    @cute.jit
    def _exit(self, mCounters, tidx):
        """The worker is done: thread 0 adds 1 to the exit count (acq_rel); the last worker,
        after which no wait reads a counter this launch, resets every counter to 0."""
        i32 = cutlass.Int32
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(mCounters.iterator + EXIT_COUNTER, i32(1), sem="acq_rel", scope="gpu")
            if old == i32(self.workers - 1):
                for c in cutlass.range_constexpr(EXIT_COUNTER + 1):
                    cute.arch.store(mCounters.iterator + c, i32(0), sem="release", scope="gpu")


def _named(bufs) -> dict:
    """The kernel's buffers (BUFFERS order) by name, the router's outputs (ROUTING) among them."""
    b = dict(zip(BUFFERS, bufs))
    b.update(zip(ROUTING, b.pop("routing")))
    return b


def _globaltimer():
    """Trace-time: the GPU's global nanosecond timer (PTX %globaltimer), an Int64."""
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return cutlass.Int64(llvm.inline_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", has_side_effects=True))


def _trap():
    """Trace-time: PTX `trap` (the launch fails with an illegal-instruction error)."""
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True)
