"""`fasttrack validate megakernel`: the LatentMoE block as one persistent launch
(kernels/ops/megakernel.py, launched by kernels/megablock.py), head against the base revision and
beside the chain (kernels/block.py MoEBlock) in one GPU run.

    fasttrack validate megakernel --base REV --prepare     # CPU host: build, audit, model-check
    PYTHONPATH=. python3 -m validation.cli validate megakernel --plan P --out DIR   # GPU host

The generic numerics cannot judge this kernel: they would fill its task table and counters with
random data. So the plan is a kernel plan (`validate.prepare_base_plan`: head and base at every
manifest batch, the static race audit, the mini variant for the sanitizers) plus what only this
kernel has:
  * each side's task tables, made by the tree that built the cubin (a base whose graph planned
    differently launches with its own table);
  * the model check of the task graph (`MODEL_CHECKS`, validation/modelcheck.py);
  * the chain at the same batches (block_stage's build of kernels/block.py), the A/B's yardstick.
The GPU run (`run`, a child process with a timeout) checks every cubin against the plan, then
with the k3 weights on the device:
  * the read-only and copy ceilings;
  * per batch, numerics: the block against the float64 oracle (the kernel's own selection
    pinned) under the four routings (`ROUTINGS`: router bias or input chosen so that the routing
    is what it says), the selection checked against the kernel's own logits, and on the same
    input the chain's error, which the megakernel's may exceed by at most CHAIN_ERROR_RATIO;
  * a stress run: STRESS_LAUNCHES launches bitwise identical, every counter back at zero;
  * timings: CUDA graphs of `calls` steps on distinct inputs, head, base and the chain
    interleaved over ROUNDS rounds; then the in-kernel timeline of one step
    (validation/timeline.py), drawn in the report.
The parent then runs the four sanitizers on the mini variant (validation/sanitize.py). Each
batch is a benchmark case against the base (the gate's no-regression evidence), with the chain's
samples and the head-against-chain verdict beside it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from .validate import KERNEL_PLAN_SCHEMAS, ValidateError

KERNEL = "megakernel"
MEGA_SCHEMA = KERNEL_PLAN_SCHEMAS[1]
ROUTINGS = ("uniform", "hot", "same", "distinct")
BIAS_BOOST = 10.0  # added to the router bias of the experts a routing forces (sigmoid scores are < 1)
HOT_FACTOR = 2  # the hot routing's pool: HOT_FACTOR * top_k experts
DISTINCT_DRAWS = 200  # inputs drawn at most to find one whose tokens share no expert
CHAIN_ERROR_RATIO = 1.1  # the megakernel's rel_fro against the oracle, at most this times the chain's
STRESS_LAUNCHES = 20
ROUNDS = 8
CALLS = 8
RUN_TIMEOUT_S = 420.0
SANITIZE_BUDGET_S = 300.0
# The model check of the task graph, run where the plan is prepared: (label, model config,
# batch, workers, columns per item, mode). Small widths, so that every interleaving of the sync
# points is explored (mode "exhaustive") or many random ones are ("random"); the graph code is
# the shipped one (kernels/taskgraph.py megakernel_graph).
TINY_COLS = {"router_rows": 4, "down": 8, "shared_gu": 12, "w13": 6, "w2": 8, "combine": 8, "out": 16}
TINY_ONE = {"router_rows": 16, "down": 32, "shared_gu": 48, "w13": 24, "w2": 32, "combine": 32, "out": 64}
MODEL_CHECKS = (
    ("tiny b1 3 workers", "tiny", 1, 3, TINY_COLS, "random"),
    ("tiny b2 4 workers", "tiny", 2, 4, TINY_COLS, "random"),
    ("tiny b4 5 workers", "tiny", 4, 5, TINY_COLS, "random"),
    ("tiny b1 2 workers, one item per stage", "tiny", 1, 2, TINY_ONE, "exhaustive"),
    ("tiny b2 2 workers, one item per stage", "tiny", 2, 2, TINY_ONE, "exhaustive"),
)
RANDOM_RUNS = 30
MAX_STATES = 100_000


class MegaError(ValidateError):
    """A user-fixable problem (no plan, a cubin that changed, a base that does not build)."""


# -- CPU host ----------------------------------------------------------------------------------

# Runs inside a tree (head: this checkout; base: a worktree of the base revision) with that tree's
# code first on sys.path: the task table of each (variant, tunables), as that tree plans it.
_TABLE_SCRIPT = """
import json, sys
from pathlib import Path
wt, reqs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, wt)
import kernels
if Path(kernels.__file__).resolve().parent != Path(wt, "kernels").resolve():
    raise SystemExit(f"imported kernels from {kernels.__file__}, not from {wt}")
from kernels.ops.megakernel import MegakernelOp
print("@@TABLES@@" + json.dumps([MegakernelOp(dict(v), **dict(t)).table for v, t in reqs]))
"""


def tables_in(tree: Path, reqs: list[tuple[dict, dict]]) -> list:
    """The task tables `tree`'s own code plans for each (variant, tunables)."""
    proc = subprocess.run([sys.executable, "-c", _TABLE_SCRIPT, str(tree), json.dumps(reqs)], cwd=tree,
                          capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("@@TABLES@@")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise MegaError(f"the task tables cannot be planned in {tree.name}: {tail[0][:400]}")
    return json.loads(line[len("@@TABLES@@"):])


def _base_tables(sha: str, reqs, repo_root: Path) -> list:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fasttrack-mega-base-") as tmp:
        wt = Path(tmp) / "wt"
        r = subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(wt), sha], cwd=repo_root,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise MegaError(f"cannot check out base {sha[:12]} in a worktree: {r.stderr.strip()[-300:]}")
        try:
            return tables_in(wt, reqs)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=repo_root, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=repo_root, capture_output=True)


def model_check() -> dict:
    """The task graph's model check (MODEL_CHECKS: the shipped graph code at small widths)."""
    from kernels.config import get_config
    from kernels.taskgraph import megakernel_graph
    from validation.modelcheck import check_graph

    cases = []
    for label, preset, batch, workers, cols, mode in MODEL_CHECKS:
        g = megakernel_graph(get_config(preset), batch, workers, cols=cols)
        r = (check_graph(g, exhaustive=True, max_states=MAX_STATES) if mode == "exhaustive"
             else check_graph(g, runs=RANDOM_RUNS, seed=batch))
        cases.append({"what": label, "mode": mode, "passed": r.passed and (r.complete or mode != "exhaustive"),
                      "complete": r.complete, "runs": r.runs, "states": r.states,
                      "findings": [f"{f.kind}: {f.message}" for f in r.findings[:20]]})
    return {"passed": all(c["passed"] for c in cases), "cases": cases,
            "not_covered": "the k3 graphs themselves (33,891 tasks at batch 1): the checker's declaration "
                           "pass is quadratic in tasks; the same graph code is checked at the tiny widths"}


def prepare_mega_plan(base: str, *, build_root: Path, plan_path: Path, repo_root: Path | None = None,
                      batches=None, log=None, minis: bool = True, tunables: dict | None = None) -> dict:
    """Build head's and base's megakernel at every manifest batch (and, with `minis`, the mini
    variant the sanitizers run), audit head, model-check its graph, plan both sides' task tables,
    build the chain at the same batches; write the plan. `tunables` builds head with them over
    its manifest defaults (a non-default variant against the base's defaults)."""
    from kernels.manifest import REPO_ROOT

    from .block_stage import BlockError, _build_block_in
    from .validate import prepare_base_plan

    repo_root = Path(repo_root or REPO_ROOT)
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        plan = prepare_base_plan(KERNEL, base, batches=batches, build_root=build_root, repo_root=repo_root,
                                 plan_path=plan_path, log=log, minis=minis, tunables=tunables)
    except ValidateError as e:
        raise MegaError(str(e)) from None
    plan["schema"] = MEGA_SCHEMA
    vs = plan["variants"]
    log(f"megakernel: task tables of {len(vs)} variant(s), head and base {plan['base']['sha'][:12]}")
    head_t = tables_in(repo_root, [(v["variant"], v["head"]["tunables"]) for v in vs])
    base_t = _base_tables(plan["base"]["sha"], [(v["variant"], v["base"]["tunables"]) for v in vs], repo_root)
    for v, ht, bt in zip(vs, head_t, base_t):
        v["head"]["table"], v["base"]["table"] = ht, bt
    Ts = [v["variant"]["batch"] for v in vs]
    log("megakernel: model check of the task graph")
    plan["model_check"] = model_check()
    log(f"megakernel: building the chain (kernels/block.py) at batches {Ts}")
    try:
        plan["chain"] = _build_block_in(repo_root, build_root, Ts)
    except BlockError as e:
        raise MegaError(str(e)) from None
    Path(plan_path).write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def load_mega_plan(path: Path, build_root: Path) -> dict:
    """The plan, every cubin it names (both sides, the chain) checked against its sha256."""
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise MegaError(f"cannot read the megakernel plan {path}: {e}") from None
    if not isinstance(plan, dict) or plan.get("schema") != MEGA_SCHEMA:
        raise MegaError(f"{path} is not a megakernel plan ({MEGA_SCHEMA}): prepare it with "
                        "`fasttrack validate megakernel --base REV --prepare`")
    dirs = [(v[s]["dir"], v[s]["cubin_sha256"]) for v in plan["variants"] for s in ("head", "base")]
    dirs += [(c["dir"], c["cubin_sha256"]) for b in plan["chain"] for c in b["cases"]]
    for d, sha in dirs:
        f = Path(build_root) / d / "kernel.cubin"
        if not f.is_file():
            raise MegaError(f"{d}/kernel.cubin is missing under {build_root}: carry it with the plan")
        if hashlib.sha256(f.read_bytes()).hexdigest() != sha:
            raise MegaError(f"{d}: its cubin no longer hashes to the plan's; prepare again")
    return plan


def binaries(plan: dict) -> list[dict]:
    """The megakernel's cubins, both sides, with their code sha256 where the plan has it (the
    evidence then binds a rebuild whose line tables alone differ; the chain's cubins are the
    benchmark's yardstick, recorded in `benchmark.chain`, not evidence for its kernels)."""
    return [{"kernel": KERNEL, "side": s, "variant": v["variant"], "tunables": v[s]["tunables"],
             "build_key": v[s]["build_key"], "cubin_sha256": v[s]["cubin_sha256"],
             **({"cubin_code_sha256": v[s]["cubin_code_sha256"]} if v[s].get("cubin_code_sha256") else {})}
            for v in plan["variants"] for s in ("head", "base")]


# -- GPU host: numerics ----------------------------------------------------------------------------

def routed_input(cfg, T: int, w, routing: str, gen):
    """(x, weights, intended): an input and weights whose routing is `routing`:
    uniform: a random input with the model's bias; same: every token on the same top_k experts
    (their bias raised); hot: every token within a pool of HOT_FACTOR * top_k experts; distinct:
    inputs drawn until no two tokens share an expert (the reference rule on fp32 logits).
    `intended(ids)` says whether a selection is that routing."""
    import dataclasses

    import torch

    from kernels import reference as R

    E, K = cfg.n_experts, cfg.top_k

    def draw():
        return (torch.randn(T, cfg.hidden, generator=gen) * 1.0).to("cuda", torch.bfloat16)

    if routing in ("same", "hot"):
        pool = torch.randperm(E, generator=gen)[: K if routing == "same" else HOT_FACTOR * K].to("cuda")
        bias = w.bias.clone()
        bias[pool] += BIAS_BOOST
        allowed = set(pool.tolist())
        return draw(), dataclasses.replace(w, bias=bias), lambda ids: set(ids.flatten().tolist()) <= allowed
    if routing == "uniform":
        return draw(), w, lambda ids: True
    if routing != "distinct":
        raise ValueError(f"unknown routing {routing!r}")
    if T * K > E:
        raise MegaError(f"batch {T}: {T * K} expert slots cannot be distinct among {E} experts")
    for _ in range(DISTINCT_DRAWS):
        x = draw()
        logits = R.linear(R.rmsnorm(x, w.gamma_pre, cfg.eps), w.w_gate, out_dtype=torch.float32)
        ids = R.select_experts(torch.sigmoid(logits), w.bias, K)
        if torch.unique(ids).numel() == T * K:
            return x, w, lambda ids: torch.unique(ids).numel() == T * K
    raise MegaError(f"batch {T}: no input in {DISTINCT_DRAWS} draws routes every token to its own experts")


def numerics(mega, chain, cfg, T: int) -> dict:
    """The block against the float64 oracle under every routing; on the uniform input the chain
    beside it; the stress run."""
    import torch

    from kernels import reference as R

    from .block_stage import check_selection, judge

    F64 = torch.float64
    w0 = mega.w
    gen = torch.Generator().manual_seed(7000 + T)
    res = {"routings": [], "chain": None, "stress": None}
    try:
        for routing in ROUTINGS:
            x, w, intended = routed_input(cfg, T, w0, routing, gen)
            mega.w = w
            out = torch.full_like(x, float("nan"))
            mega.launch(x, out)
            torch.cuda.synchronize()
            b = mega.intermediates()
            ids = b["ids"].clone()
            row = judge(f"block {routing}", out, R.moe_block(x, w, cfg, compute_dtype=F64, ids=ids),
                        R.moe_block(x, w, cfg, ids=ids))
            sel = check_selection(b["logits"], w.bias, ids, b["weights"], cfg.top_k, cfg.routed_scale)
            row.update({"routing": routing, "unique_experts": int(torch.unique(ids).numel()),
                        "routing_as_intended": bool(intended(ids)), "selection": sel,
                        "counters_clean": mega.counters_clean()})
            row["passed"] = bool(row["passed"] and sel["passed"] and row["routing_as_intended"]
                                 and row["counters_clean"])
            if routing == "uniform" and chain is not None:
                cout = torch.full_like(x, float("nan"))
                chain.launch(x, cout)
                torch.cuda.synchronize()
                cids = chain.buf["ids"].clone()
                c = judge("chain uniform", cout, R.moe_block(x, w, cfg, compute_dtype=F64, ids=cids),
                          R.moe_block(x, w, cfg, ids=cids))
                limit = max(CHAIN_ERROR_RATIO * c["kernel"]["rel_fro"], row["rel_fro_limit"] / 2 ** 4)
                res["chain"] = {"what": "error against the chain's (same input)", "chain": c["kernel"],
                                "megakernel": row["kernel"], "same_selection": bool(torch.equal(ids, cids)),
                                "ratio": row["kernel"]["rel_fro"] / c["kernel"]["rel_fro"]
                                if c["kernel"]["rel_fro"] else None, "rel_fro_limit": limit,
                                "passed": bool(c["passed"] and row["kernel"]["rel_fro"] <= limit)}
                res["stress"] = stress(mega, x, out)
            res["routings"].append(row)
    finally:
        mega.w = w0
    res["passed"] = (all(r["passed"] for r in res["routings"]) and bool(res["chain"] and res["chain"]["passed"])
                     and bool(res["stress"] and res["stress"]["passed"]))
    return res


def stress(mega, x, first) -> dict:
    """STRESS_LAUNCHES launches on `x`: each bitwise `first`, every counter back at zero."""
    import torch

    ref = first.view(torch.int16).clone()
    differ = 0
    out = torch.empty_like(first)
    for _ in range(STRESS_LAUNCHES):
        out.fill_(float("nan"))
        mega.launch(x, out)
        torch.cuda.synchronize()
        differ += int(not torch.equal(out.view(torch.int16), ref))
    clean = mega.counters_clean()
    return {"launches": STRESS_LAUNCHES, "differing": differ, "counters_clean": clean,
            "passed": differ == 0 and clean}


# -- GPU host: timings ------------------------------------------------------------------------------

def _events_time(launch_all, replays: int) -> float:
    """us per replay of `launch_all()` enqueued back to back (the fallback where a cooperative
    launch cannot be captured into a graph)."""
    import torch

    launch_all()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        launch_all()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / replays


def speed_ab(mega, base, chain, cfg, T: int, calls: int, rounds: int = ROUNDS) -> dict:
    """us per step of head, base and the chain, interleaved over `rounds`: per side and round one
    CUDA graph of `calls` steps on distinct inputs, replayed (a sample: its median per step)."""
    import torch

    from .block_stage import block_bytes, graph_time

    xs = [torch.randn(T, cfg.hidden, device="cuda").to(torch.bfloat16) for _ in range(calls)]
    outs = {k: [torch.empty_like(x) for x in xs] for k in ("head", "base", "chain")}
    uniq = []
    for x, o in zip(xs, outs["head"]):
        mega.launch(x, o)
        torch.cuda.synchronize()
        uniq.append(int(mega.buf["n_groups"][0].item()))
    n_unique = sum(uniq) / len(uniq)
    sides = {"head": lambda: [mega.launch(x, o) for x, o in zip(xs, outs["head"])],
             "base": lambda: [base.launch(x, o) for x, o in zip(xs, outs["base"])],
             "chain": lambda: [chain.launch(x, o) for x, o in zip(xs, outs["chain"])]}
    res = {"calls": calls, "unique_experts_per_step": uniq, "bytes_per_step": block_bytes(cfg, T, n_unique),
           "graph": True}
    try:
        graph_time(sides["head"], replays=2)
    except Exception as e:  # noqa: BLE001 - a cooperative launch the driver will not capture
        torch.cuda.synchronize()
        res["graph"] = False
        res["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    samples = {k: [] for k in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(reversed(list(sides)))):
            us = (graph_time(sides[name], replays=6)["median_us"] if res["graph"]
                  else _events_time(sides[name], 6))
            samples[name].append(us / calls)
    res["samples_us"] = samples
    return res


def timeline(mega, cfg, T: int, read_tbps: float | None = None) -> dict | None:
    """One step's in-kernel timeline (None for a build that records none), with the weight bytes
    each stage streamed in that step and the run's read ceiling, for the per-stage bandwidth
    (validation/timeline.py stage_summary)."""
    import torch

    from kernels.taskgraph import MEGA_STAGES

    from .timeline import timeline_from_stamps

    if mega.stamps() is None:
        return None
    x = torch.randn(T, cfg.hidden, device="cuda").to(torch.bfloat16)
    mega.buf["stamps"].zero_()
    mega.launch(x, torch.empty_like(x))
    torch.cuda.synchronize()
    tl = timeline_from_stamps(mega.stamps().cpu(), list(MEGA_STAGES), batch=T)
    tl["stage_bytes"] = mega.stage_weight_bytes()
    if read_tbps:
        tl["read_tbps"] = float(read_tbps)
    return tl


def run(plan_path: Path, build_root: Path, out_path: Path, batches=None, calls: int = CALLS) -> int:
    """The GPU child: ceilings, weights, then per batch numerics, stress, timings and the
    timeline; `out_path` rewritten after every batch (a timeout keeps what was measured)."""
    import torch

    from benchmarks.common import copy_bandwidth, gpu_environment, read_bandwidth
    from kernels.block import MoEBlock, load_block_kernels
    from kernels.config import get_config
    from kernels.megablock import MegaBlock
    from kernels.reference import make_weights

    from .block_stage import MAX_ERROR_RATIO, REL_FRO_FLOOR, plan_dirs, plan_variants

    plan = load_mega_plan(plan_path, build_root)
    cfg = get_config("k3")
    doc = {"environment": gpu_environment(), "ceilings": {}, "batches": {},
           "policy": {"rel_fro_floor": REL_FRO_FLOOR, "max_error_ratio": MAX_ERROR_RATIO,
                      "chain_error_ratio": CHAIN_ERROR_RATIO, "routings": list(ROUTINGS),
                      "stress_launches": STRESS_LAUNCHES, "rounds": ROUNDS}}
    t0 = time.time()
    doc["ceilings"]["read"] = read_bandwidth(reps=20)
    doc["ceilings"]["copy"] = copy_bandwidth(reps=20)
    print(f"megakernel: read {doc['ceilings']['read']['tbps']:.3f} TB/s, copy "
          f"{doc['ceilings']['copy']['tbps']:.3f} TB/s ({time.time() - t0:.0f} s)", flush=True)
    torch.manual_seed(0)
    w = make_weights(cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    chains = {c["batch"]: c["cases"] for c in plan["chain"]}
    for v in plan["variants"]:
        T = int(v["variant"]["batch"])
        if batches and T not in batches:
            continue
        row = doc["batches"][str(T)] = {}
        t1 = time.time()
        try:
            mega = MegaBlock(cfg, T, w, build_dir=Path(build_root) / v["head"]["dir"], table=v["head"]["table"])
            base = MegaBlock(cfg, T, w, build_dir=Path(build_root) / v["base"]["dir"], table=v["base"]["table"])
            ck = load_block_kernels(cfg, T, dirs=plan_dirs(chains[T], build_root, T),
                                    variants=plan_variants(chains[T]))
            chain = MoEBlock(cfg, T, w, kernels=ck)
            row["numerics"] = numerics(mega, chain, cfg, T)
            row["speed"] = speed_ab(mega, base, chain, cfg, T, calls)
            row["timeline"] = timeline(mega, cfg, T, doc["ceilings"]["read"].get("tbps"))
            del mega, base, chain
        except Exception as e:  # noqa: BLE001 - one failing batch must not lose the others
            import traceback

            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
        row["seconds"] = round(time.time() - t1, 1)
        out_path.write_text(json.dumps(doc, indent=1, default=str))
        if "error" in row:
            print(f"megakernel b{T}: ERROR {row['error'][:300]} ({row['seconds']:.0f} s)", flush=True)
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a sticky device error: nothing after it can be trusted
                break
        else:
            s = row["speed"]["samples_us"]
            med = {k: sorted(x)[len(x) // 2] for k, x in s.items()}
            print(f"megakernel b{T}: numerics {'ok' if row['numerics']['passed'] else 'FAIL'}, head "
                  f"{med['head']:.1f} us, base {med['base']:.1f} us, chain {med['chain']:.1f} us"
                  f"{'' if row['speed']['graph'] else ' (no graph: ' + row['speed']['graph_error'][:80] + ')'}"
                  f" ({row['seconds']:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    out_path.write_text(json.dumps(doc, indent=1, default=str))
    return 0


# -- the bundle ------------------------------------------------------------------------------------

def _case(T: int, sp: dict, read: dict) -> dict:
    from .bench import bandwidth_check, compare_samples, summarize
    from .block_stage import CEILING_NOISE

    s = sp["samples_us"]
    comp = compare_samples(s["base"], s["head"])
    vs_chain = compare_samples(s["chain"], s["head"])
    hs, cs = summarize(s["head"]), summarize(s["chain"])
    head_bw = bandwidth_check(int(sp["bytes_per_step"]), hs["median"], hs["rel_iqr"], read["tbps"], CEILING_NOISE)
    chain_bw = bandwidth_check(int(sp["bytes_per_step"]), cs["median"], cs["rel_iqr"], read["tbps"], CEILING_NOISE)
    return {"case_id": f"megakernel/b{T}", "name": f"megakernel batch {T}", "kernel": KERNEL,
            "variant": {"batch": T}, "batch": T, "bytes": sp["bytes_per_step"], "head": hs,
            "base": summarize(s["base"]), "change": comp.change, "speedup": comp.speedup, "p_value": comp.p_value,
            "noise": comp.noise, "head_bandwidth": head_bw,
            "verdict": "IMPOSSIBLE" if head_bw["impossible"] else comp.verdict, "reason": comp.reason,
            "graph": sp["graph"], "graph_error": sp.get("graph_error"), "l2_rotated": False, "copies": sp["calls"],
            "unique_experts_per_step": sp["unique_experts_per_step"],
            "chain": {"time": cs, "bandwidth": chain_bw, "verdict": vs_chain.verdict, "reason": vs_chain.reason,
                      "speedup": vs_chain.speedup, "p_value": vs_chain.p_value}}


def mega_bundle(plan: dict, result: dict | None, stage: dict, dynamic_result: dict | None = None, *,
                validator=None, repo_root=None) -> dict:
    """The evidence bundle of a megakernel run (pure: testable from a recorded `result`)."""
    from . import bundle as B
    from .bench import ALPHA, MAX_NOISE, MIN_EFFECT, benchmark_passed
    from .sanitize import dynamic_section

    result = result or {}
    not_covered, reasons, cases, bench_cases, timelines = [], [], [], [], []
    measured = result.get("batches", {})
    read = (result.get("ceilings") or {}).get("read") or {}
    stress_rows = []
    for v in plan["variants"]:
        T = int(v["variant"]["batch"])
        row = measured.get(str(T))
        if row is None:
            not_covered.append(f"megakernel batch {T}: not measured (the run ended before it)")
            continue
        if "error" in row:
            cases.append({"case_id": f"megakernel/b{T}", "batch": T, "passed": False, "reasons": [row["error"]],
                          "outputs": []})
            bench_cases.append({"case_id": f"megakernel/b{T}", "batch": T, "error": row["error"],
                                "verdict": "AMBIGUOUS"})
            continue
        n = row["numerics"]
        items = n["routings"] + ([n["chain"]] if n.get("chain") else [])
        cases.append({"case_id": f"megakernel/b{T}", "batch": T, "passed": bool(n["passed"]),
                      "reasons": [f"{o['what']}: failed" for o in items if not o.get("passed")]
                      + ([] if (n.get("stress") or {}).get("passed") else ["stress: failed"]),
                      "outputs": items})
        if n.get("stress"):
            stress_rows.append({"batch": T, **n["stress"]})
        bench_cases.append(_case(T, row["speed"], read))
        if row.get("timeline"):
            timelines.append(row["timeline"])
    correctness = {"passed": bool(cases) and all(c["passed"] for c in cases), "policy": result.get("policy"),
                   "cases": cases}
    ok, why = benchmark_passed(bench_cases)
    benchmark = {"ceilings": {"read_tbps": read.get("tbps"),
                              "copy_tbps": ((result.get("ceilings") or {}).get("copy") or {}).get("tbps")},
                 "cases": bench_cases, "passed": ok and bool(bench_cases),
                 "baseline": {"kind": "revision", "sha": plan["base"]["sha"], "ref": plan["base"]["ref"]},
                 "chain": {"what": "kernels/block.py MoEBlock at the same batches, timed interleaved with head",
                           "binaries": [{"batch": b["batch"], "kernel": c["kernel"], "variant": c["shape"],
                                         "cubin_sha256": c["cubin_sha256"]} for b in plan["chain"]
                                        for c in b["cases"]]},
                 "policy": {"min_effect": MIN_EFFECT, "alpha": ALPHA, "max_noise": MAX_NOISE,
                            "test": "two-sided Mann-Whitney U", "slow_fails": True}}
    reasons += why
    if not stage.get("ok", True):
        reasons.append(stage.get("reason") or "the megakernel stage failed")
    static = plan.get("static_race_audit")
    if static is None:
        not_covered.append("race.static: the plan holds no static audit (prepare again)")
    mc = plan.get("model_check")
    stress_sec = ({"passed": all(r["passed"] for r in stress_rows), "runs": stress_rows,
                   "detail": f"{STRESS_LAUNCHES} launches per batch bitwise identical, counters back at zero"}
                  if stress_rows else None)
    if stress_sec is None:
        not_covered.append("race.stress: no batch ran")
    failures = [f for f in ((plan.get("sanitize") or {}).get("failures") or []) if f.split(" ", 2)[1].strip("(") == KERNEL]
    dynamic = dynamic_section(dynamic_result, KERNEL, failures)
    if dynamic is None:
        not_covered.append("race.dynamic: compute-sanitizer not run on the mini megakernel")
    parts = (static, stress_sec, dynamic, mc)
    race = {"passed": all(x is None or x["passed"] for x in parts) and mc is not None,
            "static": static, "dynamic": dynamic, "stress": stress_sec, "model_check": mc}
    if mc is not None and mc.get("not_covered"):
        not_covered.append(f"race.model_check: {mc['not_covered']}")
    if mc is None:
        reasons.append("race.model_check: the plan holds no model check of the task graph (prepare again)")
    defences = {"passed": correctness["passed"], "checks": [
        {"name": "determinism", "passed": bool(stress_sec and stress_sec["passed"]), "applicable": True,
         "detail": f"{STRESS_LAUNCHES} launches per batch bitwise identical", "cases": []},
        {"name": "poisoned_outputs", "passed": correctness["passed"], "applicable": True,
         "detail": "outputs NaN-poisoned before each judged launch, checked finite and within the policy",
         "cases": []}]}
    not_covered += ["GPU-configuration axis: one configuration (the validating host's GPU) measured",
                    "batches past the manifest's: the megakernel declares only its manifest batches"]
    repo_root = Path(repo_root) if repo_root else Path(__file__).resolve().parent.parent
    vsha, vsrc = validator or B.validator_fingerprint_of_tree(repo_root)
    env = dict(result.get("environment") or {})
    env.update({"commit": plan["head"]["sha"], "dirty": plan["head"].get("dirty"), "validator_sha256": vsha,
                "validator_sources_sha256": vsrc, "stages": [stage] + (
                    [dynamic_result["stage"]] if dynamic_result and dynamic_result.get("stage") else [])})
    from kernels.manifest import load_manifest

    try:
        files = list(load_manifest(repo_root / "kernels" / "manifest.toml").kernel(KERNEL).sources)
    except Exception:  # noqa: BLE001 - the record of files is informational
        files = []
    change = {"kernel": KERNEL, "base": plan["base"]["sha"], "base_ref": plan["base"]["ref"],
              "base_sources_sha256": plan["base"].get("sources_sha256"), "head": plan["head"]["sha"],
              "files": files, "title": "validate megakernel",
              "summary": "the LatentMoE block in one persistent launch, head against the base revision, "
                         "beside the chain"}
    bundle = B.new_bundle(change=change, environment=env, binaries=binaries(plan), correctness=correctness,
                          defences=defences, race=race, benchmark=benchmark, not_covered=not_covered,
                          reasons_extra=reasons)
    bundle["timeline"] = timelines
    return bundle


def validate_mega(plan_path: Path, *, build_root: Path, out_dir: Path, timeout_s: float = RUN_TIMEOUT_S,
                  batches=None, sanitize_budget_s: float = SANITIZE_BUDGET_S, dynamic_result: dict | None = None) -> dict:
    """GPU host: the plan's run in a child process with a timeout, the sanitizers on the plan's
    mini variant (or `dynamic_result`, a sanitize stage run beside it: validate --all), then the
    bundle (written with report.html into `out_dir`)."""
    from .isolate import run_plan_stage, write_bundle_and_report
    from .sanitize import run_isolated

    plan = load_mega_plan(plan_path, build_root)
    st, result = run_plan_stage(KERNEL, "validation.mega_stage", plan_path, build_root, out_dir,
                                timeout_s=timeout_s, batches=batches)
    dyn = dynamic_result
    san = plan.get("sanitize") or {}
    if dyn is None and san.get("entries"):
        print(f"  sanitizers on {len(san['entries'])} mini variant(s)", file=sys.stderr, flush=True)
        dyn = run_isolated(san["entries"], san.get("failures", []), Path(build_root), out_dir / "sanitize",
                           budget_s=sanitize_budget_s)
    bundle = mega_bundle(plan, result, st.to_dict(), dyn)
    write_bundle_and_report(out_dir, bundle, KERNEL)
    return bundle


# The stage interface validation/policy.py OWN_STAGES names.
prepare = prepare_mega_plan
validate = validate_mega


def main(argv=None) -> int:
    from .isolate import plan_child_main

    return plan_child_main("python -m validation.mega_stage", run, MegaError, KERNEL, argv)


if __name__ == "__main__":
    sys.exit(main())
