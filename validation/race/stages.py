"""Which buffers each stage of a staged persistent kernel touches, against its declaration.

A staged kernel (the manifest's `stages`, in order) reads its item ranges from a declared task
table (`points_to`) whose entries follow the stages' order, entry s at byte s * (stride /
stages) of each row (kernels/taskgraph.py TASK_FIELDS for the megakernel). An item index
derives from its stage's entry, so an access whose address derives from entry s's slots (the
provenance analysis tags it with them, dataflow.py) is an access of stage s. Such an access of
a buffer the stage does not declare (its `reads`, or for a write its `writes`) is
`stage-undeclared-access`: the task graph, which the model checker verifies, is made from the
same declarations, so an access outside them is one no wait was checked for.

Only what derives from an item index is attributed: an access at an address that no stage's
entry reaches (a whole buffer read by every item) is not judged here; the ordering rules still
judge it. Static weights and sync words are the kernel's own business and not judged either.
"""

from __future__ import annotations

from . import ir
from .dataflow import Provenance, slot_of
from .rules import RawFinding, Roles

JUDGED_ROLES = ("activation", "scratch")


def stage_access_findings(fn: ir.Function, prov: Provenance, roles: Roles, table: int, stride: int,
                          stages: list[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> list[RawFinding]:
    """`stages`: (name, reads, writes) in the task table's entry order; `table` the table
    parameter's index, `stride` its row bytes. Findings name the stage and the buffer."""
    if not stages or not stride or stride % len(stages):
        return []
    entry = stride // len(stages)
    out = []
    for ins in fn.instrs:
        if not (ins.kind in ir.MEMORY_KINDS or ins.kind == ir.BULK_STORE):
            continue
        tags = prov.params_of_addr(ins.index)
        owners = {slot_of(p)[1] // entry for p in tags if slot_of(p) and slot_of(p)[0] == table
                  and slot_of(p)[1] < stride}
        if len(owners) != 1:
            continue  # no stage's items, or several: not attributed
        name, reads, writes = stages[owners.pop()]
        for p in sorted(q for q in tags if slot_of(q) is None):
            if roles.by_index.get(p) not in JUDGED_ROLES:
                continue
            buf = roles.names.get(p, str(p))
            if ins.writes_memory and buf not in writes:
                out.append(RawFinding("stage-undeclared-access", ins,
                                      f"stage {name!r} writes {buf!r}, which its declaration does not list "
                                      f"(writes: {', '.join(writes) or 'none'})", (p,)))
            elif ins.kind in (ir.LOAD, ir.ATOM) and buf not in reads and buf not in writes:
                out.append(RawFinding("stage-undeclared-access", ins,
                                      f"stage {name!r} reads {buf!r}, which its declaration does not list "
                                      f"(reads: {', '.join(reads) or 'none'})", (p,)))
    return out


# -- waits against the declared producers ---------------------------------------------------
# A staged kernel that declares its stage counters (the manifest's `stage_counters`: word s of
# that `sync` parameter is stage s's completion counter) has its loads of every stage's output
# checked against the acquires of those words: the ordering rules prove that a load follows
# some acquire; this proves it follows the one that covers its producer, a wait on the
# producer's counter or on the counter of a stage that (through its declared reads) waits for
# the producer (release/acquire is cumulative). A wait missing behind another stage's wait is
# caught here; the ordering rules alone cannot tell the two waits apart.


def covering_stages(stages: list[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> dict[int, set[int]]:
    """Stage index P -> the stages whose completion orders P's writes: P itself and every stage
    that reads, directly or through the stages it reads from, a buffer P writes."""
    writer = {b: i for i, (_, _, writes) in enumerate(stages) for b in writes}
    deps = {i: {writer[b] for b in reads if b in writer and writer[b] != i} for i, (_, reads, _) in enumerate(stages)}
    closure: dict[int, set[int]] = {}

    def of(i: int, seen=()) -> set[int]:
        if i not in closure:
            out = set()
            for d in deps[i]:
                if d not in seen:
                    out |= {d} | of(d, seen + (i,))
            closure[i] = out
        return closure[i]

    return {p: {p} | {q for q in range(len(stages)) if p in of(q)} for p in range(len(stages))}


def _counter_word(ins: ir.Instr, prov: Provenance, counters: int) -> int | None:
    """The int32 word of parameter `counters` the access `ins` reads, where its address is that
    parameter plus one constant offset; else None."""
    tags = prov.addr.get(ins.index, ())
    if ("param", counters) not in tags:
        return None
    offs = {t[1] for t in tags if isinstance(t, tuple) and t[0] == "off"}
    if len(offs) > 1 or None in offs:
        return None
    off = (offs.pop() if offs else 0) + ins.extra.get("addr_imm", 0)
    return off // 4 if off % 4 == 0 else None


def stage_wait_findings(cfg, prov: Provenance, roles: Roles, counters: int,
                        stages: list[tuple[str, tuple[str, ...], tuple[str, ...]]]) -> list[RawFinding]:
    """PTX: every load of a buffer a stage writes (activation or scratch) that does not follow,
    on every path, an acquire of a covering stage's counter word by this thread, or by some
    thread followed by a CTA barrier: `load-before-producer-wait`."""
    from .rules import _forward, _replay, thread_dependent_blocks

    td = thread_dependent_blocks(cfg, prov)
    by_name = {n: i for i, n in roles.names.items()}
    writer = {by_name[b]: i for i, (_, _, writes) in enumerate(stages) for b in writes if b in by_name}
    cover = covering_stages(stages)

    def step(ins: ir.Instr, st: dict, emit) -> None:
        """`st`: "mine", the counter words this thread acquired on every path; "some", those
        some thread acquired (a CTA barrier makes them every thread's)."""
        if ins.kind in (ir.LOAD, ir.ATOM) and ins.sem in (ir.ACQUIRE, ir.ACQ_REL) and ins.cross_cta_scope:
            w = _counter_word(ins, prov, counters)
            if w is not None:
                thread_varying = cfg.block_of[ins.index] in td or (ins.guard and prov.guard_is_thread_varying(ins.index))
                key = "some" if thread_varying else "mine"
                st[key] = st[key] | {w}
                return
        if ins.kind == ir.BARRIER:
            st["mine"] = st["mine"] | st["some"]
            return
        if emit is not None and ins.kind == ir.LOAD:
            for p in sorted(prov.params_of_addr(ins.index)):
                if p not in writer or roles.by_index.get(p) not in JUDGED_ROLES:
                    continue
                need = cover[writer[p]]
                if not need & st["mine"]:
                    names = ", ".join(stages[q][0] for q in sorted(need))
                    emit(RawFinding("load-before-producer-wait", ins,
                                    f"load of {roles.names.get(p, p)!r} (written by stage {stages[writer[p]][0]!r}) "
                                    f"follows no acquire of the counter of {names}: no wait of this thread, or a "
                                    "barrier after another's, covers its producer", (p,)))

    def join(b: int, preds: list[tuple[int, dict]]) -> dict | None:
        """Must-sets: this thread's acquires on every path; some thread's on every path the
        whole CTA takes, joined with those of blocks only some threads run (a thread-varying
        branch's arm: its acquire was some thread's on the other arm too)."""
        if not preds:
            return None
        uniform = [st["some"] for p, st in preds if p not in td]
        some = frozenset.intersection(*uniform) if uniform else frozenset()
        some = some.union(*[st["some"] for p, st in preds if p in td])
        return {"mine": frozenset.intersection(*[st["mine"] for _, st in preds]), "some": some}

    empty = {"mine": frozenset(), "some": frozenset()}
    ins_state = _forward(cfg, empty, set(cfg.rpo), empty, set(), step, join)
    found: list[RawFinding] = []
    _replay(cfg, ins_state, step, found.append)
    return found
