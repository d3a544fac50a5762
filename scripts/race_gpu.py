"""The race audit's GPU evidence: sanitizers, stress, mutants caught dynamically, split-K speed.

    python scripts/race_gpu.py prepare            # CPU: build every variant into build/race,
                                                  # audit it statically, write build/race/plan.json
    PYTHONPATH=. python3 scripts/race_gpu.py gpu --out DIR    # GPU host: everything, one call

`gpu` runs, in order: compute-sanitizer memcheck, racecheck, synccheck and initcheck (each a
separate run of a child that launches the correct kernels on small shapes and checks them
against the reference, printing a run marker); stress (repeated launches, persistent grid sizes
varied, a concurrent kernel occupying SMs on another stream: outputs must be bitwise identical);
the planted mutants launched the same way (caught = a wrong or non-reproducible output); and the
split-K GEMV timed on the router shape beside the non-split `gemv` kernel, torch, and the
read-only streaming ceiling, all in the same process. Results: DIR/race_gpu.json, logs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PLAN = ROOT / "build" / "race" / "plan.json"
BUILD_ROOT = ROOT / "build" / "race"
ROUTER = {"n": 896, "k": 7168}
BENCH_BATCHES = (1, 4, 8)
PRODCONS_MUTANTS = ("nc_activation", "load_before_wait", "relaxed_spin", "relaxed_publish", "missing_barrier")
SPLITK_MUTANTS = ("relaxed_atomic", "missing_barrier", "nc_partials")  # divergent_barrier would hang


# -- CPU: build and audit ---------------------------------------------------------------------


def prepare() -> int:
    from kernels.manifest import load_manifest
    from validation.race.artifacts import audit_artifact, build_variant_of, op_spec

    man = load_manifest()
    entries = []

    def add(ident, kernel, shape, tunables=None, mutant=None, role="stress"):
        spec = man.kernel(kernel)
        if mutant:
            mod, _, cls = spec.op.partition(":")
            spec = op_spec(spec, f"{mod}:{cls}_{mutant}", name=f"{kernel}__{mutant}")
        art = build_variant_of(spec, shape, tunables, root=BUILD_ROOT)
        rep = audit_artifact(art, spec, kernel=ident)
        entries.append({
            "id": ident, "kernel": kernel, "mutant": mutant, "shape": shape, "tunables": art.tunables,
            "dir": str(Path(art.dir).resolve().relative_to(ROOT)), "cubin_sha256": art.cubin_sha256,
            "role": role, "static_audit": {"clean": rep.clean, "rules": sorted(rep.rules_hit()),
                                           "checked": rep.checked},
        })
        print(f"{ident:34s} static audit: {'clean' if rep.clean else sorted(rep.rules_hit())}")

    pc = [dict(s) for s in man.kernel("prodcons").shapes]
    for s in pc:
        add(f"prodcons_p{s['producers']}c{s['consumers']}", "prodcons", s)
    for m in PRODCONS_MUTANTS:
        add(f"prodcons__{m}", "prodcons", pc[0], mutant=m, role="mutant")
    for b in BENCH_BATCHES:
        add(f"splitk_gemv_b{b}", "splitk_gemv", {"batch": b, **ROUTER}, role="bench")
        add(f"gemv_b{b}", "gemv", {"batch": b, **ROUTER, "out_dtype": "float32"}, role="bench")
    for m in SPLITK_MUTANTS:
        add(f"splitk_gemv__{m}", "splitk_gemv", {"batch": 1, **ROUTER}, mutant=m, role="mutant")
    PLAN.write_text(json.dumps({"entries": entries}, indent=1) + "\n")
    print(f"wrote {PLAN.relative_to(ROOT)} ({len(entries)} variants)")
    return 0


# -- GPU helpers ------------------------------------------------------------------------------


def _entries() -> dict:
    return {e["id"]: e for e in json.loads(PLAN.read_text())["entries"]}


def _op(e):
    import importlib

    from kernels.manifest import load_manifest

    spec = load_manifest().kernel(e["kernel"])
    mod, _, cls = spec.op.partition(":")
    return getattr(importlib.import_module(mod), cls)(e["shape"], **e["tunables"])


def _inputs(e, op, seed: int):
    import torch

    if hasattr(op, "make_inputs"):
        return type(op).make_inputs(op, device="cuda", seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    specs = op.tensor_specs()
    t = {}
    for name, s in specs.items():
        dt = getattr(torch, s.dtype)
        t[name] = (torch.randn(s.shape, generator=g) * 0.05).to(dt).to("cuda")
    t["y"].fill_(float("nan"))
    return t


def _reset(e, t):
    """Per-launch host work: poison outputs; zero prodcons flags (the split-K counters reset
    themselves, which stress checks)."""
    import math

    t["y"].fill_(math.nan)
    if e["kernel"] == "prodcons":
        t["flags"].zero_()
        t["stage"].fill_(math.nan)


def _check(op, t) -> tuple[bool, float]:
    import torch

    names = list(op.tensor_specs())
    ref = op.reference(**{k: t[k] for k in names})["y"].float()
    y = t["y"].float()
    if not torch.isfinite(y).all():
        return False, float("inf")
    err = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err < 1e-4, err


def _kernel(e):
    from kernels.launch import CubinKernel

    return CubinKernel.from_dir(ROOT / e["dir"])


def child(ids: list[str]) -> int:
    """Launch each kernel once on fresh inputs and print its run marker (for sanitizers)."""
    import torch

    from validation.race.dynamic import marker

    ents = _entries()
    for i in ids:
        e = ents[i]
        op = _op(e)
        k = _kernel(e)
        t = _inputs(e, op, seed=7)
        _reset(e, t)
        k(*[t[n] for n in op.tensor_specs()])
        torch.cuda.synchronize()
        ok, err = _check(op, t)
        print(marker(i, ok, rel_err=f"{err:.3e}"), flush=True)
    return 0


class Occupier:
    """A concurrent kernel on another stream: bf16 matmuls that occupy SMs while we launch."""

    def __init__(self):
        import torch

        self.stream = torch.cuda.Stream()
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def start(self, n: int = 6) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            for _ in range(n):
                self.a @ self.a


def stress_one(e, t, op, k, runs: int, occupier: Occupier | None, ref_bits=None) -> dict:
    """`runs` launches on the same inputs, half of them beside the occupier. Bitwise-compares
    every output to `ref_bits` (or the first) and the reference."""
    import torch

    names = list(op.tensor_specs())
    first = ref_bits
    mism, wrong, errs = 0, 0, []
    for r in range(runs):
        _reset(e, t)
        if occupier is not None and r >= runs // 2:
            occupier.start()
        k(*[t[n] for n in names])
        torch.cuda.synchronize()
        y = t["y"].clone()
        ok, err = _check(op, t)
        errs.append(err)
        wrong += not ok
        if first is None:
            first = y
        elif not torch.equal(y.view(torch.int32), first.view(torch.int32)):
            mism += 1
    out = {"runs": runs, "not_bitwise_identical": mism, "wrong_vs_reference": wrong,
           "max_rel_err": max(errs) if errs else None}
    if e["kernel"] == "splitk_gemv":
        out["counters_left_nonzero"] = int((t["counters"] != 0).sum().item())
    return out, first


def stress(ids: list[str], runs: int) -> dict:
    import torch

    ents = _entries()
    occ = Occupier()
    results, bits = {}, None
    for i in ids:
        e = ents[i]
        op = _op(e)
        k = _kernel(e)
        t = _inputs(e, op, seed=11)
        # persistent variants of one kernel share inputs; compare across grid sizes too
        share = bits if e["kernel"] == "prodcons" and e["mutant"] is None else None
        res, first = stress_one(e, t, op, k, runs, occ, ref_bits=share)
        if e["kernel"] == "prodcons" and e["mutant"] is None and bits is None:
            bits = first
        res["grid"] = list(op.launch_config().grid)
        results[i] = res
        print(json.dumps({i: res}), flush=True)
    torch.cuda.synchronize()
    return results


def bench(out: dict) -> None:
    import torch

    from benchmarks.common import read_bandwidth, rotation_count, time_launches

    ents = _entries()
    out["ceiling_read"] = read_bandwidth()
    rows = []
    for b in BENCH_BATCHES:
        n, kk = ROUTER["n"], ROUTER["k"]
        wbytes = n * kk * 2
        rot = rotation_count(wbytes)
        g = torch.Generator(device="cpu").manual_seed(3)
        ws = [(torch.randn(n, kk, generator=g) * 0.05).to(torch.bfloat16).cuda() for _ in range(rot)]
        x = torch.randn(b, kk, generator=g).to(torch.bfloat16).cuda()
        nbytes = wbytes + x.numel() * 2 + b * n * 4
        row = {"batch": b, "bytes": nbytes, "rotation": rot}
        for name in ("splitk_gemv", "gemv"):
            e = ents[f"{name}_b{b}"]
            op = _op(e)
            k = _kernel(e)
            y = torch.empty(b, n, device="cuda", dtype=torch.float32)
            extra = {}
            if name == "splitk_gemv":
                extra = {"partials": torch.zeros(op.splits, b, n, device="cuda"),
                         "counters": torch.zeros(op.tiles, dtype=torch.int32, device="cuda")}
            args = lambda i: {"x": x, "w": ws[i % rot], "y": y, **extra}
            names = list(op.tensor_specs())
            k(*[args(0)[nm] for nm in names])
            torch.cuda.synchronize()
            ok = torch.allclose(y, x.float() @ ws[0].float().t(), rtol=1e-3, atol=1e-3)
            tm = time_launches(lambda i: k(*[args(i)[nm] for nm in names]), reps=200, warmup=20)
            row[name] = {**tm.summary(), "tbps": nbytes / tm.median_us / 1e6, "correct": bool(ok),
                         "grid": list(op.launch_config().grid), "cubin_sha256": e["cubin_sha256"]}
        try:
            torch.mm(x, ws[0].t(), out_dtype=torch.float32)
            tfn, tname = (lambda i: torch.mm(x, ws[i % rot].t(), out_dtype=torch.float32)), "torch.mm(out_dtype=float32)"
        except (TypeError, RuntimeError):
            tfn, tname = (lambda i: torch.mm(x, ws[i % rot].t())), "torch.mm (bf16 out)"
        tm = time_launches(tfn, reps=200, warmup=20)
        row["torch"] = {**tm.summary(), "tbps": nbytes / tm.median_us / 1e6, "call": tname}
        row["splitk_fraction_of_read_ceiling"] = row["splitk_gemv"]["tbps"] / out["ceiling_read"]["tbps"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ws
    out["bench"] = rows


def gpu(out_dir: Path) -> int:
    import torch

    from benchmarks.common import gpu_environment
    from validation.race.dynamic import TOOLS, find_sanitizer, run_tool

    out_dir.mkdir(parents=True, exist_ok=True)
    ents = _entries()
    res: dict = {"commit": os.environ.get("FT_COMMIT"), "env": gpu_environment(),
                 "variants": {i: {k: e[k] for k in ("kernel", "mutant", "shape", "tunables", "cubin_sha256",
                                                    "static_audit")} for i, e in ents.items()}}
    sms = res["env"]["sm_count"]
    for i, e in ents.items():
        if e["kernel"] == "prodcons":
            grid = e["shape"]["producers"] + e["shape"]["consumers"]
            assert grid <= sms, f"{i}: {grid} CTAs cannot be co-resident on {sms} SMs"
    san = find_sanitizer()
    res["sanitizer"] = {"path": san, "version": subprocess.run([san, "--version"], capture_output=True,
                                                                text=True).stdout.strip().splitlines()[-1:] if san else None}
    correct = ["prodcons_p2c4", "splitk_gemv_b1"]
    child_cmd = [sys.executable, str(Path(__file__).resolve().relative_to(ROOT)), "child", "--ids", ",".join(correct)]
    log = out_dir / "sanitizers.log"
    res["sanitizers"] = {}
    for tool in TOOLS:
        r = run_tool(tool, child_cmd, correct, timeout_s=60, log_path=log, sanitizer=san)
        res["sanitizers"][tool] = r.to_dict()
        print(f"{tool:10s} clean={r.clean} ({r.reason}) {r.seconds:.1f}s", flush=True)
        (out_dir / "race_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    # Stress of the correct kernels (persistent grid sizes varied), in this process.
    stress_ids = [i for i, e in ents.items() if e["role"] == "stress"] + ["splitk_gemv_b1", "splitk_gemv_b8"]
    res["stress"] = stress(stress_ids, runs=40)
    (out_dir / "race_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    # Mutants in a child with a timeout: a mutant may hang.
    mut_ids = [i for i, e in ents.items() if e["role"] == "mutant"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "stress", "--ids", ",".join(mut_ids),
                            "--runs", "20"], capture_output=True, text=True, timeout=60)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    (out_dir / "mutants.log").write_text(text)
    mres = {}
    for line in text.splitlines():
        if line.startswith("{"):
            mres.update(json.loads(line))
    for i in mut_ids:
        r = mres.get(i)
        if r is None:
            mres[i] = {"caught": rc == "timeout", "note": f"no result (child rc={rc})"}
        else:
            r["caught"] = bool(r["not_bitwise_identical"] or r["wrong_vs_reference"])
    res["mutants"] = mres
    res["mutants_seconds"] = time.perf_counter() - t0
    (out_dir / "race_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    bench(res)
    torch.cuda.synchronize()
    (out_dir / "race_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    print("\nSUMMARY")
    for tool, r in res["sanitizers"].items():
        print(f"  {tool:10s} {'CLEAN' if r['clean'] else 'NOT CLEAN'}: {r['reason']}")
    for i, r in res["stress"].items():
        print(f"  stress {i:22s} mism={r['not_bitwise_identical']} wrong={r['wrong_vs_reference']}")
    for i, r in res["mutants"].items():
        print(f"  mutant {i:32s} caught={r.get('caught')}")
    for row in res["bench"]:
        print(f"  b={row['batch']} splitk {row['splitk_gemv']['median_us']:.2f}us "
              f"gemv {row['gemv']['median_us']:.2f}us torch {row['torch']['median_us']:.2f}us "
              f"ceiling {res['ceiling_read']['tbps']:.2f}TB/s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    g = sub.add_parser("gpu")
    g.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("child")
    c.add_argument("--ids", required=True)
    s = sub.add_parser("stress")
    s.add_argument("--ids", required=True)
    s.add_argument("--runs", type=int, default=20)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        return prepare()
    if a.cmd == "child":
        return child(a.ids.split(","))
    if a.cmd == "stress":
        stress(a.ids.split(","), a.runs)
        return 0
    return gpu(a.out)


if __name__ == "__main__":
    sys.exit(main())
