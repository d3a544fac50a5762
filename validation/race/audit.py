"""The static audit: PTX (and, when given, the SASS that runs) against the parameter roles.

`audit_ptx` is the one entry point; `audit_kernel` (in `artifacts`) builds a manifest kernel
and calls it. A finding carries its rule id, severity, the PTX and SASS locations and the
source line when line info exists. A PTX finding and a SASS finding of the same rule, parameter
and source line are one finding seen in both; a finding only in the SASS means ptxas moved or
rewrote the code after the PTX (the motivating bug: an nc load hoisted above a spin).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import ir
from .cfg import CFG
from .dataflow import LOADED_PTR, UNKNOWN_SLOT, analyze, slot_index
from .ptx import parse_ptx
from .stages import stage_access_findings, stage_wait_findings
from .rules import ERROR, RULES, RawFinding, Roles, check_function
from .sass import parse_sass

BUFFER_ROLES = ("static", "activation", "sync", "scratch")
# "tagged": a sync buffer of tagged words (a manifest `sync` parameter whose tensor spec says
# protocol "tagged"): every word is its own flag (0: not written yet), nothing else is ordered
# by it (validation/race/rules.py, rule tagged-weak-access)
# "claims": a sync buffer of work counters (protocol "claims"): every word hands out item indices
# by atomic adds and orders nothing, so no ordering rule takes it for a flag (rule claims-access)
ALL_ROLES = BUFFER_ROLES + ("scalar", "tagged", "claims")


class AuditInputError(ValueError):
    """Bad audit input: unreadable PTX, unknown parameter, unknown role."""


@dataclass
class Finding:
    rule: str
    severity: str
    message: str
    params: list[str] = field(default_factory=list)
    ptx: str | None = None  # "ptx line N: <instruction>"
    sass: str | None = None  # "sass 0xADDR: <instruction>"
    source: str | None = None  # "file.py:LINE"

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        where = "; ".join(x for x in (self.source and f"source {self.source}", self.ptx, self.sass) if x)
        return f"[{self.severity}] {self.rule}: {self.message} ({where})"


@dataclass
class AuditReport:
    kernel: str
    entry: str
    params: list[dict]  # index, name, role
    findings: list[Finding]
    checked: list[str]  # "ptx", "sass"
    instructions: dict[str, int]
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)  # seconds per analysis (parse, cfg, rules)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def clean(self) -> bool:
        """No finding of severity error."""
        return not self.errors

    def rules_hit(self) -> set[str]:
        return {f.rule for f in self.findings}

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel, "entry": self.entry, "params": self.params,
            "clean": self.clean, "checked": self.checked, "instructions": self.instructions,
            "seconds": round(self.seconds, 3), "findings": [f.to_dict() for f in self.findings],
        }


def _rel(path: str, root: Path | None) -> str:
    if root is not None:
        try:
            return str(Path(path).resolve().relative_to(root.resolve()))
        except (ValueError, OSError):
            pass
    return Path(path).name if Path(path).is_absolute() else path


def resolve_roles(params: list[ir.ParamDecl], spec: dict | list | None,
                  names: list[str] | None = None) -> tuple[dict[int, str], dict[int, str]]:
    """Roles by PTX parameter index from `spec`: a list in launch order, or a dict keyed by
    parameter name (from `names`, or the PTX name) or index. Unnamed parameters default to
    activation. Raises AuditInputError for unknown parameters or roles."""
    n = len(params)
    names = list(names) if names else []
    if names and len(names) != n:
        raise AuditInputError(f"{len(names)} parameter names given, the PTX entry has {n} parameters")
    by_name = {nm: i for i, nm in enumerate(names)}
    for p in params:
        by_name.setdefault(p.name, p.index)
        by_name.setdefault(f"param_{p.index}", p.index)
    roles = {p.index: "activation" for p in params}
    if isinstance(spec, (list, tuple)):
        if len(spec) != n:
            raise AuditInputError(f"{len(spec)} roles given, the PTX entry has {n} parameters")
        items = list(enumerate(spec))
    else:
        items = list((spec or {}).items())
    for key, role in items:
        if role not in ALL_ROLES:
            raise AuditInputError(f"unknown role {role!r} for parameter {key!r}; roles are {', '.join(ALL_ROLES)}")
        if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
            idx = int(key)
            if not 0 <= idx < n:
                raise AuditInputError(f"parameter index {idx} out of range: the PTX entry has {n} parameters")
        elif key in by_name:
            idx = by_name[key]
        else:
            known = ", ".join(names) if names else f"0..{n - 1}"
            raise AuditInputError(f"unknown parameter {key!r}; parameters are {known}")
        roles[idx] = role
    disp = {p.index: (names[p.index] if names else f"param_{p.index}") for p in params}
    return roles, disp


DIRECTIONS = ("in", "out", "inout")


def _resolve_directions(params, spec, disp: dict[int, str]) -> dict[int, str]:
    """Directions by PTX index from a list in parameter order or a dict keyed by name/index.
    Parameters not named have no direction (not checked)."""
    if spec is None:
        return {}
    by_name = {nm: i for i, nm in disp.items()}
    items = list(enumerate(spec)) if isinstance(spec, (list, tuple)) else list(spec.items())
    out = {}
    for key, d in items:
        if d not in DIRECTIONS:
            raise AuditInputError(f"unknown direction {d!r} for parameter {key!r}; directions are {', '.join(DIRECTIONS)}")
        idx = int(key) if isinstance(key, int) or str(key).isdigit() else by_name.get(key)
        if idx is None or idx not in disp:
            raise AuditInputError(f"unknown parameter {key!r} in the directions")
        out[idx] = d
    return out


def _resolve_tables(points_to: dict | None, disp: dict[int, str], roles: dict[int, str]):
    """Declared task tables: `points_to` maps a table parameter (name or index) to
    {"stride": BYTES, "slots": {OFFSET: ROLE}}: every entry of the table is `stride` bytes, and
    the 8 bytes at `OFFSET` of each entry hold a pointer to a buffer of role ROLE (or, for role
    "scalar", a number that is not an address). Returns (tables: param -> stride, slot roles by
    virtual index, slot display names)."""
    if not points_to:
        return {}, {}, {}
    by_name = {nm: i for i, nm in disp.items()}
    tables, slot_roles, slot_names = {}, {}, {}
    for key, decl in points_to.items():
        idx = int(key) if isinstance(key, int) or str(key).isdigit() else by_name.get(key)
        if idx is None or idx not in disp:
            raise AuditInputError(f"points-to: unknown table parameter {key!r}")
        if not isinstance(decl, dict) or not isinstance(decl.get("slots"), dict) or not decl["slots"]:
            raise AuditInputError(f"points-to {key!r}: expected {{'stride': BYTES, 'slots': {{OFFSET: ROLE}}}}")
        try:
            stride = int(decl.get("stride", 0))
            slots = {int(o): r for o, r in decl["slots"].items()}
        except (TypeError, ValueError):
            raise AuditInputError(f"points-to {key!r}: stride and slot offsets must be integers") from None
        if stride < 0 or any(not 0 <= o < (stride or UNKNOWN_SLOT) for o in slots):
            raise AuditInputError(f"points-to {key!r}: every slot offset must lie inside one entry (0..stride-1)")
        for o, r in slots.items():
            if r not in BUFFER_ROLES + ("scalar",):
                raise AuditInputError(f"points-to {key!r} slot {o}: unknown role {r!r}")
        tables[idx] = stride
        for o, r in slots.items():
            slot_roles[slot_index(idx, o)] = r
            slot_names[slot_index(idx, o)] = f"{disp[idx]}[+{o}]"
    return tables, slot_roles, slot_names


def audit_ptx(ptx_text: str, roles: dict | list | None = None, *, sass_text: str | None = None,
              param_names: list[str] | None = None, kernel: str | None = None,
              entry: str | None = None, syncs: bool | None = None,
              source_root: Path | None = None, directions: dict | list | None = None,
              points_to: dict | None = None, stages: list | None = None,
              stage_counters: str | None = None) -> AuditReport:
    """Audit one PTX entry (and its SASS when `sass_text` is given) against parameter roles.

    `roles`: a list in parameter order, or a dict keyed by name/index (unnamed: activation).
    `syncs`: whether the kernel synchronizes across CTAs (default: it has a `sync` or `tagged`
    parameter).
    `directions`: "in" / "out" / "inout" per parameter (list or dict; the manifest's): a store
    to an "in" buffer is an error.
    `points_to`: task tables whose entries hold pointers (see `_resolve_tables`): a pointer
    loaded from a declared slot is audited as a buffer of the slot's role.
    `stages`: a staged kernel's (name, reads, writes) in the order of its one declared task
    table's entries: an access derived from a stage's entry is checked against what the stage
    declares (validation/race/stages.py).
    `stage_counters`: the name of the `sync` parameter whose word s is stage s's completion
    counter: every load of a stage's output is checked against the acquires of those words.
    Raises AuditInputError when the PTX has no entry (or not `entry`), or roles do not fit.
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    try:
        funcs = parse_ptx(ptx_text)
    except ValueError as e:
        raise AuditInputError(f"unreadable PTX: {e}") from None
    if entry is not None:
        funcs = [f for f in funcs if f.name == entry]
        if not funcs:
            raise AuditInputError(f"no entry {entry!r} in the PTX")
    if len(funcs) > 1:
        raise AuditInputError("the PTX has several entries: name one (" + ", ".join(f.name for f in funcs) + ")")
    fn = funcs[0]
    by_index, disp = resolve_roles(fn.params, roles, param_names)
    if syncs is None:
        syncs = bool({"sync", "tagged"} & set(by_index.values()))
    dirs = _resolve_directions(fn.params, directions, disp)
    tables, slot_roles, slot_names = _resolve_tables(points_to, disp, by_index)
    timings["parse"] = time.perf_counter() - t0

    def lap(key: str, t: float) -> None:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t

    t = time.perf_counter()
    cfg = CFG(fn)
    prov = analyze(cfg, tables)
    lap("cfg+provenance", t)
    all_roles = dict(by_index)
    all_roles[LOADED_PTR] = "activation"  # a pointer loaded from memory, undeclared: audited as data
    all_roles.update(slot_roles)
    names = dict(disp)
    names[LOADED_PTR] = "<pointer loaded from memory>"
    names.update(slot_names)
    r = Roles(all_roles, names, directions=dirs, tables=set(tables))
    r.note_accesses(fn, prov)
    raw = [(fn, f) for f in check_function(cfg, prov, r, syncs=syncs, timings=timings)]
    if stages and len(tables) == 1:
        (table, stride), = tables.items()
        raw += [(fn, f) for f in stage_access_findings(fn, prov, r, table, stride, list(stages))]
    if stages and stage_counters is not None:
        idx = next((i for i, n in disp.items() if n == stage_counters), None)
        if idx is None:
            raise AuditInputError(f"stage_counters {stage_counters!r} is no parameter of the kernel")
        t = time.perf_counter()
        raw += [(fn, f) for f in stage_wait_findings(cfg, prov, r, idx, list(stages))]
        lap("producer-waits", t)
    checked = ["ptx"]
    counts = {"ptx": len(fn.instrs)}
    if sass_text is not None:
        t = time.perf_counter()
        sfuncs = [f for f in parse_sass(sass_text, fn.params) if f.name == fn.name] or parse_sass(sass_text, fn.params)
        sfn = sfuncs[0]
        scfg = CFG(sfn)
        sprov = analyze(scfg, tables)
        lap("cfg+provenance", t)
        raw += [(sfn, f) for f in check_function(scfg, sprov, r, syncs=syncs, timings=timings)]
        checked.append("sass")
        counts["sass"] = len(sfn.instrs)
    findings = _merge(raw, names, source_root)
    return AuditReport(
        kernel=kernel or fn.name, entry=fn.name,
        params=[{"index": p.index, "name": disp[p.index], "role": by_index[p.index]} for p in fn.params],
        findings=findings, checked=checked, instructions=counts, seconds=time.perf_counter() - t0,
        timings={k: round(v, 4) for k, v in timings.items()},
    )


def _merge(raw: list[tuple[ir.Function, RawFinding]], disp: dict[int, str], root) -> list[Finding]:
    merged: dict[tuple, Finding] = {}
    for fn, rf in raw:
        rule = RULES[rf.rule]
        src = f"{_rel(rf.instr.loc.file, root)}:{rf.instr.loc.line}" if rf.instr.loc else None
        key = (rf.rule, rf.params, src if src else (fn.dialect, rf.instr.index))
        where = f"{fn.location(rf.instr)}: {rf.instr.text}"
        f = merged.get(key)
        if f is None:
            f = Finding(rule.id, rule.severity, rf.message, [disp.get(p, str(p)) for p in rf.params], source=src)
            merged[key] = f
        if fn.dialect == "sass":
            f.sass = f.sass or where
        else:
            f.ptx = f.ptx or where
    out = list(merged.values())
    for f in out:
        if f.sass and not f.ptx:
            f.message += " (seen in the SASS only: ptxas moved or rewrote this access)"
    order = {r: i for i, r in enumerate(RULES)}
    out.sort(key=lambda f: (f.severity != ERROR, order[f.rule], f.source or "", f.ptx or "", f.sass or ""))
    return out
