"""Where each register's value comes from: a forward, flow-sensitive data-flow over the CFG.

Every register holds a set of provenance tags:
  ("param", i)  derived (through any arithmetic: cvta, add, mad, mul.wide, shifts, moves, ...)
                from kernel parameter i (`ld.param` in PTX, `c[0x0][..]` in SASS);
  "tid"         varies between threads of one CTA (tid, laneid, or loaded through such an address);
  "wide"        varies between the warps of a CTA too (or may: a value without it but with "tid"
                varies only between lanes: %laneid, elect.sync, tid & 31, tid % 32);
  "mem"         loaded from memory (its provenance beyond that is unknown);
  ("param", v)  with v >= SLOT_BASE: a pointer loaded from a declared slot of a task table
                (`Tables`), a buffer of its own with the role the declaration gives it.
The join is set union, so the answer is conservative: an address may derive from a parameter
whenever some path makes it so. An address whose tags hold no parameter has unknown provenance,
and the rules say so instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import ir
from .cfg import CFG

TID = "tid"
WIDE = "wide"
MEM = "mem"
Prov = frozenset
# Virtual buffer indices: a pointer loaded from memory is a buffer of its own. LOADED_PTR: loaded
# from anywhere the audit has no declaration for; SLOT_BASE + table * SLOT_SPAN + offset: loaded
# from byte `offset` (modulo the entry stride) of the entries of declared table parameter `table`.
LOADED_PTR = 99_999
SLOT_BASE = 100_000
SLOT_SPAN = 1 << 16
UNKNOWN_SLOT = SLOT_SPAN - 1


def slot_index(table: int, offset: int) -> int:
    return SLOT_BASE + table * SLOT_SPAN + offset


def slot_of(index: int) -> tuple[int, int] | None:
    """(table parameter, byte offset) of a virtual slot buffer, else None."""
    if index < SLOT_BASE:
        return None
    return (index - SLOT_BASE) // SLOT_SPAN, (index - SLOT_BASE) % SLOT_SPAN


def param_tag(i: int) -> tuple[str, int]:
    return ("param", i)


@dataclass
class Provenance:
    """Per-instruction results: address provenance of memory ops, guard provenance of branches."""

    addr: dict[int, frozenset]  # instr index -> tags of its address registers
    guard: dict[int, frozenset]  # instr index -> tags of its guard predicate
    dest: dict[int, frozenset]  # instr index -> tags of the value it defines

    def params_of_addr(self, index: int) -> set[int]:
        """Buffers the address may point into: parameters, declared table slots, and LOADED_PTR
        for an address loaded from memory the audit has no declaration for."""
        tags = self.addr.get(index, ())
        out = {t[1] for t in tags if isinstance(t, tuple) and t[0] == "param"}
        if not out and MEM in tags:
            out.add(LOADED_PTR)
        return out

    def guard_is_thread_varying(self, index: int) -> bool:
        return TID in self.guard.get(index, frozenset())

    def guard_is_lane_only(self, index: int) -> bool:
        """The guard varies between threads, but only between the lanes of one warp."""
        g = self.guard.get(index, frozenset())
        return TID in g and WIDE not in g


def _is_load_like(ins: ir.Instr) -> bool:
    op = ins.opcode.split(".")[0]
    return ins.kind in (ir.LOAD, ir.ATOM) or op in ("ld", "ldu", "LDS", "LDG", "LD", "LDL", "LDSM", "ATOMS", "ldmatrix")


_OFFSETS: dict = {}
_ABSORBED: dict = {}


def _offsets(tags) -> frozenset:
    """The offset tags of `tags` (memoized: the analysis asks for the same sets millions of
    times on a large kernel)."""
    key = tags if isinstance(tags, frozenset) else frozenset(tags)
    got = _OFFSETS.get(key)
    if got is None:
        got = _OFFSETS[key] = frozenset(t for t in key if isinstance(t, tuple) and t[0] == "off")
    return got


def _absorb(tags) -> frozenset:
    """Keep the offset tags a lattice of finite height: ("off", None), any offset, absorbs the
    others, and more than a few offsets, or a large one, is ("off", None) (a counter, not a slot
    offset). Without the absorption a widened register joined with a narrow one would shrink
    back on the next pass and the fixpoint would cycle. Memoized, a pure function of `tags`."""
    key = tags if isinstance(tags, frozenset) else frozenset(tags)
    got = _ABSORBED.get(key)
    if got is None:
        offs = _offsets(key)
        if ("off", None) in offs or len(offs) > 4 or any(abs(t[1]) > 1 << 20 for t in offs):
            got = (key - offs) | {("off", None)}
        else:
            got = key
        _ABSORBED[key] = got
    return got


# A register whose offsets at a block's entry differ from the previous pass's this many times
# is loop-carried with a moving offset (`p += 24` around a loop, a loop counter): its offset is
# widened to ("off", None) there, so each pass around the loop cannot mint a new tag. Two
# changes leave a pointer that walks a table by its stride (the same offset modulo the stride
# every pass) and a set that grows once as a loop's back edge joins in exact.
WIDEN_AFTER = 2


def _transfer(ins: ir.Instr, state: dict, record: Provenance | None, tables: dict | None = None) -> None:
    src = set()
    for r in ins.srcs:
        src |= state.get(r, frozenset())
    for p in ins.params_read:
        src.add(param_tag(p))
    if ins.reads_tid:
        src.add(TID)
        if not ins.extra.get("lane_src"):
            src.add(WIDE)
    if ins.extra.get("lane_src") and ins.opcode.startswith("elect"):
        src.add(TID)
    if ins.extra.get("lane_of") and TID in src:
        src.discard(WIDE)
    if tables:  # constant byte offsets of addresses, for the slots of declared task tables
        if "imm_add" in ins.extra:
            offs = {t for t in src if isinstance(t, tuple) and t[0] == "off"} or {("off", 0)}
            mod = tables.get("<period>") or None  # offsets matter modulo the entry strides
            src = (src - offs) | {("off", None if t[1] is None else
                                   (t[1] + ins.extra["imm_add"]) % mod if mod else t[1] + ins.extra["imm_add"])
                                  for t in offs}
        elif "scales" in ins.extra:  # a product: only the addend's offset survives
            keep = set().union(*(state.get(r, frozenset()) for r in ins.extra["scales"]))
            src = {t for t in src if not (isinstance(t, tuple) and t[0] == "off") or t in keep}
        src = set(_absorb(src))
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
        val = frozenset({MEM} | ({TID, WIDE} & addr))
        if ins.kind == ir.ATOM:
            val = val | {TID, WIDE}  # each thread's RMW returns a different old value
        elif tables and ins.kind == ir.LOAD and ins.dests:
            hit = [t[1] for t in addr if isinstance(t, tuple) and t[0] == "param" and t[1] in tables]
            if hit:  # a slot of a declared table: the pointer it holds is a buffer of its own
                stride = tables[hit[0]]
                offs = {t[1] for t in addr if isinstance(t, tuple) and t[0] == "off"} or {0}
                offs = {None if o is None else (o + ins.extra.get("addr_imm", 0)) % stride if stride
                        else o + ins.extra.get("addr_imm", 0) for o in offs}
                if None in offs:
                    offs = {UNKNOWN_SLOT, -1}
                # paths that disagree on the offset: the slot is unknown (UNKNOWN_SLOT)
                off = offs.pop() if len(offs) == 1 else UNKNOWN_SLOT
                val = frozenset({param_tag(slot_index(hit[0], off))} | ({TID, WIDE} & addr))
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


def _widen(b: int, state: dict, entry: dict, moved: dict) -> dict:
    """The join at block `b`'s entry with the widening of loop-carried offsets (WIDEN_AFTER)."""
    last = entry.setdefault(b, {})
    out = {}
    for r, tags in state.items():
        tags = _absorb(tags)
        offs = _offsets(tags)
        if not offs and not last.get(r, offs):  # no offsets now or before: nothing to widen or count
            last[r] = offs
            out[r] = tags
            continue
        if r in last and last[r] != offs:
            moved[(b, r)] = moved.get((b, r), 0) + 1
        if moved.get((b, r), 0) >= WIDEN_AFTER and offs:
            tags = (tags - offs) | {("off", None)}
            offs = frozenset({("off", None)})
        last[r] = offs
        out[r] = frozenset(tags)
    return out


def analyze(cfg: CFG, tables: dict[int, int] | None = None) -> Provenance:
    """Run the provenance analysis to a fixed point and record per-instruction tags.
    `tables`: declared task-table parameters -> their entry stride in bytes (0: one entry);
    a value loaded from one is tagged with the slot it came from (see `slot_index`). The
    memoized offset sets live for one analysis: a process that audits many kernels (the gate,
    a test session) does not keep every kernel's."""
    try:
        return _analyze(cfg, tables)
    finally:
        _OFFSETS.clear()
        _ABSORBED.clear()


def _analyze(cfg: CFG, tables: dict[int, int] | None) -> Provenance:
    fn = cfg.fn
    if tables:
        tables = dict(tables)
        strides = [v for v in tables.values() if v]
        tables["<period>"] = math.lcm(*strides) if strides else 0
    out: dict[int, dict] = {}
    entry: dict[int, dict] = {}  # block -> register -> offset tags at its entry, last pass
    moved: dict[tuple[int, str], int] = {}  # (block, register) -> passes its offsets changed
    # Passes in reverse post-order over the blocks whose predecessors' states changed since they
    # were last visited (every block on the first pass): the fixed point of the round-robin
    # iteration, without revisiting blocks whose entry cannot have moved.
    dirty = set(cfg.rpo)
    succs: dict[int, list[int]] = {b: [] for b in cfg.rpo}
    for b in cfg.rpo:
        for p in cfg.blocks[b].preds:
            succs.setdefault(p, []).append(b)
    rounds = 0
    while dirty:
        rounds += 1
        for b in cfg.rpo:
            if b not in dirty:
                continue
            dirty.discard(b)
            blk = cfg.blocks[b]
            state: dict = {}
            for p in blk.preds:
                if p in out:
                    if not state:
                        state = dict(out[p])
                        continue
                    for r, t in out[p].items():
                        old = state.get(r)
                        state[r] = t if old is None or old is t else old | t
            if tables:
                state = _widen(b, state, entry, moved)
            for k in range(blk.start, blk.end):
                _transfer(fn.instrs[k], state, None, tables)
            if out.get(b) != state:
                out[b] = state
                dirty.update(succs.get(b, ()))
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
        if tables:
            state = _widen(b, state, entry, moved)
        for k in range(blk.start, blk.end):
            _transfer(fn.instrs[k], state, rec, tables)
    return rec
