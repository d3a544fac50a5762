"""The static race audit on real kernels, built from source through the CuTe DSL build.

Every planted mutant must be flagged by the rule written for it, every correct kernel must pass,
and the motivating bug (an invariant load hoisted above an acquire spin) must reproduce.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from kernels.manifest import load_manifest  # noqa: E402
from validation.race import ir  # noqa: E402
from validation.race.artifacts import audit_kernel, build_variant_of, mutant_spec  # noqa: E402
from validation.race.cfg import CFG  # noqa: E402
from validation.race.ptx import parse_ptx  # noqa: E402

# mutant -> the rule that must flag it
PRODCONS_MUTANTS = {
    "nc_activation": "nc-load-mutable",
    "load_before_wait": "load-before-wait",
    "relaxed_spin": "relaxed-spin-no-fence",
    "relaxed_publish": "relaxed-publish",
    "missing_barrier": "publish-before-writes",
}
SPLITK_MUTANTS = {
    "relaxed_atomic": "relaxed-publish",
    "missing_barrier": "publish-before-writes",
    "nc_partials": "nc-load-mutable",
    "divergent_barrier": "barrier-divergent",
}


PDL_SHAPE = {"batch": 1, "n": 3584, "k": 7168, "out_dtype": "bfloat16"}


def _gemv_pdl_report(mutant: str | None):
    from validation.race.artifacts import audit_artifact

    spec = load_manifest().kernel("gemv")
    if mutant:
        spec = mutant_spec(spec, mutant)
    return audit_artifact(build_variant_of(spec, PDL_SHAPE, {"pdl": 1}), spec)


@pytest.mark.slow
def test_pdl_gemv_passes_and_its_hoisted_x_load_is_flagged():
    """gemv with programmatic dependent launch: the correct kernel (only weight loads before
    griddepcontrol.wait) is clean in PTX and SASS; the planted mutant that loads x before the
    wait is flagged by load-before-griddep-wait in both, naming x and the source line."""
    good = _gemv_pdl_report(None)
    assert good.clean and good.checked == ["ptx", "sass"], [str(f) for f in good.findings]
    bad = _gemv_pdl_report("x_before_wait")
    hits = [f for f in bad.errors if f.rule == "load-before-griddep-wait"]
    assert hits and {tuple(f.params) for f in hits} == {("x",)}, [str(f) for f in bad.findings]
    # batch 1 is the stream design: the copy is issued in kernels/ops/parts/stream.py's copy_row
    assert all(f.ptx and f.sass and f.source.startswith(("kernels/ops/gemv.py:", "kernels/ops/parts/stream.py:"))
               for f in hits), [f.source for f in hits]
    assert "griddepcontrol.wait" in hits[0].message


def _ptx_of(kernel: str, mutant: str | None = None) -> str:
    spec = load_manifest().kernel(kernel)
    if mutant:
        spec = mutant_spec(spec, mutant)
    art = build_variant_of(spec)
    return Path(art.paths["ptx"]).read_text()


def test_motivating_bug_invariant_load_hoisted_above_the_spin():
    """The consumer's stage read through CopyG2ROp(invariant=True) lands outside the persistent
    loop, before the first acquire; the plain read stays behind the spin, dominated by it."""
    fn = parse_ptx(_ptx_of("prodcons", "nc_activation"))[0]
    cfg = CFG(fn)
    nc = [i for i in fn.instrs if i.kind == ir.LOAD and i.nc and "v4" in i.opcode and ".b32" in i.opcode]
    acq = [i for i in fn.instrs if i.kind == ir.LOAD and i.sem == ir.ACQUIRE]
    assert nc and acq
    stage_nc = [i for i in nc if not any(cfg.block_of[i.index] in lp.body for lp in cfg.loops
                                         if any(cfg.block_of[a.index] in lp.body for a in acq))]
    assert stage_nc, "expected an nc load hoisted out of every loop that holds an acquire"
    for i in stage_nc:
        # No acquire orders it, and it runs before the consumers' spin on every path to it.
        assert not any(cfg.instr_dominates(a.index, i.index) for a in acq)
        assert any(cfg.instr_dominates(i.index, a.index) for a in acq)

    good = parse_ptx(_ptx_of("prodcons"))[0]
    gcfg = CFG(good)
    gacq = [i for i in good.instrs if i.kind == ir.LOAD and i.sem == ir.ACQUIRE]
    stage_loads = [i for i in good.instrs if i.kind == ir.LOAD and not i.nc and i.sem == ir.WEAK
                   and ".v4." in i.opcode]
    assert stage_loads
    consumer_acq = [a for a in gacq if any(gcfg.instr_dominates(a.index, s.index) for s in stage_loads)]
    assert consumer_acq, "the plain stage loads must be dominated by an acquire"


@pytest.mark.parametrize("kernel", ["prodcons", "splitk_gemv", "gemv", "rmsnorm"])
def test_correct_kernels_pass(kernel):
    man = load_manifest()
    if kernel not in man.kernels:
        pytest.skip(f"{kernel} not in the manifest")
    rep = audit_kernel(kernel, manifest=man)
    assert rep.clean, [str(f) for f in rep.findings]
    assert rep.checked == ["ptx", "sass"]


@pytest.mark.slow
@pytest.mark.parametrize("kernel,mutant,rule", [("prodcons", m, r) for m, r in PRODCONS_MUTANTS.items()]
                         + [("splitk_gemv", m, r) for m, r in SPLITK_MUTANTS.items()])
def test_planted_mutant_flagged_by_its_rule(kernel, mutant, rule):
    rep = audit_kernel(kernel, mutant=mutant)
    assert not rep.clean
    assert rule in rep.rules_hit(), [str(f) for f in rep.findings]
    hit = [f for f in rep.findings if f.rule == rule]
    # Locations: the Python line always; the PTX location unless only the SASS shows it.
    assert all(f.source and f.source.startswith("validation/race/specimens/") for f in hit)
    assert all(f.ptx or f.sass for f in hit)


def test_nc_finding_located_in_ptx_sass_and_source():
    rep = audit_kernel("prodcons", mutant="nc_activation")
    (f,) = [f for f in rep.findings if f.rule == "nc-load-mutable"]
    assert f.params == ["stage"]
    assert "ld.global.nc" in f.ptx and "LDG.E.128.CONSTANT" in f.sass
    assert f.source.startswith("validation/race/specimens/prodcons.py:")
    # The static weight is read through nc loads too, and that is allowed.
    assert not any("'w'" in x.message for x in rep.findings)


@pytest.mark.slow
def test_static_audit_of_every_kernel_cold(tmp_path):
    """Cold: a fresh build folder, so every kernel is compiled and audited from scratch (its
    time goes to benchmarks/race_audit_rules.py, not here)."""
    man = load_manifest()
    reports = [audit_kernel(name, manifest=man, root=tmp_path) for name in man.kernels]
    assert all(r.clean for r in reports), [str(f) for r in reports for f in r.findings]


def _fixture_spec(op_class: str):
    from kernels.manifest import KernelSpec, ParamSpec

    return KernelSpec(
        name=f"cpasync_pdl__{op_class}", description="cp.async under PDL (race audit probe)",
        op=f"tests.fixtures.cpasync_pdl_op:{op_class}", reference="tests.fixtures.cpasync_pdl_op:none",
        sources=("tests/fixtures/cpasync_pdl_op.py",),
        params=(ParamSpec("x", "activation"), ParamSpec("w", "static"), ParamSpec("y", "activation", "out")),
        tunables=(), shapes=({"n": 256},))


def test_cp_async_of_an_activation_before_griddep_wait_is_flagged():
    """A real kernel that copies x into shared memory with cp.async before griddepcontrol.wait
    (SASS: LDGSTS before ACQBULK) races the previous kernel's writes of x; the same copy after
    the wait is clean. Before cp.async counted as a load, the mutant passed the audit."""
    from validation.race.artifacts import audit_artifact

    reports = {}
    for cls in ("CpAsyncPdlOp", "CpAsyncPdlOp_x_before_wait"):
        spec = _fixture_spec(cls)
        reports[cls] = audit_artifact(build_variant_of(spec), spec)
    good = reports["CpAsyncPdlOp"]
    assert good.clean and good.checked == ["ptx", "sass"], [str(f) for f in good.findings]
    bad = reports["CpAsyncPdlOp_x_before_wait"]
    hits = [f for f in bad.errors if f.rule == "load-before-griddep-wait"]
    assert len(hits) == 1 and hits[0].params == ["x"], [str(f) for f in bad.findings]
    assert "cp.async" in hits[0].ptx and "LDGSTS" in hits[0].sass
    assert hits[0].source.startswith("tests/fixtures/cpasync_pdl_op.py:")


@pytest.mark.slow
def test_prodcons_handshake_through_an_undeclared_buffer_is_flagged():
    """The real producer/consumer kernel with its flags declared an activation instead of sync
    (a manifest that hides the handshake): the consumers' spin is flagged in PTX and SASS at its
    source line; declared sync, it is clean."""
    from validation.race.audit import audit_ptx

    spec = load_manifest().kernel("prodcons")
    art = build_variant_of(spec)
    ptx, sass = (Path(art.paths[k]).read_text() for k in ("ptx", "sass"))
    names = [p.name for p in spec.params]
    roles = {p.name: p.role for p in spec.params}
    assert roles["flags"] == "sync" and audit_ptx(ptx, roles, sass_text=sass, param_names=names).clean
    rep = audit_ptx(ptx, {**roles, "flags": "activation"}, sass_text=sass, param_names=names)
    hits = [f for f in rep.findings if f.rule == "undeclared-sync"]
    assert hits and {tuple(f.params) for f in hits} == {("flags",)}, [str(f) for f in rep.findings]
    assert all(f.ptx and f.sass and f.source.startswith("validation/race/specimens/prodcons.py:") for f in hits)


@pytest.mark.slow
def test_cluster_reduction_is_clean_and_its_missing_entry_barrier_is_flagged():
    """gemv's warpgroup design at batch 64 (k split over a cluster of 2, the reduction pushing
    accumulators into the peer's shared memory): clean in PTX and SASS. The same PTX without the
    cluster phase every CTA arrives at on entry and waits on before its first push (the build
    of 0f66911, which racecheck caught on the H200 and numerics did not) is flagged by
    dsmem-before-cluster-wait at every push, at the source line of the push."""
    from validation.race.artifacts import audit_artifact
    from validation.race.audit import audit_ptx

    spec = load_manifest().kernel("gemv")
    art = build_variant_of(spec, {"batch": 64, "n": 7168, "k": 3584, "out_dtype": "bfloat16"}, {"wg_rows": 128})
    assert art.meta["launch"]["cluster"] == [2, 1, 1]
    good = audit_artifact(art, spec)
    assert good.clean and good.checked == ["ptx", "sass"], [str(f) for f in good.findings]
    lines = Path(art.paths["ptx"]).read_text().splitlines()
    arrive = next(i for i, l in enumerate(lines) if "barrier.cluster.arrive.relaxed" in l)
    wait = next(i for i, l in enumerate(lines) if "barrier.cluster.wait" in l)
    mutant = "\n".join(l for i, l in enumerate(lines) if i not in (arrive, wait))
    from kernels.manifest import REPO_ROOT

    bad = audit_ptx(mutant, [p.role for p in spec.params], param_names=[p.name for p in spec.params],
                    source_root=REPO_ROOT)
    hits = [f for f in bad.errors if f.rule == "dsmem-before-cluster-wait"]
    # the 32 pushes (one per accumulator) come from one source line: one finding, located there
    assert len(hits) == 1 and "st.shared::cluster" in hits[0].ptx, [str(f) for f in bad.findings]
    path, line = hits[0].source.split(":")
    assert path == "kernels/ops/gemv.py" and "map_dsmem_ptr" in (REPO_ROOT / path).read_text().splitlines()[int(line) - 1]
    # The barrier after the pushes removed, or made relaxed: the owner's sums may read its slots
    # before the peers' pushes land (dsmem-write-unsynced, at the owner's shared load).
    arrive2 = max(i for i, l in enumerate(lines) if "barrier.cluster.arrive" in l)
    wait2 = max(i for i, l in enumerate(lines) if "barrier.cluster.wait" in l)
    assert arrive2 != arrive and wait2 != wait and "relaxed" not in lines[arrive2]
    for mutant in ("\n".join(l for i, l in enumerate(lines) if i not in (arrive2, wait2)),
                   "\n".join(l.replace("barrier.cluster.arrive", "barrier.cluster.arrive.relaxed") if i == arrive2
                             else l for i, l in enumerate(lines))):
        rep = audit_ptx(mutant, [p.role for p in spec.params], param_names=[p.name for p in spec.params],
                        source_root=REPO_ROOT)
        assert "dsmem-write-unsynced" in rep.rules_hit(), [str(f) for f in rep.findings]


TMA_PDL_SHAPE = {"batch": 8, "n": 3584, "k": 7168, "out_dtype": "bfloat16"}


@pytest.mark.slow
def test_pdl_tma_gemv_passes_and_its_early_x_copy_is_flagged():
    """gemv's warpgroup design (TMA) with pdl: x and w are read through tensor maps (by-value
    128-byte parameters), and the audit attributes each `cp.async.bulk.tensor` to the map's
    parameter: the correct kernel (only W tiles before griddepcontrol.wait) is clean in PTX and
    SASS; the mutant that issues x's tiles before the wait is flagged, naming x only."""
    from validation.race.artifacts import audit_artifact

    spec = load_manifest().kernel("gemv")
    tun = {"pdl": 1}
    good_art = build_variant_of(spec, TMA_PDL_SHAPE, tun)
    assert "cp.async.bulk.tensor" in Path(good_art.paths["ptx"]).read_text()
    assert [p["size"] for p in good_art.meta["params"][:2]] == [128, 128]
    good = audit_artifact(good_art, spec)
    assert good.clean and good.checked == ["ptx", "sass"], [str(f) for f in good.findings]
    mspec = mutant_spec(spec, "x_before_wait")
    bad = audit_artifact(build_variant_of(mspec, TMA_PDL_SHAPE, tun), mspec)
    hits = [f for f in bad.errors if f.rule == "load-before-griddep-wait"]
    assert hits and {tuple(f.params) for f in hits} == {("x",)}, [str(f) for f in bad.findings]
    assert all(f.ptx and f.source.startswith("kernels/ops/gemv.py:") for f in hits), [f.source for f in hits]
    # ...and in the SASS: UTMALDG's map address is the parameter space's pointer plus the
    # map's offset (validation/race/sass.py PARAM_SPACE_POINTER), so no TMA copy is left
    # without a parameter
    assert all(f.sass and "UTMALDG" in str(f) for f in hits), [str(f) for f in hits]
    for rep in (good, bad):
        assert not [f for f in rep.findings if f.rule == "unknown-provenance" and "UTMALDG" in str(f)]


def test_sass_parameter_base_follows_the_largest_alignment():
    """SASS reads parameter offset o at c[0x0][base + o], base 0x210 rounded up to the largest
    parameter alignment: 0x240 behind two 64-byte-aligned TMA maps (measured: moe_w2's `wg`
    path reads its parameter at PTX offset 0x108 from c[0x0][0x348]), 0x210 without them; the
    parameter space pointer path (+ 0x30 + o for the maps) lands on the same parameters."""
    from validation.race import ir as IR
    from validation.race import sass as S

    maps = [IR.ParamDecl(0, "p0", "b8", 128, 0, 64), IR.ParamDecl(1, "p1", "b8", 128, 128, 64),
            IR.ParamDecl(2, "p2", "b8", 8, 256, 8), IR.ParamDecl(3, "p3", "b8", 8, 264, 8)]
    assert S._param_base(maps) == 0x240
    # 0x318 = 0x210 + 0x108 (where a base of 0x210 would put p3) lies inside the second map
    assert S._param_at(0x348, maps) == 3 and S._param_at(0x340, maps) == 2 and S._param_at(0x318, maps) == 1
    assert S._param_at(S.PARAM_BASE + 0x30, maps) == 0 and S._param_at(S.PARAM_BASE + 0xb0, maps) == 1
    plain = [IR.ParamDecl(0, "q0", "b8", 8, 0, 8), IR.ParamDecl(1, "q1", "b8", 8, 8, 8)]
    assert S._param_base(plain) == 0x210 and S._param_at(0x218, plain) == 1 and S._param_at(0x220, plain) is None
