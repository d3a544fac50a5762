"""The task-graph model checker: the block's decode graph is clean under random and exhaustive
interleavings, and each planted defect (a missing wait, a signal before the writes it covers, a
wait that needs too much, a schedule that cannot make progress) is found."""

from __future__ import annotations

import dataclasses

import pytest

from kernels.config import get_config
from kernels.taskgraph import Task, TaskGraph, TaskGraphError, latent_moe_graph
from validation.modelcheck import check_graph, static_problems


def _graph(batch=1, workers=2, row_items=2, slots=2):
    return latent_moe_graph(get_config("tiny"), batch, workers=workers, row_items=row_items, expert_slots=slots)


def _edit(g: TaskGraph, stage: str, item: int, fn, **kw) -> TaskGraph:
    tasks = [dataclasses.replace(t, ops=tuple(fn(list(t.ops)))) if (t.stage, t.item) == (stage, item) else t
             for t in g.tasks]
    return TaskGraph(buffers=g.buffers, counters=g.counters, tasks=tasks, workers=kw.get("workers", g.workers),
                     schedule=kw.get("schedule", g.schedule))


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_block_graph_is_clean_random(batch):
    r = check_graph(_graph(batch, workers=3), runs=60, seed=batch)
    assert r.passed, r.summary()
    assert r.states > 0


@pytest.mark.parametrize("workers,row_items,delay", [(2, 1, True), (3, 1, True), (2, 2, False)])
def test_block_graph_is_clean_exhaustive(workers, row_items, delay):
    r = check_graph(_graph(1, workers=workers, row_items=row_items), exhaustive=True, delay=delay,
                    max_states=20_000)
    assert r.passed and r.complete, r.summary()


def test_missing_wait_is_an_unordered_read():
    bad = _edit(_graph(), "w13", 0, lambda ops: [o for o in ops if o[:2] != ("wait", "z_ready")])
    r = check_graph(bad, runs=100)
    kinds = {f.kind for f in r.findings}
    assert "uncovered-read" in kinds  # the declaration: nothing covers z
    assert "unordered-read" in kinds, r.summary()  # and a replay reads z before its write
    assert any("w13[0] reads z" in f.message for f in r.findings)


def test_missing_wait_is_found_exhaustively_too():
    bad = _edit(_graph(row_items=1), "w13", 0, lambda ops: [o for o in ops if o[:2] != ("wait", "z_ready")])
    r = check_graph(bad, exhaustive=True, max_states=20_000)
    assert any(f.kind == "unordered-read" and "w13[0] reads z" in f.message for f in r.findings), r.summary()


def test_signal_before_the_writes_it_covers():
    def early(ops):
        sig = [o for o in ops if o[0] == "signal"]
        return [o for o in ops if o[0] != "signal"][:2] + sig + [o for o in ops if o[0] != "signal"][2:]

    bad = _edit(_graph(), "down", 0, early)
    r = check_graph(bad, runs=100)
    kinds = {f.kind for f in r.findings}
    assert "signal-before-write" in kinds
    assert "unordered-read" in kinds, r.summary()


def test_partial_target_orders_only_some_producers():
    def partial(ops):
        return [("wait", "logits_ready", 1) if o[:2] == ("wait", "logits_ready") else o for o in ops]

    r = check_graph(_edit(_graph(), "select", 0, partial), runs=200)
    assert any(f.kind == "unordered-read" and "select[0] reads logits" in f.message for f in r.findings), r.summary()


def test_wait_that_never_reaches_its_target():
    def too_much(ops):
        return [("wait", "h_ready", 2) if o[:2] == ("wait", "h_ready") else o for o in ops]

    r = check_graph(_edit(_graph(), "router", 0, too_much), runs=20)
    kinds = {f.kind for f in r.findings}
    assert "never-reaches-target" in kinds and "deadlock" in kinds, r.summary()


def test_static_schedule_with_consumer_before_producer_deadlocks():
    g = _graph(workers=1)
    order = list(range(len(g.tasks)))
    router, norm = g.stage_tasks("router")[0], g.stage_tasks("norm_pre")[0]
    order[router], order[norm] = order[norm], order[router]
    r = check_graph(TaskGraph(buffers=g.buffers, counters=g.counters, tasks=g.tasks, workers=1, schedule=[order]),
                    runs=5)
    kinds = {f.kind for f in r.findings}
    assert "cycle" in kinds and "deadlock" in kinds, r.summary()


def test_work_queue_with_too_few_workers_is_not_resident():
    g = _graph(workers=1)
    # consumers first in the queue: the one worker takes router[0], which waits for norm_pre
    tasks = [g.tasks[i] for i in g.stage_tasks("router")] + [t for t in g.tasks if t.stage != "router"]
    r = check_graph(TaskGraph(buffers=g.buffers, counters=g.counters, tasks=tasks, workers=1), runs=5)
    dl = [f for f in r.findings if f.kind == "deadlock"]
    assert dl and "not resident" in dl[0].message, r.summary()


def test_malformed_graphs_are_refused():
    g = _graph()
    with pytest.raises(TaskGraphError, match="unknown buffer"):
        TaskGraph(buffers=g.buffers, counters=g.counters,
                  tasks=[Task("s", 0, (("read", "nope", 0, 1),))], workers=1)
    with pytest.raises(TaskGraphError, match="outside"):
        TaskGraph(buffers=g.buffers, counters=g.counters,
                  tasks=[Task("s", 0, (("read", "x", 0, 10 ** 9),))], workers=1)
    with pytest.raises(TaskGraphError, match="every task exactly once"):
        TaskGraph(buffers=g.buffers, counters=g.counters, tasks=g.tasks, workers=1, schedule=[[0]])


def test_clean_graph_has_no_static_problems():
    assert static_problems(_graph(4, row_items=3, slots=5)) == []


def test_a_wait_orders_the_later_tasks_of_its_worker_under_a_static_schedule():
    """A worker that waits once and then runs several tasks orders all of their reads (the
    megakernel waits once per stage); with a work counter the later task may run anywhere, so
    its read is uncovered."""
    from kernels.taskgraph import Counter

    def graph(schedule):
        tasks = [Task("p", 0, (("write", "a", 0, 4), ("signal", "a_ready"))),
                 Task("c", 0, (("wait", "a_ready", 1), ("read", "a", 0, 2), ("write", "b", 0, 2))),
                 Task("c", 1, (("read", "a", 2, 4), ("write", "b", 2, 4)))]
        return TaskGraph(buffers={"a": 4, "b": 4}, counters={"a_ready": Counter("a_ready", (("a", 0, 4),))},
                         tasks=tasks, workers=2, schedule=schedule, stages=["p", "c"])

    assert check_graph(graph([[0], [1, 2]]), runs=40).passed
    r = check_graph(graph(None), runs=40)
    assert any(f.kind == "uncovered-read" and "c[1] reads a" in f.message for f in r.findings), r.summary()


def _claims_graph(claimed, wait_in_each=True):
    """p (static: two tasks write a) -> q (four tasks read a, write b) -> r (static: reads b),
    on two workers listed p0 q0 q1 r0 / p1 q2 q3. Without `wait_in_each`, only the first q task
    of each worker's list waits for a, as a static stage's may (a worker waits once per stage)."""
    from kernels.taskgraph import Counter

    tasks = [Task("p", i, (("write", "a", 2 * i, 2 * i + 2), ("signal", "a_ready"))) for i in range(2)]
    for i in range(4):
        wait = (("wait", "a_ready", 2),) if wait_in_each or i in (0, 2) else ()
        tasks.append(Task("q", i, wait + (("read", "a", 0, 4), ("write", "b", i, i + 1), ("signal", "b_ready"))))
    tasks.append(Task("r", 0, (("wait", "b_ready", 4), ("read", "b", 0, 4), ("write", "c", 0, 1))))
    counters = {"a_ready": Counter("a_ready", (("a", 0, 4),)), "b_ready": Counter("b_ready", (("b", 0, 4),))}
    return TaskGraph(buffers={"a": 4, "b": 4, "c": 1}, counters=counters, tasks=tasks, workers=2,
                     schedule=[[0, 2, 3, 6], [1, 4, 5]], stages=["p", "q", "r"], claimed=claimed)


def test_a_claimed_stage_is_replayed_with_any_worker_claiming_its_tasks():
    """A claimed stage's tasks go to whichever worker claims them, so each must carry its own
    waits: a wait passed once per worker orders that worker's later tasks only if its list is
    fixed. The same graph is clean as a static schedule and dirty once the stage is claimed."""
    assert check_graph(_claims_graph(("q",)), exhaustive=True).passed
    static = check_graph(_claims_graph((), wait_in_each=False), exhaustive=True)
    assert static.passed and static.complete, static.summary()
    r = check_graph(_claims_graph(("q",), wait_in_each=False), exhaustive=True)
    assert r.complete
    kinds = {f.kind for f in r.findings if "reads a" in f.message}
    assert kinds == {"uncovered-read", "unordered-read"}, r.summary()


def test_a_claimed_stage_must_be_a_stage():
    with pytest.raises(TaskGraphError, match="claimed"):
        _claims_graph(("nope",))


def test_two_claimed_stages_in_a_row_are_claimed_in_stage_order():
    """p and q both claimed: every worker claims p's tasks, then q's (and the clean graph stays
    clean, exhaustively)."""
    g = _claims_graph(("p", "q"))
    r = check_graph(g, exhaustive=True)
    assert r.passed and r.complete, r.summary()
    from validation.modelcheck import _Replay

    assert _Replay(g, True).plans == [["p", "q", 6], ["p", "q"]]
