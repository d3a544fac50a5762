"""Which pipeline step of a loop each memory access touches: induction variables and the
constant offsets derived from them, for the per-step ordering rule (rules.py, MODEL.md).

For one loop, every register defined in it is, at the loop header, its own base: `(r, 0,
False)` stands for "r's value when this iteration began". Through the iteration a register's
form is `(base, c, scaled)`: its value is `base_hdr + c` (adds and subtracts of immediates,
moves, and adds of loop-invariant registers keep the form), or a product of that (`scaled`:
`mul`, `shl`, `mad`, `IMAD`, `LEA`; the step is fixed by `c` before the product, later
immediates are byte offsets inside the step). `and`/`rem` keep the form: a ring slot `s % N`
belongs to step `s`, and two steps closer than N hit distinct slots. Anything else (a load, a
shift right, a select) has no form. A register is an induction variable with increment `inc`
when its form on every back edge is `(r, inc, False)`, `inc != 0`. An access whose address has
the form `(iv, c, _)` touches step `floor(c / inc)` of the iteration: 0 the current one, 1 the
next. PTX counts steps on an index (`s += 1`, then scaled); ptxas strength-reduces the index
into the addresses themselves (`R4 += 0x100`), which is the same form with a byte increment, so
the rule reads both dialects alike: offsets modulo the loop's stride.

Before the loop, forms are relative to registers' current values (a redefinition kills forms
based on the register); `pre_forms` gives them so that a prologue's wait can be credited to the
loop's first step.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .cfg import CFG

_KEEP = ("mov", "cvta", "add", "sub", "and", "rem", "MOV", "IADD3", "IADD", "UIADD3", "UMOV",
         "LOP3", "IABS")
_SCALE = ("mul", "shl", "mad", "IMAD", "UIMAD", "SHF", "USHF", "IMUL", "LEA", "ULEA")


def _is_pred(r: str) -> bool:
    return r.startswith(("%p", "P", "UP", "!P", "!UP")) or r in ("PT", "RZ", "URZ")


@dataclass
class LoopSteps:
    header: int
    ivs: dict[str, int]  # induction register -> increment per iteration
    forms: dict[int, tuple]  # instr index -> (base, c, scaled) of its address (in the loop)
    pre_forms: dict[int, tuple]  # instr index outside the loop -> form relative to current values
    pre_kill: dict[int, tuple[str, ...]]  # instr index outside the loop -> registers it redefines
    # back-edge source block -> 1: the edge starts the next step, 0: it repeats this step (a
    # spin sharing the header), None: the induction variables disagree
    advance: dict[int, int | None] = None

    def step_of(self, idx: int) -> int | None:
        f = self.forms.get(idx)
        if f is None or f[0] not in self.ivs:
            return None
        return f[1] // self.ivs[f[0]]


def _transfer(ins: ir.Instr, get) -> tuple | None:
    """The form of the value `ins` defines, given `get(reg)` for its sources."""
    base = ins.opcode.split(".")[0]
    srcs = [r for r in ins.srcs if not _is_pred(r) and r != ins.guard]
    if ins.kind in (ir.LOAD, ir.ATOM) or base in ("ld", "ldu", "LDG", "LDS", "LD", "LDC", "ULDC", "S2R", "S2UR"):
        return None
    forms = [get(r) for r in srcs]
    known = [f for f in forms if f is not None]
    if len(known) != 1:
        return None
    f = known[0]
    if "imm_add" in ins.extra:
        return f if f[2] else (f[0], f[1] + ins.extra["imm_add"], False)
    if "scales" in ins.extra:
        scaled_src = [r for r, g in zip(srcs, forms) if g is not None][0]
        if scaled_src in ins.extra["scales"]:  # the addend: a product of invariants added to it
            return f
        return (f[0], f[1], True)
    if "MOV" in ins.opcode.split(".") or base in _KEEP:
        return f  # a copy, a slot of a ring (and/rem), or an invariant added to the form
    if base in _SCALE:
        return (f[0], f[1], True)
    return None


def _join(vals: list) -> tuple | None:
    first = vals[0]
    return first if all(v == first for v in vals[1:]) else None


def analyze_loop(cfg: CFG, lp) -> LoopSteps:
    """Two passes: every register the loop defines is a candidate base; then only the
    induction variables found are (so a form never mixes with a non-induction register's)."""
    body = lp.body
    defined = {d for b in body for k in range(cfg.blocks[b].start, cfg.blocks[b].end)
               for d in cfg.fn.instrs[k].dests}
    first = _pass(cfg, lp, defined)
    second = _pass(cfg, lp, set(first.ivs))
    if set(second.ivs) != set(first.ivs) or any(first.ivs[r] != i for r, i in second.ivs.items()):
        second.ivs = {r: i for r, i in second.ivs.items() if first.ivs.get(r) == i}
        second.advance = {t: None for t in second.advance}
    return second


def _pass(cfg: CFG, lp, bases: set[str]) -> LoopSteps:
    fn = cfg.fn
    body = lp.body
    defined = bases
    fresh = {r: (r, 0, False) for r in bases}
    out: dict[int, dict] = {}
    forms: dict[int, tuple] = {}
    pre_forms: dict[int, tuple] = {}
    pre_kill: dict[int, tuple[str, ...]] = {}

    def state_in(b: int) -> dict:
        if b == lp.header:
            return dict(fresh)
        inside = b in body
        preds = [p for p in cfg.blocks[b].preds if p in out and (p in body) == inside]
        if not preds:
            return {}
        keys = set().union(*(out[p] for p in preds))
        st = {}
        for r in keys:
            # outside the loop a register absent from a state is itself (identity)
            ident = (r, 0, False) if r in bases else None
            v = _join([out[p].get(r, None if inside else ident) for p in preds])
            if inside or v != ident:
                st[r] = v
        return st

    def run(b: int, record: bool) -> dict:
        st = state_in(b)
        inside = b in body
        blk = cfg.blocks[b]
        for k in range(blk.start, blk.end):
            ins = fn.instrs[k]

            def get(r, st=st, inside=inside):
                return st.get(r) if inside or r in st else ((r, 0, False) if r in bases else None)

            if record and (ins.addr_regs or ins.kind in ir.MEMORY_KINDS):
                af = {get(r) for r in ins.addr_regs if not _is_pred(r)} - {None}
                if len(af) == 1:
                    f = af.pop()
                    f = f if f[2] else (f[0], f[1] + ins.extra.get("addr_imm", 0), False)
                    (forms if inside else pre_forms)[k] = f
            val = _transfer(ins, get) if ins.dests else None
            if record and not inside and ins.dests:
                pre_kill[k] = tuple(ins.dests)
            for d in ins.dests:
                if not inside:
                    # a redefinition outside the loop: forms based on the old value die
                    for r, f in list(st.items()):
                        if f is not None and f[0] == d:
                            st[r] = None
                    if d in bases:
                        st.pop(d, None)  # the new value is its own base again
                    else:
                        st[d] = val
                else:
                    st[d] = val
        return st

    changed, rounds = True, 0
    while changed and rounds < 50:
        changed, rounds = False, rounds + 1
        for b in cfg.rpo:
            st = run(b, False)
            if out.get(b) != st:
                out[b] = st
                changed = True
    for b in cfg.rpo:
        run(b, True)
    # An induction variable advances by the same increment on every back edge that advances
    # it; a back edge that leaves it unchanged repeats the step (ptxas may give a spin and the
    # loop around it one header).
    ivs: dict[str, int] = {}
    latches = [t for t, _ in lp.back_edges if t in out]
    for r in defined:
        fs = [out[t].get(r) for t in latches]
        if fs and all(f is not None and f[0] == r and not f[2] for f in fs):
            incs = {f[1] for f in fs} - {0}
            if len(incs) == 1:
                ivs[r] = incs.pop()
    advance: dict[int, int | None] = {}
    for t in latches:
        moved = {out[t][r][1] != 0 for r in ivs}
        advance[t] = (1 if moved == {True} else 0 if moved == {False} else None) if ivs else None
    return LoopSteps(lp.header, ivs, forms, pre_forms, pre_kill, advance)


def analyze(cfg: CFG, headers: set[int]) -> dict[int, LoopSteps]:
    """Per loop header in `headers`: its induction variables and the step of each access."""
    return {lp.header: analyze_loop(cfg, lp) for lp in cfg.loops if lp.header in headers}
