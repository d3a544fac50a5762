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
(the next free task to whoever is free).

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
