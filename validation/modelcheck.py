"""A CPU model checker for task graphs (kernels/taskgraph.py): replays the graph's tasks on its
workers under random and exhaustive interleavings, with counter increments delayed, and reports
every read that no wait orders after its write, and every deadlock.

Workers take their tasks as the graph's schedule says: a static list each, a work counter
(schedule None), or, in a static schedule, a work counter per claimed stage (`claimed`): a
worker reaching the stage claims its next task while one is left, so the replays try every
assignment of those tasks that the interleavings allow, not the one the schedule lists.

The memory model is release/acquire on counters, tracked with vector clocks:
  * a worker's operations are ordered by program order (one task after another);
  * a `signal` is a release: its increment carries the signalling worker's clock and becomes
    visible later (the checker chooses when: that is the delay);
  * a `wait` passes once the visible value reaches its target, and acquires every visible
    increment of that counter (a counter is added to by read-modify-writes, so reading a value
    synchronises with every increment before it);
  * a read of a region that an earlier stage writes must happen after that write (its clock is
    below the reader's); a write over a region that an earlier stage reads must happen after that
    read. Anything else is a race, whatever value the hardware happened to return.

Deadlocks are reported with the waits that cannot pass: a cycle, a counter that never reaches
its target (fewer signals than the target), or a wait whose producers sit behind it on a worker
or in the work queue with no worker free to take them (not resident).

Besides the replays, `static_problems` checks the graph's own declarations: every read of
another stage's output follows a wait on a counter that covers it, and every signal follows the
writes its counter covers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kernels.taskgraph import TaskGraph


@dataclass(frozen=True)
class Finding:
    kind: str  # "unordered-read", "unordered-overwrite", "deadlock", "never-reaches-target",
    #            "cycle", "uncovered-read", "signal-before-write", "overlapping-writes"
    message: str


@dataclass
class CheckResult:
    findings: list[Finding]
    runs: int
    states: int
    exhaustive: bool
    complete: bool  # False when the exhaustive search hit its state bound

    @property
    def passed(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        how = ("exhaustive" + ("" if self.complete else ", bound reached")) if self.exhaustive else "random"
        return (f"{len(self.findings)} finding(s) over {self.runs} run(s), {self.states} state(s) ({how})"
                + "".join(f"\n  {f.kind}: {f.message}" for f in self.findings[:20]))


def _overlap(a_lo, a_hi, b_lo, b_hi) -> bool:
    return a_lo < b_hi and b_lo < a_hi


class _Deps:
    """Per read and write operation, the operations of other stages it must be ordered after."""

    def __init__(self, g: TaskGraph):
        order = {s: i for i, s in enumerate(g.stages)}
        writes, reads = [], []
        for ti, t in enumerate(g.tasks):
            for oi, op in enumerate(t.ops):
                if op[0] == "write":
                    writes.append((ti, oi, op[1], op[2], op[3]))
                elif op[0] == "read":
                    reads.append((ti, oi, op[1], op[2], op[3]))
        self.producers: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.readers: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for ti, oi, b, lo, hi in reads:
            st = order[g.tasks[ti].stage]
            self.producers[(ti, oi)] = [(tj, oj) for tj, oj, b2, lo2, hi2 in writes
                                        if b2 == b and order[g.tasks[tj].stage] < st and _overlap(lo, hi, lo2, hi2)]
        for ti, oi, b, lo, hi in writes:
            st = order[g.tasks[ti].stage]
            self.readers[(ti, oi)] = [(tj, oj) for tj, oj, b2, lo2, hi2 in reads
                                      if b2 == b and order[g.tasks[tj].stage] < st and _overlap(lo, hi, lo2, hi2)]


def static_problems(g: TaskGraph) -> list[Finding]:
    """What the graph's declarations get wrong, found without replaying it."""
    out: list[Finding] = []
    deps = _Deps(g)
    signals = {c: 0 for c in g.counters}
    for t in g.tasks:
        for op in t.ops:
            if op[0] == "signal":
                signals[op[1]] += 1
    for t in g.tasks:
        for op in t.ops:
            if op[0] == "wait" and op[2] > signals[op[1]]:
                out.append(Finding("never-reaches-target",
                                   f"{t.name} waits for {op[1]} >= {op[2]}, but only {signals[op[1]]} task(s) signal it"))
    signallers: dict[str, list[int]] = {c: [] for c in g.counters}
    for i, t in enumerate(g.tasks):
        for op in t.ops:
            if op[0] == "signal":
                signallers[op[1]].append(i)
    prior = _prior_waits(g)
    for ti, t in enumerate(g.tasks):
        waited: list[tuple[str, int]] = list(prior.get(ti, ()))
        for oi, op in enumerate(t.ops):
            if op[0] == "wait":
                waited.append((op[1], op[2]))
            elif op[0] == "read" and deps.producers.get((ti, oi)):
                _, b, lo, hi = op
                known = _known_counters(g, waited, signals, signallers, prior)
                if not any(_covers(g.counters[c].covers, b, lo, hi) for c in known):
                    out.append(Finding("uncovered-read",
                                       f"{t.name} reads {b}[{lo}:{hi}), which another stage writes, "
                                       f"after no wait on a counter that covers it, directly or through its "
                                       f"producers' waits (waited: {[c for c, _ in waited] or 'none'})"))
            elif op[0] == "signal":
                # the writes of this task that the counter covers must all come before the signal
                later = [o for o in t.ops[oi + 1:] if o[0] == "write"
                         and any(c[0] == o[1] and _overlap(o[2], o[3], c[1], c[2]) for c in g.counters[op[1]].covers)]
                for o in later:
                    out.append(Finding("signal-before-write",
                                       f"{t.name} signals {op[1]} before its write of {o[1]}[{o[2]}:{o[3]}), "
                                       "which that counter covers"))
    by_stage: dict[str, list[tuple[str, str, int, int]]] = {}
    for t in g.tasks:
        for op in t.ops:
            if op[0] == "write":
                for other, b, lo, hi in by_stage.get(t.stage, []):
                    if other != t.name and b == op[1] and _overlap(lo, hi, op[2], op[3]):
                        out.append(Finding("overlapping-writes",
                                           f"{t.name} and {other} (one stage, unordered) both write {b}[{max(lo, op[2])}:{min(hi, op[3])})"))
                by_stage.setdefault(t.stage, []).append((t.name, op[1], op[2], op[3]))
    out += _cycles(g, signals)
    return out


def _prior_waits(g: TaskGraph) -> dict[int, list[tuple[str, int]]]:
    """Per task of a static schedule, the waits its worker passed in the tasks before it: a
    wait orders everything after it in program order, so a worker that waits once before a run
    of tasks orders all of them (the megakernel waits once per stage). Empty for a graph with a
    work counter, whose task order on a worker is not known; so, within a static schedule, are
    the tasks of a claimed stage (`g.claimed`): whichever worker claims one has passed only the
    task's own waits, and passing the schedule's listed ones orders nothing after them."""
    out: dict[int, list[tuple[str, int]]] = {}
    for lst in g.schedule or []:
        acc: list[tuple[str, int]] = []
        for ti in lst:
            if g.tasks[ti].stage in g.claimed:
                continue
            out[ti] = list(acc)
            acc += [(o[1], o[2]) for o in g.tasks[ti].ops if o[0] == "wait"]
    return out


def _known_counters(g: TaskGraph, waited, signals, signallers, prior=None) -> set[str]:
    """Counters whose covered writes are ordered before this point: the ones waited for, and,
    where a wait needs every signal of its counter, what its signallers waited for before
    signalling, in their own task or earlier on their worker (`prior`, `_prior_waits`):
    release/acquire is cumulative, so the order is transitive."""
    prior = prior or {}
    known: set[str] = set()
    todo = list(waited)
    while todo:
        c, target = todo.pop()
        if c in known:
            continue
        known.add(c)
        if target < signals[c]:
            continue  # only some signallers are known to be done
        for j in signallers[c]:
            ops = g.tasks[j].ops
            first_signal = next(i for i, o in enumerate(ops) if o[0] == "signal" and o[1] == c)
            todo += list(prior.get(j, ())) + [(o[1], o[2]) for o in ops[:first_signal] if o[0] == "wait"]
    return known


def _covers(covers, b, lo, hi) -> bool:
    """Whether the union of `covers` regions of buffer `b` contains [lo, hi)."""
    pos = lo
    for cb, clo, chi in sorted(c for c in covers if c[0] == b):
        if clo <= pos < chi:
            pos = chi
        if pos >= hi:
            return True
    return pos >= hi


def _cycles(g: TaskGraph, signals: dict[str, int]) -> list[Finding]:
    """A cycle of waits that need every signal of their counter, through program order too."""
    signallers: dict[str, list[int]] = {c: [] for c in g.counters}
    for i, t in enumerate(g.tasks):
        for op in t.ops:
            if op[0] == "signal":
                signallers[op[1]].append(i)
    edges: dict[int, set[int]] = {i: set() for i in range(len(g.tasks))}
    for i, t in enumerate(g.tasks):
        for op in t.ops:
            if op[0] == "wait" and op[2] >= signals[op[1]]:  # needs all of them
                edges[i].update(j for j in signallers[op[1]] if j != i)
            if op[0] == "wait" and i in signallers[op[1]] and op[2] >= signals[op[1]]:
                # waits for its own signal, which comes after or before the wait in its op list
                idx_wait = t.ops.index(op)
                if any(o[0] == "signal" and o[1] == op[1] for o in t.ops[idx_wait + 1:]):
                    return [Finding("cycle", f"{t.name} waits for all of {op[1]}, including its own later signal")]
    if g.schedule is not None:
        for lst in g.schedule:
            static = [t for t in lst if g.tasks[t].stage not in g.claimed]  # (claims: the replay's)
            for a, b in zip(static, static[1:]):
                edges[b].add(a)  # b cannot start before a ends
    colour = [0] * len(g.tasks)
    stack: list[int] = []

    def visit(u: int) -> list[int] | None:
        colour[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if colour[v] == 1:
                return stack[stack.index(v):] + [v]
            if colour[v] == 0:
                cyc = visit(v)
                if cyc:
                    return cyc
        stack.pop()
        colour[u] = 2
        return None

    for u in range(len(g.tasks)):
        if colour[u] == 0:
            cyc = visit(u)
            if cyc:
                names = " -> ".join(g.tasks[i].name for i in cyc)
                return [Finding("cycle", f"tasks that wait on each other (or run after each other on one worker): {names}")]
    return []


@dataclass
class _State:
    pos: list[int]  # per worker: index into its plan (static) or -1 idle (dynamic)
    op: list[int]  # per worker: next op of its current task
    task: list[int]  # per worker: current task (-1: none)
    next_task: int  # dynamic schedule: the work counter
    visible: dict[str, int]
    delivered: dict[str, list[dict[int, int]]]
    pending: list[tuple[str, dict[int, int]]]
    vc: list[dict[int, int]]
    events: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)  # (task, op) -> clock
    done: int = 0
    claims: dict[str, int] = field(default_factory=dict)  # claimed stage -> its next task's rank

    def key(self):
        return (tuple(self.pos), tuple(self.op), tuple(self.task), self.next_task,
                tuple(sorted(self.claims.items())),
                tuple(sorted(self.visible.items())),
                tuple(sorted((c, tuple(sorted(v.items()))) for c, v in self.pending)),
                tuple(tuple(sorted(v.items())) for v in self.vc),
                tuple(sorted((k, tuple(sorted(v.items()))) for k, v in self.events.items())))

    def copy(self) -> "_State":
        return _State(list(self.pos), list(self.op), list(self.task), self.next_task, dict(self.visible),
                      {c: list(v) for c, v in self.delivered.items()}, list(self.pending),
                      [dict(v) for v in self.vc], dict(self.events), self.done, dict(self.claims))


def _leq(a: dict[int, int], b: dict[int, int]) -> bool:
    return all(b.get(k, 0) >= v for k, v in a.items())


def _join(a: dict[int, int], b: dict[int, int]) -> None:
    for k, v in b.items():
        if a.get(k, 0) < v:
            a[k] = v


class _Replay:
    def __init__(self, g: TaskGraph, delay: bool):
        self.g, self.delay = g, delay
        self.deps = _Deps(g)
        self.findings: dict[tuple, Finding] = {}
        # a static schedule as each worker's plan: its tasks, with each claimed stage's run of them
        # replaced by one entry (the stage's name), at the stage's place in stage order whether
        # or not the listed assignment gave the worker any of its tasks
        self.plans: list[list[int | str]] = []
        self.claimable = {c: g.stage_tasks(c) for c in g.claimed}
        order = {st: i for i, st in enumerate(g.stages)}
        for lst in g.schedule or []:
            plan: list[int | str] = [t for t in lst if g.tasks[t].stage not in g.claimed]
            for c in g.claimed:
                at = next((i for i, e in enumerate(plan)
                           if order[e if isinstance(e, str) else g.tasks[e].stage] > order[c]), len(plan))
                plan.insert(at, c)
            self.plans.append(plan)

    def initial(self) -> _State:
        W = self.g.workers
        s = _State(pos=[0] * W, op=[0] * W, task=[-1] * W, next_task=0,
                   visible={c: 0 for c in self.g.counters}, delivered={c: [] for c in self.g.counters},
                   pending=[], vc=[{w: 0} for w in range(W)], claims={c: 0 for c in self.g.claimed})
        for w in range(W):
            self._claim(s, w)
        return s

    def _claim(self, s: _State, w: int) -> None:
        """Give worker `w` its next task (its plan's next entry, a claimed stage's next task
        while one is left, or the work counter's), or none."""
        if self.g.schedule is not None:
            plan = self.plans[w]
            s.task[w] = -1
            while s.pos[w] < len(plan):
                e = plan[s.pos[w]]
                if not isinstance(e, str):
                    s.task[w] = e
                    break
                if s.claims[e] < len(self.claimable[e]):
                    s.task[w] = self.claimable[e][s.claims[e]]
                    s.claims[e] += 1
                    break
                s.pos[w] += 1  # the stage has no task left: the worker's claims of it end
        elif s.next_task < len(self.g.tasks):
            s.task[w] = s.next_task
            s.next_task += 1
        else:
            s.task[w] = -1
        s.op[w] = 0

    def _blocked(self, s: _State, w: int) -> bool:
        t = s.task[w]
        if t < 0:
            return True
        op = self.g.tasks[t].ops[s.op[w]] if s.op[w] < len(self.g.tasks[t].ops) else None
        return op is not None and op[0] == "wait" and s.visible[op[1]] < op[2]

    def actions(self, s: _State) -> list[tuple[str, int]]:
        acts = [("run", w) for w in range(self.g.workers) if not self._blocked(s, w)]
        if self.delay:
            acts += [("deliver", i) for i in range(len(s.pending))]
        return acts

    def step(self, s: _State, act: tuple[str, int]) -> None:
        kind, arg = act
        if kind == "deliver":
            c, clock = s.pending.pop(arg)
            s.visible[c] += 1
            s.delivered[c].append(clock)
            return
        w = arg
        # run worker w's operations until its next wait that cannot pass, or its task's end (then it
        # takes its next task and stops there). Reads and writes between waits need no finer steps:
        # a race is a missing happens-before edge, which the clocks show whatever the timing.
        while True:
            t = s.task[w]
            if t < 0:
                return
            ops = self.g.tasks[t].ops
            if s.op[w] >= len(ops):
                s.done += 1
                if self.g.schedule is not None and not isinstance(self.plans[w][s.pos[w]], str):
                    s.pos[w] += 1  # (a claim entry stays: the worker claims again)
                self._claim(s, w)
                return  # a task boundary is a scheduling point: others may claim or run first
            op = ops[s.op[w]]
            vc = s.vc[w]
            if op[0] == "wait":
                if s.visible[op[1]] < op[2]:
                    return
                for clock in s.delivered[op[1]]:
                    _join(vc, clock)
            elif op[0] == "read":
                for p in self.deps.producers.get((t, s.op[w]), []):
                    wc = s.events.get(p)
                    if wc is None or not _leq(wc, vc):
                        self._race("unordered-read", t, s.op[w], p, "read", "written")
            elif op[0] == "write":
                for r in self.deps.readers.get((t, s.op[w]), []):
                    rc = s.events.get(r)
                    if rc is None or not _leq(rc, vc):
                        self._race("unordered-overwrite", t, s.op[w], r, "overwrite", "read")
            vc[w] = vc.get(w, 0) + 1
            if op[0] in ("read", "write"):
                s.events[(t, s.op[w])] = dict(vc)
            elif op[0] == "signal":
                inc = (op[1], dict(vc))
                if self.delay:
                    s.pending.append(inc)
                else:
                    s.visible[op[1]] += 1
                    s.delivered[op[1]].append(inc[1])
            s.op[w] += 1

    def _race(self, kind, t, oi, other, verb, other_verb) -> None:
        g = self.g
        op, oop = g.tasks[t].ops[oi], g.tasks[other[0]].ops[other[1]]
        key = (kind, t, oi, other)
        if key not in self.findings:
            self.findings[key] = Finding(
                kind, f"{g.tasks[t].name} {verb}s {op[1]}[{op[2]}:{op[3]}) with no wait ordering it after "
                      f"{g.tasks[other[0]].name}, which {other_verb} {oop[1]}[{oop[2]}:{oop[3]})")

    def deadlock(self, s: _State) -> Finding:
        g = self.g
        lines = []
        for w in range(g.workers):
            t = s.task[w]
            if t < 0:
                continue
            op = g.tasks[t].ops[s.op[w]]
            lines.append(f"worker {w} in {g.tasks[t].name} waits for {op[1]} >= {op[2]} (visible {s.visible[op[1]]})")
        unclaimed = ((len(g.tasks) - s.next_task) if g.schedule is None
                     else sum(len(v) - s.claims[c] for c, v in self.claimable.items()))
        why = f"; {unclaimed} task(s) still queued with no worker free to run them (not resident)" if unclaimed else ""
        return Finding("deadlock", f"no worker can go on after {s.done} of {len(g.tasks)} tasks: "
                                   + "; ".join(lines) + why)


def check_graph(g: TaskGraph, *, runs: int = 200, seed: int = 0, exhaustive: bool = False,
                delay: bool = True, max_states: int = 200_000) -> CheckResult:
    """Check `g`: its declarations (`static_problems`), then replays under interleavings.

    Random mode runs `runs` replays with choices drawn from `seed`. Exhaustive mode explores every
    interleaving of the workers' sync points and every delivery order of pending increments
    (`delay`), merging identical states, up to `max_states` states (`complete` says whether the
    bound was reached). Findings are deduplicated by the operations involved.
    """
    findings = static_problems(g)
    rep = _Replay(g, delay)
    deadlocks: dict[str, Finding] = {}
    states = 0
    complete = True
    if exhaustive:
        seen = set()
        stack = [rep.initial()]
        while stack:
            s = stack.pop()
            k = s.key()
            if k in seen:
                continue
            seen.add(k)
            states += 1
            if states > max_states:
                complete = False
                break
            acts = rep.actions(s)
            if not acts:
                if s.done < len(g.tasks):
                    f = rep.deadlock(s)
                    deadlocks.setdefault(f.message, f)
                continue
            for a in acts:
                n = s.copy()
                rep.step(n, a)
                stack.append(n)
        n_runs = 1
    else:
        rng = random.Random(seed)
        for _ in range(runs):
            s = rep.initial()
            while True:
                acts = rep.actions(s)
                if not acts:
                    break
                rep.step(s, rng.choice(acts))
                states += 1
            if s.done < len(g.tasks):
                f = rep.deadlock(s)
                deadlocks.setdefault(f.message, f)
        n_runs = runs
    findings += list(rep.findings.values()) + list(deadlocks.values())[:5]
    return CheckResult(findings, n_runs, states, exhaustive, complete)
