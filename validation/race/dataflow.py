"""Where each register's value comes from: a forward, flow-sensitive data-flow over the CFG.

Every register holds a set of provenance tags:
  ("param", i)  derived (through any arithmetic: cvta, add, mad, mul.wide, shifts, moves, ...)
                from kernel parameter i (`ld.param` in PTX, `c[0x0][..]` in SASS);
  "tid"         varies between threads of one CTA (tid, laneid, or loaded through such an address);
  "mem"         loaded from memory (its provenance beyond that is unknown).
The join is set union, so the answer is conservative: an address may derive from a parameter
whenever some path makes it so. An address whose tags hold no parameter has unknown provenance,
and the rules say so instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .cfg import CFG

TID = "tid"
MEM = "mem"
Prov = frozenset


def param_tag(i: int) -> tuple[str, int]:
    return ("param", i)


@dataclass
class Provenance:
    """Per-instruction results: address provenance of memory ops, guard provenance of branches."""

    addr: dict[int, frozenset]  # instr index -> tags of its address registers
    guard: dict[int, frozenset]  # instr index -> tags of its guard predicate
    dest: dict[int, frozenset]  # instr index -> tags of the value it defines

    def params_of_addr(self, index: int) -> set[int]:
        return {t[1] for t in self.addr.get(index, ()) if isinstance(t, tuple)}

    def guard_is_thread_varying(self, index: int) -> bool:
        return TID in self.guard.get(index, frozenset())


def _is_load_like(ins: ir.Instr) -> bool:
    op = ins.opcode.split(".")[0]
    return ins.kind in (ir.LOAD, ir.ATOM) or op in ("ld", "ldu", "LDS", "LDG", "LD", "LDL", "LDSM", "ATOMS", "ldmatrix")


def _transfer(ins: ir.Instr, state: dict, record: Provenance | None) -> None:
    src = set()
    for r in ins.srcs:
        src |= state.get(r, frozenset())
    for p in ins.params_read:
        src.add(param_tag(p))
    if ins.reads_tid:
        src.add(TID)
    if record is not None:
        if ins.addr_regs or ins.kind in ir.MEMORY_KINDS or ins.kind == ir.BULK_STORE:
            a = set()
            for r in ins.addr_regs:
                a |= state.get(r, frozenset())
            record.addr[ins.index] = frozenset(a)
        if ins.guard:
            record.guard[ins.index] = state.get(ins.guard, frozenset())
    if ins.params_read and ins.opcode.startswith(("ld.param", "LDC", "ULDC", "mov")):
        val = frozenset(src)
    elif _is_load_like(ins):
        addr = set()
        for r in ins.addr_regs:
            addr |= state.get(r, frozenset())
        val = frozenset({MEM} | ({TID} if TID in addr else set()))
        if ins.kind == ir.ATOM:
            val = val | {TID}  # each thread's RMW returns a different old value
    else:
        val = frozenset(src)
    if "param_exact" in ins.extra:  # an address known to be exactly this parameter's (sass.py)
        val = frozenset({param_tag(ins.extra["param_exact"])})
    if record is not None and ins.dests:
        record.dest[ins.index] = val
    # A predicated definition overwrites too: compilers read such a register under the same
    # predicate (keeping the old tags would mix in whatever the register held before).
    for d in ins.dests:
        state[d] = val


def analyze(cfg: CFG) -> Provenance:
    """Run the provenance analysis to a fixed point and record per-instruction tags."""
    fn = cfg.fn
    out: dict[int, dict] = {}
    changed = True
    rounds = 0
    while changed:
        changed = False
        rounds += 1
        for b in cfg.rpo:
            blk = cfg.blocks[b]
            state: dict = {}
            for p in blk.preds:
                if p in out:
                    for r, t in out[p].items():
                        state[r] = state.get(r, frozenset()) | t
            for k in range(blk.start, blk.end):
                _transfer(fn.instrs[k], state, None)
            if out.get(b) != state:
                out[b] = state
                changed = True
        if rounds > 200:  # the lattice is finite; this only guards against a bug
            raise RuntimeError("provenance analysis did not converge")
    rec = Provenance({}, {}, {})
    for b in cfg.rpo:
        blk = cfg.blocks[b]
        state = {}
        for p in blk.preds:
            if p in out:
                for r, t in out[p].items():
                    state[r] = state.get(r, frozenset()) | t
        for k in range(blk.start, blk.end):
            _transfer(fn.instrs[k], state, rec)
    return rec
