"""The router op (kernels/ops/router.py): the grouping it promises (torch model of phase 2), its
contract with the manifest, the reference on the tiny preset, its two designs (stream at batch 1:
plan, shared-memory union, the SASS order of its copies; mma above), its k3 builds (read-only or
L2-only paths for weights, the acq_rel arrival and release reset)."""

from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.config import get_config
from kernels.manifest import load_manifest
from kernels.ops import router as RT
from validation.numerics import ROUTINGS, routing_ids

SPEC = load_manifest().kernel("router")
K3 = {"batch": 1, "n_experts": 896, "hidden": 7168, "top_k": 16, "latent": 3584}
# the stream design with weights and h by cp.async and the radix select (round 9's defaults)
# round 9's stream design: weights by cp.async, the radix select, the selector's counter (arrive 2)
CP_ASYNC = {"stream_w_regs": 0, "stream_topk": 2, "group_one": 0, "stream_ctas_per_sm": 0, "arrive": 2}


def _ids(pattern, T=5, E=16, K=4, seed=0):
    return routing_ids(T, E, K, pattern, torch.Generator().manual_seed(seed), "cpu")


@pytest.mark.parametrize("pattern", ROUTINGS)
def test_grouping_lists_each_expert_once_with_its_slots_in_token_order(pattern):
    ids = _ids(pattern)
    g = RT.routing_groups_ref(ids, 16)
    n = int(g["n_groups"][0])
    experts = g["group_expert"][:n].tolist()
    assert experts == sorted(set(ids.flatten().tolist()))  # once each, ascending
    flat = ids.flatten()
    slots = g["sorted_slots"]
    assert sorted(slots.tolist()) == list(range(ids.numel()))  # a permutation of the slots
    for u, e in enumerate(experts):
        grp = slots[g["group_start"][u]:g["group_start"][u + 1]]
        assert (flat[grp.long()] == e).all()  # contiguous, this expert only
        assert grp.tolist() == sorted(grp.tolist())  # token order
    assert int(g["group_start"][n]) == ids.numel()


def counting_sort_groups(ids, n_experts: int):
    """Phase 2's grouping as the kernel computes it: per-expert token bit masks, counts by
    population count, an exclusive scan over experts, ranks by masked population counts."""
    T, K = ids.shape
    masks = [0] * n_experts
    for t in range(T):
        for e in ids[t].tolist():
            masks[e] |= 1 << t
    counts = [bin(m).count("1") for m in masks]
    start, group_expert, group_start, pos = [0] * n_experts, [], [], 0
    for e in range(n_experts):
        start[e] = pos
        if counts[e]:
            group_expert.append(e)
            group_start.append(pos)
        pos += counts[e]
    sorted_slots = [0] * (T * K)
    for p in range(T * K):
        t = p // K
        e = int(ids[t, p % K])
        sorted_slots[start[e] + bin(masks[e] & ((1 << t) - 1)).count("1")] = p
    return len(group_expert), group_expert, group_start + [T * K], sorted_slots


@pytest.mark.parametrize("pattern", ROUTINGS)
@pytest.mark.parametrize("T", [1, 5, 33, 64])
def test_counting_sort_grouping_is_the_reference_grouping(pattern, T):
    ids = routing_ids(T, 64, 8, pattern, torch.Generator().manual_seed(T), "cpu")
    n, experts, starts, slots = counting_sort_groups(ids, 64)
    ref = RT.routing_groups_ref(ids, 64)
    assert n == int(ref["n_groups"][0])
    assert experts == ref["group_expert"][:n].tolist()
    assert starts == ref["group_start"][: n + 1].tolist()
    assert slots == ref["sorted_slots"].tolist()


def test_same_routing_gives_top_k_groups_holding_every_token():
    ids = _ids("same", T=6)
    g = RT.routing_groups_ref(ids, 16)
    assert int(g["n_groups"][0]) == 4
    assert torch.diff(g["group_start"][:5]).tolist() == [6, 6, 6, 6]


def test_reference_selection_breaks_ties_to_the_lower_expert():
    s = torch.tensor([[0.5, 0.7, 0.7, 0.1, 0.7]])
    ids = reference.select_experts(s, torch.zeros(5), 2)
    assert ids.tolist() == [[1, 2]]


def test_reference_outputs_on_tiny_match_the_projects_router():
    cfg = get_config("tiny")
    w = reference.make_weights(cfg)
    h = reference.rmsnorm(reference.make_hidden(cfg, 3), w.gamma_pre)
    op = RT.RouterOp({"batch": 3, "n_experts": 16, "hidden": 64, "top_k": 4, "latent": 32}, warps_per_cta=2)
    out = op.reference(h=h, w_gate=w.w_gate, bias=w.bias, w_down=w.w_down)
    r = reference.router(h, w.w_gate, w.bias, 4)
    assert torch.equal(out["ids"], r.ids) and torch.equal(out["weights"], r.weights)
    assert torch.equal(out["z"], reference.linear(h, w.w_down))
    assert set(out) == {p.name for p in SPEC.params if p.direction == "out"}


def test_default_tunables_and_params_follow_the_manifest():
    assert RT.DEFAULT_TUNABLES == SPEC.tunable_defaults()
    for shape in SPEC.shapes:
        op = RT.RouterOp(shape)
        assert list(op.tensor_specs()) == [p.name for p in SPEC.params]
        if shape["batch"] <= 2:  # stream: the selector CTA, one CTA per two rows of W_g, then of W_down
            assert op.stream and op.launch_config().grid[0] == 1 + 896 // 2 + 3584 // 2
        else:
            assert not op.stream and op.launch_config().grid[0] == 896 // 8 + 3584 // 16


def test_stream_design_at_batch_1_one_grid_of_whole_row_ctas():
    """Batch 1 (and 2 by default): the selector CTA 0, router rows (CTAs 1..448), then W_down's;
    256 threads, two rows of 128 threads, 7 vectors each; shared memory = two weight rows + h
    (the phase-2 arrays reuse it) + partials."""
    op = RT.RouterOp(K3)
    assert op.stream and (op.ctas, op.down_ctas, op.threads) == (448, 1792, 256)
    assert op.plan.vectors == op.down_plan.vectors == 7 and op.plan.rows == 2 and op.plan.row_threads == 128
    # the default holds its weights in registers: shared memory is h or phase 2's arrays, the
    # threshold selection's candidates last
    o = op.phase2_offsets
    assert op.w_regs == 1 and op.union_elems == 2 * (o["cand_id"] + op.n_experts) > 7168
    assert op.smem_bytes == op.union_elems * 2 + 32 + 16 + 64 and all(v % 4 == 0 for v in o.values())
    # stream_ctas_per_sm 4 (not the default): the carveout that holds 4 CTAs per SM and not 5
    n4 = RT.RouterOp(K3, stream_ctas_per_sm=4)
    per = n4.smem_bytes + RT.SMEM_RESERVED_PER_CTA
    assert n4.carveout == 40 and 4 * per <= 0.40 * RT.SM90_SMEM_PER_SM < 5 * per
    assert n4.launch_config().smem_carveout == 40 and op.launch_config().smem_carveout is None
    assert "smem_carveout" not in RT.RouterOp({**K3, "batch": 8}).launch_config().to_dict()  # mma: none
    cp = RT.RouterOp(K3, **CP_ASYNC)  # weights and h by cp.async: two weight rows + h
    assert cp.union_elems == 3 * 7168 and cp.smem_bytes == 3 * 7168 * 2 + 32 + 16 + 64
    o = cp.phase2_offsets  # 16-byte aligned int32 arrays inside the union, the radix scratch last
    assert all(v % 4 == 0 for v in o.values()) and 2 * (o["key"] + op.n_experts) <= cp.union_elems
    assert op.launch_config().pdl is True and RT.RouterOp(K3, pdl=0).launch_config().pdl is False
    assert RT.RouterOp({**K3, "batch": 4}, pdl=1).launch_config().pdl is False  # mma: plain launch
    assert not RT.RouterOp(K3, stream_max_batch=0).stream
    assert RT.RouterOp({**K3, "batch": 4}, stream_max_batch=4).stream
    # round 7's shape: one row of 128 threads per CTA
    one = RT.RouterOp(K3, stream_threads=128, stream_cta_kib=8, **CP_ASYNC)
    assert (one.rows_per_cta, one.ctas, one.down_ctas, one.plan.row_threads) == (1, 896, 3584, 128)
    assert one.union_elems == 2 * 7168
    wide = RT.RouterOp(K3, stream_threads=128, stream_cta_kib=32)  # two rows per CTA: 64 threads each
    assert (wide.rows_per_cta, wide.down_rows_per_cta, wide.ctas, wide.plan.row_threads) == (2, 2, 448, 64)
    # the union also holds phase 2 where rows are tiny (mini-like shapes)
    small = RT.RouterOp({"batch": 3, "n_experts": 64, "hidden": 1024, "top_k": 8, "latent": 512},
                        stream_max_batch=4)
    assert small.stream and small.union_elems >= 2 * (small.phase2_offsets["cand_id"] + small.n_experts)


def test_selection_designs_arrival_and_timeline():
    """stream_topk picks the stream design's selection, topk the mma design's (TOPK_DESIGNS);
    only the radix select (2) takes shared scratch. arrive 3 (default) and 2 add the selector CTA
    0; with 3 the counter buffer holds the tagged logits (one word per token and expert, its
    spec says protocol "tagged"), with 2 one counter; the explorer-only choices (timeline 1,
    arrive 0) are never a tuner's candidates; the timeline (explorer only) widens the counter,
    every stamp in its own word, the two maxima over CTAs each alone in a 128-byte line away
    from the arrival counter (word 0), the tagged logits after the stamps."""
    assert RT.TOPK_DESIGNS == ("shuffle", "redux", "radix", "thresh")
    assert RT.RouterOp(K3).topk == 3 and RT.RouterOp({**K3, "batch": 8}).topk == 0
    assert dict(RT.RouterOp(K3)._radix_words()) == {"ctl": 4, "wb_key": 8, "wb_id": 8, "cand_key": 896,
                                                     "cand_id": 896}
    assert RT.RouterOp(K3, stream_topk=1).topk == 1 and RT.RouterOp({**K3, "batch": 8}, topk=1).topk == 1
    assert RT.RouterOp(K3, stream_topk=0)._radix_words() == ()
    words = dict(RT.RouterOp(K3, stream_topk=2)._radix_words())
    assert words == {"hist": 512, "ctl": 4, "cand_key": 16, "cand_id": 16, "key": 896}
    mma = RT.RouterOp({**K3, "batch": 8})
    assert RT.RouterOp({**K3, "batch": 8}, topk=2).smem_bytes == mma.smem_bytes + 4 * (512 + 4 + 16 + 16 + 896)
    assert RT.RouterOp(K3).launch_config().grid[0] == 1 + 448 + 1792  # arrive 3: the selector CTA
    assert RT.RouterOp(K3, arrive=2).launch_config().grid[0] == 1 + 448 + 1792
    assert RT.RouterOp(K3, arrive=1).launch_config().grid[0] == RT.RouterOp(K3, arrive=0).launch_config().grid[0]
    assert RT.RouterOp(K3, arrive=0).launch_config().grid[0] == 448 + 1792
    assert RT.RouterOp({**K3, "batch": 8}, arrive=2).launch_config().grid == mma.launch_config().grid  # stream only
    for bad in ({"stream_topk": 4}, {"topk": -1}, {"arrive": 4}, {"timeline": 2}, {"stream_w_regs": 2},
                {"group_one": 2}):
        with pytest.raises(ValueError, match="must be one of"):
            RT.RouterOp(K3, **bad)
    for bad in (-1, 1001):
        with pytest.raises(ValueError, match="poll_sleep must be 0..1000"):
            RT.RouterOp(K3, poll_sleep=bad)
    from agent.proposers.tuner import tunable_grid

    tuned = {t.name: t.tuned_choices for t in SPEC.tunables}
    assert tuned["timeline"] == (0,) and tuned["arrive"] == (1, 2, 3) and tuned["stream_topk"] == (0, 1, 2, 3)
    grid = tunable_grid(SPEC)
    assert grid[0] == SPEC.tunable_defaults() and not any(c["timeline"] or not c["arrive"] for c in grid)
    tagged = RT.RouterOp(K3).tensor_specs()["counter"]
    assert tagged.shape == (896,) and tagged.to_dict()["protocol"] == "tagged"
    assert RT.RouterOp({**K3, "batch": 2}).tensor_specs()["counter"].shape == (2 * 896,)
    assert RT.RouterOp(K3, timeline=1).tensor_specs()["counter"].shape == (RT.TIMELINE_WORDS + 896,)
    for counter in (RT.RouterOp(K3, arrive=2), RT.RouterOp({**K3, "batch": 8})):  # a counter, not tagged
        assert counter.tensor_specs()["counter"].shape == (1,) and "protocol" not in counter.tensor_specs()[
            "counter"].to_dict()
    assert RT.RouterOp(K3, arrive=2, timeline=1).tensor_specs()["counter"].shape == (RT.TIMELINE_WORDS,)
    slots = RT.TIMELINE_SLOTS
    assert len(set(slots.values())) == len(slots) and all(0 < w < RT.TIMELINE_WORDS for w in slots.values())
    for contended in ("last_down_end", "last_router_arrival"):
        line = slots[contended] // 32
        assert line != 0 and [n for n, w in slots.items() if w // 32 == line] == [contended]


def test_mma_design_cta_widths():
    """row_tiles and down_row_tiles widen the mma design's router and down CTAs (8 rows per
    tile): fewer CTAs, each reading h once, so less h per weight byte; the partials grow with
    the rows."""
    b64 = {**K3, "batch": 64}
    base = RT.RouterOp(b64)
    assert (base.rows_per_cta, base.down_rows_per_cta, base.ctas, base.down_ctas) == (8, 16, 112, 224)
    wide = RT.RouterOp(b64, row_tiles=4, down_row_tiles=8)
    assert (wide.rows_per_cta, wide.down_rows_per_cta, wide.ctas, wide.down_ctas) == (32, 64, 28, 56)
    assert wide.launch_config().grid[0] == 28 + 56 and wide.partial_rows == 64
    assert wide.plan.row_tiles == 4 and wide.down_plan.row_tiles == 8
    # the block's settings (kernels/block.py ROUTER_IN_BLOCK) fit sm_90's shared memory per CTA
    from kernels.block import block_tunables
    from kernels.build import SM90_SMEM_PER_CTA

    for T in (8, 16, 32, 64):
        op = RT.RouterOp({**K3, "batch": T}, **block_tunables("router", T))
        assert not op.stream and op.smem_bytes + 1024 <= SM90_SMEM_PER_CTA, (T, op.smem_bytes)
    for T in (1, 2):  # the block runs the router's stream design (threshold select) at batches 1 and 2
        op = RT.RouterOp({**K3, "batch": T}, **block_tunables("router", T))
        assert op.stream and op.topk == 3 and op.smem_bytes + 1024 <= SM90_SMEM_PER_CTA
    with pytest.raises(ValueError, match="not a multiple of 24 rows"):
        RT.RouterOp({**b64, "n_experts": 64 * 14}, row_tiles=3)
    for bad in ({"down_row_tiles": 0}, {"row_tiles": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            RT.RouterOp(b64, **bad)


@pytest.mark.parametrize("shape, fragment", [
    ({**K3, "batch": 65}, "batch 65"),
    ({**K3, "top_k": 0}, "top_k 0"),
    ({k: v for k, v in K3.items() if k != "latent"}, "missing"),
    ({**K3, "n_experts": 900, "batch": 4}, "multiple of 8"),  # the mma design's rows per CTA
    ({**K3, "n_experts": 898}, "not a multiple of 4"),  # stream: 16-byte logit copies
    ({**K3, "hidden": 7164}, "not a multiple of 8"),  # stream: 16-byte weight vectors
])
def test_rejects_what_it_cannot_compute(shape, fragment):
    with pytest.raises(ValueError, match=fragment):
        RT.RouterOp(shape)


@pytest.mark.slow
def test_k3_build_ptx_mma_design(tmp_path):
    cute = pytest.importorskip("cutlass.cute")
    op = RT.RouterOp({**K3, "batch": 64})
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(Path(tmp_path).glob("*.ptx")).read_text()
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert "ld.global.nc.v4" in ptx  # weights through the read-only path
    assert "atom.global.acq_rel" in ptx and "st.release.gpu" in ptx  # arrival, counter reset


def _sass_ops(art) -> list[str]:
    return [l.split("*/", 1)[1].split(";")[0].strip() for l in Path(art.paths["sass"]).read_text().splitlines()
            if l.strip().startswith("/*") and "*/" in l and ";" in l]


@pytest.mark.slow
def test_stream_sass_issues_every_copy_before_one_wait(tmp_path):
    """Through the real build, batch 1, the last-arrival scheme (arrive 1), pdl 0 and 1: each streaming body (router rows, down
    rows) issues its 7 weight copies (LDGSTS, L2 only) and h's 7 before its one wait (DEPBAR)
    and before any shared load or FMA; nothing is loaded into registers before the arrival
    (ATOMG, acq_rel) and its reset (release store); the last CTA stages logits and bias by
    L2-only copies after it; with pdl the weight copies precede ACQBULK and h's follow it."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    for pdl in (0, 1):
        art = build_variant("router", K3, {**CP_ASYNC, "pdl": pdl, "arrive": 1}, root=tmp_path)
        ops = _sass_ops(art)
        arrive = next(i for i, o in enumerate(ops) if "ATOMG.E.ADD.STRONG.GPU" in o)
        assert any("STG.E.STRONG.GPU" in o for o in ops[arrive:arrive + 20])  # the reset
        assert not any(o.split()[-1].startswith("LDG.") or o.split()[0].startswith("LDG.")
                       for o in ops[:arrive] if o.split())
        waits = [i for i, o in enumerate(ops) if o.startswith("DEPBAR")]
        assert len(waits) == 3  # router rows, phase 2 staging, down rows
        bodies = 0
        for lo, hi in zip([0] + waits, waits):
            seg = [(i, o) for i, o in enumerate(ops[lo:hi], lo) if "LDGSTS" in o]
            if seg[0][0] > arrive and hi < ops.index("EXIT", arrive):  # phase 2 staging: L2 only
                assert seg and all("BYPASS" in o for _, o in seg)
                continue
            bodies += 1
            w = [i for i, o in seg if "BYPASS" in o]
            x = [i for i, o in seg if "BYPASS" not in o]
            assert len(w) == 7 and len(x) == 7, seg
            first_use = min(i for i, o in enumerate(ops) if i > seg[0][0] and o.split()[0] in ("LDS.128", "FFMA"))
            assert first_use > hi
            acq = [i for i in range(lo, hi) if "ACQBULK" in ops[i]]
            if pdl:
                assert len(acq) == 1 and max(w) < acq[0] < min(x)
            else:
                assert not acq
        assert bodies == 2


@pytest.mark.slow
def test_stream_sass_selector_spins_after_the_wait_and_router_ctas_release(tmp_path):
    """The default arrival (arrive 2), batch 1, pdl 0 and 1, the cp.async design
    (`stream_w_regs` 0; the default's weights in registers: the next test): the selector CTA lets the next
    launch start and waits for the previous one (PREEXIT, ACQBULK) before its spin, whose
    counter loads are gpu-scope strong loads each followed by an L1 invalidation (acquire);
    the counter's reset is a strong store behind a gpu-scope fence (release), before phase 2's
    staging; each router CTA's add is a reduction (no reply awaited) behind a fence, after its
    one wait; each streaming body keeps its 7 weight copies before ACQBULK and h's 7 after."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    for pdl in (0, 1):
        ops = _sass_ops(build_variant("router", K3, {**CP_ASYNC, "pdl": pdl}, root=tmp_path))
        spin = [i for i, o in enumerate(ops) if o.startswith("LDG.E.STRONG.GPU")]
        assert spin and all(ops[i + 1] == "CCTL.IVALL" for i in spin)
        reset = next(i for i, o in enumerate(ops) if o.startswith("STG.E.STRONG.GPU"))
        assert reset > max(spin) and "MEMBAR.ALL.GPU" in ops[reset - 3:reset]
        waits = [i for i, o in enumerate(ops) if o.startswith("DEPBAR")]
        assert len(waits) == 3 and reset < waits[0]  # phase 2's staging, router rows, down rows
        red = [i for i, o in enumerate(ops) if o.startswith("REDG.E.ADD.S32.STRONG.GPU")]
        # the router CTAs' body (between the selector's staging wait and the down CTAs' body)
        assert len(red) == 1 and waits[1] < red[0] < waits[2]
        assert ops[red[0] - 3:red[0]].count("MEMBAR.ALL.GPU") == 1
        assert not any("ATOMG" in o for o in ops)
        acq = [i for i, o in enumerate(ops) if "ACQBULK" in o]
        pre = [i for i, o in enumerate(ops) if o == "PREEXIT"]
        if pdl:
            assert len(acq) == 3 and len(pre) == 3 and pre[0] < acq[0] < min(spin)
            for a, lo, w in zip(acq[1:], waits, waits[1:]):  # the two streaming bodies
                seg = [(i, ops[i]) for i in range(lo + 1, w) if "LDGSTS" in ops[i]]
                wts = [i for i, o in seg if "BYPASS" in o]
                xs = [i for i, o in seg if "BYPASS" not in o]
                assert len([i for i in wts if i < a]) == 7 and len([i for i in xs if a < i < w]) == 7
        else:
            assert not acq and not pre


@pytest.mark.slow
def test_stream_sass_default_tagged_logits_no_fence_no_atomic(tmp_path):
    """The default arrival (arrive 3, tagged logits), batch 1, pdl 1: the selector copies the
    bias (cp.async) before its ACQBULK; after it, each round of its poll (a 2 us sleep first,
    poll_sleep 2) issues every word's strong
    gpu-scope load (no L1 invalidation: relaxed, the words are their own flags) before the
    test that loops; the resets are strong stores after the poll, before the bias wait. Each
    router CTA stores its logit (plain) and its tagged word (strong) and exits: no barrier,
    fence or atomic after its last partial-sum barrier. Nowhere a fence or an atomic. The
    static audit sees the counter as tagged and is clean; round 10's arrival (arrive 2) on the
    same design is audited as a counter."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant
    from validation.race.artifacts import audit_artifact
    from kernels.manifest import load_manifest

    art = build_variant("router", K3, {}, root=tmp_path)
    ops = _sass_ops(art)
    assert not any(o.startswith(("MEMBAR", "REDG", "ATOMG", "CCTL")) for o in ops)
    acq = [i for i, o in enumerate(ops) if "ACQBULK" in o]
    bias = [i for i, o in enumerate(ops) if o.startswith("LDGSTS.E.BYPASS.128")]
    assert bias and max(bias) < acq[0]
    first_wait = next(i for i, o in enumerate(ops) if o.startswith("DEPBAR"))
    poll = [i for i, o in enumerate(ops[:first_wait]) if "LDG.E.STRONG.GPU" in o]
    resets = [i for i, o in enumerate(ops[:first_wait]) if "STG.E.STRONG.GPU" in o and o.endswith("RZ")]
    assert len(poll) == len(resets) == 4 and acq[0] < min(poll)  # 896 words over 256 threads
    # poll_sleep 2: the warps sleep before each round (the loop's first instruction that matters)
    assert any(o.startswith("NANOSLEEP") for o in ops[acq[0]:min(poll)])
    loop = next(i for i in range(max(poll), first_wait) if ops[i].startswith("@P0 BRA"))
    assert max(poll) < loop < min(resets)  # every load issued, then one test
    tag = [i for i, o in enumerate(ops) if "STG.E.STRONG.GPU" in o and not o.endswith("RZ")]
    assert len(tag) == 1
    last_bar = max(i for i in range(tag[0]) if ops[i].startswith("BAR.SYNC"))
    assert not any(o.startswith(("BAR", "MEMBAR")) for o in ops[last_bar + 1:tag[0]])
    assert ops[tag[0] + 1] == "EXIT" and any(o.startswith("STG.E ") for o in ops[last_bar + 1:tag[0]])
    spec = load_manifest().kernel("router")
    rep = audit_artifact(art, spec)
    assert rep.clean, [str(f) for f in rep.findings]
    assert next(p for p in rep.params if p["name"] == "counter")["role"] == "tagged"
    # as the gate and `fasttrack validate` hand it over (paths only): the meta.json beside the PTX
    from types import SimpleNamespace

    bare = audit_artifact(SimpleNamespace(paths={"ptx": art.paths["ptx"], "sass": art.paths["sass"]}), spec)
    assert bare.clean and next(p for p in bare.params if p["name"] == "counter")["role"] == "tagged"
    old = audit_artifact(build_variant("router", K3, {"arrive": 2}, root=tmp_path), spec)
    assert old.clean and next(p for p in old.params if p["name"] == "counter")["role"] == "sync"


@pytest.mark.slow
def test_stream_sass_default_loads_weights_into_registers_before_the_wait(tmp_path):
    """The default stream design (`stream_w_regs` 1), batch 1, pdl 1, with round 10's arrival
    (arrive 2; the default's tagged arrival: the test above): each streaming body loads its
    7 weight vectors by plain 16-byte loads (LDG.E.128: not the read-only path, which ptxas
    moved below the wait in round 9) before its ACQBULK, and copies h's 7 vectors into shared
    memory after it, before its one wait; no read-only load anywhere; the selector spins
    (acquire) after its own ACQBULK and resets the counter (release) before phase 2's staging;
    each router CTA's add is a fenced reduction after its wait. 64 registers: four CTAs per SM,
    with either arrival."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    assert build_variant("router", K3, {}, root=tmp_path).meta["resources"]["registers"] == 64
    art = build_variant("router", K3, {"arrive": 2}, root=tmp_path)
    # four CTAs per SM by registers (256 threads x 64): with five, phase 2 became the critical path
    res = art.meta["resources"]
    assert res["registers"] == 64 and res["spill_store_bytes"] == 0 and "smem_carveout" not in art.meta["launch"]
    assert 4 * (res["dynamic_smem_bytes"] + res["static_smem_bytes"] + 1024) <= RT.SM90_SMEM_PER_SM
    ops = _sass_ops(art)
    assert not any(".CONSTANT" in o for o in ops)
    acq = [i for i, o in enumerate(ops) if "ACQBULK" in o]
    waits = [i for i, o in enumerate(ops) if o.startswith("DEPBAR")]
    assert len(acq) == 3 and len(waits) == 3  # selector, router rows, down rows; staging, rows, rows
    spin = [i for i, o in enumerate(ops) if o.startswith("LDG.E.STRONG.GPU")]
    assert spin and all(ops[i + 1] == "CCTL.IVALL" for i in spin) and acq[0] < min(spin)
    reset = next(i for i, o in enumerate(ops) if o.startswith("STG.E.STRONG.GPU"))
    assert reset > max(spin) and "MEMBAR.ALL.GPU" in ops[reset - 3:reset] and reset < waits[0]
    red = [i for i, o in enumerate(ops) if o.startswith("REDG.E.ADD.S32.STRONG.GPU")]
    assert len(red) == 1 and waits[1] < red[0] < acq[2] and ops[red[0] - 3:red[0]].count("MEMBAR.ALL.GPU") == 1
    for a, w in zip(acq[1:], waits[1:]):  # the two streaming bodies
        lo = max(i for i in [0] + waits + [ops.index("EXIT")] if i < a)
        loads = [i for i in range(lo, w) if ops[i].startswith("LDG.E.128 ")]
        h = [i for i in range(lo, w) if ops[i].startswith("LDGSTS") and "BYPASS" not in ops[i]]
        assert len(loads) == 7 and max(loads) < a, (lo, a, w)
        assert len(h) == 7 and a < min(h) and max(h) < w


# -- router_select: the router's phase 2 from a GEMM's logits ------------------------------------


def test_router_select_reference_is_the_routers_on_the_same_logits():
    from kernels.ops.router import RouterOp, RouterSelectOp

    cfg = get_config("mini")
    g = torch.Generator().manual_seed(4)
    T = 5
    h = torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16)
    w_gate = torch.randn(cfg.n_experts, cfg.hidden, generator=g).to(torch.bfloat16)
    w_down = torch.randn(cfg.latent, cfg.hidden, generator=g).to(torch.bfloat16)
    bias = 0.1 * torch.randn(cfg.n_experts, generator=g)
    full = RouterOp({"batch": T, "n_experts": cfg.n_experts, "hidden": cfg.hidden, "top_k": cfg.top_k,
                     "latent": cfg.latent}).reference(h=h, w_gate=w_gate, bias=bias, w_down=w_down)
    sel = RouterSelectOp({"batch": T, "n_experts": cfg.n_experts, "top_k": cfg.top_k}).reference(
        logits=full["logits"], bias=bias)
    assert set(sel) == set(full) - {"logits", "z"}
    for k, v in sel.items():
        assert torch.equal(v, full[k]), k


def test_router_select_contract():
    from kernels.manifest import load_manifest
    from kernels.ops.router import SELECT_TUNABLES, RouterSelectOp

    spec = load_manifest().kernel("router_select")
    assert SELECT_TUNABLES == spec.tunable_defaults()
    for shape in spec.shapes:
        op = RouterSelectOp(dict(shape))
        assert list(op.tensor_specs()) == [p.name for p in spec.params]
        lc = op.launch_config()
        # a warp per token, every token in some CTA, no CTA without one
        assert lc.block[0] == 32 * op.tokens_per_cta and (lc.grid[0] - 1) * op.tokens_per_cta < shape["batch"]
        assert lc.grid[0] * op.tokens_per_cta >= shape["batch"]
    with pytest.raises(ValueError, match="multiple of 4"):
        RouterSelectOp({"batch": 1, "n_experts": 30, "top_k": 2})
    with pytest.raises(ValueError, match="power of two"):
        RouterSelectOp({"batch": 1, "n_experts": 32, "top_k": 2}, warps_per_cta=3)
    with pytest.raises(ValueError, match="unknown tunables"):
        RouterSelectOp({"batch": 1, "n_experts": 32, "top_k": 2}, row_tiles=2)


@pytest.mark.parametrize("shape", [{"batch": 64, "n_experts": 896, "top_k": 16},
                                   {"batch": 5, "n_experts": 64, "top_k": 8}])
def test_router_select_builds_and_audits_clean(tmp_path, shape):
    """The static race audit over its PTX and SASS: the arrival's acq_rel counter, the ids other
    CTAs stored read back only after it, the logits staged by cp.async (an activation: never the
    read-only path)."""
    pytest.importorskip("cutlass.cute")
    from validation.race.artifacts import audit_kernel

    rep = audit_kernel("router_select", shape=shape, root=tmp_path)
    assert rep.clean, [str(f) for f in rep.findings]
    assert rep.checked == ["ptx", "sass"]
    ptx = next(Path(tmp_path).rglob("kernel.ptx")).read_text()
    assert "cp.async.cg.shared.global" in ptx and "atom.global.acq_rel.add" in ptx
    assert "ld.global.nc" not in ptx
