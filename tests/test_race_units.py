"""Parsers, CFG and the rules that no repository kernel exercises yet (bulk-async stores),
plus the sanitizer-summary judge. Hand-written PTX here is supplementary: the rules are tested
on real builds in test_race_static.py."""

from __future__ import annotations

import json

import pytest

from validation.race import ir
from validation.race.audit import AuditInputError, audit_ptx
from validation.race.cfg import CFG
from validation.race.dynamic import marker, parse_tool_output, sanitizer_command
from validation.race.ptx import parse_ptx
from validation.race.sass import parse_sass

HEADER = """
.version 8.8
.target sm_90a
.address_size 64
.visible .entry k(
	.param .align 8 .b8 k_param_0[8],
	.param .align 8 .b8 k_param_1[8],
	.param .u32 k_param_2
)
{
	.reg .pred %p<4>;
	.reg .b32 %r<16>;
	.reg .b64 %rd<16>;
	ld.param.b64 %rd1, [k_param_0];
	ld.param.b64 %rd2, [k_param_1];
	ld.param.u32 %r9, [k_param_2];
	mov.u32 %r1, %tid.x;
"""


def _ptx(body: str) -> str:
    return HEADER + body + "\n\tret;\n}\n"


def test_params_offsets_and_provenance():
    fn = parse_ptx(_ptx("\tmul.wide.u32 %rd3, %r1, 4;\n\tadd.s64 %rd4, %rd2, %rd3;\n\tst.global.b32 [%rd4], %r1;"))[0]
    assert [(p.index, p.size, p.offset) for p in fn.params] == [(0, 8, 0), (1, 8, 8), (2, 4, 16)]
    from validation.race.dataflow import analyze

    cfg = CFG(fn)
    prov = analyze(cfg)
    st = [i for i in fn.instrs if i.kind == ir.STORE][0]
    assert prov.params_of_addr(st.index) == {1}


# An inline-asm wait as the DSL pastes it (cute.arch.mbarrier_wait): the same labels each time.
_MBAR_WAIT = """
	{
	.reg .pred       P1;
	LAB_WAIT:
	mbarrier.try_wait.parity.shared.b64 P1, [%r3], 0, 10000000;
	@P1 bra.uni DONE;
	bra.uni     LAB_WAIT;
	DONE:
	}
"""


def test_labels_of_pasted_inline_asm_blocks_are_their_own():
    """Two copies of one inline-asm wait loop: each `bra DONE` leaves its own loop (PTX scopes
    labels to their block), so the code after the first copy is reachable and judged: an
    unordered load of another CTA's data there is still caught."""
    body = _MBAR_WAIT + "\tld.acquire.gpu.global.b32 %r4, [%rd1];\n\tld.global.b32 %r5, [%rd2];\n" + _MBAR_WAIT
    fn = parse_ptx(_ptx(body))[0]
    cfg = CFG(fn)
    assert all(cfg.block_of[i.index] in cfg.reachable for i in fn.instrs)
    waits = [i for i in fn.instrs if i.kind == ir.BRANCH and i.targets[0].startswith("DONE")]
    assert len({i.targets[0] for i in waits}) == 2  # one DONE per block
    unordered = _MBAR_WAIT + "\tld.relaxed.gpu.global.b32 %r4, [%rd1];\n\tld.global.b32 %r5, [%rd2];\n" + _MBAR_WAIT
    assert "relaxed-spin-no-fence" in audit_ptx(_ptx(unordered), ["sync", "activation", "scalar"]).rules_hit()


def test_bulk_store_must_drain_before_release():
    body = """
	cp.async.bulk.global.shared::cta.bulk_group [%rd2], [%r2], 256;
	cp.async.bulk.commit_group;
	fence.acq_rel.gpu;
	red.release.gpu.global.add.s32 [%rd1], 1;"""
    rep = audit_ptx(_ptx(body), ["sync", "activation", "scalar"])
    assert "bulk-store-not-drained" in rep.rules_hit()
    drained = body.replace("cp.async.bulk.commit_group;", "cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group 0;")
    assert "bulk-store-not-drained" not in audit_ptx(_ptx(drained), ["sync", "activation", "scalar"]).rules_hit()
    read_only = body.replace("cp.async.bulk.commit_group;", "cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read 0;")
    assert "bulk-store-not-drained" in audit_ptx(_ptx(read_only), ["sync", "activation", "scalar"]).rules_hit()


def test_barrier_under_thread_dependent_branch_only():
    body = """
	setp.ne.s32 %p1, %r1, 0;
	@%p1 bra $L__skip;
	bar.sync 0;
$L__skip:
	bar.sync 0;"""
    rep = audit_ptx(_ptx(body), ["activation", "activation", "scalar"])
    bad = [f for f in rep.findings if f.rule == "barrier-divergent"]
    assert len(bad) == 1 and "line" in bad[0].ptx
    uniform = body.replace("%r1, 0", "%r9, 0")  # a by-value parameter: same for every thread
    assert "barrier-divergent" not in audit_ptx(_ptx(uniform), ["activation", "activation", "scalar"]).rules_hit()


def test_relaxed_publish_after_fence_is_a_release():
    # a barrier between: every thread's flag store comes after every thread's data write
    fenced = "\tst.global.b32 [%rd2], %r1;\n\tbar.sync 0;\n\tfence.acq_rel.gpu;\n\tst.relaxed.gpu.global.b32 [%rd1], 1;"
    assert audit_ptx(_ptx(fenced), ["sync", "activation", "scalar"]).clean
    late = "\tfence.acq_rel.gpu;\n\tst.global.b32 [%rd2], %r1;\n\tst.relaxed.gpu.global.b32 [%rd1], 1;"
    assert "relaxed-publish" in audit_ptx(_ptx(late), ["sync", "activation", "scalar"]).rules_hit()


# Tagged words (role "tagged": a sync buffer whose every word is its own flag, 0 until written).
# PUBLISH: a logit stored into word tid of param 0 with no fence; POLL: reload the word until it
# is non-zero, use it, reset it.
_TAG_PUBLISH = "\tmul.wide.u32 %rd3, %r1, 4;\n\tadd.s64 %rd4, %rd1, %rd3;\n\t{st}.global.b32 [%rd4], %r9;"
_TAG_POLL = """
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd1, %rd3;
$L_poll:
	{ld}.global.b32 %r2, [%rd4];
	setp.eq.s32 %p1, %r2, 0;
	@%p1 bra $L_poll;
	add.s64 %rd5, %rd2, %rd3;
	st.global.b32 [%rd5], %r2;
	st.relaxed.gpu.global.b32 [%rd4], 0;"""


def test_tagged_words_need_strong_gpu_scope_accesses_and_no_fence():
    """A tagged buffer's words are written and polled by relaxed gpu-scope accesses with no fence
    or acquire (each word is its own flag): clean. As a plain `sync` buffer the same code is a
    relaxed publish; a weak, cta-scope or atomic access to a tagged word is tagged-weak-access."""
    roles = ["tagged", "activation", "scalar"]
    ok = _TAG_PUBLISH.format(st="st.relaxed.gpu") + _TAG_POLL.format(ld="ld.relaxed.gpu")
    rep = audit_ptx(_ptx(ok), roles, param_names=["tags", "out", "n"])
    assert rep.clean and not rep.findings, [str(f) for f in rep.findings]
    assert "relaxed-publish" in audit_ptx(_ptx(ok), ["sync", "activation", "scalar"]).rules_hit()
    assert audit_ptx(_ptx(_TAG_PUBLISH.format(st="st.volatile") + _TAG_POLL.format(ld="ld.volatile")), roles).clean
    for bad, why in ((_TAG_PUBLISH.format(st="st") + _TAG_POLL.format(ld="ld.relaxed.gpu"), "weak"),
                     (_TAG_PUBLISH.format(st="st.relaxed.gpu") + _TAG_POLL.format(ld="ld"), "weak"),
                     (_TAG_PUBLISH.format(st="st.relaxed.cta") + _TAG_POLL.format(ld="ld.relaxed.gpu"), "cta-scope"),
                     (_TAG_PUBLISH.format(st="st.relaxed.gpu") + _TAG_POLL.replace("{ld}.global.b32", "ld.global.nc.b32"),
                      "non-coherent"),
                     ("\tatom.global.add.u32 %r3, [%rd1], 1;", "atomic")):
        rep = audit_ptx(_ptx(bad), roles, param_names=["tags", "out", "n"])
        f = [x for x in rep.findings if x.rule == "tagged-weak-access"]
        assert f and all(x.params == ["tags"] for x in f) and why in f[0].message, (why, [str(x) for x in rep.findings])


# Work counters (role "claims": a sync buffer whose every word hands out item indices by atomic
# adds). CLAIM: thread 0 claims an index from word 0 of param 0 and uses it to index the data
# (param 1), after an acquire on nothing: the claim orders nothing and needs none.
_CLAIM = """
	{atom}.global.add.u32 %r2, [%rd1], 1;
	mul.wide.u32 %rd3, %r2, 4;
	add.s64 %rd4, %rd2, %rd3;
	ld.global.b32 %r3, [%rd4];
	st.global.b32 [%rd4], %r3;"""


def test_work_counter_claims_are_atomic_adds_and_order_nothing():
    """A relaxed gpu-scope atomic add on a work counter, its value an index into data read and
    written after it, is clean: no acquire, no publish, no spin. As a plain `sync` buffer the
    same claim is a relaxed publish and a spin without an acquire; a load of the counter, a
    cta-scope add or another atomic on it is claims-access."""
    roles = ["claims", "activation", "scalar"]
    rep = audit_ptx(_ptx(_CLAIM.format(atom="atom.relaxed.gpu")), roles, param_names=["claims", "data", "n"])
    assert rep.clean and not rep.findings, [str(f) for f in rep.findings]
    reset = _CLAIM.format(atom="atom.relaxed.gpu") + "\n\tst.relaxed.gpu.global.b32 [%rd1], 0;"
    assert audit_ptx(_ptx(reset), roles).clean
    assert not audit_ptx(_ptx(_CLAIM.format(atom="atom.relaxed.gpu")), ["sync", "activation", "scalar"]).clean
    for bad, why in ((_CLAIM.format(atom="atom.relaxed.cta"), "cta-scope"),
                     (_CLAIM.format(atom="atom.relaxed.gpu").replace("add.u32", "exch.b32"), "other than an add"),
                     ("\tld.relaxed.gpu.global.b32 %r2, [%rd1];", "a load"),
                     ("\tst.global.b32 [%rd1], 0;", "weak")):
        rep = audit_ptx(_ptx(bad), roles, param_names=["claims", "data", "n"])
        f = [x for x in rep.findings if x.rule == "claims-access"]
        assert f and all(x.params == ["claims"] for x in f) and why in f[0].message, (why, [str(x) for x in rep.findings])


# Three stages: "a" writes param 1, "c" reads it, "b" neither; word s of param 0 is stage s's
# counter (a 0, b 1, c 2).
_STAGE_WAIT = """
	{acq}.global.b32 %r4, [%rd1+{off}];
	ld.global.b32 %r5, [%rd2];"""


def test_a_load_of_a_stages_output_needs_the_wait_on_that_stages_counter():
    """With declared stage counters, a load of stage a's output after an acquire of a's counter
    (word 0), or of c's (c reads y: it waited for a), is clean; after an acquire of b's counter
    only, it is load-before-producer-wait (the ordering rules alone see an acquire either way)."""
    roles = ["sync", "activation", "scalar"]
    kw = dict(param_names=["counters", "y", "n"], stages=[("a", (), ("y",)), ("b", (), ()), ("c", ("y",), ())],
              stage_counters="counters")
    ok = _STAGE_WAIT.format(acq="ld.acquire.gpu", off=0)
    assert audit_ptx(_ptx(ok), roles, **kw).clean
    assert audit_ptx(_ptx(_STAGE_WAIT.format(acq="ld.acquire.gpu", off=8)), roles, **kw).clean
    wrong = _STAGE_WAIT.format(acq="ld.acquire.gpu", off=4)
    rep = audit_ptx(_ptx(wrong), roles, **kw)
    assert "load-before-producer-wait" in rep.rules_hit(), [str(f) for f in rep.findings]
    assert audit_ptx(_ptx(wrong), roles, param_names=["counters", "y", "n"]).clean  # undeclared: not judged
    # thread 0's acquire orders the others' loads only after a CTA barrier
    guarded = ("\tsetp.ne.s32 %p1, %r1, 0;\n\t@%p1 bra $L_skip;\n\tld.acquire.gpu.global.b32 %r4, [%rd1];\n"
               "$L_skip:\n{bar}\tld.global.b32 %r5, [%rd2];")
    assert "load-before-producer-wait" in audit_ptx(_ptx(guarded.format(bar="")), roles, **kw).rules_hit()
    assert "load-before-producer-wait" not in audit_ptx(_ptx(guarded.format(bar="\tbar.sync 0;\n")), roles,
                                                         **kw).rules_hit()


def test_a_tagged_word_orders_no_other_data():
    """Data written before a tagged word and read by another CTA after polling it is not
    published by it: the writer side is publish-before-writes (no release follows the data
    write), the reader side relaxed-spin-no-fence (no acquire between the poll and the read)."""
    writer = "\tst.global.b32 [%rd2], %r9;\n" + _TAG_PUBLISH.format(st="st.relaxed.gpu")
    reader = _TAG_POLL.format(ld="ld.relaxed.gpu").replace("st.global.b32 [%rd5], %r2;", "ld.global.b32 %r6, [%rd5];")
    rep = audit_ptx(_ptx(writer + reader), ["tagged", "activation", "scalar"])
    assert {"publish-before-writes", "relaxed-spin-no-fence"} <= rep.rules_hit(), [str(f) for f in rep.findings]


def test_roles_input_errors():
    text = _ptx("")
    with pytest.raises(AuditInputError, match="3 parameters"):
        audit_ptx(text, ["static"])
    with pytest.raises(AuditInputError, match="unknown role"):
        audit_ptx(text, {"0": "weights"})
    with pytest.raises(AuditInputError, match="unreadable PTX"):
        audit_ptx("not ptx at all", None)


def test_cfg_dominators_and_loops():
    body = """
	mov.u32 %r2, 0;
$L__head:
	ld.acquire.gpu.global.b32 %r3, [%rd1];
	setp.eq.s32 %p1, %r3, 0;
	@%p1 bra $L__head;
	ld.global.b32 %r4, [%rd2];"""
    fn = parse_ptx(_ptx(body))[0]
    cfg = CFG(fn)
    acq = next(i for i in fn.instrs if i.sem == ir.ACQUIRE)
    ld = next(i for i in fn.instrs if i.kind == ir.LOAD and i.sem == ir.WEAK)
    assert cfg.instr_dominates(acq.index, ld.index)
    assert not cfg.instr_dominates(ld.index, acq.index)
    assert len(cfg.loops) == 1 and cfg.block_of[acq.index] in cfg.loops[0].body


def test_sass_parse_params_and_kinds():
    text = """
	.text.k:
        /*0000*/                   LDC.64 R2, c[0x0][0x210] ;
        /*0010*/                   LDG.E.STRONG.GPU R7, desc[UR6][R2.64] ;
        /*0020*/                   CCTL.IVALL ;
        /*0030*/                   LDC.64 R4, c[0x0][0x218] ;
        /*0040*/                   LDG.E.128.CONSTANT R8, desc[UR6][R4.64] ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/                   EXIT ;
"""
    params = parse_ptx(_ptx(""))[0].params
    fn = parse_sass(text, params)[0]
    kinds = [i.kind for i in fn.instrs]
    assert kinds == [ir.OTHER, ir.LOAD, ir.INVALIDATE, ir.OTHER, ir.LOAD, ir.BARRIER, ir.EXIT]
    assert fn.instrs[0].params_read == (0,) and fn.instrs[3].params_read == (1,)
    assert fn.instrs[4].nc and fn.instrs[1].strong
    assert fn.instrs[4].dests == ("R8", "R9", "R10", "R11")


# -- sanitizer judge ----------------------------------------------------------------------------

CLEAN = "========= COMPUTE-SANITIZER\n{m}\n========= ERROR SUMMARY: 0 errors\n"


def test_clean_needs_summary_and_marker():
    ok = CLEAN.format(m=marker("k", True, rel_err="1e-7"))
    assert parse_tool_output("memcheck", ok, ["k"], 0).clean
    # No marker: the kernel may never have run.
    r = parse_tool_output("memcheck", CLEAN.format(m=""), ["k"], 0)
    assert not r.clean and "no proof" in r.reason
    # Marker says the output was wrong.
    r = parse_tool_output("memcheck", CLEAN.format(m=marker("k", False)), ["k"], 0)
    assert not r.clean and "wrong" in r.reason
    # Errors reported.
    r = parse_tool_output("memcheck", ok.replace("0 errors", "3 errors"), ["k"], 0)
    assert not r.clean and r.errors == 3
    # No summary at all (crash) or a timeout.
    assert not parse_tool_output("memcheck", marker("k", True), ["k"], 0).clean
    assert not parse_tool_output("memcheck", ok, ["k"], None, timed_out=True).clean


def test_a_failed_launch_is_told_from_a_wrong_output():
    """A run marker whose `why` is an exception (the launch never completed: a trap, an illegal
    address) says so, with the exception; a judged output that was wrong says wrong; a line of
    the kernel's watchdog names the wait it trapped, also when the tool timed out."""
    why = json.dumps("AcceleratorError: CUDA error: unspecified launch failure\nSearch for ...")
    r = parse_tool_output("racecheck", marker("k", False, why=why)
                          + "\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", ["k"], 0)
    assert not r.clean
    assert r.reason == "kernel launch failed inside the sanitized run: k: AcceleratorError: CUDA error: unspecified launch failure"
    r = parse_tool_output("memcheck", CLEAN.format(m=marker("k", False, why=json.dumps("rel_fro 0.3 > 0.01"))), ["k"], 0)
    assert r.reason == "kernel output wrong inside the sanitized run: k: rel_fro 0.3 > 0.01"
    dog = "megakernel watchdog: stage 5 waits on counter 4: 7 of 8\n"
    r = parse_tool_output("synccheck", dog + CLEAN.format(m=marker("k", False, why=why)), ["k"], 0)
    assert r.reason.startswith("kernel launch failed inside the sanitized run: k: AcceleratorError")
    assert r.reason.endswith("(the kernel's watchdog trapped a wait: megakernel watchdog: stage 5 waits on counter 4: 7 of 8)")
    r = parse_tool_output("memcheck", dog, ["k"], None, timed_out=True)
    assert r.reason == ("timed out (a hung kernel?): the kernel's watchdog trapped a wait: "
                        "megakernel watchdog: stage 5 waits on counter 4: 7 of 8")


def test_racecheck_summary():
    text = marker("k", True) + "\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert parse_tool_output("racecheck", text, ["k"], 0).clean
    bad = text.replace("0 hazards displayed (0 errors, 0 warnings)", "2 hazards displayed (1 error, 1 warning)")
    assert not parse_tool_output("racecheck", bad, ["k"], 0).clean


def test_sanitizer_command_line():
    cmd = sanitizer_command("cs", "racecheck", ["python", "x.py"])
    assert cmd[:5] == ["cs", "--tool", "racecheck", "--report-api-errors", "no"]
    assert cmd[-2:] == ["python", "x.py"]
    with pytest.raises(ValueError):
        sanitizer_command("cs", "leakcheck", [])


def test_griddep_wait_orders_mutable_loads_and_every_write():
    """load-before-griddep-wait: before griddepcontrol.wait only static loads are allowed; a
    wait on one branch only does not dominate what follows the join; kernels without the wait
    are not subject to the rule."""
    roles = ["static", "activation", "scalar"]
    ok = ("\tld.global.nc.b32 %r2, [%rd1];\n\tgriddepcontrol.wait;\n\tld.global.b32 %r3, [%rd2];"
          "\n\tst.global.b32 [%rd2], %r2;")
    assert audit_ptx(_ptx(ok), roles).clean
    early_load = "\tld.global.b32 %r3, [%rd2];\n\tgriddepcontrol.wait;\n\tst.global.b32 [%rd2], %r3;"
    f = [x for x in audit_ptx(_ptx(early_load), roles).findings if x.rule == "load-before-griddep-wait"]
    assert len(f) == 1 and f[0].params == ["param_1"] and f[0].severity == "error"
    early_store = "\tld.global.nc.b32 %r2, [%rd1];\n\tst.global.b32 [%rd2], %r2;\n\tgriddepcontrol.wait;"
    assert "load-before-griddep-wait" in audit_ptx(_ptx(early_store), roles).rules_hit()
    one_branch = ("\tsetp.ne.s32 %p1, %r9, 0;\n\t@%p1 bra $L__skip;\n\tgriddepcontrol.wait;\n$L__skip:"
                  "\n\tld.global.b32 %r3, [%rd2];")
    assert "load-before-griddep-wait" in audit_ptx(_ptx(one_branch), roles).rules_hit()
    no_wait = "\tld.global.b32 %r3, [%rd2];\n\tst.global.b32 [%rd2], %r3;"
    assert "load-before-griddep-wait" not in audit_ptx(_ptx(no_wait), roles).rules_hit()


def test_sass_acqbulk_is_the_griddep_wait():
    fn = parse_sass("""
        .text.k:
k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   ACQBULK ;
        /*0020*/                   PREEXIT ;
        /*0030*/                   EXIT ;
""", [])[0]
    kinds = [i.kind for i in fn.instrs]
    assert ir.GRIDDEP_WAIT in kinds and kinds.count(ir.GRIDDEP_WAIT) == 1


def test_global_to_shared_copies_are_loads_of_their_global_operand():
    """cp.async (and bulk/TMA copies into shared memory) read global memory: they are loads of
    the second operand's buffer, so an early copy of an activation breaks griddepcontrol.wait
    ordering just as an ld does, and one of cross-CTA data needs the acquire."""
    roles = ["static", "activation", "scalar"]
    for copy in ("cp.async.cg.shared.global [%r2], [%rd2], 16;",
                 "cp.async.ca.shared.global [%r2], [%rd2], 16, 16;",
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r2], [%rd2], 256, [%r3];"):
        fn = parse_ptx(_ptx(f"\t{copy}"))[0]
        (cp,) = [i for i in fn.instrs if i.opcode.startswith("cp.async")]
        assert cp.kind == ir.LOAD and cp.addr_regs == ("%rd2",) and not cp.nc, copy
        early = f"\t{copy}\n\tgriddepcontrol.wait;"
        f = [x for x in audit_ptx(_ptx(early), roles).findings if x.rule == "load-before-griddep-wait"]
        assert f and f[0].params == ["param_1"], copy
        # a copy of the static weights may run ahead of the wait
        assert audit_ptx(_ptx(early.replace("[%rd2]", "[%rd1]")), roles).clean, copy
    spin_first = """
	cp.async.cg.shared.global [%r2], [%rd2], 16;
	ld.acquire.gpu.global.b32 %r3, [%rd1];
	st.global.b32 [%rd2], %r3;"""
    rep = audit_ptx(_ptx(spin_first), ["sync", "activation", "scalar"])
    assert "load-before-wait" in rep.rules_hit(), [str(x) for x in rep.findings]
    # The stores stay what they were: shared -> global bulk copies are bulk stores.
    fn = parse_ptx(_ptx("\tcp.async.bulk.global.shared::cta.bulk_group [%rd2], [%r2], 256;"))[0]
    assert [i.kind for i in fn.instrs if i.opcode.startswith("cp.")] == [ir.BULK_STORE]


def test_sass_global_to_shared_copies_are_loads():
    text = """
	.text.k:
        /*0000*/                   LDC.64 R2, c[0x0][0x218] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R11], desc[UR4][R2.64] ;
        /*0020*/                   ULDC.64 UR6, c[0x0][0x218] ;
        /*0030*/                   UTMALDG.2D [UR8], [UR6] ;
        /*0040*/                   UBLKCP.S.G [UR8], [UR6], UR10 ;
        /*0050*/                   EXIT ;
"""
    fn = parse_sass(text, parse_ptx(_ptx(""))[0].params)[0]
    loads = [i for i in fn.instrs if i.kind == ir.LOAD]
    assert [i.opcode.split(".")[0] for i in loads] == ["LDGSTS", "UTMALDG", "UBLKCP"]
    assert loads[0].addr_regs == ("R2", "R3") and loads[1].addr_regs == ("UR6",)
    assert not any(i.dests for i in loads)


def test_nc_load_of_unknown_provenance_is_an_error():
    """An ld.global.nc through a pointer loaded from memory cannot be shown to read a static
    buffer, so it is an error (it was only an unknown-provenance warning: a clean audit)."""
    body = "\tld.global.u64 %rd3, [%rd1];\n\tld.global.nc.b32 %r2, [%rd3];\n\tst.global.b32 [%rd2], %r2;"
    rep = audit_ptx(_ptx(body), ["static", "activation", "scalar"])
    assert not rep.clean and "nc-load-mutable" in rep.rules_hit(), [str(x) for x in rep.findings]
    plain = body.replace("ld.global.nc.b32", "ld.global.b32")
    rep = audit_ptx(_ptx(plain), ["static", "activation", "scalar"])
    # audited as a buffer of its own (role activation), not a warning
    assert rep.clean and rep.rules_hit() == set()


# A loop over param 1's words whose bound is param 2. SPIN: each iteration reloads param 0's
# word and exits when it is non-zero (a wait on memory). BOUND: the same loop with the word
# loaded once before the loop (a bound read from memory, not a wait).
_SPIN = """
	mov.u32 %r2, 0;
$L_top:
	ld.global.u32 %r3, [%rd1];
	ld.global.u32 %r4, [%rd2];
	add.s32 %r2, %r2, %r4;
	setp.eq.s32 %p1, %r3, 0;
	@%p1 bra $L_top;
	st.global.u32 [%rd2], %r2;"""
_BOUND = """
	mov.u32 %r2, 0;
	mov.u32 %r5, 0;
	ld.global.u32 %r3, [%rd1];
$L_top:
	ld.global.u32 %r4, [%rd2];
	add.s32 %r2, %r2, %r4;
	add.s32 %r5, %r5, 1;
	setp.lt.u32 %p1, %r5, %r3;
	@%p1 bra $L_top;
	st.global.u32 [%rd2], %r2;"""


@pytest.mark.parametrize("role", ["activation", "scratch"])
def test_a_wait_on_a_buffer_not_declared_sync_is_an_error(role):
    """A loop that exits on a value it reloads from an activation/scratch buffer is a
    handshake the manifest hides from the ordering rules: undeclared-sync names the buffer."""
    rep = audit_ptx(_ptx(_SPIN), [role, "activation", "scalar"], param_names=["flag", "data", "n"])
    f = [x for x in rep.findings if x.rule == "undeclared-sync"]
    assert len(f) == 1 and f[0].params == ["flag"] and f[0].severity == "error", rep.findings
    assert "bra" in f[0].ptx


def test_declared_static_or_sync_waits_and_bounds_read_before_the_loop_are_not_flagged():
    # declared sync: the ordering rules own it (this spin has no acquire, so they fire instead)
    rep = audit_ptx(_ptx(_SPIN), ["sync", "activation", "scalar"])
    assert "undeclared-sync" not in rep.rules_hit() and rep.rules_hit()
    # static: cannot change during the launch, so the loop cannot be waiting on it
    assert "undeclared-sync" not in audit_ptx(_ptx(_SPIN), ["static", "activation", "scalar"]).rules_hit()
    # a bound loaded once before the loop decides the exit: no wait
    assert "undeclared-sync" not in audit_ptx(_ptx(_BOUND), ["activation", "activation", "scalar"]).rules_hit()
    # ... but the same bound reloaded inside the loop is one
    inside = _BOUND.replace("\tld.global.u32 %r3, [%rd1];\n$L_top:\n", "$L_top:\n\tld.global.u32 %r3, [%rd1];\n")
    assert "undeclared-sync" in audit_ptx(_ptx(inside), ["activation", "activation", "scalar"]).rules_hit()


def test_sass_lines_padded_with_whitespace_parse():
    """nvdisasm pads some lines with long whitespace runs (no `;`): they parse to their
    instruction (the pattern once backtracked on them: 0.4 s a line; its speed is the audit
    benchmark's, benchmarks/race_audit_rules.py, not a test's)."""
    line = "        /*24ec0*/                   STL [R1+0x1c], R19" + " " * 200
    text = ".text.k:\n" + "\n".join([line, "        /*24ed0*/   EXIT ;  /* 0x000fea0003800000 */"] * 50)
    fn = parse_sass(text)[0]
    assert [i.opcode for i in fn.instrs[:2]] == ["STL", "EXIT"] and fn.instrs[0].text == "STL [R1+0x1c], R19"


# Waits the latch test alone would miss: the flag decides a conditional exit inside the loop,
# a branch in a block before the exiting one, or reaches the test through shared memory
# (cp.async) or a local-memory spill.
_HIDDEN_SPINS = {
    "conditional exit": """
$L_top:
	ld.global.u32 %r3, [%rd1];
	setp.ne.s32 %p1, %r3, 0;
	@%p1 ret;
	bra $L_top;""",
    "flag tested before the exiting block": """
$L_top:
	ld.global.u32 %r3, [%rd1];
	setp.ne.s32 %p1, %r3, 0;
	@%p1 bra $L_mid;
	bra $L_top;
$L_mid:
	setp.lt.u32 %p2, %r1, %r9;
	@%p2 bra $L_top;
	bra $L_out;
$L_out:
	st.global.u32 [%rd2], %r3;""",
    "through shared memory": """
	.shared .align 4 .b8 sm[16];
	mov.u32 %r7, sm;
$L_top:
	cp.async.ca.shared.global [%r7], [%rd1], 4;
	cp.async.wait_all;
	ld.shared.u32 %r3, [%r7];
	setp.eq.s32 %p1, %r3, 0;
	@%p1 bra $L_top;""",
    "through a local spill": """
	.local .align 4 .b8 lc[4];
	mov.u64 %rd6, lc;
$L_top:
	ld.global.u32 %r3, [%rd1];
	st.local.u32 [%rd6], %r3;
	ld.local.u32 %r4, [%rd6];
	setp.eq.s32 %p1, %r4, 0;
	@%p1 bra $L_top;""",
}


@pytest.mark.parametrize("case", sorted(_HIDDEN_SPINS))
def test_waits_decided_off_the_latch_or_through_cta_memory_are_flagged(case):
    rep = audit_ptx(_ptx(_HIDDEN_SPINS[case]), ["activation", "activation", "scalar"],
                    param_names=["flag", "data", "n"])
    f = [x for x in rep.findings if x.rule == "undeclared-sync"]
    assert f and {tuple(x.params) for x in f} == {("flag",)}, rep.findings


def test_a_data_dependent_if_inside_a_counted_loop_is_not_a_wait():
    """The arms rejoin before the loop's own counter test: the loaded value decides no exit."""
    body = """
	mov.u32 %r5, 0;
$L_top:
	mul.wide.u32 %rd7, %r5, 4;
	add.s64 %rd8, %rd2, %rd7;
	ld.global.u32 %r3, [%rd8];
	setp.eq.s32 %p1, %r3, 0;
	@%p1 bra $L_skip;
	st.global.u32 [%rd8], %r5;
$L_skip:
	add.s32 %r5, %r5, 1;
	setp.lt.u32 %p2, %r5, %r9;
	@%p2 bra $L_top;"""
    assert "undeclared-sync" not in audit_ptx(_ptx(body), ["activation", "activation", "scalar"]).rules_hit()


_SHARED = "\t.shared .align 16 .b8 smem[256];\n\tmov.u32 %r3, smem;\n\tmapa.shared::cluster.u32 %r4, %r3, 1;\n"


def test_distributed_shared_memory_needs_the_peer_started_and_alive():
    """dsmem-before-cluster-wait: a store to (or load from) another CTA's shared memory must
    come after a barrier.cluster.wait on every path (the peer has started); the relaxed arrive
    on entry is what the wait completes. dsmem-read-at-exit: after reading a peer's shared
    memory a CTA must arrive (release, not relaxed) and wait before it exits."""
    roles = ["activation", "activation", "scalar"]
    entry = "\tbarrier.cluster.arrive.relaxed.aligned;\n"
    push = "\tst.shared::cluster.f32 [%r4], %r9;\n"
    done = "\tbarrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;\n"
    ok = entry + _SHARED + "\tbarrier.cluster.wait.aligned;\n" + push + done
    assert audit_ptx(_ptx(ok), roles).clean, [str(f) for f in audit_ptx(_ptx(ok), roles).findings]
    early = _SHARED + push + done  # the push lands before any wait: the peer may not have started
    f = [x for x in audit_ptx(_ptx(early), roles).findings if x.rule == "dsmem-before-cluster-wait"]
    assert len(f) == 1 and f[0].severity == "error" and "may not have started" in f[0].message
    one_branch = (entry + _SHARED + "\tsetp.ne.s32 %p1, %r9, 0;\n\t@%p1 bra $L__skip;\n"
                  "\tbarrier.cluster.wait.aligned;\n$L__skip:\n" + push + done)
    assert "dsmem-before-cluster-wait" in audit_ptx(_ptx(one_branch), roles).rules_hit()
    pull = "\tld.shared::cluster.f32 %r5, [%r4];\n\tst.global.b32 [%rd2], %r5;\n"
    read_ok = entry + _SHARED + "\tbarrier.cluster.wait.aligned;\n" + pull + done
    assert audit_ptx(_ptx(read_ok), roles).clean
    read_exit = entry + _SHARED + "\tbarrier.cluster.wait.aligned;\n" + pull  # straight to ret
    g = [x for x in audit_ptx(_ptx(read_exit), roles).findings if x.rule == "dsmem-read-at-exit"]
    assert len(g) == 1 and "release" in g[0].message
    relaxed_only = (entry + _SHARED + "\tbarrier.cluster.wait.aligned;\n" + pull
                    + "\tbarrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;\n")
    assert "dsmem-read-at-exit" in audit_ptx(_ptx(relaxed_only), roles).rules_hit()
    plain = _SHARED + "\tld.shared.f32 %r5, [%r3];\n\tst.global.b32 [%rd2], %r5;\n"
    assert audit_ptx(_ptx(plain), roles).clean  # the CTA's own shared memory: no cluster rule


def test_writes_to_a_peer_must_land_before_they_are_read_or_the_kernel_exits():
    """dsmem-write-unsynced: after pushing into another CTA's shared memory, a CTA reads shared
    memory (the slots its peers pushed into it) or exits only after a release arrive and a wait;
    a relaxed arrive orders nothing. An atom on a peer both reads and writes."""
    roles = ["activation", "activation", "scalar"]
    head = "\tbarrier.cluster.arrive.relaxed.aligned;\n" + _SHARED + "\tbarrier.cluster.wait.aligned;\n"
    push = "\tst.shared::cluster.f32 [%r4], %r9;\n"
    own = "\tld.shared.f32 %r5, [%r3];\n\tst.global.b32 [%rd2], %r5;\n"
    done = "\tbarrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;\n"
    assert audit_ptx(_ptx(head + push + done + own), roles).clean
    early = [f for f in audit_ptx(_ptx(head + push + own + done), roles).findings if f.rule == "dsmem-write-unsynced"]
    assert len(early) == 1 and "before the peers' writes land" in early[0].message
    relaxed = head + push + "\tbarrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;\n" + own
    assert "dsmem-write-unsynced" in audit_ptx(_ptx(relaxed), roles).rules_hit()
    exits = [f for f in audit_ptx(_ptx(head + push), roles).findings if f.rule == "dsmem-write-unsynced"]
    assert len(exits) == 1 and "exited" in exits[0].message
    atom = head + "\tatom.shared::cluster.add.u32 %r5, [%r4], 1;\n\tst.global.b32 [%rd2], %r5;\n"
    assert {"dsmem-read-at-exit", "dsmem-write-unsynced"} <= audit_ptx(_ptx(atom), roles).rules_hit()
    assert audit_ptx(_ptx(atom + done), roles).clean


MAP_HEADER = """
.version 8.8
.target sm_90a
.address_size 64
.visible .entry k(
	.param .align 64 .b8 k_param_0[128],
	.param .align 64 .b8 k_param_1[128],
	.param .align 8 .b8 k_param_2[8]
)
{
	ret;
}
"""


def _map_sass(body: str) -> str:
    return "\n\t.text.k:\n" + "\n".join(
        f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(body.strip().splitlines())) + "\n"


def _tma_params(sass_body: str):
    params = parse_ptx(MAP_HEADER)[0].params
    fn = parse_sass(_map_sass(sass_body), params)[0]
    return [i for i in fn.instrs if i.opcode.startswith("UTMALDG")], fn


@pytest.mark.parametrize("body, want", [
    # the pointer plus 0x30 + the map's offset (0: param 0, 0x80: param 1)
    ("ULDC.64 UR4, c[0x0][0x198]\nUIADD3 UR8, UP0, UR4, 0x30, URZ\nUIADD3.X UR9, URZ, UR5, URZ, UP0, !UPT\n"
     "UTMALDG.2D [UR12], [UR8]", [0]),
    ("ULDC.64 UR4, c[0x0][0x198]\nUIADD3 UR8, UP0, UR4, 0xb0, URZ\nUTMALDG.2D [UR12], [UR8]", [1]),
    # a chain: in place to param 0, then on to param 1 (not param 0 + 0x80 - 0x30)
    ("ULDC.64 UR4, c[0x0][0x198]\nUIADD3 UR4, UP0, UR4, 0x30, URZ\nUIADD3 UR8, UP0, UR4, 0x80, URZ\n"
     "UTMALDG.2D [UR12], [UR8]", [1]),
    # through a spill: MOV to a vector register and R2UR back
    ("ULDC.64 UR56, c[0x0][0x198]\nMOV R2, UR56\nR2UR UR40, R2\nUIADD3 UR8, UP0, UR40, 0xb0, URZ\n"
     "UTMALDG.2D [UR12], [UR8]", [1]),
    # the pointer register redefined before the add: no parameter
    ("ULDC.64 UR4, c[0x0][0x198]\nUMOV UR4, 0x10\nUIADD3 UR8, UP0, UR4, 0x30, URZ\nUTMALDG.2D [UR12], [UR8]", []),
])
def test_sass_tensor_map_addresses_name_their_parameter(body, want):
    """UTMALDG's map address is the parameter space's pointer (c[0x0][0x198]) plus 0x30 plus the
    map's offset; the audit follows adds (chained, in place), moves and spills to name it."""
    from validation.race.dataflow import analyze

    (tma,), fn = _tma_params(body)
    prov = analyze(CFG(fn))
    assert sorted(prov.params_of_addr(tma.index)) == want


def test_an_unattributed_tma_copy_before_the_wait_is_an_error():
    """Before griddepcontrol.wait a TMA copy must be shown to read a static weight: one whose
    map the audit cannot tie to a parameter is an error, one tied to the static map is not."""
    roles = ["static", "activation", "activation"]
    tied = "ULDC.64 UR4, c[0x0][0x198]\nUIADD3 UR8, UP0, UR4, 0x30, URZ\nUTMALDG.2D [UR12], [UR8]\nACQBULK\nEXIT"
    lost = "ULDC.64 UR4, c[0x0][0x198]\nUMOV UR4, 0x10\nUIADD3 UR8, UP0, UR4, 0x30, URZ\nUTMALDG.2D [UR12], [UR8]\nACQBULK\nEXIT"
    act = tied.replace("0x30", "0xb0")
    for body, bad in ((tied, False), (lost, True), (act, True)):
        rep = audit_ptx(MAP_HEADER, roles, sass_text=_map_sass(body))
        hits = [f for f in rep.findings if f.rule == "load-before-griddep-wait"]
        assert bool(hits) == bad and all(f.sass for f in hits), [str(f) for f in rep.findings]


def test_steps_reads_the_induction_pattern_in_ptx_and_strength_reduced_sass():
    """The PTX counts steps on an index (s += 1, then scaled); ptxas walks the addresses
    themselves (R += 0x100) and may give a spin and its loop one header. Both read as the same
    steps: the flag waited is step 0, the early load at +256 bytes step 1."""
    from pathlib import Path

    from validation.race import steps

    here = Path(__file__).resolve().parent / "fixtures" / "race"
    ptx_text = (here / "step_ptr_next_before_wait.ptx").read_text()
    fn = parse_ptx(ptx_text)[0]
    sfn = parse_sass((here / "step_ptr_next_before_wait.sass").read_text(), fn.params)[0]
    for f in (fn, sfn):
        cfg = CFG(f)
        found = {}
        for lp in cfg.loops:
            ls = steps.analyze_loop(cfg, lp)
            for ins in f.instrs:
                if ins.kind == ir.LOAD and cfg.block_of[ins.index] in lp.body:
                    s = ls.step_of(ins.index)
                    if s is not None:
                        found.setdefault(ins.index, set()).add(s)
        assert {frozenset(v) for v in found.values()} >= {frozenset({0}), frozenset({1})}, f.dialect


# A loop that walks a task table by its entry stride, loading the pointer in slot 8 of each
# entry, with a loop counter beside it: both are loop-carried registers with an immediate add.
_TABLE_WALK = """
	mov.u64 %rd3, %rd1;
	mov.u32 %r2, 0;
$L__walk:
	ld.global.b64 %rd4, [%rd3+8];
	ld.global.b32 %r3, [%rd4];
	add.s64 %rd3, %rd3, 24;
	add.s32 %r2, %r2, 1;
	setp.lt.u32 %p1, %r2, %r9;
	@%p1 bra $L__walk;"""


@pytest.mark.parametrize("stride", [24, 0, 48])
def test_provenance_converges_on_loop_carried_offsets(stride):
    """The loop counter's offset moves on every pass around the loop (and, with the table read
    as one entry or a stride the walk does not divide, so does the pointer's): the analysis
    widens it to an unknown offset and converges. A pointer that walks the table by its stride
    keeps its exact slot."""
    from validation.race.dataflow import analyze, slot_index, UNKNOWN_SLOT

    fn = parse_ptx(_ptx(_TABLE_WALK))[0]
    prov = analyze(CFG(fn), {0: stride})
    inner = [i for i in fn.instrs if i.kind == ir.LOAD and i.addr_regs == ("%rd4",)][0]
    want = {slot_index(0, 8)} if stride == 24 else {slot_index(0, UNKNOWN_SLOT)}
    assert prov.params_of_addr(inner.index) == want


_SCALAR_TABLE = {"0": {"stride": 16, "slots": {"0": "scalar", "8": "scalar"}}}
# a number from slot 0 of the table (param 0), as an index into param 1, or as an address itself
_INDEXED = """
	ld.global.u32 %r2, [%rd1];
	mul.wide.u32 %rd3, %r2, 4;
	add.s64 %rd4, %rd2, %rd3;
	st.global.b32 [%rd4], %r1;"""
_AS_POINTER = """
	ld.global.u64 %rd3, [%rd1+8];
	st.global.b32 [%rd3], %r1;"""


def test_a_scalar_slot_may_index_a_buffer_but_never_be_one():
    """A task table of numbers (every slot "scalar"): a number that indexes a parameter's buffer
    is that buffer's access, clean; the same number used as an address is points-to-undeclared."""
    roles = ["static", "activation", "scalar"]
    dirs = ["in", "out", "in"]
    rep = audit_ptx(_ptx(_INDEXED), roles, directions=dirs, points_to=_SCALAR_TABLE)
    assert "points-to-undeclared" not in rep.rules_hit(), [str(f) for f in rep.findings]
    rep = audit_ptx(_ptx(_AS_POINTER), roles, directions=dirs, points_to=_SCALAR_TABLE)
    assert "points-to-undeclared" in rep.rules_hit(), [str(f) for f in rep.findings]


# Two stages' entries in one 32-byte row of a task table of numbers (param 0): stage 0's item
# index (the word at +0) addresses a store to y (param 1), stage 1's (+16) a load of it.
_STAGED = """
	ld.global.u32 %r2, [%rd1];
	mul.wide.u32 %rd3, %r2, 4;
	add.s64 %rd4, %rd2, %rd3;
	st.global.b32 [%rd4], %r1;
	ld.global.u32 %r3, [%rd1+16];
	mul.wide.u32 %rd5, %r3, 4;
	add.s64 %rd6, %rd2, %rd5;
	ld.global.b32 %r4, [%rd6];
	st.global.b32 [%rd4+4], %r4;"""
_STAGED_TABLE = {"0": {"stride": 32, "slots": {"0": "scalar", "8": "scalar", "16": "scalar", "24": "scalar"}}}


def test_a_stage_touches_only_what_it_declares():
    """An access is its stage's when its address derives from that stage's task-table entry;
    stage 1 reading y, which only stage 0 declares, is stage-undeclared-access."""
    kw = dict(param_names=["tasks", "y", "n"], directions=["in", "inout", "in"], points_to=_STAGED_TABLE)
    roles = ["static", "activation", "scalar"]
    ok = audit_ptx(_ptx(_STAGED), roles, stages=[("s0", (), ("y",)), ("s1", ("y",), ())], **kw)
    assert "stage-undeclared-access" not in ok.rules_hit(), [str(f) for f in ok.findings]
    bad = audit_ptx(_ptx(_STAGED), roles, stages=[("s0", (), ("y",)), ("s1", (), ())], **kw)
    f = [x for x in bad.findings if x.rule == "stage-undeclared-access"]
    assert len(f) == 1 and "stage 's1' reads 'y'" in f[0].message, [str(x) for x in bad.findings]
