"""The LatentMoE block in one persistent cooperative launch: the megakernel.

`workers` CTAs (one per H200 SM) of THREADS threads each run the stages of
kernels/taskgraph.py MEGA_STAGES in order:

    norm_pre     h = RMSNorm(x) * gamma_pre          rmsnorm's tile, an item per token
    router_rows  logits = h @ W_g.T (fp32)            the router's whole-row stream CTAs
    select       top-k, weights, grouping by expert   the router's phase 2 from logits in memory
    down         z = h @ W_down.T                     the router's W_down rows
    shared_gu    a_s = SiTU(h @ W_sgu.T)              shared_gate_up's tile
    w13          act = SiTU(z[token] @ W13_e.T)       moe_w13's stream tile, an item per (group, cols)
    w2           o, then c = sum_k w_k o_k            moe_w2's stream tile and its row-block combine
    norm_latent  n = RMSNorm(c) * gamma_latent        rmsnorm's tile
    out          out = x + n @ W_up.T + a_s @ W_sd.T  latent_out's tile

Each stage's items are the op's own tile function (the ops are built with THREADS threads and
no programmatic dependent launch); the chain (kernels/block.py) launches the same code one op
at a time. The schedule is data: `task_table` of the stage's graph (kernels/taskgraph.py
`megakernel_graph`, the one declaration of stages, items, buffers and counters), int32
[workers][stages][4] = (lo, hi, step, target), read by each worker at the start of each stage:
its items are range(lo, hi, step); `target` is the item count of the stage, what its completion
counter reaches.

The protocol, per worker and stage (`counters` holds one int32 per stage and an exit count):
  * wait, once, before the worker's first item of the stage, for each stage it depends on
    (MEGA_DEPS): thread 0 spins with ld.acquire.gpu until the counter reaches the producer's
    target, a CTA barrier, then every thread loads the counter with acquire itself, so each
    thread's later loads, those of all the worker's items of the stage, are ordered after the
    producers' writes. Activations are read only after it, and only by coherent paths (plain
    loads and cp.async; never ld.global.nc, which only static weights may use);
  * the items, a CTA barrier after each (the next item's copies overwrite shared memory);
  * signal, once, after the worker's last item: a CTA barrier (every thread's writes of the
    items done), then thread 0 adds the worker's item count with red.release.gpu. A consumer
    waits for a stage's whole item count, so signals per item would tell it nothing sooner;
    they cost a release and the next item's wait (two gpu-scope round trips) per item, and
    measured, batch 1 to 4, 1.5 to 2 times the step (docs/decisions.md);
  * w2's items also meet among themselves on moe_w2's row-block counters (the last item of a
    column block to arrive combines c): no item waits on them, and the worker's one signal
    after its last item covers the combines it made;
  * with `watchdog` 1 a wait that polls 2^24 times prints the stage and counter and traps, so a
    broken graph fails instead of hanging;
  * at exit each worker adds 1 to the exit count (acq_rel); the last resets every counter, so
    the next launch starts from zero (the host zeroes them once).
Shared memory is one region, laid out per stage (`_Region`): a stage's tensors overlap the
previous stage's, which the barrier of each signal separates.

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
from kernels.ops.parts.common import BF16_PER_VECTOR, cute, cutlass
from kernels.ops.rmsnorm import RMSNormOp
from kernels.ops.router import ROUTER_MAX_BATCH, RouterOp
from kernels.taskgraph import MEGA_DEPS, MEGA_STAGES, TASK_FIELDS, megakernel_graph, task_table

THREADS = 256
WORKERS = 132  # one CTA per H200 SM
WATCHDOG_POLLS = 1 << 24
SMEM_ALIGN = 1024
# Stages that can run prefetched (tunable `<stage>_prefetch_max_batch`: at batches up to it, 0
# never): each item's copies are issued before the previous item computes, so two items'
# copies are in flight.
PREFETCH_STAGES = ("w13",)
MAX_BATCH = ROUTER_MAX_BATCH  # the router's one-selector phase 2; past it the router stages need gemv tiles
STAGE_INDEX = {s: i for i, s in enumerate(MEGA_STAGES)}
EXIT_COUNTER = len(MEGA_STAGES)  # counters[EXIT_COUNTER]: workers that have finished
# the buffers a stage's item is given, in order ("routing": the router's seven outputs)
BUFFERS = ("x", "gamma_pre", "w_gate", "bias", "w_down", "w_shared_gate_up", "w13", "w2", "gamma_latent", "w_up",
           "w_shared_down", "w2_counters", "h", "routing", "z", "a_shared", "act", "o", "c", "n", "out")
ROUTING = ("logits", "ids", "weights", "n_groups", "group_expert", "group_start", "sorted_slots")
# Every tunable of the stages' ops, given here in full: the megakernel's design is declared by
# its own module and its manifest tunables (and a compile child has no manifest to read). The
# designs are sized for THREADS threads: the experts' and the router's stream designs; for
# shared_gu and out the mma designs at every batch (stream_max_batch 0). The stream design wants
# several short CTAs per SM in flight; with one worker per SM it read at a third of the rate the
# mma design does (the timeline at batch 1 against batch 2, docs/decisions.md).
SHARED_GU = {"warps_per_cta": THREADS // 32, "row_tiles": 2, "k_unroll": 8, "stream_max_batch": 0,
             "stream_rows": 1, "stream_threads": THREADS // 2}
EXPERTS = {"stream_slots": 1, "wg": 0, "wg_stages": 4, "wg_k": 128, "wg_n": 8}
LATENT_OUT = {"warps_per_cta": THREADS // 32, "row_tiles": 2, "k_unroll": 8, "stream_max_batch": 0,
              "stream_rows": 1, "stream_up_threads": 64, "stream_down_threads": THREADS - 64}


def shape_config(shape: dict) -> ModelConfig:
    """The model widths of a megakernel shape {"batch", "hidden", "latent", "n_experts",
    "top_k", "expert_inter", "shared_inter"} as a ModelConfig."""
    keys = ("hidden", "latent", "n_experts", "top_k", "expert_inter", "shared_inter")
    try:
        return ModelConfig(name="megakernel", **{k: int(shape[k]) for k in keys})
    except KeyError as e:
        raise ValueError(f"megakernel: shape needs batch and {', '.join(keys)}; missing {e}") from None


class MegaStages:
    """The ops whose tiles the stages run at one batch, each planned for THREADS threads and
    without programmatic dependent launch (host side; no DSL needed). `cols` gives the output
    columns per item of MEGA_COL_STAGES, for `megakernel_graph`."""

    def __init__(self, cfg: ModelConfig, batch: int, stream_cta_kib: int, prefetch: tuple[str, ...] = ()):
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"megakernel: batch {batch} outside 1..{MAX_BATCH} (past it the router's stages "
                             "need the gemv tiles, not yet a stage)")
        T, H, L, E, K, I, S = (batch, cfg.hidden, cfg.latent, cfg.n_experts, cfg.top_k, cfg.expert_inter,
                               cfg.shared_inter)
        stream = {"stream_threads": THREADS, "stream_cta_kib": stream_cta_kib, "pdl": 0}
        experts = {"batch": T, "n_experts": E, "latent": L, "expert_inter": I, "top_k": K}
        self.norm_pre = RMSNormOp({"batch": T, "width": H}, threads=THREADS)
        self.router = RouterOp({"batch": T, "n_experts": E, "hidden": H, "top_k": K, "latent": L},
                               **stream, poll_sleep=0)
        self.shared_gu = SharedGateUpOp({"batch": T, "hidden": H, "shared_inter": S}, **SHARED_GU)
        self.w13 = ExpertsUpOp(experts, **stream, **EXPERTS)
        self.w2 = ExpertsDownOp(experts, **stream, **EXPERTS)
        self.norm_latent = RMSNormOp({"batch": T, "width": L}, threads=THREADS)
        self.out = LatentOutOp({"batch": T, "hidden": H, "latent": L, "shared_inter": S}, **LATENT_OUT)
        for name in ("norm_pre", "router", "shared_gu", "w13", "w2", "norm_latent", "out"):
            op = getattr(self, name)
            if op.threads != THREADS:
                raise ValueError(f"megakernel: the {name} stage's op plans {op.threads} threads, not {THREADS}")
        self.cols = {"router_rows": self.router.rows_per_cta, "down": self.router.down_rows_per_cta,
                     "shared_gu": self.shared_gu.half_rows, "w13": self.w13.stream_cols,
                     "w2": self.w2.rows_per_cta, "out": self.out.rows_per_cta}
        # shared memory per stage, as each op lays it out (the router's for its three stages)
        self.smem = {"norm_pre": self.norm_pre.launch_config().smem_bytes,
                     "router_rows": self.router.smem_bytes, "select": self.router.smem_bytes,
                     "down": self.router.smem_bytes, "shared_gu": self.shared_gu.smem_bytes,
                     "w13": self.w13.smem_bytes, "w2": self.w2.smem_bytes,
                     "norm_latent": self.norm_latent.launch_config().smem_bytes, "out": self.out.smem_bytes}
        # a prefetching stage holds two items' shared memory: the next item's copies land in one
        # while the other's item computes
        unknown = set(prefetch) - set(PREFETCH_STAGES)
        if unknown:
            raise ValueError(f"megakernel: stages {sorted(unknown)} cannot prefetch (only {PREFETCH_STAGES})")
        self.prefetch = tuple(prefetch)
        for stage in self.prefetch:
            self.smem[stage] *= 2


def prefetched(tunables: dict, batch: int) -> tuple[str, ...]:
    """The stages that run prefetched at `batch` (`batch` <= their `<stage>_prefetch_max_batch`),
    in PREFETCH_STAGES order."""
    return tuple(s for s in PREFETCH_STAGES if batch <= int(tunables[f"{s}_prefetch_max_batch"]))


def stage_cols(cfg: ModelConfig, batch: int, stream_cta_kib: int | None = None) -> dict[str, int]:
    """Output columns per item of the column-split stages, as the megakernel plans them at
    `batch` (`stream_cta_kib` default: the manifest's)."""
    if stream_cta_kib is None:
        stream_cta_kib = int(op_tunables("megakernel", MegakernelOp.TUNABLES, {})["stream_cta_kib"])
    return MegaStages(cfg, batch, stream_cta_kib).cols


class _Region:
    """Trace-time: the allocator interface the ops' `allocate_smem` use (`allocate_tensor`),
    carving one stage's tensors from the shared region at `base` (a byte pointer) from offset 0,
    so every stage's layout overlaps the others' (the megakernel's shared memory is the largest
    stage's, not their sum). `used` is the bytes laid out so far."""

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
    tunables `stream_cta_kib` (the router's and the experts' stream CTAs), `watchdog` and, per
    stage of PREFETCH_STAGES, `<stage>_prefetch_max_batch`."""

    kernel_name = "megakernel"
    TUNABLES = ("stream_cta_kib", "watchdog", *(f"{s}_prefetch_max_batch" for s in PREFETCH_STAGES))

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
        self.stages = MegaStages(self.cfg, self.batch, int(self.tunables["stream_cta_kib"]),
                                 prefetched(self.tunables, self.batch))
        self.graph = megakernel_graph(self.cfg, self.batch, self.workers, cols=self.stages.cols)
        self.table = task_table(self.graph)
        self.region_bytes = -(-max(self.stages.smem.values()) // SMEM_ALIGN) * SMEM_ALIGN
        self.smem_bytes = self.region_bytes + SMEM_ALIGN  # the allocator's alignment slack

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        c = self.cfg
        T, H, L, E, K, I, S = self.batch, c.hidden, c.latent, c.n_experts, c.top_k, c.expert_inter, c.shared_inter
        r, w2 = self.stages.router, self.stages.w2
        G = r.groups
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
            "w2_counters": TensorSpec((w2.row_blocks,), i32),
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
                 mW2Counters: cute.Tensor, mH: cute.Tensor, mLogits: cute.Tensor, mIds: cute.Tensor,
                 mWeights: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor,
                 mSorted: cute.Tensor, mZ: cute.Tensor, mAs: cute.Tensor, mAct: cute.Tensor, mO: cute.Tensor,
                 mC: cute.Tensor, mN: cute.Tensor, mOut: cute.Tensor, mStamps: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mGammaPre, mWg, mBias, mWd, mWsgu, mW13, mW2, mGammaLat, mWup, mWsd, mTasks, mCounters,
                    mW2Counters, mH, mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mZ,
                    mAs, mAct, mO, mC, mN, mOut, mStamps).launch(grid=list(lc.grid), block=list(lc.block),
                                                        smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mGammaPre: cute.Tensor, mWg: cute.Tensor, mBias: cute.Tensor,
               mWd: cute.Tensor, mWsgu: cute.Tensor, mW13: cute.Tensor, mW2: cute.Tensor, mGammaLat: cute.Tensor,
               mWup: cute.Tensor, mWsd: cute.Tensor, mTasks: cute.Tensor, mCounters: cute.Tensor,
               mW2Counters: cute.Tensor, mH: cute.Tensor, mLogits: cute.Tensor, mIds: cute.Tensor,
               mWeights: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor,
               mSorted: cute.Tensor, mZ: cute.Tensor, mAs: cute.Tensor, mAct: cute.Tensor, mO: cute.Tensor,
               mC: cute.Tensor, mN: cute.Tensor, mOut: cute.Tensor, mStamps: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        worker, _, _ = cute.arch.block_idx()
        base = cutlass.memory.SmemAllocator().allocate(self.region_bytes, byte_alignment=SMEM_ALIGN)
        bufs = (mX, mGammaPre, mWg, mBias, mWd, mWsgu, mW13, mW2, mGammaLat, mWup, mWsd, mW2Counters, mH,
                (mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted), mZ, mAs, mAct, mO, mC, mN,
                mOut)
        for si, stage in enumerate(MEGA_STAGES):  # trace-time: the stages in order
            self._stage(si, stage, worker, tidx, base, mTasks, mCounters, bufs, mStamps)
        self._exit(mCounters, tidx)

    @cute.jit
    def _stage(self, si, stage, worker, tidx, base, mTasks, mCounters, bufs, mStamps):
        """Trace-time: this worker's items of `stage` (task-table entry si), if it has any."""
        lo = mTasks[worker, si, 0]
        hi = mTasks[worker, si, 1]
        step = mTasks[worker, si, 2]
        if lo < hi:  # CTA-uniform
            self._run_stage(si, stage, worker, tidx, base, mTasks, mCounters, bufs, lo, hi, step, mStamps)
            if tidx == 0:
                mStamps[worker, si, 1] = _globaltimer()

    @cute.jit
    def _run_stage(self, si, stage, worker, tidx, base, mTasks, mCounters, bufs, lo, hi, step, mStamps):
        """Trace-time: lay out the stage's shared memory, wait for the stages `stage` depends on
        (their targets from the task table), run the worker's items (a CTA barrier after each),
        then signal them all at once: the wait dominates every item's loads, which is what the
        static audit proves of a loop that waits before it and signals after it (w2's loop
        synchronizes on its row-block counters too: the audit carries the wait before it, on a
        counter of no item, into every iteration, and takes the signal after it as every
        iteration's publish)."""
        st = self.stages
        region = _Region(base, self.region_bytes)
        self._waits(stage, si, worker, tidx, mTasks, mCounters)
        if tidx == 0:
            mStamps[worker, si, 0] = _globaltimer()
        if cutlass.const_expr(stage in st.prefetch):
            self._run_prefetched(stage, tidx, region, bufs, lo, hi, step)
        else:
            op = st.router if stage in ("router_rows", "select", "down") else getattr(st, stage)
            smem = op.allocate_smem(region)
            for item in cutlass.range(lo, hi, step, unroll=1):
                self._item(stage, item, tidx, smem, bufs)
                cute.arch.sync_threads()  # the next item's copies overwrite this one's shared memory
        self._signal(mCounters, si, tidx, (hi - lo + step - 1) // step)

    @cute.jit
    def _waits(self, stage, si, worker, tidx, mTasks, mCounters):
        """Trace-time: the waits of `stage`, one per stage it depends on."""
        for dep in self._deps(stage):
            d = STAGE_INDEX[dep]
            self._wait(mCounters, d, mTasks[worker, d, 3], tidx, si)

    @cute.jit
    def _run_prefetched(self, stage, tidx, region, bufs, lo, hi, step):
        """The items of a stage that runs prefetched (`prefetched`), after the stage's waits: two
        item buffers (the op's `allocate_smem` twice); item k's copies (`_issue`: one commit
        group, empty for an item past n_groups) go into buffer k % 2, and only then does item
        k - 1 compute (`_finish`, waiting for all but the newest commit group), each followed by
        a CTA barrier (the next item's copies overwrite its buffer). The last item computes
        after the loop."""
        op = getattr(self.stages, stage)
        sm = (op.allocate_smem(region), op.allocate_smem(region))
        for item in cutlass.range(lo, hi, step, unroll=1):
            k = (item - lo) // step
            if k % 2 == 0:  # CTA-uniform
                self._issue(item, tidx, sm[0], bufs)
                if k > 0:
                    self._finish(item - step, tidx, sm[1], bufs, 1)
                    cute.arch.sync_threads()
            else:
                self._issue(item, tidx, sm[1], bufs)
                self._finish(item - step, tidx, sm[0], bufs, 1)
                cute.arch.sync_threads()
        last = lo + (hi - 1 - lo) // step * step
        if (last - lo) // step % 2 == 0:
            self._finish(last, tidx, sm[0], bufs, 0)
        else:
            self._finish(last, tidx, sm[1], bufs, 0)
        cute.arch.sync_threads()

    @cute.jit
    def _issue(self, item, tidx, smem, bufs):
        """w13's item `item`: its copies into `smem` (moe_w13's `up_issue`; none for a group past
        n_groups), one commit group."""
        b = _named(bufs)
        P = self.stages.w13.stream_plan
        u = item // self.stages.w13.col_blocks
        if u < b["n_groups"][0]:  # CTA-uniform
            self.stages.w13.up_issue(P, smem["w"], smem["x"], tidx // P.row_threads, tidx % P.row_threads, u,
                                     item % self.stages.w13.col_blocks, None, b["z"], b["w13"],
                                     b["group_expert"], b["group_start"], b["sorted_slots"])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _finish(self, item, tidx, smem, bufs, pending):
        """w13's item `item`: its compute over `smem` (moe_w13's `up_finish`; nothing for a group
        past n_groups), its copies waited for with `pending` newer commit groups left in flight."""
        b = _named(bufs)
        P = self.stages.w13.stream_plan
        blocks = self.stages.w13.col_blocks
        u = item // blocks
        if u < b["n_groups"][0]:  # CTA-uniform
            pos0 = b["group_start"][u]
            cnt = 1
            if cutlass.const_expr(self.batch > 1):
                cnt = b["group_start"][u + 1] - pos0
            self.stages.w13.up_finish(P, smem["w"], smem["x"], smem["partials"], tidx // P.row_threads,
                                      tidx % P.row_threads, tidx, pos0, cnt, item % blocks, b["z"],
                                      b["sorted_slots"], b["act"], pending)

    def _deps(self, stage: str) -> tuple[str, ...]:
        """The stages whose counters `stage` waits for (MEGA_DEPS), before its items."""
        return MEGA_DEPS[stage]

    @cute.jit
    def _item(self, stage, item, tidx, smem, bufs):
        """Trace-time: work item `item` of `stage`, the op's tile over this stage's `smem`;
        `bufs` the kernel's buffers in BUFFERS order."""
        (mX, mGammaPre, mWg, mBias, mWd, mWsgu, mW13, mW2, mGammaLat, mWup, mWsd, mW2Counters, mH, routing, mZ, mAs,
         mAct, mO, mC, mN, mOut) = bufs
        st = self.stages
        mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted = routing
        if cutlass.const_expr(stage == "norm_pre"):
            st.norm_pre.tile(item, tidx, smem, mX, mGammaPre, mH)
        elif cutlass.const_expr(stage == "router_rows"):
            vU = cute.zipped_divide(smem["union"], (BF16_PER_VECTOR,))
            st.router._stream_rows(st.router.plan, mWg, mH, mLogits, item, vU, smem["partials"], tidx)
        elif cutlass.const_expr(stage == "select"):
            self._select(smem, routing, mBias, tidx)
        elif cutlass.const_expr(stage == "down"):
            vU = cute.zipped_divide(smem["union"], (BF16_PER_VECTOR,))
            st.router._stream_rows(st.router.down_plan, mWd, mH, mZ, item, vU, smem["partials"], tidx)
        elif cutlass.const_expr(stage == "shared_gu"):
            st.shared_gu.tile(item, tidx, smem, mH, mWsgu, mAs)
        elif cutlass.const_expr(stage == "w13"):
            st.w13.tile(item, tidx, smem, mZ, mW13, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct)
        elif cutlass.const_expr(stage == "w2"):
            st.w2.tile(item, tidx, smem, mAct, mW2, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mO,
                       mW2Counters, mC)
        elif cutlass.const_expr(stage == "norm_latent"):
            st.norm_latent.tile(item, tidx, smem, mC, mGammaLat, mN)
        else:
            st.out.tile(item, tidx, smem, mX, mN, mWup, mAs, mWsd, mOut)

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
