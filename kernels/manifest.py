"""The kernel manifest: the one place that declares each kernel's scope.

`kernels/manifest.toml` names, per kernel: its source files, its op class, its reference op,
the role of every launch parameter (in launch order), its tunables with their ranges, and its
validation shapes; for a kernel that reads a task table, what each slot of an entry points to
(`points_to`); for a persistent kernel made of stages, its stages (`stages`: the scope units of
a fast-track change, with the buffers each reads and writes and the protocol between them); and
the decode paths (`[paths.<name>]`: the kernels one model's decode step
runs, and the composite entry whose evidence covers them end to end). The gate, the audit and the
agent read it through this module; nothing else decides a kernel's scope.

Roles:
  static      weights: read-only for the whole launch (the only buffers allowed ld.global.nc)
  activation  inputs/outputs written or read by this launch or by other CTAs of it
  sync        flags and counters used for cross-CTA synchronisation
  scratch     workspace (partial sums, ...) private to the launch
  scalar      a by-value integer/float parameter (not a buffer)
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("static", "activation", "sync", "scratch", "scalar")
MANIFEST_PATH = Path(__file__).with_name("manifest.toml")
REPO_ROOT = Path(__file__).resolve().parent.parent


class ManifestError(ValueError):
    """The manifest is malformed, or names a kernel that it does not declare."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    role: str
    # "out" buffers are written by the kernel; used by the validator (poisoning, coverage).
    direction: str = "in"


@dataclass(frozen=True)
class Tunable:
    name: str
    choices: tuple
    default: Any
    # choices that only an explorer builds (instrumentation, timing bounds): valid builds, but not
    # ops, so never candidates of a tuner (`tuned_choices`)
    explore_only: tuple = ()

    @property
    def tuned_choices(self) -> tuple:
        return tuple(c for c in self.choices if c not in self.explore_only)


@dataclass(frozen=True)
class Stage:
    """One stage of a persistent kernel (`[[kernels.K.stages]]`): the declared sources that hold
    its device code, the buffers it reads and writes, and the protocol by which it waits for the
    stages that write what it reads (e.g. "counters"), and the kernel's tunables that belong to
    it alone (`tunables`: what the tuner searches for this stage, `propose-optimization --stage`).
    A fast-track change of a staged kernel touches one stage (validation/policy.py)."""

    name: str
    sources: tuple[str, ...]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    protocol: str = ""
    tunables: tuple[str, ...] = ()


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    op: str  # "module:Class" of the op (QuACK-style class)
    reference: str  # "module:function" of the pure-torch reference
    sources: tuple[str, ...]  # repo-relative paths that belong to this kernel
    params: tuple[ParamSpec, ...]
    tunables: tuple[Tunable, ...]
    shapes: tuple[dict, ...]  # one dict per variant (batch and problem size)
    syncs_across_ctas: bool = False
    extra: dict = field(default_factory=dict)
    # task-table parameter -> {"stride": entry bytes, "slots": {byte offset: role}} (the audit's
    # `points_to`, validation/race/MODEL.md); None when the kernel reads no task table
    points_to: dict | None = None
    stages: tuple[Stage, ...] = ()
    # the `sync` parameter whose int32 word s is stage s's completion counter (stages in
    # order): the audit then checks that every load of a stage's output follows an acquire of
    # that stage's counter, or of one whose stage waits for it (validation/race/stages.py)
    stage_counters: str | None = None

    def stage(self, name: str) -> Stage:
        for st in self.stages:
            if st.name == name:
                return st
        known = ", ".join(st.name for st in self.stages) or "none"
        raise ManifestError(f"kernel {self.name!r} has no stage {name!r} (stages: {known})")

    def stage_of_tunable(self, tunable: str) -> str | None:
        """The stage that declares `tunable` as its own, else None (a kernel-wide tunable)."""
        return next((st.name for st in self.stages if tunable in st.tunables), None)

    def stages_of(self, path: str) -> list[str]:
        """The stages whose sources include the repo-relative `path` (several for a shared file)."""
        return [st.name for st in self.stages if path in st.sources]

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise ManifestError(f"kernel {self.name!r} has no parameter {name!r}")

    def roles(self) -> dict[str, str]:
        return {p.name: p.role for p in self.params}

    def tunable_defaults(self) -> dict[str, Any]:
        return {t.name: t.default for t in self.tunables}


@dataclass(frozen=True)
class DecodePath:
    """The kernels one model's decode step runs (`[paths.<name>]`), and its composite entry: the
    name under which evidence covers the path end to end (an evidence bundle whose
    `change.kernel` is `composite`, e.g. `fasttrack validate block`). A fast-track change may
    touch several kernels when they all lie in one path (validation/policy.py)."""

    name: str
    kernels: tuple[str, ...]
    composite: str
    description: str = ""


@dataclass(frozen=True)
class Manifest:
    kernels: dict[str, KernelSpec]
    path: Path
    paths: dict[str, DecodePath] = field(default_factory=dict)

    def paths_of(self, kernel: str) -> list[str]:
        """The decode paths that run `kernel`."""
        return [p.name for p in self.paths.values() if kernel in p.kernels]

    def kernel(self, name: str) -> KernelSpec:
        try:
            return self.kernels[name]
        except KeyError:
            known = ", ".join(sorted(self.kernels)) or "(none)"
            raise ManifestError(f"unknown kernel {name!r}; the manifest declares: {known}") from None

    def owners_of(self, path: str) -> list[str]:
        """Kernels whose declared sources include the repo-relative `path`."""
        return [k.name for k in self.kernels.values() if path in k.sources]


def _expand_shapes(name: str, raw: dict) -> tuple[dict, ...]:
    """`[kernels.X.shapes]` holds axes; variants are their product.

    `batch = [...]` and `problems = [{...}, ...]` are the usual axes; any other key whose value is
    a list is another axis; scalars are copied into every variant.
    """
    if not raw:
        raise ManifestError(f"kernel {name!r}: no validation shapes declared")
    axes: list[tuple[str, list]] = []
    fixed: dict = {}
    for key, val in raw.items():
        if isinstance(val, list):
            if not val:
                raise ManifestError(f"kernel {name!r}: shape axis {key!r} is empty")
            axes.append((key, val))
        else:
            fixed[key] = val
    variants = []
    for combo in itertools.product(*(v for _, v in axes)):
        d = dict(fixed)
        for (key, _), val in zip(axes, combo):
            if key == "problems":
                if not isinstance(val, dict):
                    raise ManifestError(f"kernel {name!r}: each of 'problems' must be a table")
                d.update(val)
            else:
                d[key] = val
        variants.append(d)
    return tuple(variants)


def _parse_kernel(name: str, raw: dict) -> KernelSpec:
    def need(key: str, typ):
        if key not in raw:
            raise ManifestError(f"kernel {name!r}: missing required key {key!r}")
        if not isinstance(raw[key], typ):
            raise ManifestError(f"kernel {name!r}: {key!r} must be {typ.__name__}")
        return raw[key]

    params = []
    seen = set()
    for i, p in enumerate(need("params", list)):
        if not isinstance(p, dict) or "name" not in p or "role" not in p:
            raise ManifestError(f"kernel {name!r}: params[{i}] needs a name and a role")
        if p["role"] not in ROLES:
            raise ManifestError(
                f"kernel {name!r}: parameter {p['name']!r} has role {p['role']!r}; "
                f"roles are {', '.join(ROLES)}"
            )
        if p["name"] in seen:
            raise ManifestError(f"kernel {name!r}: parameter {p['name']!r} declared twice")
        seen.add(p["name"])
        direction = p.get("direction", "in")
        if direction not in ("in", "out", "inout"):
            raise ManifestError(f"kernel {name!r}: parameter {p['name']!r} direction {direction!r}")
        if p["role"] == "static" and direction != "in":
            raise ManifestError(
                f"kernel {name!r}: parameter {p['name']!r} is static (read-only) but direction {direction!r}"
            )
        params.append(ParamSpec(p["name"], p["role"], direction))

    tunables = []
    for tname, t in raw.get("tunables", {}).items():
        if not isinstance(t, dict) or "choices" not in t or "default" not in t:
            raise ManifestError(f"kernel {name!r}: tunable {tname!r} needs choices and default")
        if t["default"] not in t["choices"]:
            raise ManifestError(
                f"kernel {name!r}: tunable {tname!r} default {t['default']!r} not among its choices"
            )
        explore_only = tuple(t.get("explore_only", ()))
        if not set(explore_only) <= set(t["choices"]) or t["default"] in explore_only:
            raise ManifestError(f"kernel {name!r}: tunable {tname!r} explore_only {list(explore_only)} must be "
                                f"choices other than the default")
        tunables.append(Tunable(tname, tuple(t["choices"]), t["default"], explore_only))

    sources = tuple(need("sources", list))
    for s in sources:
        if s.startswith("/") or ".." in Path(s).parts:
            raise ManifestError(f"kernel {name!r}: source {s!r} must be a repo-relative path")

    points_to = _parse_points_to(name, raw.get("points_to"), {p.name: p for p in params})
    stages = _parse_stages(name, raw.get("stages"), sources, tuple(t.name for t in tunables))
    stage_counters = raw.get("stage_counters")
    if stage_counters is not None:
        roles = {p.name: p.role for p in params}
        if not isinstance(stage_counters, str) or roles.get(stage_counters) != "sync" or not stages:
            raise ManifestError(f"kernel {name!r}: stage_counters must name a `sync` parameter of a kernel with "
                                f"stages, got {stage_counters!r}")

    return KernelSpec(
        name=name,
        description=raw.get("description", ""),
        op=need("op", str),
        reference=need("reference", str),
        sources=sources,
        params=tuple(params),
        tunables=tuple(tunables),
        shapes=_expand_shapes(name, raw.get("shapes", {})),
        syncs_across_ctas=bool(raw.get("syncs_across_ctas", False)),
        extra={k: v for k, v in raw.items() if k not in {
            "description", "op", "reference", "sources", "params", "tunables", "shapes",
            "syncs_across_ctas", "points_to", "stages", "stage_counters"}},
        points_to=points_to,
        stages=stages,
        stage_counters=stage_counters,
    )


SLOT_BYTES = 8  # one task-table slot: a 64-bit pointer (or, for role "scalar", a 64-bit number)


def _parse_points_to(name: str, raw, params: dict[str, ParamSpec]) -> dict | None:
    """`[kernels.K.points_to.<param>]` with `stride = BYTES` and `slots = { "OFFSET" = "ROLE" }`
    -> {param: {"stride": int, "slots": {int: role}}}. TOML keys are strings, so the offsets are
    converted to byte offsets; each slot's 8 bytes lie inside one entry and overlap no other."""
    if raw is None:
        return None
    where = f"kernel {name!r}: points_to"
    if not isinstance(raw, dict) or not raw:
        raise ManifestError(f"{where} must be a table of [kernels.{name}.points_to.<param>] tables")
    out = {}
    for param, decl in raw.items():
        at = f"{where} {param!r}"
        if param not in params:
            raise ManifestError(f"{at}: not a parameter of the kernel ({', '.join(params) or 'none'})")
        if params[param].role == "scalar":
            raise ManifestError(f"{at}: the parameter is a scalar, not a task table in memory")
        if not isinstance(decl, dict):
            raise ManifestError(f"{at} must be a table with stride and slots")
        extra = set(decl) - {"stride", "slots"}
        if extra:
            raise ManifestError(f"{at}: unknown key(s) {', '.join(sorted(extra))} (stride, slots)")
        stride = decl.get("stride")
        if not isinstance(stride, int) or isinstance(stride, bool) or stride < SLOT_BYTES:
            raise ManifestError(f"{at}: stride must be an integer number of bytes, at least {SLOT_BYTES}")
        slots_raw = decl.get("slots")
        if not isinstance(slots_raw, dict) or not slots_raw:
            raise ManifestError(f"{at}: slots must be a non-empty table {{ \"OFFSET\" = \"ROLE\" }}")
        slots: dict[int, str] = {}
        for key, role in slots_raw.items():
            slot = f"{at} slot {key!r}"
            if not str(key).isdigit():
                raise ManifestError(f"{slot}: the offset must be a non-negative integer number of bytes")
            off = int(key)
            if off in slots:
                raise ManifestError(f"{slot}: offset {off} declared twice")
            if off % SLOT_BYTES or off + SLOT_BYTES > stride:
                raise ManifestError(f"{slot}: a slot is {SLOT_BYTES} aligned bytes inside one {stride}-byte "
                                    f"entry (offsets 0, {SLOT_BYTES}, ... {stride - SLOT_BYTES})")
            if role not in ROLES:
                raise ManifestError(f"{slot}: role {role!r} is not a role ({', '.join(ROLES)})")
            slots[off] = role
        out[param] = {"stride": stride, "slots": dict(sorted(slots.items()))}
    return out


def _parse_stages(name: str, raw, sources: tuple[str, ...], tunables: tuple[str, ...] = ()) -> tuple[Stage, ...]:
    """`[[kernels.K.stages]]` with name, sources (a subset of the kernel's declared sources),
    reads and writes (buffer names), protocol and tunables (names of the kernel's tunables, each
    of at most one stage)."""
    if raw is None:
        return ()
    where = f"kernel {name!r}: stages"
    if not isinstance(raw, list) or not raw:
        raise ManifestError(f"{where} must be an array of [[kernels.{name}.stages]] tables")
    out: list[Stage] = []
    for i, st in enumerate(raw):
        if not isinstance(st, dict):
            raise ManifestError(f"{where}[{i}] must be a table")
        sname = st.get("name")
        if not isinstance(sname, str) or not sname:
            raise ManifestError(f"{where}[{i}]: name must be a non-empty string")
        at = f"kernel {name!r}: stage {sname!r}"
        extra = set(st) - {"name", "sources", "reads", "writes", "protocol", "tunables"}
        if extra:
            raise ManifestError(f"{at}: unknown key(s) {', '.join(sorted(extra))} (name, sources, reads, "
                                "writes, protocol, tunables)")
        if sname in {x.name for x in out}:
            raise ManifestError(f"{at}: declared twice")

        def names(key: str, required: bool) -> tuple[str, ...]:
            v = st.get(key, None if required else [])
            if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or (required and not v):
                raise ManifestError(f"{at}: {key} must be a {'non-empty ' if required else ''}list of strings")
            if len(set(v)) != len(v):
                raise ManifestError(f"{at}: {key} names {sorted(x for x in set(v) if v.count(x) > 1)[0]!r} twice")
            return tuple(v)

        ssources = names("sources", True)
        undeclared = [x for x in ssources if x not in sources]
        if undeclared:
            raise ManifestError(f"{at}: source {undeclared[0]} is not among the kernel's declared sources")
        protocol = st.get("protocol", "")
        if not isinstance(protocol, str):
            raise ManifestError(f"{at}: protocol must be a string (e.g. \"counters\")")
        stunables = names("tunables", False)
        for t in stunables:
            if t not in tunables:
                raise ManifestError(f"{at}: tunable {t!r} is not among the kernel's tunables")
            owner = next((x.name for x in out if t in x.tunables), None)
            if owner:
                raise ManifestError(f"{at}: tunable {t!r} already belongs to stage {owner!r}")
        out.append(Stage(sname, ssources, names("reads", False), names("writes", False), protocol, stunables))
    return tuple(out)


def parse_manifest(text: str, path: Path = MANIFEST_PATH) -> Manifest:
    """Parse manifest TOML text; raises ManifestError with the reason."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path.name}: not valid TOML: {e}") from None
    kernels = raw.get("kernels")
    if not isinstance(kernels, dict) or not kernels:
        raise ManifestError(f"{path.name}: no [kernels.*] tables")
    specs = {n: _parse_kernel(n, k) for n, k in kernels.items()}
    return Manifest(specs, path, _parse_paths(raw.get("paths", {}), specs, path))


def _parse_paths(raw, specs: dict, path: Path) -> dict[str, DecodePath]:
    if not isinstance(raw, dict):
        raise ManifestError(f"{path.name}: [paths] must be a table of [paths.<name>] tables")
    out = {}
    for name, p in raw.items():
        where = f"{path.name}: path {name!r}"
        if not isinstance(p, dict):
            raise ManifestError(f"{where} must be a table")
        extra = set(p) - {"kernels", "composite", "description"}
        if extra:
            raise ManifestError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")
        ks = p.get("kernels")
        if not isinstance(ks, list) or not ks or not all(isinstance(k, str) for k in ks):
            raise ManifestError(f"{where}: kernels must be a non-empty list of kernel names")
        missing = [k for k in ks if k not in specs]
        if missing:
            raise ManifestError(f"{where}: kernel(s) {', '.join(missing)} not declared under [kernels]")
        comp = p.get("composite")
        if not isinstance(comp, str) or not comp:
            raise ManifestError(f"{where}: composite must name the path's end-to-end evidence entry")
        if comp in specs:
            raise ManifestError(f"{where}: composite {comp!r} is a kernel's name; it names the whole path")
        out[name] = DecodePath(name, tuple(ks), comp, str(p.get("description", "")))
    return out


def load_manifest(path: Path | None = None) -> Manifest:
    """Load the repository's manifest (or the one at `path`)."""
    p = Path(path) if path else MANIFEST_PATH
    try:
        text = p.read_text()
    except OSError as e:
        raise ManifestError(f"cannot read manifest {p}: {e.strerror}") from None
    return parse_manifest(text, p)


def resolve(dotted: str):
    """Import "module:attr" and return the attribute."""
    import importlib

    mod, _, attr = dotted.partition(":")
    if not mod or not attr:
        raise ManifestError(f"{dotted!r} is not of the form module:attribute")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ManifestError(f"cannot import {mod!r}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ManifestError(f"{mod!r} has no attribute {attr!r}") from None
    return obj
