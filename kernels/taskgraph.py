"""The decode step as a task graph: stages, work items, the buffers each reads and writes, and the
counters between them. Data made on the host, the contract a persistent megakernel runs and that
the validator checks (validation/modelcheck.py replays it under interleavings; the static audit
checks the kernel's loads against it).

A task is one work item of one stage: an ordered list of operations

    ("wait",   counter, target)   spin (acquire) until `counter` holds at least `target`
    ("read",   buffer, lo, hi)    read elements [lo, hi) of `buffer`
    ("write",  buffer, lo, hi)    write elements [lo, hi)
    ("signal", counter)           add 1 to `counter` (release), after the writes it covers

Static weights are not listed: nothing writes them during a launch, so reading them needs no
order (and may be prefetched before a wait). Every counter declares what it covers: the buffer
regions whose writes its signals publish. A counter is zeroed before the launch and reaches
`expected` (its number of signals) by the end.

Workers are the persistent CTAs. `schedule` is either one static task list per worker (each
worker runs its list in order) or None: workers take tasks in graph order from a work counter
(the next free task to whoever is free). With a static schedule, the stages in `claimed` are
taken from a work counter of their own: a worker reaching such a stage in its list claims the
stage's next task until none is left, then goes on with its list (the schedule lists one
assignment of their tasks, which the model checker does not assume; each such task carries
its own waits).

Data-dependent work (the routed experts: which experts, how many tokens) is a fixed number of
expert slots, each a stage item that reads its expert id and token count from the router's
output, so the graph's shape depends on the batch and the configuration only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels.config import ModelConfig

OPS = ("wait", "read", "write", "signal")


class TaskGraphError(ValueError):
    """A malformed graph: an unknown buffer or counter, a bad range or operation."""


@dataclass(frozen=True)
class Counter:
    name: str
    covers: tuple[tuple[str, int, int], ...]  # (buffer, lo, hi) regions its signals publish
    expected: int = 0  # signals it receives in one launch (filled in by TaskGraph)


@dataclass(frozen=True)
class Task:
    stage: str
    item: int
    ops: tuple[tuple, ...]

    @property
    def name(self) -> str:
        return f"{self.stage}[{self.item}]"


@dataclass
class TaskGraph:
    buffers: dict[str, int]  # name -> elements
    counters: dict[str, Counter]
    tasks: list[Task]
    workers: int
    schedule: list[list[int]] | None = None  # per worker: task indices; None: a work counter
    stages: list[str] = field(default_factory=list)
    claimed: tuple[str, ...] = ()  # stages whose tasks are claimed from a work counter of their own

    def __post_init__(self) -> None:
        self.validate()
        counts = {c: 0 for c in self.counters}
        for t in self.tasks:
            for op in t.ops:
                if op[0] == "signal":
                    counts[op[1]] += 1
        self.counters = {n: Counter(c.name, c.covers, counts[n]) for n, c in self.counters.items()}
        if not self.stages:
            self.stages = list(dict.fromkeys(t.stage for t in self.tasks))
        unknown = [s for s in self.claimed if s not in self.stages]
        if unknown:
            raise TaskGraphError(f"claimed stages {unknown} are not stages of the graph")

    def validate(self) -> None:
        """Raise TaskGraphError naming the first malformed task, counter or schedule entry."""
        for name, c in self.counters.items():
            for buf, lo, hi in c.covers:
                self._range(f"counter {name}", buf, lo, hi)
        for t in self.tasks:
            for op in t.ops:
                if not op or op[0] not in OPS:
                    raise TaskGraphError(f"{t.name}: unknown operation {op!r}")
                if op[0] in ("read", "write"):
                    self._range(t.name, *op[1:])
                elif op[1] not in self.counters:
                    raise TaskGraphError(f"{t.name}: unknown counter {op[1]!r}")
                elif op[0] == "wait" and (len(op) != 3 or not isinstance(op[2], int) or op[2] < 1):
                    raise TaskGraphError(f"{t.name}: a wait needs a target >= 1, got {op!r}")
        if self.workers < 1:
            raise TaskGraphError("a graph needs at least one worker")
        if self.schedule is not None:
            if len(self.schedule) != self.workers:
                raise TaskGraphError(f"schedule has {len(self.schedule)} lists for {self.workers} workers")
            flat = sorted(i for lst in self.schedule for i in lst)
            if flat != list(range(len(self.tasks))):
                raise TaskGraphError("the schedule must list every task exactly once")

    def _range(self, where: str, buf: str, lo: int, hi: int) -> None:
        if buf not in self.buffers:
            raise TaskGraphError(f"{where}: unknown buffer {buf!r}")
        if not (0 <= lo < hi <= self.buffers[buf]):
            raise TaskGraphError(f"{where}: range [{lo}, {hi}) outside {buf} ({self.buffers[buf]} elements)")

    def stage_tasks(self, stage: str) -> list[int]:
        return [i for i, t in enumerate(self.tasks) if t.stage == stage]


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of `parts` near-equal pieces of range(n) (no empty piece)."""
    parts = max(1, min(parts, n))
    step, extra = divmod(n, parts)
    out, lo = [], 0
    for p in range(parts):
        hi = lo + step + (1 if p < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def latent_moe_graph(cfg: ModelConfig, batch: int, *, workers: int = 8, row_items: int = 4,
                     expert_slots: int | None = None) -> TaskGraph:
    """The LatentMoE block's decode step (kernels/reference.py moe_block) as a task graph.

    Stages and what they read (activations only; weights are static):
      norm_pre      x -> h                         1 item
      router        h -> logits                    row_items items over the experts
      select        logits -> ids, weights, slots  1 item (top-k, grouping into expert slots)
      down          h -> z                         row_items items over the latent
      w13           z, slots -> act                expert_slots items (each reads its slot)
      w2            act, slots -> o                expert_slots items (fp32 outputs per pair)
      combine       o, weights -> c                row_items items over the latent (fixed k order)
      norm_latent   c -> n                         1 item
      shared_gu     h -> a_s                       row_items items
      out           x, n, a_s -> y                 row_items items over the hidden width
    One counter per stage boundary covers the producer stage's whole output; a consumer waits for
    every producer item (target = the producer's item count). Element counts are per token row
    times `batch`; ranges are split by rows of the output width.
    """
    T, H, L, E, K = batch, cfg.hidden, cfg.latent, cfg.n_experts, cfg.top_k
    slots = expert_slots if expert_slots is not None else min(E, T * K)
    bufs = {"x": T * H, "h": T * H, "logits": T * E, "route": T * K * 3 + 2 * slots,
            "z": T * L, "act": T * K * cfg.expert_inter, "o": T * K * L, "c": T * L, "n": T * L,
            "a_s": T * cfg.shared_inter, "y": T * H}
    counters = {
        "h_ready": Counter("h_ready", (("h", 0, bufs["h"]),)),
        "logits_ready": Counter("logits_ready", (("logits", 0, bufs["logits"]),)),
        "route_ready": Counter("route_ready", (("route", 0, bufs["route"]),)),
        "z_ready": Counter("z_ready", (("z", 0, bufs["z"]),)),
        "act_ready": Counter("act_ready", (("act", 0, bufs["act"]),)),
        "o_ready": Counter("o_ready", (("o", 0, bufs["o"]),)),
        "c_ready": Counter("c_ready", (("c", 0, bufs["c"]),)),
        "n_ready": Counter("n_ready", (("n", 0, bufs["n"]),)),
        "a_ready": Counter("a_ready", (("a_s", 0, bufs["a_s"]),)),
    }
    tasks: list[Task] = []

    def add(stage, ops):
        tasks.append(Task(stage, sum(1 for t in tasks if t.stage == stage), tuple(ops)))

    add("norm_pre", [("read", "x", 0, bufs["x"]), ("write", "h", 0, bufs["h"]), ("signal", "h_ready")])
    for lo, hi in _split(E, row_items):
        add("router", [("wait", "h_ready", 1), ("read", "h", 0, bufs["h"])]
            + [("write", "logits", t * E + lo, t * E + hi) for t in range(T)] + [("signal", "logits_ready")])
    n_router = len(_split(E, row_items))
    add("select", [("wait", "logits_ready", n_router), ("read", "logits", 0, bufs["logits"]),
                   ("write", "route", 0, bufs["route"]), ("signal", "route_ready")])
    for lo, hi in _split(L, row_items):
        add("down", [("wait", "h_ready", 1), ("read", "h", 0, bufs["h"])]
            + [("write", "z", t * L + lo, t * L + hi) for t in range(T)] + [("signal", "z_ready")])
    n_down = len(_split(L, row_items))
    act_per_slot = _split(bufs["act"], slots)
    for lo, hi in act_per_slot:
        add("w13", [("wait", "route_ready", 1), ("read", "route", 0, bufs["route"]),
                    ("wait", "z_ready", n_down), ("read", "z", 0, bufs["z"]),
                    ("write", "act", lo, hi), ("signal", "act_ready")])
    # Each w2 slot writes its experts' outputs o (fp32 scratch, one row per selected pair); the
    # combine c = sum_k w_k o_k is done per latent row block by items that wait for every slot.
    o_per_slot = _split(bufs["o"], slots)
    for (lo, hi), (olo, ohi) in zip(act_per_slot, o_per_slot):
        add("w2", [("wait", "act_ready", slots), ("read", "act", lo, hi), ("read", "route", 0, bufs["route"]),
                   ("write", "o", olo, ohi), ("signal", "o_ready")])
    combine_blocks = _split(L, row_items)
    for lo, hi in combine_blocks:
        add("combine", [("wait", "o_ready", slots), ("read", "o", 0, bufs["o"]), ("read", "route", 0, bufs["route"])]
            + [("write", "c", t * L + lo, t * L + hi) for t in range(T)] + [("signal", "c_ready")])
    add("norm_latent", [("wait", "c_ready", len(combine_blocks)), ("read", "c", 0, bufs["c"]),
                        ("write", "n", 0, bufs["n"]), ("signal", "n_ready")])
    S = cfg.shared_inter
    for lo, hi in _split(S, row_items):
        add("shared_gu", [("wait", "h_ready", 1), ("read", "h", 0, bufs["h"])]
            + [("write", "a_s", t * S + lo, t * S + hi) for t in range(T)] + [("signal", "a_ready")])
    n_gu = len(_split(S, row_items))
    for lo, hi in _split(H, row_items):
        add("out", [("read", "x", 0, bufs["x"]), ("wait", "n_ready", 1), ("read", "n", 0, bufs["n"]),
                    ("wait", "a_ready", n_gu), ("read", "a_s", 0, bufs["a_s"])]
            + [("write", "y", t * H + lo, t * H + hi) for t in range(T)])
    return TaskGraph(buffers=bufs, counters=counters, tasks=tasks, workers=workers)


# -- the megakernel's graph ---------------------------------------------------------------------
# The persistent megakernel (kernels/ops/megakernel.py) runs these stages in this order on every
# worker. Each stage's items are one op's tile-function work items; a worker waits for the
# completion counters of the stages in MEGA_DEPS (each for every item of that stage) before its
# first item of a stage, and after its last item of the stage signals its own counter once for
# each of its items (one red.add of their count, after a CTA barrier that follows their writes).
# At MEGA_ROUTING_AT every worker makes that stage's waits whether or not it has items there, and
# copies the routing into shared memory: from there on its ring may issue the routed experts'
# weights, whose addresses are the routing's (the graph puts those waits on the worker's first
# task at or after that stage). A static stage's items are fixed per worker (`mega_range`); a
# claimed stage's (MEGA_CLAIMED) are taken from a work counter, each worker claiming the next
# item whenever its ring has room, so a worker on a faster SM takes more (every worker runs the
# stage, with its waits, whether it gets items or not). Dependencies point only to earlier
# stages and a worker claims in stage order, so nothing waits on an item that no running
# worker holds: no deadlock with every worker resident (a cooperative launch).
MEGA_STAGES = ("norm_pre", "router_rows", "select", "down", "shared_gu", "w13", "w2", "combine", "norm_latent", "out")
MEGA_DEPS = {
    "norm_pre": (),
    "router_rows": ("norm_pre",),
    "select": ("router_rows",),
    "down": ("norm_pre",),
    "shared_gu": ("norm_pre", "select"),  # select: the routing, for the ring's routed weights
    "w13": ("select", "down"),
    "w2": ("w13",),  # the routing through w13's wait on select (release/acquire is cumulative)
    "combine": ("w2",),
    "norm_latent": ("combine",),
    "out": ("norm_latent", "shared_gu"),
}
MEGA_ROUTING_AT = "shared_gu"
# shared_gu and w13 are claimed: their static shares ended up to 20% apart (some SMs stream
# their 28 KiB items faster, and which ones changes per launch), and w2 waits for all of w13
# (docs/decisions.md); a worker that ends shared_gu late claims less of w13.
MEGA_CLAIMED = ("shared_gu", "w13")
# Stages whose items skip the worker of a one-item stage (stage -> that stage): select's worker
# runs the selection while the others stream down and shared_gu, so it takes none of theirs and
# reaches w13 with the rest (each worker's share of w13 is fixed, and w2 waits for all of it).
MEGA_SPARE = {"down": "select", "shared_gu": "select"}
# Output columns per item of the stages split by columns (the rest: one item per token row, or
# one item): the ops' plans give them (kernels.ops.megakernel.stage_cols).
MEGA_COL_STAGES = ("router_rows", "down", "shared_gu", "w13", "w2", "combine", "out")
# One task-table entry: the worker's items of the stage are range(lo, hi, step); `target` is the
# count the stage's completion counter reaches in a launch (its item count), what its
# consumers wait for.
TASK_FIELDS = ("lo", "hi", "step", "target")


def mega_counter(stage: str) -> str:
    return f"{stage}_done"


def megakernel_graph(cfg: ModelConfig, batch: int, workers: int = 132, *, cols: dict[str, int]) -> TaskGraph:
    """The task graph of exactly what the megakernel runs at `batch` on `workers` persistent
    CTAs: MEGA_STAGES with their items, the buffers each item reads and writes, one completion
    counter per stage (covering the stage's whole output), and the static per-worker schedule
    (`mega_range`). `cols` gives MEGA_COL_STAGES' output columns per item: the kernel's own plan
    (kernels.ops.megakernel.stage_cols, what MegakernelOp passes), or a smaller graph's for the
    model checker. The graph imports nothing of the kernel; the kernel imports the graph.

    The routed experts' items are (group u, column block) pairs for every possible group
    (G = min(batch * top_k, n_experts)); an item past the launch's n_groups does nothing. Their
    rows of act and o depend on the routing: the graph names the rows of the routing where
    every selected (token, k) pair is a group of its own (at batch 1 the only routing there is;
    past n_experts pairs, the positions split evenly). The combine's items, blocks of latent
    columns, read o for every (token, k) after the wait on w2."""
    T, H, L, E, K = batch, cfg.hidden, cfg.latent, cfg.n_experts, cfg.top_k
    I, S = cfg.expert_inter, cfg.shared_inter
    TK = T * K
    G = min(TK, E)
    widths = {"router_rows": E, "down": L, "shared_gu": S, "w13": I, "w2": L, "combine": L, "out": H}
    for st in MEGA_COL_STAGES:
        if st not in cols or cols[st] < 1 or widths[st] % cols[st]:
            raise TaskGraphError(f"megakernel: {st} needs a column count dividing {widths[st]}, got {cols.get(st)}")
    bufs = {"x": T * H, "h": T * H, "logits": T * E, "ids": TK, "weights": TK, "n_groups": 1,
            "group_expert": G, "group_start": G + 1, "sorted_slots": TK, "z": T * L, "a_shared": T * S,
            "act": TK * I, "o": TK * L, "c": T * L, "n": T * L, "out": T * H}
    outputs = {"norm_pre": ("h",), "router_rows": ("logits",),
               "select": ("ids", "weights", "n_groups", "group_expert", "group_start", "sorted_slots"),
               "down": ("z",), "shared_gu": ("a_shared",), "w13": ("act",), "w2": ("o",), "combine": ("c",),
               "norm_latent": ("n",), "out": ("out",)}
    counters = {mega_counter(s): Counter(mega_counter(s), tuple((b, 0, bufs[b]) for b in outputs[s]))
                for s in MEGA_STAGES}
    routing = [("read", b, 0, bufs[b]) for b in ("n_groups", "group_expert", "group_start", "sorted_slots")]
    positions = _split(TK, G)  # group u's sorted positions, nominally (see the docstring)
    items: dict[str, list[list[tuple]]] = {}

    def cols_of(buf, width, c0, n):  # one write per token row of columns [c0, c0 + n)
        return [("write", buf, t * width + c0, t * width + c0 + n) for t in range(T)]

    items["norm_pre"] = [[("read", "x", t * H, (t + 1) * H), ("write", "h", t * H, (t + 1) * H)] for t in range(T)]
    whole_h = ("read", "h", 0, bufs["h"])
    c = cols["router_rows"]
    items["router_rows"] = [[whole_h] + cols_of("logits", E, i * c, c) for i in range(E // c)]
    items["select"] = [[("read", "logits", 0, bufs["logits"])]
                       + [("write", b, 0, bufs[b]) for b in outputs["select"]]]
    c = cols["down"]
    items["down"] = [[whole_h] + cols_of("z", L, i * c, c) for i in range(L // c)]
    c = cols["shared_gu"]
    items["shared_gu"] = [[whole_h] + cols_of("a_shared", S, i * c, c) for i in range(S // c)]
    c = cols["w13"]
    items["w13"] = [routing + [("read", "z", 0, bufs["z"])]
                    + [("write", "act", p * I + cb * c, p * I + (cb + 1) * c) for p in range(*positions[u])]
                    for u in range(G) for cb in range(I // c)]
    c = cols["w2"]
    w2 = []
    for u in range(G):
        for rb in range(L // c):
            lo, hi = positions[u]
            ops = routing + [("read", "act", lo * I, hi * I)]
            ops += [("write", "o", p * L + rb * c, p * L + (rb + 1) * c) for p in range(lo, hi)]
            w2.append(ops)
    items["w2"] = w2
    c = cols["combine"]
    items["combine"] = [[("read", "weights", 0, TK)] + [("read", "o", p * L + i * c, p * L + (i + 1) * c)
                                                        for p in range(TK)] + cols_of("c", L, i * c, c)
                        for i in range(L // c)]
    items["norm_latent"] = [[("read", "c", t * L, (t + 1) * L), ("write", "n", t * L, (t + 1) * L)]
                            for t in range(T)]
    c = cols["out"]
    items["out"] = [[("read", "x", 0, bufs["x"]), ("read", "n", 0, bufs["n"]), ("read", "a_shared", 0, bufs["a_shared"])]
                    + cols_of("out", H, i * c, c) for i in range(H // c)]

    counts = {s: len(items[s]) for s in MEGA_STAGES}
    routing_waits = [("wait", mega_counter(d), counts[d]) for d in MEGA_DEPS[MEGA_ROUTING_AT]]
    at = MEGA_STAGES.index(MEGA_ROUTING_AT)
    tasks: list[Task] = []
    first: dict[str, int] = {}
    for s in MEGA_STAGES:
        first[s] = len(tasks)
        waits = [("wait", mega_counter(d), counts[d]) for d in MEGA_DEPS[s]]
        if s in MEGA_CLAIMED:  # whichever worker claims an item has waited, and signals after it
            head = routing_waits + waits if MEGA_STAGES.index(s) > at else waits
            tasks += [Task(s, i, tuple(head + items[s][i] + [("signal", mega_counter(s))])) for i in range(counts[s])]
            continue
        # item i's worker, and whether i is its first or last item of the stage (the waits go
        # before the first, the worker's signals, one per item, after the last)
        staged: list[Task | None] = [None] * counts[s]
        for w in range(workers):
            run = range(*mega_range(counts, s, w, workers))
            for i in run:
                head = waits if i == run[0] else []
                if i == run[0] and MEGA_STAGES.index(s) > at and not any(
                        mega_range(counts, p, w, workers)[0] < counts[p] for p in MEGA_STAGES[at:MEGA_STAGES.index(s)]):
                    head = routing_waits + head  # the worker's first task since the routing point
                tail = [("signal", mega_counter(s))] * len(run) if i == run[-1] else []
                staged[i] = Task(s, i, tuple(head + items[s][i] + tail))
        tasks += staged
    # the static stages' per-worker lists; a claimed stage's items in one assignment of the many
    # a launch may make (`mega_range`'s round-robin), each task with its own waits and signal
    # (the model checker replays the claims, not that assignment: TaskGraph.claimed)
    schedule = [[first[s] + i for s in MEGA_STAGES for i in range(*mega_range(counts, s, w, workers))]
                for w in range(workers)]
    return TaskGraph(buffers=bufs, counters=counters, tasks=tasks, workers=workers, schedule=schedule,
                     stages=list(MEGA_STAGES), claimed=MEGA_CLAIMED)


def mega_offsets(counts: dict[str, int], workers: int) -> dict[str, int]:
    """The worker that takes each stage's item 0: stage after stage, where the previous stage's
    items ended (round-robin across stages, so one-item and one-per-token stages do not all land
    on worker 0)."""
    off, out = 0, {}
    for s in MEGA_STAGES:
        out[s] = off % workers
        off += counts[s]
    return out


def mega_range(counts: dict[str, int], stage: str, worker: int, workers: int) -> tuple[int, int, int]:
    """(lo, hi, step): the items of `stage` that `worker` runs, range(lo, hi, step); item i goes
    to worker (offset + i) % workers (`mega_offsets`), except in the stages MEGA_SPARE spares a
    one-item stage's worker: their items go round-robin over the other workers. For a claimed
    stage (MEGA_CLAIMED), one assignment of its items (the model check replays it; a launch
    claims them)."""
    n = counts[stage]
    offsets = mega_offsets(counts, workers)
    spared = MEGA_SPARE.get(stage)
    if spared is None or workers < 2 or counts[spared] != 1:
        return (min((worker - offsets[stage]) % workers, n), n, workers)
    x = offsets[spared]  # the worker of the spared stage's one item
    if worker == x:
        return (n, n, workers - 1)
    rank = worker if worker < x else worker - 1
    return (min((rank - offsets[stage]) % (workers - 1), n), n, workers - 1)


def task_table(graph: TaskGraph) -> list[list[list[int]]]:
    """The int32 table the megakernel reads, [workers][len(stages)][len(TASK_FIELDS)]: per
    worker and stage, (lo, hi, step, target): a static stage's `mega_range`, a claimed stage's
    whole range (0, n, 1: the worker's claims are indices into it), with the stage's item count
    as target. Made from `graph` (a `megakernel_graph`) and checked against its schedule: a
    TaskGraphError says where they disagree."""
    if list(graph.stages) != list(MEGA_STAGES) or graph.schedule is None:
        raise TaskGraphError("task_table: not a megakernel graph (its stages or its static schedule differ)")
    counts = {s: len(graph.stage_tasks(s)) for s in MEGA_STAGES}
    firsts = {s: graph.stage_tasks(s)[0] for s in MEGA_STAGES}
    table = []
    for w in range(graph.workers):
        rows = [[*mega_range(counts, s, w, graph.workers), counts[s]] for s in MEGA_STAGES]
        listed = [firsts[s] + i for s, (lo, hi, step, _) in zip(MEGA_STAGES, rows) for i in range(lo, hi, step)]
        if listed != graph.schedule[w]:
            raise TaskGraphError(f"task_table: worker {w}'s entries do not give its scheduled tasks")
        table.append([[0, counts[s], 1, counts[s]] if s in MEGA_CLAIMED else row
                      for s, row in zip(MEGA_STAGES, rows)])
    return table
