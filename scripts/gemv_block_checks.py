"""The dynamic checks of the kernels the block gained with its gemv paths (kernels/block.py
GEMV_ROUTER, GEMV_DENSE): router_select, gated_situ and residual. One GPU call.

  python scripts/gemv_block_checks.py plan            # CPU host with the DSL: build, audit, carry
  PYTHONPATH=. python3 scripts/gemv_block_checks.py gpu --out DIR   # GPU host, carrying .devcarry/gemv_checks

`plan` builds every variant of `VARIANTS` (small shapes, so that racecheck instruments every
shared-memory access in seconds; router_select also at k3's batch 64) into build/gemv_checks,
audits each statically and copies cubin and metadata to .devcarry/gemv_checks/<id>/ with
plan.json. `gpu`, in order:
  * compute-sanitizer memcheck, racecheck, synccheck and initcheck (validation/race/dynamic.py),
    each over a child that launches every variant once on fresh inputs, outputs poisoned
    first, and checks it against its reference (router_select: ids and weights of the
    reference rule on the same logits, the grouping exactly, the counter back at zero;
    gated_situ within a few ulps of the fp32 reference, residual bitwise equal to it), one
    run marker per variant: a tool is clean only with its clean summary and every marker;
  * stress: every variant 32 times on the same inputs, the second half beside bf16 matmuls on
    another stream: bitwise identical, router_select's counter zero after each.
Results: DIR/gemv_checks.json and DIR/sanitizers.log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

BUILD = ROOT / "build" / "gemv_checks"
CARRY = ROOT / ".devcarry" / "gemv_checks"
SEL_MINI = {"n_experts": 64, "top_k": 8}
# (id, kernel, shape, tunables): router_select with one CTA, with several and a partial last one,
# with 64 tokens (two words of token mask per expert), and at k3's widths; the epilogues with a
# partial last CTA of a row.
VARIANTS = [
    ("sel_b3", "router_select", {"batch": 3, **SEL_MINI}, {}),
    ("sel_b21", "router_select", {"batch": 21, **SEL_MINI}, {}),
    ("sel_b64_w2", "router_select", {"batch": 64, **SEL_MINI}, {"warps_per_cta": 2}),
    ("sel_k3_b64", "router_select", {"batch": 64, "n_experts": 896, "top_k": 16}, {}),
    ("situ_b5", "gated_situ", {"batch": 5, "width": 1032}, {}),
    ("residual_b5", "residual", {"batch": 5, "width": 1032}, {}),
]
IDS = [v[0] for v in VARIANTS]


def plan(jobs: int) -> int:
    from explore_common import build_and_carry, invocation

    return build_and_carry(VARIANTS, build_root=BUILD, carry=CARRY, jobs=jobs, command=invocation())


# -- GPU ----------------------------------------------------------------------------------------


def _case(e, g):
    """(op, kernel, inputs, outputs) of one variant: fresh inputs from `g`, outputs poisoned."""
    import torch

    from kernels.launch import CubinKernel
    from kernels.manifest import load_manifest

    spec = load_manifest().kernel(e["kernel"])
    mod, _, cls = spec.op.partition(":")
    op = getattr(__import__(mod, fromlist=[cls]), cls)(e["shape"], **e["tunables"])
    k = CubinKernel.from_dir(CARRY / e["id"])
    k.load()
    specs = op.tensor_specs()
    bufs = {}
    for p in spec.params:
        sp = specs[p.name]
        dt = getattr(torch, sp.dtype)
        if p.direction == "in":
            t = torch.randn(sp.shape, generator=g) * (2.0 if p.name == "logits" else 1.0)
            if p.name == "bias":
                t = 0.1 * t
            bufs[p.name] = t.to(dt).cuda()
        elif p.role == "sync":
            bufs[p.name] = torch.zeros(sp.shape, dtype=dt, device="cuda")
        else:
            bufs[p.name] = torch.empty(sp.shape, dtype=dt, device="cuda")
    return op, k, spec, bufs


def _poison(spec, bufs):
    for p in spec.params:
        if p.direction == "out":
            t = bufs[p.name]
            t.fill_(float("nan") if t.dtype.is_floating_point else -7)


def _check(op, spec, bufs) -> dict:
    import torch

    ins = {p.name: bufs[p.name] for p in spec.params if p.direction == "in"}
    want = op.reference(**ins)
    r = {"counter_zero": all(int(bufs[p.name].abs().sum().item()) == 0 for p in spec.params if p.role == "sync")}
    for name, ref in want.items():
        got = bufs[name]
        if name in ("n_groups", "group_expert", "group_start"):
            n = int(want["n_groups"][0])
            cut = {"n_groups": 1, "group_expert": n, "group_start": n + 1}[name]
            r[name] = bool(torch.equal(got[:cut].cpu(), ref[:cut].cpu()))
        elif got.dtype.is_floating_point and not (op.kernel_name == "residual"):
            # the kernels' exp / tanh against torch's: a few ulps (bf16: a few 2^-8)
            tol = 1e-5 if got.dtype == torch.float32 else 2 ** -6
            r[name] = bool(torch.isfinite(got).all()) and bool(torch.allclose(got.float().cpu(), ref.float().cpu(),
                                                                              rtol=tol, atol=tol))
        else:  # integers exactly; residual's fp32 sums in the reference's order, bitwise
            r[name] = bool(torch.equal(got.cpu(), ref.to(got.dtype).cpu()))
    r["passed"] = all(v for v in r.values())
    return r


def _launch(k, spec, bufs):
    k(*[bufs[p.name] for p in spec.params])


def child() -> int:
    """Every variant once, checked, a run marker each (the sanitized process)."""
    import torch

    from explore_common import entries
    from validation.race.dynamic import marker

    ents = entries(CARRY)
    g = torch.Generator().manual_seed(11)
    for ident in IDS:
        op, k, spec, bufs = _case(ents[ident], g)
        _poison(spec, bufs)
        _launch(k, spec, bufs)
        torch.cuda.synchronize()
        r = _check(op, spec, bufs)
        print(marker(ident, r["passed"], **{n: int(v) for n, v in r.items() if n != "passed"}), flush=True)
    return 0


def stress(runs: int = 32) -> dict:
    import torch

    from block_explore import Occupier, _same_bits
    from explore_common import entries

    ents = entries(CARRY)
    occ = Occupier()
    g = torch.Generator().manual_seed(12)
    out = {}
    for ident in IDS:
        op, k, spec, bufs = _case(ents[ident], g)
        outs = [p.name for p in spec.params if p.direction == "out"]
        first, mism, nonzero, failed = None, 0, 0, 0
        for r in range(runs):
            _poison(spec, bufs)
            if r >= runs // 2:
                occ.start()
            _launch(k, spec, bufs)
            torch.cuda.synchronize()
            chk = _check(op, spec, bufs)
            failed += int(not chk["passed"])
            nonzero += int(not chk["counter_zero"])
            snap = {n: bufs[n].clone() for n in outs}
            if first is None:
                first = snap
            elif not all(_same_bits(snap[n], first[n]) for n in outs):
                mism += 1
        out[ident] = {"runs": runs, "with_concurrent_matmul": runs - runs // 2, "not_bitwise_identical": mism,
                      "counters_left_nonzero": nonzero, "failed_checks": failed}
        print(f"stress {ident:12s} {json.dumps(out[ident])}", flush=True)
    return out


def gpu(out_dir: Path) -> int:
    import time

    from benchmarks.common import gpu_environment
    from explore_common import invocation, read_plan, run_sanitizers

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = read_plan(CARRY)
    res = {"commit": plan_doc["commit"], "plan_dirty": plan_doc["dirty"], "env": gpu_environment(),
           "command": invocation("PYTHONPATH=. python3"), "variants": plan_doc["entries"]}
    path = out_dir / "gemv_checks.json"
    t0 = time.time()
    run_sanitizers(res, "scripts/gemv_block_checks.py", IDS, out_dir, timeout_s=120)
    path.write_text(json.dumps(res, indent=1, default=str))
    res["stress"] = stress()
    clean = all(r["clean"] for r in res["sanitizers"].values())
    steady = not any(s["not_bitwise_identical"] or s["counters_left_nonzero"] or s["failed_checks"]
                     for s in res["stress"].values())
    res["passed"] = clean and steady
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"done ({time.time() - t0:.0f} s): sanitizers {'CLEAN' if clean else 'NOT CLEAN'}, stress "
          f"{'ok' if steady else 'NOT OK'} -> {path}")
    return 0 if res["passed"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--jobs", type=int, default=2)
    g = sub.add_parser("gpu")
    g.add_argument("--out", type=Path, required=True)
    sub.add_parser("child")
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return plan(a.jobs)
    if a.cmd == "gpu":
        return gpu(a.out)
    return child()


if __name__ == "__main__":
    sys.exit(main())
