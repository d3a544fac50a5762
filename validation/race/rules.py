"""The static race rules, run over one function (PTX or SASS) with its CFG and provenance.

Each rule has a stable id (used by tests, the gate and the reports) and a severity. The
analyses are small data-flows over the CFG:

* ordering (forward): has this thread (or, through a CTA barrier, some thread of the CTA)
  performed a gpu-scope acquire since the start of the current iteration of the enclosing
  synchronizing loop? Loads of cross-CTA data must be reached only when it has;
* release (forward): has a gpu-scope fence executed since the last data write? A relaxed
  publish is only a release when it has;
* publish-ahead (backward): is every cross-CTA data write followed, within its iteration, by a
  publish (an elected publisher counts for the whole CTA);
* unbarriered access (forward): did threads other than an elected publisher touch cross-CTA
  data since the last CTA barrier?
* undeclared handshake (forward, per loop, any kernel): does a loop's exit depend on a value
  it loads from an activation or scratch buffer? That is a wait on memory; the ordering rules
  above run only on buffers the manifest declares `sync`, so such a loop must be declared;
* per access (any kernel): writes to read-only buffers (static, inputs, declared task tables),
  nc loads of anything written during the launch, accesses through task-table slots the
  declaration does not name.

Pointers loaded from memory are buffers of their own (dataflow.LOADED_PTR, or a declared
table slot), so every rule above applies to them. Where the rules follow the PTX memory model
strictly and where they rely on documented CUDA guarantees: MODEL.md beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import time

from . import ir
from . import steps as steps_mod
from .cfg import CFG
from .dataflow import LOADED_PTR, UNKNOWN_SLOT, Provenance, slot_of

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    title: str


RULES: dict[str, Rule] = {r.id: r for r in (
    Rule("nc-load-mutable", ERROR,
         "non-coherent load (ld.global.nc / LDG.CONSTANT) from a parameter that is not static"),
    Rule("load-before-wait", ERROR,
         "load of cross-CTA data not dominated, within its loop iteration, by the wait that orders it"),
    Rule("relaxed-spin-no-fence", ERROR,
         "spin on a relaxed/weak load with no acquire fence before the data it guards is read"),
    Rule("relaxed-publish", ERROR,
         "write to a sync parameter that is relaxed and not preceded by a release fence"),
    Rule("publish-before-writes", ERROR,
         "publish that precedes the writes it should publish, or an elected publish with no CTA "
         "barrier after the other threads' accesses"),
    Rule("bulk-store-not-drained", ERROR,
         "bulk-async (TMA) global store not drained by cp.async.bulk.wait_group 0 before a release"),
    Rule("barrier-divergent", ERROR, "bar.sync under thread-dependent control flow"),
    Rule("load-before-griddep-wait", ERROR,
         "in a kernel with griddepcontrol.wait (programmatic dependent launch): a load from a "
         "parameter that is not static, or any global write, not dominated by the wait"),
    Rule("undeclared-sync", ERROR,
         "a loop whose exit depends on a value it loads from a buffer the manifest does not "
         "declare `sync` (a cross-CTA handshake the ordering rules would not check)"),
    Rule("dsmem-before-cluster-wait", ERROR,
         "a distributed-shared-memory access (ld/st/atom/red .shared::cluster) not dominated by a "
         "barrier.cluster.wait: the peer CTA may not have started, its shared memory not valid yet"),
    Rule("dsmem-read-at-exit", ERROR,
         "a path from a distributed-shared-memory read to the kernel's exit with no "
         "barrier.cluster.arrive (not .relaxed) and wait after it: the peer may exit and release "
         "the shared memory being read"),
    Rule("dsmem-write-unsynced", ERROR,
         "after a write to another CTA's shared memory, a read of shared memory or the kernel's "
         "exit with no barrier.cluster.arrive (not .relaxed) and wait between: the owner may read "
         "before the write lands, or the write may land in a CTA that has exited"),
    Rule("claims-access", ERROR,
         "access to a work counter (a `claims` sync buffer, whose words hand out item indices) "
         "other than a gpu- or sys-scope atomic add or a strong store: a plain load, a flag use"),
    Rule("tagged-weak-access", ERROR,
         "access to a tagged sync buffer (each word its own flag) that is not a strong, gpu- or "
         "sys-scope load or store of whole words: weak, cp.async, cta/cluster-scope or atomic"),
    Rule("store-to-readonly", ERROR,
         "a write to a buffer declared read-only for the launch: a `static` parameter (weights), an "
         "input (direction \"in\"), or a declared task table"),
    Rule("points-to-undeclared", ERROR,
         "an access through a pointer loaded from a declared task table at a slot the declaration "
         "does not name (or declares scalar), or an offset the audit cannot tell"),
    Rule("load-before-step-wait", ERROR,
         "load of a pipeline step's cross-CTA data in a synchronizing loop ordered only by the wait "
         "for another step (or slot): each flag's acquire orders its own step's data"),
    Rule("load-before-producer-wait", ERROR,
         "in a staged kernel with declared stage counters, a load of a stage's output that follows "
         "no acquire of that stage's counter or of a stage's that waits for it (validation/race/stages.py)"),
    Rule("stage-undeclared-access", ERROR,
         "in a staged kernel, an access at an address derived from a stage's task-table entry to a "
         "buffer that stage does not declare (validation/race/stages.py)"),
    Rule("unknown-provenance", WARNING,
         "a global access whose address derives from no kernel parameter (provenance unknown)"),
)}


@dataclass
class RawFinding:
    rule: str
    instr: ir.Instr
    message: str
    params: tuple[int, ...] = ()
    related: ir.Instr | None = None


@dataclass
class Roles:
    """Parameter roles by PTX index, and the derived sets the rules use."""

    by_index: dict[int, str]
    names: dict[int, str]
    written: set[int] = field(default_factory=set)  # buffers some instruction writes
    loaded: set[int] = field(default_factory=set)  # buffers some instruction reads
    directions: dict[int, str] = field(default_factory=dict)  # "in" / "out" / "inout" (declared)
    tables: set[int] = field(default_factory=set)  # declared task-table parameters

    def note_accesses(self, fn: ir.Function, prov: Provenance) -> None:
        """Record which buffers `fn` writes and reads (scalars excepted)."""
        for ins in fn.instrs:
            ps = {p for p in prov.params_of_addr(ins.index) if self.by_index.get(p) != "scalar"}
            if ins.writes_memory:
                self.written |= ps
            if ins.kind in (ir.LOAD, ir.ATOM):
                self.loaded |= ps

    def readonly(self, p: int) -> str | None:
        """Why buffer `p` may not be written during the launch, or None."""
        if self.by_index.get(p) == "static":
            return "declared static (weights, read-only for the launch)"
        if p in self.tables:
            return "a declared task table (the pointers it holds must not change during the launch)"
        if self.directions.get(p) == "in":
            return "an input (direction \"in\")"
        return None

    def of(self, role: str) -> set[int]:
        return {i for i, r in self.by_index.items() if r == role}

    @property
    def sync(self) -> set[int]:
        """Sync buffers, tagged ones included."""
        return self.of("sync") | self.of("tagged")

    @property
    def claims(self) -> set[int]:
        """Sync buffers of work counters: every word hands out item indices by atomic adds and
        orders nothing, so no rule takes an access to one for a flag (no acquire, no publish,
        no spin), and `claims-access` checks that each access is such an add (or the reset's
        strong store)."""
        return self.of("claims")

    @property
    def tagged(self) -> set[int]:
        """Sync buffers of tagged words: each word is its own flag (0 until written), so a write
        to one publishes that word alone, not other data."""
        return self.of("tagged")

    @property
    def data(self) -> set[int]:
        """Activation/scratch buffers written by this kernel: reads of them may race."""
        return {i for i in self.written if self.by_index.get(i) in ("activation", "scratch")}

    @property
    def mutable(self) -> set[int]:
        """Every activation/scratch buffer, written by this kernel or not: after a spin, a read
        of one reads what the other side of the handshake (maybe another launch) wrote."""
        return {i for i, r in self.by_index.items() if r in ("activation", "scratch")}

    @property
    def xcta_data(self) -> set[int]:
        """Data both written and read by this kernel: what publishes must cover."""
        return self.data & self.loaded


def _buffer_params(prov: Provenance, idx: int, roles: Roles) -> set[int]:
    return {p for p in prov.params_of_addr(idx) if roles.by_index.get(p, "activation") != "scalar"}


def thread_dependent_blocks(cfg: CFG, prov: Provenance) -> set[int]:
    """Blocks whose execution differs between threads of one CTA (control dependent on a
    branch whose predicate derives from the thread index, directly or transitively)."""
    td: set[int] = set()
    changed = True
    while changed:
        changed = False
        for b in cfg.rpo:
            if b in td:
                continue
            for x in cfg.control_deps.get(b, ()):
                br = cfg.branch_instr(x)
                if x in td or prov.guard_is_thread_varying(br.index):
                    td.add(b)
                    changed = True
                    break
    return td


def thread_contexts(cfg: CFG, prov: Provenance) -> dict[int, frozenset]:
    """Block -> the thread-varying branch blocks it is (transitively) control dependent on."""
    ctx: dict[int, frozenset] = {}
    for b in cfg.rpo:  # dominators come first in reverse post-order
        acc = set()
        for x in cfg.control_deps.get(b, ()):
            if prov.guard_is_thread_varying(cfg.branch_instr(x).index):
                acc.add(x)
            acc |= ctx.get(x, frozenset())
        ctx[b] = frozenset(acc)
    return ctx


def _sync_loops(cfg: CFG, prov: Provenance, roles: Roles) -> set[int]:
    """Headers of loops whose body accesses a sync parameter or acquires: persistent and spin
    loops. An iteration of such a loop must find its own wait."""
    fn = cfg.fn
    heads = set()
    for lp in cfg.loops:
        for b in lp.body:
            blk = cfg.blocks[b]
            if any(_touches_sync(fn.instrs[k], prov, roles) or fn.instrs[k].kind == ir.INVALIDATE
                   for k in range(blk.start, blk.end)):
                heads.add(lp.header)
                break
    return heads


# Pseudo-registers for CTA-local memory: a value staged through shared memory (cp.async, a
# shared store) or spilled to local memory and read back keeps the tags of what was written.
# One cell per space, weakly updated: any write taints every later read of that space.
_SHARED_CELL = "<shared>"
_LOCAL_CELL = "<local>"


def _local_space(ins: ir.Instr) -> tuple[str | None, bool]:
    """(cell, is_write) when `ins` reads or writes shared or local memory, else (None, False).
    PTX names the space in the opcode (ld.shared, st.local, ldmatrix, stmatrix); SASS in the
    opcode's base (LDS, STS, LDSM, STSM, LDL, STL)."""
    toks = ins.opcode.split(".")
    base = toks[0]
    if base in ("LDS", "LDSM"):
        return _SHARED_CELL, False
    if base in ("STS", "STSM"):
        return _SHARED_CELL, True
    if base == "LDL":
        return _LOCAL_CELL, False
    if base == "STL":
        return _LOCAL_CELL, True
    spaces = {t.split("::")[0] for t in toks[1:]}
    if base in ("ld", "ldmatrix", "st", "stmatrix") and spaces & {"shared", "local"}:
        return (_SHARED_CELL if "shared" in spaces else _LOCAL_CELL), base in ("st", "stmatrix")
    return None, False


def _exit_deciding_blocks(cfg: CFG, lp, order: list[int]) -> list[int]:
    """The blocks of loop `lp` whose branch decides whether the current iteration leaves the
    loop: the outcomes its successors allow differ. An outcome is `exit` (an edge out of the
    loop, or the exit instruction itself) or `continue` (an edge back to the header); a block
    inside the loop allows the outcomes reachable from it without passing the header. So both
    the latch test of a spin and a flag tested in a block before the exiting one count, and an
    if/else whose arms rejoin before the loop's own test does not."""
    body = lp.body
    EXIT_, CONT = (True, False), (False, True)
    reach: dict[int, tuple[bool, bool]] = {}

    def outcomes(b: int) -> set[tuple[bool, bool]]:
        """What each way out of block b allows: its successors' outcomes, plus exit when the
        block ends in an exit instruction."""
        outs = {EXIT_ if s not in body else CONT if s == lp.header else reach.get(s, (False, False))
                for s in cfg.blocks[b].succs}
        if cfg.blocks[b].end > cfg.blocks[b].start and cfg.branch_instr(b).kind == ir.EXIT:
            outs.add(EXIT_)
        return outs

    changed = True
    while changed:
        changed = False
        for b in reversed(order):
            outs = outcomes(b)
            r = (any(o[0] for o in outs), any(o[1] for o in outs))
            if reach.get(b) != r:
                reach[b] = r
                changed = True
    return [b for b in order if cfg.blocks[b].end > cfg.blocks[b].start and len(outcomes(b)) > 1]


def _undeclared_spins(cfg: CFG, prov: Provenance, roles: Roles) -> list[RawFinding]:
    """Loops that wait on memory through a buffer not declared `sync`: a branch deciding a
    loop exit whose predicate depends on a value loaded (or returned by an atomic) inside the
    same loop from an activation or scratch buffer. Such a loop reads what another thread or CTA
    writes during the launch, i.e. a handshake; without the `sync` role the ordering rules
    (acquire before the data, release after it) never run on it. Static buffers cannot change
    during the launch and `sync` ones are checked by those rules, so neither counts.

    A loop exit is any edge out of the loop or a (conditional) exit inside it; the branches that
    decide it are those of `_exit_deciding_blocks`, so a flag tested in a block before the
    exiting one counts. Loaded values keep their tags through shared memory (cp.async, shared
    stores) and local memory (spills).

    The dependence is tracked inside each loop only (values from before the loop carry no tag),
    so a loop bound read once before the loop, or per-item metadata that does not decide the
    exit, is not a spin. Known over-approximation: a search that stops early on a value it
    loads from an activation buffer (a scan for the first match) is flagged too, though it waits
    on nothing; that routes the change to full review, the safe direction, and no repository
    kernel has such a loop."""
    fn = cfg.fn
    out: list[RawFinding] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for lp in cfg.loops:
        body = lp.body
        order = [b for b in cfg.rpo if b in body]
        end: dict[int, dict] = {}
        guard_tags: dict[int, frozenset] = {}
        changed = True
        while changed:
            changed = False
            for b in order:
                st: dict = {}
                for p in cfg.blocks[b].preds:
                    if p in body and p in end:  # the header's entry edge brings no tags
                        for r, t in end[p].items():
                            st[r] = st.get(r, frozenset()) | t
                blk = cfg.blocks[b]
                for k in range(blk.start, blk.end):
                    ins = fn.instrs[k]
                    if ins.guard:
                        guard_tags[k] = st.get(ins.guard, frozenset())
                    cell, cell_write = _local_space(ins)
                    if ins.kind in (ir.LOAD, ir.ATOM):
                        val = frozenset(p for p in _buffer_params(prov, k, roles)
                                        if roles.by_index.get(p, "activation") in ("activation", "scratch"))
                        if not ins.dests and val:  # a copy into shared memory (cp.async, TMA)
                            st[_SHARED_CELL] = st.get(_SHARED_CELL, frozenset()) | val
                    else:
                        val = frozenset().union(*(st.get(r, frozenset()) for r in ins.srcs))
                        if cell and cell_write:
                            if val:
                                st[cell] = st.get(cell, frozenset()) | val
                        elif cell:
                            val = val | st.get(cell, frozenset())
                    for d in ins.dests:
                        st[d] = val
                if end.get(b) != st:
                    end[b] = st
                    changed = True
        deciding = _exit_deciding_blocks(cfg, lp, order)
        for b in deciding:
            last = cfg.branch_instr(b)
            if last.kind not in (ir.BRANCH, ir.EXIT) or not last.guard:
                continue
            hit = tuple(sorted(guard_tags.get(last.index, frozenset())))
            if hit and (last.index, hit) not in seen:
                seen.add((last.index, hit))
                names = ", ".join(f"{roles.names[p]!r} (role {roles.by_index.get(p, 'activation')})" for p in hit)
                out.append(RawFinding(
                    "undeclared-sync", last,
                    f"this loop exits on a value it loads from {names}: a wait on memory another "
                    "thread or CTA writes. Declare the buffer `sync` in the manifest so the ordering "
                    "rules check the handshake", hit))
    return out


def _touches_sync(ins: ir.Instr, prov: Provenance, roles: Roles) -> bool:
    return ins.kind in ir.MEMORY_KINDS and bool(prov.params_of_addr(ins.index) & roles.sync)


def _is_acquire(ins: ir.Instr) -> bool:
    return (ins.kind in (ir.LOAD, ir.ATOM) and ins.sem in (ir.ACQUIRE, ir.ACQ_REL)
            and ins.cross_cta_scope)


def _is_publish(ins: ir.Instr, prov: Provenance, roles: Roles) -> bool:
    """A write to a sync flag: a release of the data written before it (tagged words excepted:
    such a word publishes only itself)."""
    return (ins.kind in (ir.STORE, ir.RED, ir.ATOM)
            and bool(prov.params_of_addr(ins.index) & (roles.sync - roles.tagged)))


def _hit_of(ins: ir.Instr, prov: Provenance, roles: Roles, params: set[int]) -> tuple[tuple, str] | None:
    """(the buffers of `params` that memory access `ins` touches, their names quoted), or None."""
    if ins.kind not in ir.MEMORY_KINDS:
        return None
    hit = tuple(sorted(prov.params_of_addr(ins.index) & params))
    return (hit, ", ".join(repr(roles.names[p]) for p in hit)) if hit else None


def _claims_access(ins: ir.Instr, prov: Provenance, roles: Roles) -> RawFinding | None:
    """A finding when `ins` touches a work counter other than by a gpu- or sys-scope atomic
    add (the claim: its value is the claimer's item, nothing else is read through it) or a
    strong store (the last worker's reset)."""
    touched = _hit_of(ins, prov, roles, roles.claims)
    if touched is None:
        return None
    hit, names = touched
    if ins.kind in (ir.ATOM, ir.RED):
        if "add" in ins.opcode.lower().split("."):
            if ins.cross_cta_scope:
                return None
            why = f"a {ins.scope}-scope atomic: other CTAs' claims are not ordered with it"
        else:
            why = f"an atomic other than an add ({ins.opcode})"
    elif ins.kind == ir.STORE:
        if ins.sem != ir.WEAK and ins.cross_cta_scope:
            return None
        why = "a weak or narrow-scope store (only the reset's strong store may write a work counter)"
    else:
        why = "a load (a work counter is read only by the atomic that claims from it, never polled)"
    return RawFinding("claims-access", ins, f"access to work counter {names} is {why}", hit)


def _tagged_weak(ins: ir.Instr, prov: Provenance, roles: Roles) -> RawFinding | None:
    """A finding when `ins` touches a tagged buffer other than by a strong (relaxed or stronger;
    SASS .STRONG), gpu- or sys-scope plain load or store: a weak or cp.async access may tear
    or read a stale line, a cta/cluster scope does not reach the other CTAs, and an atomic
    means the buffer is used as a counter, which the tagged protocol does not check."""
    touched = _hit_of(ins, prov, roles, roles.tagged)
    if touched is None:
        return None
    hit, names = touched
    if ins.kind in (ir.ATOM, ir.RED):
        why = "an atomic on it (a tagged buffer is polled and written word by word, never counted)"
    elif ins.nc:
        why = "a non-coherent load"
    elif ins.sem == ir.WEAK:
        why = "a weak access (plain ld/st or cp.async): it may be split, cached in L1 or merged"
    elif not ins.cross_cta_scope:
        why = f"a {ins.scope}-scope access: other CTAs' words are not ordered with it"
    else:
        return None
    return RawFinding("tagged-weak-access", ins, f"access to tagged buffer {names} is {why}", hit)


def _meet(sides: list[frozenset]) -> frozenset:
    """Must-join of sets of step keys: a key holds after the join when every side holds it or a
    key that implies it (fewer constraints: the empty key orders every step)."""
    acc = sides[0]
    for other in sides[1:]:
        acc = frozenset({k for k in acc if any(o <= k for o in other)}
                        | {k for k in other if any(a <= k for a in acc)})
    return acc


def _forward(cfg: CFG, init: dict, reset_heads: set[int], reset: dict, must: set[str], step,
             head_state=None):
    """Generic forward analysis over boolean facts and sets. `must` facts join by AND (sets by
    `_meet`), the others by OR (union). `step(instr, state)` updates `state` in place. At a
    block of `reset_heads` the state is `reset`, or `head_state(block, [(pred, OUT state)])`
    when given (None: no state reaches the block yet, which this pass skips). Returns the IN
    state of every block reached."""
    ins_state: dict[int, dict] = {}
    out: dict[int, dict] = {}
    changed = True
    while changed:
        changed = False
        for b in cfg.rpo:
            if b == cfg.rpo[0]:
                st = dict(init)
            elif b in reset_heads:
                st = (dict(reset) if head_state is None else
                      head_state(b, [(p, out[p]) for p in cfg.blocks[b].preds if p in out]))
                if st is None:
                    continue
            else:
                preds = [out[p] for p in cfg.blocks[b].preds if p in out]
                if not preds:
                    continue
                st = {}
                for k in init:
                    vals = [p[k] for p in preds]
                    if isinstance(init[k], frozenset):
                        st[k] = _meet(vals) if k in must else frozenset().union(*vals)
                    else:
                        st[k] = all(vals) if k in must else any(vals)
            if b in reset_heads and b == cfg.rpo[0]:
                st = dict(reset)
            ins_state[b] = dict(st)
            blk = cfg.blocks[b]
            for k in range(blk.start, blk.end):
                step(cfg.fn.instrs[k], st, None)
            if out.get(b) != st:
                out[b] = st
                changed = True
    return ins_state


def _replay(cfg: CFG, ins_state: dict, step, emit) -> None:
    for b in cfg.rpo:
        if b not in ins_state:
            continue
        st = dict(ins_state[b])
        blk = cfg.blocks[b]
        for k in range(blk.start, blk.end):
            step(cfg.fn.instrs[k], st, emit)


def _names(roles: Roles, ps) -> str:
    return ", ".join(f"{roles.names.get(p, p)!r} (role {roles.by_index.get(p, 'activation')})" for p in ps)


def check_function(cfg: CFG, prov: Provenance, roles: Roles, *, syncs: bool,
                   timings: dict | None = None) -> list[RawFinding]:
    """All rules on one function. PTX and SASS differ only in how acquires look (SASS: a
    strong load of a sync flag followed by CCTL.IVALL) and in which rules apply. `timings`,
    when given, accumulates the seconds each rule group takes (benchmarks/race_audit_rules.py)."""
    fn = cfg.fn
    sass = fn.dialect == "sass"
    findings: list[RawFinding] = []
    clock = [time.perf_counter()]

    def lap(key: str) -> None:
        now = time.perf_counter()
        if timings is not None:
            timings[key] = timings.get(key, 0.0) + now - clock[0]
        clock[0] = now

    td = thread_dependent_blocks(cfg, prov)
    ctx = thread_contexts(cfg, prov)
    lap("thread-contexts")

    # -- nc loads, unknown provenance, read-only buffers, table slots, tagged buffers ---------
    for ins in fn.instrs:
        if cfg.block_of and cfg.block_of[ins.index] not in cfg.reachable:
            continue
        if ins.kind in ir.MEMORY_KINDS or ins.kind == ir.BULK_STORE:
            n_before = len(findings)
            bufs = _buffer_params(prov, ins.index, roles)
            for p in sorted(prov.params_of_addr(ins.index)):
                so = slot_of(p)
                if so is None:
                    continue
                role = roles.by_index.get(p)
                if role == "scalar" and so[1] != UNKNOWN_SLOT and bufs:
                    continue  # a number from the table indexing a buffer the address derives from
                if so[1] == UNKNOWN_SLOT or role in (None, "scalar"):
                    what = ("an offset the audit cannot tell (paths disagree, or it is not a constant)"
                            if so[1] == UNKNOWN_SLOT else
                            f"slot +{so[1]}, which the declaration " + ("declares scalar (not a pointer)" if role else "does not name"))
                    findings.append(RawFinding(
                        "points-to-undeclared", ins,
                        f"access through a pointer loaded from task table {roles.names.get(so[0], so[0])!r} at {what}: "
                        "declare what each slot points to", (p,)))
            if not bufs:
                if ins.kind == ir.LOAD and ins.nc:
                    # nc is allowed only where the buffer is proven static; unknown is not proven.
                    findings.append(RawFinding(
                        "nc-load-mutable", ins,
                        "non-coherent load whose address derives from no kernel parameter: it "
                        "cannot be shown to read static weights"))
                    continue
                if len(findings) == n_before:  # not already a table-slot finding
                    findings.append(RawFinding("unknown-provenance", ins,
                                               "address derives from no kernel parameter"))
                continue
            if ins.writes_memory:
                for p in sorted(bufs):
                    why = roles.readonly(p)
                    if why:
                        findings.append(RawFinding(
                            "store-to-readonly", ins,
                            f"write to {roles.names.get(p, p)!r}, {why}: nothing may write it during the "
                            "launch (a buffer used as scratch and restored still races every reader)", (p,)))
            if roles.tagged:  # a tagged buffer: only strong, cross-CTA-scope loads and stores
                f = _tagged_weak(ins, prov, roles)
                if f is not None:
                    findings.append(f)
            if roles.claims:  # a work counter: only cross-CTA atomic adds and the reset's stores
                f = _claims_access(ins, prov, roles)
                if f is not None:
                    findings.append(f)
            if ins.kind == ir.LOAD and ins.nc:
                bad = sorted(p for p in bufs if roles.by_index.get(p) != "static" or p in roles.written)
                if bad:
                    findings.append(RawFinding(
                        "nc-load-mutable", ins,
                        "non-coherent load from " + _names(roles, bad)
                        + ": valid only for data nothing writes during the launch", tuple(bad)))
    lap("per-access")

    # -- programmatic dependent launch: nothing but static loads before griddepcontrol.wait ---
    if any(ins.kind == ir.GRIDDEP_WAIT for ins in fn.instrs):
        findings += _before_griddep_wait(cfg, prov, roles)
    lap("griddep")

    # -- distributed shared memory: peers started before, and still there during, any access --
    if not sass and any(ins.extra.get("dsmem") for ins in fn.instrs):
        findings += _dsmem_order(cfg)
    lap("dsmem")

    # -- barriers under thread-dependent control ----------------------------------------------
    if not sass:
        for ins in fn.instrs:
            if ins.kind != ir.BARRIER or cfg.block_of[ins.index] not in cfg.reachable:
                continue
            if cfg.block_of[ins.index] in td or (ins.guard and prov.guard_is_thread_varying(ins.index)):
                findings.append(RawFinding("barrier-divergent", ins,
                                           "CTA barrier reached by only some threads of the CTA"))

    # -- handshakes through buffers not declared sync (any kernel) -----------------------------
    findings += _undeclared_spins(cfg, prov, roles)
    lap("undeclared-sync")

    if not syncs:
        return findings

    heads = _sync_loops(cfg, prov, roles)
    data = roles.data
    mutable = roles.mutable
    sync_data = roles.sync - roles.tagged
    lane_blocks = {b for b in td if ctx.get(b) and all(
        prov.guard_is_lane_only(cfg.branch_instr(x).index) for x in ctx[b])}

    def divergence(ins: ir.Instr) -> tuple[bool, bool]:
        """(only some threads of the CTA execute `ins` on this path although the path model
        does not show it: a thread-varying guard; only lanes of each warp differ)."""
        if ins.guard and prov.guard_is_thread_varying(ins.index):
            b = cfg.block_of[ins.index]
            return True, prov.guard_is_lane_only(ins.index) and (b not in td or b in lane_blocks)
        return False, False

    def acquired(st: dict, ins: ir.Instr, guard_raw: str | None, lane: bool, keys) -> None:
        """An acquire by this thread of the flags whose step keys are `keys`; `guard_raw`: the
        thread-varying predicate it ran under (only threads holding it acquired), `lane`: that
        predicate varies only within warps."""
        st["S"] = True
        st["SK"] = st["SK"] | keys
        b = cfg.block_of[ins.index]
        if lane or b in lane_blocks:
            st["L"] = True
        if guard_raw is None:
            st["A"] = st["A"] | keys
        else:
            st["G"] = st["G"] | {(guard_raw, k) for k in keys}

    # -- steps: which pipeline step of each enclosing synchronizing loop an access touches ----
    # A flag's wait orders only the data of its own step (MODEL.md: ordering per step): every
    # acquire carries a key, the (loop, step) pairs of its flag's address; a load is ordered by
    # a key that agrees with its own on every loop both name. ("pre", loop, base, c): a wait
    # before the loop on the address `base + c`, credited to the loop's first step when `base`
    # reaches the loop unchanged.
    lap("ordering")
    loop_steps = steps_mod.analyze(cfg, heads)
    lap("step-keys")  # induction variables and steps of the synchronizing loops (steps.py)
    body_of = {lp.header: lp.body for lp in cfg.loops if lp.header in loop_steps}

    def flag_reads(blocks) -> set:
        return {p for x in blocks for k in range(cfg.blocks[x].start, cfg.blocks[x].end)
                if fn.instrs[k].kind in (ir.LOAD, ir.ATOM) and _touches_sync(fn.instrs[k], prov, roles)
                for p in _buffer_params(prov, k, roles)}

    # synchronizing loops that read a flag buffer their prologue (the blocks that dominate the
    # header) reads too
    outside = {h: flag_reads({x for x in cfg.reachable if x not in body and cfg.dominates(x, h)})
               for h, body in body_of.items()}
    per_step_flags = {h for h, body in body_of.items() if flag_reads(body) & outside[h]}
    key_cache: dict[int, frozenset] = {}

    def key_of(idx: int) -> frozenset:
        if idx in key_cache:
            return key_cache[idx]
        b = cfg.block_of[idx]
        out = set()
        for h, ls in loop_steps.items():
            if b in body_of[h]:
                s = ls.step_of(idx)
                if s is not None:
                    out.add((h, s))
            else:
                f = ls.pre_forms.get(idx)
                if f is not None and f[0] in ls.ivs:
                    out.add(("pre", h, f[0], f[1]))
        key_cache[idx] = frozenset(out)
        return key_cache[idx]

    def agrees(acq: frozenset, load: frozenset) -> bool:
        mine = {c[0]: c[1] for c in load if len(c) == 2}
        return all(mine.get(c[0], c[1]) == c[1] for c in acq if len(c) == 2)

    def ordered(st: dict, ins: ir.Instr) -> bool:
        lk = key_of(ins.index)
        if any(agrees(k, lk) for k in st["A"]):
            return True
        g = ins.extra.get("guard_raw")
        return bool(g) and any(gg == g and agrees(k, lk) for gg, k in st["G"])

    def head_state(b: int, preds: list[tuple[int, dict]]) -> dict:
        """A synchronizing loop's header: a fresh iteration, but a wait the previous iteration
        made for the next step (a wait rotated to the bottom), or the prologue made for the
        first, still orders that step's data, and a wait the prologue made on a flag of no
        step orders every iteration's."""
        st = dict(zero)
        body = body_of.get(b)
        if body is None:
            return st
        ivs = loop_steps[b].ivs

        def back(p, keys):  # the previous iteration's step s+1 is this one's step s
            adv = loop_steps[b].advance.get(p)
            if adv is None:
                return frozenset()
            # an earlier step's wait is not carried (that keeps the sets finite)
            return frozenset(frozenset((c[0], c[1] - adv) if len(c) == 2 and c[0] == b else c for c in k)
                             for k in keys
                             if any(len(c) == 2 and c[0] == b for c in k)
                             and all(c[1] - adv >= 0 for c in k if len(c) == 2 and c[0] == b))

        def enter(keys):  # the prologue's waits on the loop's induction registers
            out = set()
            for k in keys:
                nk = set()
                for c in k:
                    if len(c) == 4 and c[1] == b:
                        if c[2] in ivs:
                            nk.add((b, c[3] // ivs[c[2]]))
                    else:
                        nk.add(c)
                out.add(frozenset(nk))
            return frozenset(out)

        entry = [enter(s["A"]) for p, s in preds if p not in body]
        # an acquire made before the loop whose flag names no step of it (a counter at a fixed
        # address) happened before every iteration: it orders every iteration's loads
        # unless the loop reads that flag buffer too (then the prologue's wait is its first step's)
        held = _meet(entry) if entry and b not in per_step_flags else frozenset()
        prior = frozenset(k for k in held if not any(len(c) == 2 and c[0] == b for c in k))
        sides = entry + [back(p, s["A"]) | (s["A"] & prior) for p, s in preds if p in body]
        st["A"] = _meet(sides) if sides else frozenset()
        st["SK"] = frozenset().union(*([enter(s["SK"]) for p, s in preds if p not in body]
                                      + [back(p, s["SK"]) for p, s in preds if p in body]))
        st["S"] = bool(st["SK"])
        return st

    # -- ordering: loads of cross-CTA data after a wait ---------------------------------------
    # A (must): this thread acquired (or a barrier followed some thread's acquire) since the
    # iteration began; S: some thread did; L: a lane of this warp did (a warp sync then orders
    # it for the warp: MODEL.md); G: guards under which a predicated acquire ran (a load under
    # the same guard is ordered); R: this thread read a sync flag without acquire semantics.
    def order_step(ins: ir.Instr, st: dict, emit) -> None:
        k = ins.kind
        before = (st["R"] or bool(st["RG"]), st["S"])  # what this load is judged by
        some, lane = divergence(ins)
        graw = ins.extra.get("guard_raw") if some else None
        poll = (k in (ir.LOAD, ir.ATOM) and _touches_sync(ins, prov, roles)
                and (ins.strong if sass else not _is_acquire(ins)))
        if ins.dests and st["A"]:  # a prologue's wait is credited only while its base lives
            dead = set(ins.dests)
            if any(len(c) == 4 and c[2] in dead and cfg.block_of[ins.index] not in body_of[c[1]]
                   for kk in st["A"] for c in kk):
                st["A"] = frozenset(frozenset(c for c in kk if not (len(c) == 4 and c[2] in dead))
                                    for kk in st["A"])
        if poll:  # a read of a sync flag without acquire semantics (SASS: every one)
            st["RK"] = st["RK"] | {key_of(ins.index)}
            if graw:
                st["RG"] = st["RG"] | {graw}
                st["Rl"] = st["Rl"] or lane
            else:
                st["R"] = True
        elif not sass and _is_acquire(ins):
            acquired(st, ins, graw, lane, frozenset({key_of(ins.index)}))
        elif (k == ir.INVALIDATE if sass else k == ir.FENCE) and (st["R"] or st["RG"]):
            if st["R"]:
                acquired(st, ins, graw, lane, st["RK"])
            for g in st["RG"]:
                acquired(st, ins, g, st["Rl"], st["RK"])
        if k == ir.BARRIER and st["S"]:
            st["A"] = st["A"] | st["SK"]
        if ins.extra.get("warp_sync") and st["L"]:
            st["A"] = st["A"] | st["SK"]
        if emit is None or k != ir.LOAD or _is_acquire(ins) or ordered(st, ins):
            return
        bufs = _buffer_params(prov, ins.index, roles)
        polled, some_acq = before if k == ir.LOAD and not ins.strong and ins.sem == ir.WEAK else (
            st["R"] or bool(st["RG"]), st["S"])
        hit = bufs & data
        if polled or some_acq:
            hit |= bufs & mutable  # read after a spin: the other side may be another launch
        weak_sync = bufs & sync_data if (not ins.strong if sass else ins.sem == ir.WEAK) else set()
        hit = sorted(hit | weak_sync)
        if hit:
            names = ", ".join(repr(roles.names.get(p, p)) for p in hit)
            lk = {c[0]: c[1] for c in key_of(ins.index) if len(c) == 2}
            waited = sorted({c[1] for kk in st["A"] | st["SK"] | {k for _, k in st["G"]}
                             for c in kk if len(c) == 2 and c[0] in lk})
            if lk and (st["A"] or st["SK"] or st["G"]):
                emit(RawFinding("load-before-step-wait", ins,
                                f"load of {names} for step s{lk and max(lk.values()):+d} of its loop is "
                                f"ordered only by the wait for step(s) {', '.join(f's{w:+d}' for w in waited) or '(another loop)'}: "
                                "a flag's acquire orders the data of its own step only (wait for this "
                                "step's flag, or the same slot, before the load)", tuple(hit)))
            elif some_acq:
                emit(RawFinding("load-before-wait", ins,
                                f"load of {names} after another thread's acquire with no CTA barrier (or, "
                                "for a lane's acquire, warp sync) after that acquire: the acquire orders "
                                "only the acquiring thread's reads", tuple(hit)))
            elif polled:
                emit(RawFinding("relaxed-spin-no-fence", ins,
                                f"load of {names} after a relaxed/weak read of a sync flag (a spin or an "
                                "RMW) with no acquire fence (fence.acq_rel.gpu) in between", tuple(hit)))
            else:
                emit(RawFinding("load-before-wait", ins,
                                f"load of {names}, written by other CTAs or another launch, is not "
                                "ordered by a gpu-scope acquire earlier in its iteration", tuple(hit)))

    zero = {"A": frozenset(), "S": False, "SK": frozenset(), "R": False, "RK": frozenset(), "L": False,
            "G": frozenset(), "RG": frozenset(), "Rl": False}
    st_in = _forward(cfg, zero, heads, zero, {"A"}, order_step, head_state)
    _replay(cfg, st_in, order_step, findings.append)
    lap("ordering")

    # -- release: writes to sync params after a fence or with release semantics ---------------
    def release_step(ins: ir.Instr, st: dict, emit) -> None:
        k = ins.kind
        if k == ir.FENCE:
            st["F"] = True
            return
        if k in (ir.STORE, ir.RED, ir.ATOM, ir.BULK_STORE):
            if _is_publish(ins, prov, roles):
                released = st["F"] or (not sass and ins.sem in (ir.RELEASE, ir.ACQ_REL) and ins.cross_cta_scope)
                if emit is not None and not released:
                    emit(RawFinding("relaxed-publish", ins,
                                    "write to sync parameter " + ", ".join(
                                        repr(roles.names[p]) for p in sorted(prov.params_of_addr(ins.index) & roles.sync))
                                    + " is relaxed and no gpu-scope fence precedes it since the last data write",
                                    tuple(sorted(prov.params_of_addr(ins.index) & roles.sync))))
            elif _buffer_params(prov, ins.index, roles):
                st["F"] = False

    st_in = _forward(cfg, {"F": False}, set(), {"F": False}, {"F"}, release_step)
    _replay(cfg, st_in, release_step, findings.append)
    lap("release")

    if sass:
        return findings

    # -- publish-before-writes (a): every cross-CTA data write is published later ------------
    xdata = roles.xcta_data
    if xdata:
        findings += _unpublished_writes(cfg, prov, roles, heads, td, xdata)
    lap("publish-ahead")

    # -- publish-before-writes (b) and bulk drains: forward over the iteration ----------------
    # U holds (context, warp-synced) of the data writes (this kernel's, whoever reads them: the
    # reader may be another launch) and the cross-CTA data reads since the last CTA barrier,
    # a context being the set of thread-varying branches the access ran under. A publish orders
    # only accesses made under (at least) its own guards, i.e. by the publishing thread itself,
    # or, after a warp sync, by its warp when the publisher's further guards vary by lane only.
    # B: contexts of bulk stores not drained (wait_group, not .read) by their thread; X: those
    # still pending at the last barrier (a drain after it orders nothing for other threads).
    lane_branch = {x for b in cfg.rpo for x in ctx.get(b, ())
                   if prov.guard_is_lane_only(cfg.branch_instr(x).index)}

    def pub_step(ins: ir.Instr, st: dict, emit) -> None:
        k = ins.kind
        b = cfg.block_of[ins.index]
        here = ctx.get(b, frozenset())
        if k == ir.BARRIER:
            st["U"] = frozenset()
            st["X"] = st["B"]
        elif ins.extra.get("warp_sync") and ins.kind != ir.BARRIER:
            st["U"] = frozenset((c, True) for c, _ in st["U"])
        elif (k in ir.MEMORY_KINDS or k == ir.BULK_STORE) and not _is_publish(ins, prov, roles):
            bufs = _buffer_params(prov, ins.index, roles)
            if (ins.writes_memory and bufs & (data | sync_data)) or bufs & xdata:
                st["U"] = st["U"] | {(here, False)}
        if k == ir.BULK_STORE:
            st["B"] = st["B"] | {here}
        elif k == ir.BULK_WAIT and ins.extra.get("pending_allowed", 0) == 0:
            st["B"] = frozenset()
        if emit is None or not _is_publish(ins, prov, roles):
            return
        some, _ = divergence(ins)
        elected = b in td or some
        if elected:
            def covered(c, synced):
                extra = here - c
                return not extra or (synced and extra <= lane_branch)
            if any(not covered(c, w) for c, w in st["U"]):
                emit(RawFinding("publish-before-writes", ins,
                                "publish by an elected thread with no CTA barrier (bar.sync) after the "
                                "other threads' accesses to cross-CTA data: their writes (or reads) "
                                "are not ordered before it"))
        elif ins.kind == ir.STORE and st["U"]:
            emit(RawFinding("publish-before-writes", ins,
                            "every thread stores the flag, with no CTA barrier after the data writes: "
                            "the first thread's release signals the other threads' data before it is "
                            "written (a barrier between, or a counter each thread adds to)"))
        if st["B"]:
            emit(RawFinding("bulk-store-not-drained", ins,
                            "bulk-async global store still in flight at this publish: "
                            "cp.async.bulk.wait_group 0 must come first"))
        elif any(not c <= here for c in st["X"]):
            emit(RawFinding("bulk-store-not-drained", ins,
                            "bulk-async global store by another thread was drained after the last CTA "
                            "barrier (or not at all): its cp.async.bulk.wait_group 0 must come before "
                            "the barrier that orders it before this publish"))

    init = {"U": frozenset(), "B": frozenset(), "X": frozenset()}
    st_in = _forward(cfg, init, set(), init, set(), pub_step)
    _replay(cfg, st_in, pub_step, findings.append)
    lap("publish-order")
    return findings


def _before_griddep_wait(cfg: CFG, prov: Provenance, roles: Roles) -> list[RawFinding]:
    """Forward must-analysis: has every path from the entry passed a griddepcontrol.wait? Under
    programmatic dependent launch the kernel may run while the previous grid still writes, so
    before the wait only loads of `static` parameters (read-only for the whole step) are safe;
    a load of anything else may read stale data, and a write may race the previous grid's reads
    or writes of the same buffer."""
    def step(ins: ir.Instr, st: dict, emit) -> None:
        if ins.kind == ir.GRIDDEP_WAIT:
            st["W"] = True
            return
        if emit is None or st["W"] or not (ins.kind in ir.MEMORY_KINDS or ins.kind == ir.BULK_STORE):
            return
        bufs = sorted(_buffer_params(prov, ins.index, roles))
        names = ", ".join(f"{roles.names[p]!r} (role {roles.by_index.get(p, 'activation')})" for p in bufs)
        if ins.writes_memory and bufs:
            emit(RawFinding("load-before-griddep-wait", ins,
                            f"write to {names} before griddepcontrol.wait: the previous kernel in the "
                            "stream may still be reading or writing it", tuple(bufs)))
        elif ins.kind == ir.LOAD and not bufs and ins.opcode.startswith(("UTMALDG", "UBLKCP", "cp.async.bulk")):
            # A bulk/TMA copy names its buffer only through a tensor map or an address the
            # audit could not tie to a parameter: nothing shows it reads a static weight.
            emit(RawFinding("load-before-griddep-wait", ins,
                            "bulk/TMA copy from a buffer the audit cannot tie to a parameter, before "
                            "griddepcontrol.wait: it may read an activation the previous kernel still writes"))
        elif ins.kind == ir.LOAD:
            mutable = [p for p in bufs if roles.by_index.get(p) != "static"]
            if mutable:
                hit = ", ".join(f"{roles.names[p]!r} (role {roles.by_index.get(p, 'activation')})"
                                for p in mutable)
                emit(RawFinding("load-before-griddep-wait", ins,
                                f"load of {hit} before griddepcontrol.wait: the previous kernel in the "
                                "stream may still be writing it (only static weights may be read early)",
                                tuple(mutable)))

    st_in = _forward(cfg, {"W": False}, set(), {"W": False}, {"W"}, step)
    found: list[RawFinding] = []
    _replay(cfg, st_in, step, found.append)
    return found


def _dsmem_order(cfg: CFG) -> list[RawFinding]:
    """PTX only (SASS shows distributed shared memory as generic LD/ST). Forward analyses over
    the cluster barrier phases a thread passes:
      * W (must): every path from the entry has passed a barrier.cluster.wait. A CTA may touch
        a peer's shared memory only once the peer has started, which a wait on a phase every
        CTA arrives at guarantees; before it, an access may land in a CTA that has not.
      * R (may): a read of a peer's shared memory not yet followed by an arrive (release) and a
        wait; P (must): that arrive has happened. At an exit with R set, the peer may already
        have passed its last barrier and exited, releasing the memory this CTA reads.
      * S (may): a write to a peer's shared memory not yet followed by an arrive (release) and a
        wait; Q (must): that arrive has happened. A read of shared memory (this CTA's own: the
        owner reading what peers pushed, or a peer's) with S set may run before the writes land;
        an exit with S set may leave a write to land in a CTA that has exited.
    Known limits: peer addresses reached through a generic `mapa` and a plain ld/st, and bulk
    copies or mbarrier operations on shared::cluster, are not tracked."""
    def step(ins: ir.Instr, st: dict, emit) -> None:
        bar = ins.extra.get("cluster_barrier")
        if bar == "wait":
            st["W"] = True
            if st["P"]:
                st["R"], st["P"] = False, False
            if st["Q"]:
                st["S"], st["Q"] = False, False
            return
        if bar == "arrive":
            st["P"] = st["P"] or st["R"]
            st["Q"] = st["Q"] or st["S"]
            return
        access = ins.extra.get("dsmem")
        reads = access in ("read", "rw") or ins.extra.get("shared_read")
        if emit is not None and reads and st["S"]:
            emit(RawFinding("dsmem-write-unsynced", ins,
                            "read of shared memory after a write to another CTA's shared memory with no "
                            "barrier.cluster.arrive (release) and wait between: the read may run before "
                            "the peers' writes land"))
        if access:
            if emit is not None and not st["W"]:
                emit(RawFinding("dsmem-before-cluster-wait", ins,
                                f"{'read of' if access == 'read' else 'write to'} another CTA's shared memory "
                                "before any barrier.cluster.wait: that CTA may not have started yet (arrive "
                                "at a cluster barrier on entry, wait on it before the first access)"))
            if access in ("read", "rw"):
                st["R"], st["P"] = True, False
            if access in ("write", "rw"):
                st["S"], st["Q"] = True, False
            return
        if ins.kind == ir.EXIT and emit is not None:
            if st["R"]:
                emit(RawFinding("dsmem-read-at-exit", ins,
                                "exit after reading another CTA's shared memory with no barrier.cluster.arrive "
                                "and wait since: the peer may exit first and release what is being read"))
            if st["S"]:
                emit(RawFinding("dsmem-write-unsynced", ins,
                                "exit after writing another CTA's shared memory with no barrier.cluster.arrive "
                                "and wait since: the write may land in a CTA that has exited"))

    init = {"W": False, "R": False, "P": False, "S": False, "Q": False}
    st_in = _forward(cfg, init, set(), init, {"W", "P", "Q"}, step)
    found: list[RawFinding] = []
    _replay(cfg, st_in, step, found.append)
    return found


def _unpublished_writes(cfg, prov, roles, heads, td, xdata) -> list[RawFinding]:
    """Backward: at each write to cross-CTA data, is a publish ahead on every path to the end
    of the iteration, or, past its last iteration, on every way out of the loop (one publish
    after a loop covers every iteration's writes: a counter of the loop's item count)? At a
    thread-dependent branch one side suffices (an elected publisher)."""
    fn = cfg.fn
    exits = {}  # back edge of a synchronizing loop -> the blocks its loop leaves to
    for lp in cfg.loops:
        if lp.header in heads:
            out = {s for x in lp.body for s in cfg.blocks[x].succs if s not in lp.body}
            for e in lp.back_edges:
                exits[e] = out
    out_state: dict[int, bool] = {}
    in_state: dict[int, bool] = {}

    def block_in(b: int, after: bool, emit) -> bool:
        p = after
        blk = cfg.blocks[b]
        for k in range(blk.end - 1, blk.start - 1, -1):
            ins = fn.instrs[k]
            if _is_publish(ins, prov, roles):
                p = True
            elif ins.kind in (ir.STORE, ir.BULK_STORE) and _buffer_params(prov, ins.index, roles) & xdata:
                if emit is not None and not p:
                    hit = sorted(_buffer_params(prov, ins.index, roles) & xdata)
                    emit(RawFinding("publish-before-writes", ins,
                                    "write to " + ", ".join(repr(roles.names[q]) for q in hit)
                                    + " (read by other CTAs) is not followed by any publish in its "
                                    "iteration: a publish before it signals data not yet written", tuple(hit)))
        return p

    order = list(reversed(cfg.rpo))
    changed = True
    while changed:
        changed = False
        for b in order:
            succs = cfg.blocks[b].succs
            vals = [(bool(exits[(b, s)]) and all(in_state.get(x, True) for x in exits[(b, s)]))
                    if (b, s) in exits else in_state.get(s, True) for s in succs]
            if not succs:
                after = False
            elif prov.guard_is_thread_varying(cfg.branch_instr(b).index) and len(succs) > 1:
                after = any(vals)
            else:
                after = all(vals)
            out_state[b] = after
            v = block_in(b, after, None)
            if in_state.get(b) != v:
                in_state[b] = v
                changed = True
    found: list[RawFinding] = []
    for b in cfg.rpo:
        block_in(b, out_state.get(b, False), found.append)
    return found
