"""Proof of the LatentMoE block's CuTe DSL ops on a GPU host: numerics against the float64 oracle over
routing patterns and batch sizes, and speed against the read-only streaming ceiling and a torch
baseline measured in the same run.

  python scripts/block_proof.py plan                         # CPU host with the DSL: build, write the plan
  PYTHONPATH=. python scripts/block_proof.py run --out DIR   # GPU host (no DSL), carrying `build`

`run` launches exactly the cubins its plan built: each case's folder (carried with the run) is
checked against the plan's sha256, then loaded as it is, so an older plan, made with another
block configuration or before a source change, still runs as built (a same-call A/B).
With the k3 weights generated on the device (kernels.reference.make_weights, ~61 GB):
  * ceilings first: read-only streaming and device copy (benchmarks/common.py);
  * per batch size (1, 2, 4, 8, 16, 32, 64), numerics (outputs poisoned with NaN first, checked
    fully written and finite; relative Frobenius error against the float64 oracle at most
    max(2 x the bf16 torch path's error, the dtype floor), the policy of validation/tolerances.toml):
      - each op on the block's own upstream values (router: logits vs the oracle, selection
        re-derived from the kernel's logits with the reference rule, weights, grouping exactly;
        down-projection; routed experts; latent RMSNorm; shared gate/up; latent_out);
      - the routed experts alone under forced routing patterns (uniform, hot, same, distinct);
      - the whole block against the float64 oracle with the kernel's own expert selection pinned
        (kernels.reference.moe_block(ids=...)), beside the bf16 torch path's error;
      - run twice: bitwise identical;
  * speed, per batch: one CUDA graph of `calls` block steps on distinct inputs (so distinct
    routings: the expert weights rotate naturally; every step reads > 1 GB, far past the L2), and
    the torch baseline (benchmarks/block_baseline.py) the same way, interleaved; per-op graphs
    of the same steps' inputs, dense weights rotated past the L2. Bytes: the weights each op must
    read at that batch (only the selected experts, averaged over the steps' routings) plus its
    activations; the block's: all weights it must read plus x and out.
The JSON is rewritten after every batch, so a timeout keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.explore_common import invocation  # noqa: E402

PLAN_PATH = Path("build") / "block_plan.json"
SCHEMA = "fasttrack.block_proof/1"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PATTERN_BATCHES = (1, 8, 64)
PATTERNS = ("uniform", "hot", "same", "distinct")
REL_FRO_FLOOR = {"bfloat16": 2.0**-9, "float32": 2.0**-16}
MAX_ERROR_RATIO = 2.0


class ProofError(RuntimeError):
    """A user-fixable problem (no plan, no GPU, a missing build folder)."""


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# -- plan (CPU host) ---------------------------------------------------------------------------


def plan_dirs(plan_doc: dict, batch: int):
    """`dirs(kernel, shape)` for load_block_kernels from a plan's cases: the block runs the
    cubins the plan built (their folders; `run` checks each against the plan's sha256 first),
    not this checkout's block_tunables nor a rebuild from today's sources. So two plans of two
    block configurations can be timed in one call, also when the sources changed between them.
    A variant the plan lacks is a ProofError."""
    known = {(c["kernel"], json.dumps(c["shape"], sort_keys=True)): c["dir"] for c in plan_doc["cases"]}

    def pick(name: str, shape: dict) -> Path:
        try:
            return REPO / known[(name, json.dumps(shape, sort_keys=True))]
        except KeyError:
            raise ProofError(f"the plan has no {name} variant for {shape} (batch {batch}): plan that batch "
                             "with `block_proof.py plan --batches ...`") from None

    return pick


def plan_variants(plan_doc: dict, cfg, batch: int) -> list:
    """The (role, kernel, shape) list of the block a plan built at `batch`: the block's structure
    under the choices its cases show (router_select built: the router's projections as gemv
    launches; residual built: the output side's), so a plan of an earlier configuration runs as
    that configuration."""
    from kernels.block import block_variants

    kernels = {c["kernel"] for c in plan_doc["cases"] if c["shape"].get("batch") == batch}
    return block_variants(cfg, batch, gemv_router="router_select" in kernels, gemv_dense="residual" in kernels)


def plan(args) -> int:
    """Build every kernel variant the block launches at the batch sizes; write the plan."""
    from kernels.block import block_tunables, block_variants
    from kernels.build import BuildError, build_variant
    from kernels.config import get_config

    cfg = get_config("k3")
    root = Path(args.root).resolve()
    if not root.is_relative_to(REPO):
        raise ProofError(f"--root {args.root} is outside the repository: the GPU call carries only paths inside it")
    cases, seen = [], set()
    for T in args.batches:
        for _role, name, shape in block_variants(cfg, T):
            try:
                a = build_variant(name, shape, block_tunables(name, T), root=Path(args.root).resolve())
            except BuildError as e:
                raise ProofError(str(e)) from None
            if a.key in seen:
                continue
            seen.add(a.key)
            r = a.meta["resources"]
            cases.append({"kernel": name, "shape": shape, "tunables": a.tunables, "build_key": a.key,
                          "dir": str(Path(a.dir).resolve().relative_to(REPO)),
                          "cubin_sha256": a.cubin_sha256, "cubin_code_sha256": a.cubin_code_sha256,
                          "registers": r["registers"],
                          "spill_bytes": r["spill_store_bytes"] + r["spill_load_bytes"]})
            print(f"  {name} {shape} regs {r['registers']} {'(cached)' if a.cache_hit else ''}", flush=True)
    dirty = _git("status", "--porcelain", "--", "kernels", "benchmarks", "scripts")
    doc = {"schema": SCHEMA + "#plan", "commit": _git("rev-parse", "HEAD"), "dirty": bool(dirty),
           "command": invocation("python"), "batches": list(args.batches),
           "root": str(Path(args.root).resolve().relative_to(REPO)), "cases": cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"plan: {len(cases)} variants -> {args.out}{' (sources dirty)' if dirty else ''}")
    return 0


# -- numerics helpers (GPU host) ---------------------------------------------------------------


def errors(out, oracle) -> dict:
    import torch

    o = oracle.double()
    d = out.double() - o
    ref = torch.linalg.vector_norm(o).item()
    return {"max_abs": d.abs().max().item(), "rel_fro": torch.linalg.vector_norm(d).item() / ref if ref else float("inf")}


def judge(name, out, oracle, torch_path, dtype="bfloat16") -> dict:
    """One output against the oracle, with the bf16 torch path's error as the yardstick."""
    import torch

    finite = bool(torch.isfinite(out.float()).all().item())
    mine, yard = errors(out, oracle), errors(torch_path, oracle)
    limit = max(MAX_ERROR_RATIO * yard["rel_fro"], REL_FRO_FLOOR[dtype])
    return {"what": name, "kernel": mine, "torch_path": yard, "rel_fro_limit": limit,
            "ratio": mine["rel_fro"] / yard["rel_fro"] if yard["rel_fro"] else None,
            "finite": finite, "passed": finite and mine["rel_fro"] <= limit}


def check_selection(logits, bias, ids, weights, top_k, scale, tie_tol=1e-6) -> dict:
    """The kernel's selection against the reference rule applied to the kernel's own logits:
    every chosen expert's biased score >= every unchosen one's (within `tie_tol`), exact ids
    where no near-tie exists, weights from those scores."""
    import torch

    from kernels.reference import select_experts

    s = torch.sigmoid(logits.float())
    biased = s + bias.float()
    ref_ids = select_experts(s, bias, top_k)
    if not bool(((ids >= 0) & (ids < logits.shape[1])).all().item()):  # a failed kernel, not a crash here
        return {"distinct": False, "ids_in_range": False, "top_k_by_biased_score": False,
                "tokens_exactly_reference": 0, "tokens": ids.shape[0], "weights_max_abs_err": float("inf"),
                "passed": False}
    chosen = torch.zeros_like(biased, dtype=torch.bool).scatter_(1, ids.long(), True)
    distinct = bool((chosen.sum(1) == top_k).all().item())
    lo_chosen = torch.where(chosen, biased, torch.full_like(biased, float("inf"))).min(1).values
    hi_other = torch.where(chosen, torch.full_like(biased, float("-inf")), biased).max(1).values
    order_ok = bool((lo_chosen >= hi_other - tie_tol).all().item())
    exact = int((ids.long() == ref_ids.long()).all(1).sum().item())
    sel = torch.gather(s, 1, ids.long())
    ref_w = sel / (sel.sum(-1, keepdim=True) + 1e-20) * scale
    w_err = (weights.float() - ref_w).abs().max().item()
    return {"distinct": distinct, "top_k_by_biased_score": order_ok, "tokens_exactly_reference": exact,
            "tokens": ids.shape[0], "weights_max_abs_err": w_err,
            "passed": distinct and order_ok and w_err <= 1e-5}


def check_grouping(buf, n_experts) -> dict:
    import torch

    from kernels.ops.router import routing_groups_ref

    ref = routing_groups_ref(buf["ids"], n_experts)
    n = int(buf["n_groups"][0].item())
    ok = (n == int(ref["n_groups"][0].item())
          and torch.equal(buf["group_expert"][:n].cpu(), ref["group_expert"][:n].cpu())
          and torch.equal(buf["group_start"][: n + 1].cpu(), ref["group_start"][: n + 1].cpu())
          and torch.equal(buf["sorted_slots"].cpu(), ref["sorted_slots"].cpu()))
    return {"n_groups": n, "passed": bool(ok)}


def run_experts(blk, z, ids, weights):
    """moe_w13 + moe_w2 of `blk` on a given routing (metadata from the reference grouping)."""
    import torch

    from kernels.ops.router import routing_groups_ref

    b, w = blk.buf, blk.w
    meta = routing_groups_ref(ids, blk.cfg.n_experts)
    G = b["group_expert"].numel()
    for k in ("n_groups", "group_start", "sorted_slots"):
        b[k].copy_(meta[k] if k != "group_start" else meta[k][: G + 1])
    b["group_expert"].copy_(meta["group_expert"][:G])
    b["weights"].copy_(weights)
    b["z"].copy_(z)
    b["c"].fill_(float("nan"))
    blk.k.w13(b["z"], w.w13, b["n_groups"], b["group_expert"], b["group_start"], b["sorted_slots"], b["act"])
    blk.k.w2(b["act"], w.w2, b["weights"], b["n_groups"], b["group_expert"], b["group_start"],
             b["sorted_slots"], b["o"], b["w2_counters"], b["c"])
    torch.cuda.synchronize()
    return b["c"].clone()


def numerics(blk, cfg, T, patterns) -> dict:
    import torch

    from kernels import reference as R
    from validation.numerics import routing_ids

    F64, F32 = torch.float64, torch.float32
    w = blk.w
    res = {"ops": [], "patterns": [], "block": None}
    x = torch.randn(T, cfg.hidden, device="cuda").to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    blk.launch(x, out)
    torch.cuda.synchronize()
    b = {k: v.clone() for k, v in blk.buf.items()}
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    ops = res["ops"]
    ops.append(judge("rmsnorm_pre h", b["h"], R.rmsnorm(x, w.gamma_pre, cfg.eps, compute_dtype=F64),
                     R.rmsnorm(x, w.gamma_pre, cfg.eps)))
    ops.append(judge("router logits", b["logits"], R.linear(b["h"], w.w_gate, compute_dtype=F64),
                     R.linear(b["h"], w.w_gate, out_dtype=F32), "float32"))
    sel = check_selection(b["logits"], w.bias, b["ids"], b["weights"], cfg.top_k, cfg.routed_scale)
    grp = check_grouping(b, cfg.n_experts)
    ops.append({"what": "router selection", **sel})
    ops.append({"what": "router grouping", **grp})
    ops.append(judge("down z", b["z"], R.linear(b["h"], w.w_down, compute_dtype=F64), R.linear(b["h"], w.w_down)))
    ops.append(judge("routed experts c", b["c"],
                     R.routed_experts(b["z"], b["ids"], b["weights"].double(), w.w13, w.w2, compute_dtype=F64, **kw),
                     R.routed_experts(b["z"], b["ids"], b["weights"], w.w13, w.w2, **kw)))
    ops.append(judge("rmsnorm_latent n", b["n"], R.rmsnorm(b["c"], w.gamma_latent, cfg.eps, compute_dtype=F64),
                     R.rmsnorm(b["c"], w.gamma_latent, cfg.eps)))
    S = cfg.shared_inter
    gu64 = b["h"].double() @ w.w_shared_gate_up.double().T
    gu32 = b["h"].float() @ w.w_shared_gate_up.float().T
    ops.append(judge("shared_gate_up a", b["a_shared"], R.situ(gu64[:, :S], gu64[:, S:], **kw),
                     R.situ(gu32[:, :S], gu32[:, S:], **kw).to(torch.bfloat16)))
    r64 = R.linear(b["n"], w.w_up, compute_dtype=F64)
    s64 = b["a_shared"].double() @ w.w_shared_down.double().T
    r32 = R.linear(b["n"], w.w_up)
    s32 = (b["a_shared"].float() @ w.w_shared_down.float().T).to(torch.bfloat16)
    ops.append(judge("latent_out out", out, R.residual(x, r64, s64, compute_dtype=F64), R.residual(x, r32, s32)))
    # the block, expert selection pinned to the kernel's
    oracle = R.moe_block(x, w, cfg, compute_dtype=F64, ids=b["ids"])
    bf16_path = R.moe_block(x, w, cfg, ids=b["ids"])
    res["block"] = judge("block out", out, oracle, bf16_path)
    out2 = torch.full_like(x, float("nan"))
    blk.launch(x, out2)
    torch.cuda.synchronize()
    res["block"]["deterministic"] = bool(torch.equal(out.view(torch.int16), out2.view(torch.int16)))
    res["block"]["passed"] = res["block"]["passed"] and res["block"]["deterministic"]
    # routed experts under forced routing patterns
    g = torch.Generator(device="cpu").manual_seed(1000 + T)
    for pat in patterns:
        ids = routing_ids(T, cfg.n_experts, cfg.top_k, pat, g, "cuda")
        z = torch.randn(T, cfg.latent, device="cuda").to(torch.bfloat16)
        wts = torch.rand(T, cfg.top_k, device="cuda") + 0.05
        wts = wts / wts.sum(-1, keepdim=True)
        c = run_experts(blk, z, ids, wts)
        row = judge(f"experts {pat}", c,
                    R.routed_experts(z, ids, wts.double(), w.w13, w.w2, compute_dtype=F64, **kw),
                    R.routed_experts(z, ids, wts, w.w13, w.w2, **kw))
        row["unique_experts"] = int(torch.unique(ids).numel())
        res["patterns"].append(row)
    res["passed"] = (all(o.get("passed", False) for o in ops) and res["block"]["passed"]
                     and all(p["passed"] for p in res["patterns"]))
    return res


# -- bytes and timing (GPU host) ---------------------------------------------------------------


def op_bytes(cfg, T: int, n_unique: float) -> dict:
    """Bytes each op must move at batch T: weights it must read (routed: the selected experts)
    plus activations read and written."""
    H, L, E, I, S, K = cfg.hidden, cfg.latent, cfg.n_experts, cfg.expert_inter, cfg.shared_inter, cfg.top_k
    return {
        "rmsnorm_pre": H * 2 + 2 * T * H * 2,
        "router+down": E * H * 2 + E * 4 + L * H * 2 + T * H * 2 + T * E * 4 + T * K * 8 + T * L * 2,
        "moe_w13": n_unique * 2 * I * L * 2 + T * L * 2 + T * K * I * 2,
        "moe_w2": n_unique * L * I * 2 + T * K * I * 2 + T * L * 2,
        "rmsnorm_latent": L * 2 + 2 * T * L * 2,
        "shared_gate_up": 2 * S * H * 2 + T * H * 2 + T * S * 2,
        "latent_out": H * L * 2 + H * S * 2 + T * (L + S) * 2 + 2 * T * H * 2,
    }


def block_bytes(cfg, T: int, n_unique: float) -> float:
    """The block's bytes: every weight it must read (the selected experts only) plus x and out."""
    dense = cfg.dense_params() * 2 + cfg.n_experts * 4  # bf16 weights, fp32 router bias
    return dense + n_unique * cfg.routed_expert_params() * 2 + 2 * T * cfg.hidden * 2


def graph_time(launch_all, replays: int = 12, warmup: int = 2) -> dict:
    """Capture `launch_all()` once into a graph and time its replays (us per replay)."""
    from benchmarks.common import time_graph

    return time_graph(lambda _i: launch_all(), launches=1, replays=replays, warmup=warmup).summary()


def speed(blk, cfg, T, calls: int, read_tbps: float, baseline_ok: bool, per_op: bool) -> dict:
    import torch

    from benchmarks.block_baseline import torch_block
    from benchmarks.common import l2_bytes, rotation_count

    xs = [torch.randn(T, cfg.hidden, device="cuda").to(torch.bfloat16) for _ in range(calls)]
    outs = [torch.empty_like(x) for x in xs]
    # the routing of each step (for byte counts), from the block's own router
    uniq, snaps = [], []
    for x, o in zip(xs, outs):
        blk.launch(x, o)
        torch.cuda.synchronize()
        uniq.append(int(blk.buf["n_groups"][0].item()))
        snaps.append({k: v.clone() for k, v in blk.buf.items()})
    n_unique = sum(uniq) / len(uniq)
    res = {"calls": calls, "unique_experts_per_step": uniq, "bytes_per_step": block_bytes(cfg, T, n_unique)}

    def ours():
        for x, o in zip(xs, outs):
            blk.launch(x, o)

    t_outs = [torch.empty_like(x) for x in xs]

    def theirs():
        for i, x in enumerate(xs):
            t_outs[i].copy_(torch_block(x, blk.w, cfg))

    rounds = {"kernel": [], "torch": []}
    for _ in range(2):  # interleaved A/B/A/B
        rounds["kernel"].append(graph_time(ours))
        if baseline_ok:
            try:
                rounds["torch"].append(graph_time(theirs))
            except Exception as e:  # the baseline failing must not lose the kernel's figures
                res["baseline_error"] = f"{type(e).__name__}: {e}"
                baseline_ok = False
                torch.cuda.synchronize()
    us = min(r["median_us"] for r in rounds["kernel"]) / calls
    res["block"] = {"rounds": rounds, "us": us, "tbps": res["bytes_per_step"] / us / 1e6,
                    "fraction_of_read": res["bytes_per_step"] / us / 1e6 / read_tbps}
    if baseline_ok:
        tus = min(r["median_us"] for r in rounds["torch"]) / calls
        res["block"].update(torch_us=tus, torch_fraction_of_read=res["bytes_per_step"] / tus / 1e6 / read_tbps,
                            speedup_vs_torch=tus / us)
    if not per_op:
        return res

    # per op: graphs of the same steps' inputs; dense weights rotated past the L2
    w, k = blk.w, blk.k
    ob = op_bytes(cfg, T, n_unique)
    l2 = l2_bytes()

    def copies(nbytes):
        return min(8, rotation_count(int(nbytes), l2))

    def rot(t, n):
        return [t] + [t.clone() for _ in range(n - 1)]

    nr = copies((cfg.n_experts + cfg.latent) * cfg.hidden * 2)
    ns = copies(2 * cfg.shared_inter * cfg.hidden * 2)
    nl = copies((cfg.hidden * cfg.latent + cfg.hidden * cfg.shared_inter) * 2)
    wg, wd, wsgu = rot(w.w_gate, nr), rot(w.w_down, nr), rot(w.w_shared_gate_up, ns)
    wu, wsd = rot(w.w_up, nl), rot(w.w_shared_down, nl)
    b = blk.buf
    S = snaps
    cnt = max(calls, nr, ns, nl)

    def each(fn):
        def run():
            for i in range(cnt):
                fn(i, S[i % calls])
        return run

    ops = {
        "rmsnorm_pre": lambda i, s: k.norm_pre(xs[i % calls], w.gamma_pre, b["h"]),
        "router+down": lambda i, s: blk.route(s["h"], wg[i % nr], wd[i % nr]),
        "moe_w13": lambda i, s: k.w13(s["z"], w.w13, s["n_groups"], s["group_expert"], s["group_start"],
                                      s["sorted_slots"], b["act"]),
        "moe_w2": lambda i, s: k.w2(s["act"], w.w2, s["weights"], s["n_groups"], s["group_expert"],
                                    s["group_start"], s["sorted_slots"], b["o"], b["w2_counters"], b["c"]),
        "rmsnorm_latent": lambda i, s: k.norm_latent(s["c"], w.gamma_latent, b["n"]),
        "shared_gate_up": lambda i, s: blk.shared_gate_up(s["h"], wsgu[i % ns]),
        "latent_out": lambda i, s: blk.latent_out(xs[i % calls], s["n"], wu[i % nl], s["a_shared"], wsd[i % nl],
                                                  outs[i % calls]),
    }
    res["ops"] = {}
    for name, fn in ops.items():
        t = graph_time(each(fn))
        us = t["median_us"] / cnt
        res["ops"][name] = {"us": us, "bytes": ob[name], "tbps": ob[name] / us / 1e6,
                            "fraction_of_read": ob[name] / us / 1e6 / read_tbps}
    e13, e2 = res["ops"]["moe_w13"], res["ops"]["moe_w2"]
    eb = ob["moe_w13"] + ob["moe_w2"]
    res["ops"]["experts (w13+w2)"] = {"us": e13["us"] + e2["us"], "bytes": eb,
                                      "tbps": eb / (e13["us"] + e2["us"]) / 1e6,
                                      "fraction_of_read": eb / (e13["us"] + e2["us"]) / 1e6 / read_tbps}
    del wg, wd, wsgu, wu, wsd
    return res


# -- run (GPU host) ----------------------------------------------------------------------------


def run(args) -> int:
    import torch

    from benchmarks.block_baseline import grouped_mm_available
    from benchmarks.common import copy_bandwidth, gpu_environment, read_bandwidth
    from kernels.block import MoEBlock, load_block_kernels
    from kernels.config import get_config
    from kernels.launch import CubinKernel
    from kernels.reference import make_weights

    if not torch.cuda.is_available():
        raise ProofError("no CUDA device: run this on the GPU host")
    try:
        plan_doc = json.loads(Path(args.plan).read_text())
    except OSError as e:
        raise ProofError(f"cannot read the plan {args.plan}: {e.strerror} (run `block_proof.py plan` first)") from None
    for c in plan_doc["cases"]:
        d = REPO / c["dir"]
        if not d.is_dir():
            raise ProofError(f"build folder {c['dir']} is missing: carry `{plan_doc.get('root', 'build')}` "
                             "with the run")
        if CubinKernel.from_dir(d).sha256 != c["cubin_sha256"]:
            raise ProofError(f"{c['dir']}: cubin sha256 differs from the plan's")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "block_proof.json"
    torch.manual_seed(args.seed)
    cfg = get_config("k3")
    doc = {
        "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": invocation("PYTHONPATH=. python"),
        "plan_command": plan_doc.get("command"), "commit": plan_doc.get("commit"),
        "sources_dirty": plan_doc.get("dirty"), "environment": gpu_environment(),
        "cubins": {f"{c['kernel']} {json.dumps(c['shape'], sort_keys=True)}": c["cubin_sha256"]
                   for c in plan_doc["cases"]},
        "policy": {"rel_fro_floor": REL_FRO_FLOOR, "max_error_ratio": MAX_ERROR_RATIO},
        "ceilings": {}, "batches": {},
    }
    t0 = time.time()
    doc["ceilings"]["read"] = read_bandwidth(reps=20)
    doc["ceilings"]["copy"] = copy_bandwidth(reps=20)
    read_tbps = doc["ceilings"]["read"]["tbps"]
    print(f"read-only {read_tbps:.3f} TB/s, copy {doc['ceilings']['copy']['tbps']:.3f} TB/s "
          f"({time.time() - t0:.0f} s)", flush=True)
    w = make_weights(cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    print(f"weights {w.nbytes() / 1e9:.1f} GB ({time.time() - t0:.0f} s)", flush=True)
    why = grouped_mm_available()
    doc["baseline"] = {"grouped_mm": why or "ok"}
    for T in args.batches:
        row = {}
        doc["batches"][str(T)] = row
        try:
            kern = load_block_kernels(cfg, T, dirs=plan_dirs(plan_doc, T), variants=plan_variants(plan_doc, cfg, T))
            row["cubins"] = kern.hashes()
            blk = MoEBlock(cfg, T, w, kernels=kern, concurrent=not args.sequential)
            if not args.skip_numerics:
                row["numerics"] = numerics(blk, cfg, T, PATTERNS if T in PATTERN_BATCHES else ("uniform",))
            row["speed"] = speed(blk, cfg, T, args.calls, read_tbps, why is None, per_op=T in args.per_op_batches)
        except Exception as e:  # one failing batch must not lose the others
            import traceback

            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
        out_path.write_text(json.dumps(doc, indent=1))
        print(summary_line(T, row), f"({time.time() - t0:.0f} s)", flush=True)
        if "error" in row:
            try:
                torch.cuda.synchronize()
            except Exception:
                break  # a sticky device error: nothing after it can be trusted
    doc["passed_numerics"] = all(r.get("numerics", {}).get("passed") for r in doc["batches"].values())
    out_path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out_path}")
    return 0 if doc["passed_numerics"] else 1


def summary_line(T, row) -> str:
    if "error" in row:
        return f"b{T}: ERROR {row['error'][:300]}"
    s = [f"b{T}:"]
    n = row.get("numerics")
    if n:
        s.append(f"numerics {'ok' if n['passed'] else 'FAIL'} block err {n['block']['kernel']['rel_fro']:.2e} "
                 f"(torch path {n['block']['torch_path']['rel_fro']:.2e})")
        bad = [o["what"] for o in n["ops"] + n["patterns"] if not o.get("passed")]
        if bad:
            s.append(f"failed: {', '.join(bad)}")
    b = row["speed"]["block"]
    s.append(f"block {b['us']:.1f} us {b['fraction_of_read']:.1%} of read")
    if "torch_us" in b:
        s.append(f"torch {b['torch_us']:.1f} us ({b['torch_fraction_of_read']:.1%}) x{b['speedup_vs_torch']:.2f}")
    for name, o in row["speed"].get("ops", {}).items():
        s.append(f"\n    {name:18s} {o['us']:8.2f} us {o['fraction_of_read']:6.1%}")
    return " ".join(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("plan", help="build the block's variants and write the plan (CPU host, needs the DSL)")
    pp.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    pp.add_argument("--root", default="build")
    pp.add_argument("--out", default=str(PLAN_PATH))
    pr = sub.add_parser("run", help="check and time the block (GPU host, no DSL)")
    pr.add_argument("--plan", default=str(PLAN_PATH))
    pr.add_argument("--out", required=True)
    pr.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    pr.add_argument("--per-op-batches", nargs="+", type=int, default=[1, 8, 64])
    pr.add_argument("--calls", type=int, default=8, help="block steps (distinct inputs) per graph")
    pr.add_argument("--sequential", action="store_true", help="no side streams")
    pr.add_argument("--skip-numerics", action="store_true")
    pr.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        return plan(args) if args.step == "plan" else run(args)
    except ProofError as e:
        print(f"block_proof: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
