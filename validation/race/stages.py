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
