"""Build what the audit reads, through the project's real build (`kernels.build`).

`audit_kernel` audits a manifest kernel; `build_op` builds any op class of the repository
(planted mutants are subclasses that fix a compile-time `mutant` option) through the same
build, by handing `kernels.build` a one-kernel manifest that names that class and keeps the
manifest kernel's roles. Nothing here runs on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from kernels.manifest import REPO_ROOT, KernelSpec, Manifest, load_manifest

from .audit import AuditReport, audit_ptx

# The protocols a `sync` parameter's tensor spec may name, each the audit role it becomes
# (kernels/ops/base.py TensorSpec.protocol): tagged words, work counters.
PROTOCOLS = ("tagged", "claims")


def _build_module():
    from kernels import build  # imported lazily: it is heavy and the GPU host never needs it

    return build


def op_spec(spec: KernelSpec, op: str, name: str | None = None) -> KernelSpec:
    """`spec` with another op class ("module:Class"), e.g. one of its planted mutants."""
    return dataclasses.replace(spec, name=name or spec.name, op=op)


def mutant_op(spec: KernelSpec, mutant: str) -> str:
    """The op ("module:Class") of `spec`'s planted mutant `mutant`: the class `<Op>_<mutant>` of
    validation/race/specimens/mutants.py (the shipped kernels' mutants), else of the op's own
    module (the specimens keep theirs beside them)."""
    from validation.race.specimens import mutants

    mod, _, cls = spec.op.partition(":")
    name = f"{cls}_{mutant}"
    return f"{mutants.__name__}:{name}" if hasattr(mutants, name) else f"{mod}:{name}"


def mutant_spec(spec: KernelSpec, mutant: str) -> KernelSpec:
    """`spec` with its planted mutant `mutant` as the op, named `<kernel>__<mutant>`."""
    return op_spec(spec, mutant_op(spec, mutant), name=f"{spec.name}__{mutant}")


def build_variant_of(spec: KernelSpec, shape: dict | None = None, tunables: dict | None = None,
                     root: Path | None = None):
    """Build one variant of `spec` (default: its first validation shape, default tunables)."""
    build = _build_module()
    man = Manifest({spec.name: spec}, Path("manifest.toml"))
    kwargs = {"manifest": man}
    if root is not None:
        kwargs["root"] = Path(root)
    return build.build_variant(spec.name, dict(shape or spec.shapes[0]), tunables, **kwargs)


def _meta(art) -> dict:
    """The artifact's meta.json: `art.meta` (kernels.build), else the file its paths name or the
    one beside its PTX (a plan's build folder); {} where there is none."""
    meta = getattr(art, "meta", None)
    if isinstance(meta, dict):
        return meta
    paths = getattr(art, "paths", {}) or {}
    path = Path(paths.get("meta") or Path(paths["ptx"]).with_name("meta.json"))
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def audit_artifact(art, spec: KernelSpec, *, kernel: str | None = None) -> AuditReport:
    """Audit a build artifact (its kernel.ptx and kernel.sass) against the roles in `spec`."""
    ptx = Path(art.paths["ptx"]).read_text()
    sass = Path(art.paths["sass"]).read_text() if Path(art.paths["sass"]).is_file() else None
    roles = [p.role for p in spec.params]
    names = [p.name for p in spec.params]
    # a sync buffer this variant uses as tagged words or work counters (its tensor spec's
    # protocol, in meta.json)
    built = {q["name"]: q.get("spec", {}) for q in _meta(art).get("params", [])}
    roles = [built.get(n, {}).get("protocol") if r == "sync" and built.get(n, {}).get("protocol") in PROTOCOLS
             else r for r, n in zip(roles, names)]
    directions = [getattr(p, "direction", None) or "in" for p in spec.params]
    # a task table's declaration of what each slot points to (the manifest's `points_to`, when
    # the kernel has one: {param: {"stride": BYTES, "slots": {OFFSET: ROLE}}})
    points_to = getattr(spec, "points_to", None) or None
    return audit_ptx(ptx, roles, sass_text=sass, param_names=names, kernel=kernel or spec.name,
                     syncs=spec.syncs_across_ctas or None, source_root=REPO_ROOT,  # None: from the roles
                     directions=directions, points_to=points_to,
                     stages=[(st.name, st.reads, st.writes) for st in getattr(spec, "stages", ())] or None,
                     stage_counters=getattr(spec, "stage_counters", None))


def audit_kernel(name: str, *, shape: dict | None = None, tunables: dict | None = None,
                 mutant: str | None = None, manifest: Manifest | None = None,
                 root: Path | None = None) -> AuditReport:
    """Build (or reuse from the build cache) and audit one variant of manifest kernel `name`.

    `mutant` selects a planted mutant of the kernel's op (a class named `<Op>_<mutant>`,
    `mutant_op`); the roles stay the manifest's. Raises kernels.manifest.ManifestError for an
    unknown kernel and kernels.build.BuildError when the build fails.
    """
    spec = (manifest or load_manifest()).kernel(name)
    label = name
    if mutant is not None:
        spec = mutant_spec(spec, mutant)
        label = f"{name} [mutant {mutant}]"
    t0 = time.perf_counter()
    art = build_variant_of(spec, shape, tunables, root=root)
    rep = audit_artifact(art, spec, kernel=label)
    rep.seconds = time.perf_counter() - t0
    return rep
