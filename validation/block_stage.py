"""`fasttrack validate block`: the whole LatentMoE block (kernels/block.py MoEBlock, with its
per-batch kernel choices) at every decode batch, head against the base revision in one GPU run.

    fasttrack validate block --base REV --prepare        # CPU host: build both sides' block kernels
    PYTHONPATH=. python3 -m validation.cli validate block --plan P --out DIR   # GPU host

`prepare_block_plan` builds, per batch, every kernel variant the block launches (`block_variants`,
`block_tunables` of kernels/block.py) at head (this checkout) and at the base revision (a git
worktree, built by that revision's own kernels/block.py and kernels/build.py), and writes the
plan. The GPU run (`run`, a child process with a timeout) checks every cubin against the plan,
then with the k3 weights on the device:
  * the read-only and copy ceilings;
  * per batch, numerics of head's block: each op on the block's own upstream values (router
    logits against the oracle, the selection re-derived from the kernel's logits, grouping
    exactly, z, the routed experts, the latent RMSNorm, shared gate/up, latent_out), the routed
    experts alone under the uniform, hot, same and distinct routings (batches 1, 8, 64), the whole
    block against the float64 oracle (the kernel's selection pinned) beside the bf16 torch path,
    and twice bitwise identical;
  * per batch, timings: CUDA graphs of `calls` block steps on distinct inputs, head, base and the
    torch baseline (benchmarks/block_baseline.py) interleaved over rounds; per-op graphs of head.
The bundle (change.kernel "block") lists every cubin of both sides; each batch's block time is a
benchmark case (head against base, the validator's verdict statistics).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

BLOCK_SCHEMA = "fasttrack.block-plan/1"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PATTERN_BATCHES = (1, 8, 64)
PATTERNS = ("uniform", "hot", "same", "distinct")
PER_OP_BATCHES = (1, 8, 64)
REL_FRO_FLOOR = {"bfloat16": 2.0**-9, "float32": 2.0**-16}
MAX_ERROR_RATIO = 2.0
ROUNDS = 6
CALLS = 8
RUN_TIMEOUT_S = 540.0
CEILING_NOISE = 0.02  # the read ceiling's allowance in the IMPOSSIBLE check (bench.bandwidth_check)


class BlockError(RuntimeError):
    """A user-fixable problem (no plan, a cubin that changed, a base that does not build)."""


# -- CPU host ----------------------------------------------------------------------------------

# Runs inside a worktree (head: this checkout; base: the base revision) with that tree's code
# first on sys.path: the block's variants at each batch, built by that tree's kernels/build.py.
_BLOCK_BUILD_SCRIPT = """
import json, sys
from pathlib import Path
wt, root, batches = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, wt)
import kernels
if Path(kernels.__file__).resolve().parent != Path(wt, "kernels").resolve():
    raise SystemExit(f"imported kernels from {kernels.__file__}, not from {wt}")
from kernels.block import block_tunables, block_variants
from kernels.build import build_variant
from kernels.config import get_config
cfg = get_config("k3")
out = []
for T in batches:
    cases = []
    for role, name, shape in block_variants(cfg, T):
        a = build_variant(name, shape, block_tunables(name, T), root=Path(root), repo_root=Path(wt))
        cases.append({"role": role, "kernel": name, "shape": shape, "tunables": a.tunables, "build_key": a.key,
                      "dir": str(Path(a.dir).resolve().relative_to(Path(root).resolve())),
                      "cubin_sha256": a.cubin_sha256, "cubin_code_sha256": a.cubin_code_sha256})
    out.append({"batch": T, "cases": cases})
print("@@BLOCK@@" + json.dumps(out))
"""


def _build_block_in(tree: Path, build_root: Path, batches) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _BLOCK_BUILD_SCRIPT, str(tree), str(Path(build_root).resolve()),
                           json.dumps(list(batches))], cwd=tree, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("@@BLOCK@@")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BlockError(f"the block does not build in {tree.name}: {tail[0][:400]}")
    return json.loads(line[len("@@BLOCK@@"):])


def prepare_block_plan(base: str, *, build_root: Path, repo_root: Path | None = None, plan_path: Path,
                       batches=BATCHES, log=print, build_in=None) -> dict:
    """Build head's and base's block kernels at every batch into `build_root`; write the plan.
    `build_in(tree, build_root, batches)` is for tests."""
    import tempfile

    from kernels.manifest import REPO_ROOT

    from .validate import _git

    repo_root = Path(repo_root or REPO_ROOT)
    build_in = build_in or _build_block_in
    sha = _git(["rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"], repo_root)
    if not sha:
        raise BlockError(f"--base {base!r} does not name a commit in this repository")
    log(f"block: building head's kernels at batches {list(batches)}")
    head = build_in(repo_root, build_root, batches)
    with tempfile.TemporaryDirectory(prefix="fasttrack-block-base-") as tmp:
        wt = Path(tmp) / "wt"
        r = subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(wt), sha], cwd=repo_root,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise BlockError(f"cannot check out base {sha[:12]} in a worktree: {r.stderr.strip()[-300:]}")
        try:
            log(f"block: building base {sha[:12]}'s kernels (its own kernels/block.py)")
            based = build_in(wt, build_root, batches)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=repo_root, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=repo_root, capture_output=True)
    plan = {"schema": BLOCK_SCHEMA, "kernel": "block", "base": {"ref": base, "sha": sha},
            "head": {"sha": _git(["rev-parse", "HEAD"], repo_root)},
            "batches": [{"batch": h["batch"], "head": {"cases": h["cases"]}, "base": {"cases": b["cases"]}}
                        for h, b in zip(head, based)]}
    Path(plan_path).parent.mkdir(parents=True, exist_ok=True)
    Path(plan_path).write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def load_block_plan(path: Path, build_root: Path) -> dict:
    """The plan, every folder's cubin checked against the plan's sha256 (no DSL, no git)."""
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise BlockError(f"cannot read the block plan {path}: {e}") from None
    if not isinstance(plan, dict) or plan.get("schema") != BLOCK_SCHEMA:
        raise BlockError(f"{path} is not a block plan ({BLOCK_SCHEMA})")
    for b in plan["batches"]:
        for side in ("head", "base"):
            for c in b[side]["cases"]:
                f = Path(build_root) / c["dir"] / "kernel.cubin"
                if not f.is_file():
                    raise BlockError(f"{c['dir']}/kernel.cubin is missing under {build_root}: carry it with the plan")
                if hashlib.sha256(f.read_bytes()).hexdigest() != c["cubin_sha256"]:
                    raise BlockError(f"{c['dir']}: its cubin no longer hashes to the plan's; prepare again")
    return plan


def binaries(plan: dict) -> list[dict]:
    """Every cubin of both sides, once per (side, kernel, shape, hash)."""
    out, seen = [], set()
    for b in plan["batches"]:
        for side in ("head", "base"):
            for c in b[side]["cases"]:
                key = (side, c["kernel"], json.dumps(c["shape"], sort_keys=True), c["cubin_sha256"])
                if key in seen:
                    continue
                seen.add(key)
                out.append({"kernel": c["kernel"], "side": side, "variant": c["shape"], "tunables": c["tunables"],
                            "build_key": c["build_key"], "cubin_sha256": c["cubin_sha256"],
                            "cubin_code_sha256": c.get("cubin_code_sha256"), "role": c["role"],
                            "block_batch": b["batch"]})
    return out


# -- GPU host: numerics (each op on its upstream values, the block against the oracle) -------------

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


# -- GPU host: timings ----------------------------------------------------------------------------


def speed_ab(blk, base_blk, cfg, T, calls: int, read_tbps: float, baseline_ok: bool, per_op: bool,
             rounds: int = ROUNDS) -> dict:
    """Block step time of head, base and the torch baseline, interleaved over `rounds` (one CUDA
    graph of `calls` steps on distinct inputs per side and round: samples of us per step); per-op
    graphs of head (dense weights rotated past the L2)."""
    import torch

    from benchmarks.block_baseline import torch_block

    xs = [torch.randn(T, cfg.hidden, device="cuda").to(torch.bfloat16) for _ in range(calls)]
    outs = [torch.empty_like(x) for x in xs]
    bouts = [torch.empty_like(x) for x in xs]
    uniq, snaps = [], []
    for x, o in zip(xs, outs):
        blk.launch(x, o)
        torch.cuda.synchronize()
        uniq.append(int(blk.buf["n_groups"][0].item()))
        snaps.append({k: v.clone() for k, v in blk.buf.items()})
    n_unique = sum(uniq) / len(uniq)
    nbytes = block_bytes(cfg, T, n_unique)
    res = {"calls": calls, "unique_experts_per_step": uniq, "bytes_per_step": nbytes}
    t_outs = [torch.empty_like(x) for x in xs]
    sides = {"head": lambda: [blk.launch(x, o) for x, o in zip(xs, outs)]}
    if base_blk is not None:
        sides["base"] = lambda: [base_blk.launch(x, o) for x, o in zip(xs, bouts)]
    if baseline_ok:
        sides["torch"] = lambda: [t_outs[i].copy_(torch_block(x, blk.w, cfg)) for i, x in enumerate(xs)]
    samples = {k: [] for k in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(list(sides)))
        for name in order:
            try:
                samples[name].append(graph_time(sides[name], replays=6)["median_us"] / calls)
            except Exception as e:  # the baseline failing must not lose the kernels' figures
                if name != "torch":
                    raise
                res["baseline_error"] = f"{type(e).__name__}: {e}"
                sides.pop("torch")
                samples.pop("torch")
                torch.cuda.synchronize()
                break
    res["samples_us"] = samples
    for name, xs_ in samples.items():
        if xs_:
            us = sorted(xs_)[len(xs_) // 2]
            res[name] = {"us": us, "tbps": nbytes / us / 1e6, "fraction_of_read": nbytes / us / 1e6 / read_tbps}
    if "torch" in res and "head" in res:
        res["speedup_vs_torch"] = res["torch"]["us"] / res["head"]["us"]
    if per_op:
        res["ops"] = per_op_times(blk, cfg, T, xs, outs, snaps, n_unique, read_tbps)
    return res


def per_op_times(blk, cfg, T, xs, outs, snaps, n_unique, read_tbps) -> dict:
    from benchmarks.common import l2_bytes, rotation_count

    w, k, b = blk.w, blk.k, blk.buf
    calls = len(xs)
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
    res = {}
    for name, fn in ops.items():
        us = graph_time(each(fn))["median_us"] / cnt
        res[name] = {"us": us, "bytes": ob[name], "tbps": ob[name] / us / 1e6,
                     "fraction_of_read": ob[name] / us / 1e6 / read_tbps}
    e13, e2 = res["moe_w13"], res["moe_w2"]
    eb = ob["moe_w13"] + ob["moe_w2"]
    res["experts (w13+w2)"] = {"us": e13["us"] + e2["us"], "bytes": eb, "tbps": eb / (e13["us"] + e2["us"]) / 1e6,
                               "fraction_of_read": eb / (e13["us"] + e2["us"]) / 1e6 / read_tbps}
    return res


def plan_dirs(cases: list[dict], build_root: Path, batch: int):
    """`dirs(kernel, shape)` for load_block_kernels from one side's cases: the block runs the
    cubins the plan built (checked against its sha256), not this checkout's choices nor a rebuild;
    a variant the plan lacks is a BlockError."""
    known = {(c["kernel"], json.dumps(c["shape"], sort_keys=True)): c["dir"] for c in cases}

    def pick(name: str, shape: dict) -> Path:
        try:
            return Path(build_root) / known[(name, json.dumps(shape, sort_keys=True))]
        except KeyError:
            raise BlockError(f"the plan has no {name} variant for {shape} (batch {batch})") from None

    return pick


def plan_variants(cases: list[dict]) -> list[tuple[str, str, dict]]:
    """The (role, kernel, shape) list of one side's block, in launch order, as its tree declared it."""
    return [(c["role"], c["kernel"], c["shape"]) for c in cases]


def run(plan_path: Path, build_root: Path, out_path: Path, batches=None, calls: int = CALLS) -> int:
    """The GPU child: ceilings, weights, then per batch numerics and the interleaved timings;
    `out_path` rewritten after every batch (a timeout keeps what was measured)."""
    import torch

    from benchmarks.block_baseline import grouped_mm_available
    from benchmarks.common import copy_bandwidth, gpu_environment, read_bandwidth
    from kernels.block import MoEBlock, load_block_kernels
    from kernels.config import get_config
    from kernels.reference import make_weights

    plan = load_block_plan(plan_path, build_root)
    cfg = get_config("k3")
    doc = {"environment": gpu_environment(), "ceilings": {}, "batches": {},
           "policy": {"rel_fro_floor": REL_FRO_FLOOR, "max_error_ratio": MAX_ERROR_RATIO}}
    t0 = time.time()
    doc["ceilings"]["read"] = read_bandwidth(reps=20)
    doc["ceilings"]["copy"] = copy_bandwidth(reps=20)
    read_tbps = doc["ceilings"]["read"]["tbps"]
    print(f"block: read {read_tbps:.3f} TB/s, copy {doc['ceilings']['copy']['tbps']:.3f} TB/s ({time.time() - t0:.0f} s)",
          flush=True)
    torch.manual_seed(0)
    w = make_weights(cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    why = grouped_mm_available()
    doc["baseline"] = {"grouped_mm": why or "ok"}
    for b in plan["batches"]:
        T = b["batch"]
        if batches and T not in batches:
            continue
        row = doc["batches"][str(T)] = {}
        t1 = time.time()
        try:
            hk = load_block_kernels(cfg, T, dirs=plan_dirs(b["head"]["cases"], build_root, T),
                                    variants=plan_variants(b["head"]["cases"]))
            bk = load_block_kernels(cfg, T, dirs=plan_dirs(b["base"]["cases"], build_root, T),
                                    variants=plan_variants(b["base"]["cases"]))
            blk, bblk = MoEBlock(cfg, T, w, kernels=hk), MoEBlock(cfg, T, w, kernels=bk)
            row["numerics"] = numerics(blk, cfg, T, PATTERNS if T in PATTERN_BATCHES else ("uniform",))
            row["speed"] = speed_ab(blk, bblk, cfg, T, calls, read_tbps, why is None, per_op=T in PER_OP_BATCHES)
            del blk, bblk
        except Exception as e:  # one failing batch must not lose the others
            import traceback

            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
        row["seconds"] = round(time.time() - t1, 1)
        out_path.write_text(json.dumps(doc, indent=1, default=str))
        sp = row.get("speed", {})
        print(f"block b{T}: " + (f"ERROR {row['error'][:200]}" if "error" in row else
              f"numerics {'ok' if row['numerics']['passed'] else 'FAIL'}, head {sp['head']['us']:.1f} us "
              f"({sp['head']['fraction_of_read']:.1%} of read)"
              + (f", base {sp['base']['us']:.1f} us" if "base" in sp else "")
              + (f", torch {sp['torch']['us']:.1f} us" if "torch" in sp else ""))
              + f" ({row['seconds']:.0f} s)", flush=True)
        if "error" in row:
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a sticky device error: nothing after it can be trusted
                break
        torch.cuda.empty_cache()
    out_path.write_text(json.dumps(doc, indent=1, default=str))
    return 0


# -- the bundle ------------------------------------------------------------------------------------

def block_bundle(plan: dict, result: dict | None, stage: dict, *, validator=None, repo_root=None) -> dict:
    """The evidence bundle of a block run (pure: testable from a recorded `result`)."""
    from . import bundle as B
    from .bench import ALPHA, MAX_NOISE, MIN_EFFECT, bandwidth_check, benchmark_passed, compare_samples, summarize

    not_covered, reasons = [], []
    cases, bench_cases = [], []
    result = result or {}
    planned = [b["batch"] for b in plan["batches"]]
    measured = result.get("batches", {})
    for T in planned:
        row = measured.get(str(T))
        if row is None:
            not_covered.append(f"block batch {T}: not measured (the run ended before it)")
            continue
        if "error" in row:
            cases.append({"case_id": f"block/b{T}", "batch": T, "passed": False, "reasons": [row["error"]], "outputs": []})
            continue
        n = row["numerics"]
        items = n["ops"] + n["patterns"] + [n["block"]]
        cases.append({"case_id": f"block/b{T}", "batch": T, "passed": bool(n["passed"]),
                      "reasons": [f"{o['what']}: failed" for o in items if not o.get("passed")],
                      "outputs": items})
        sp = row["speed"]
        s = sp["samples_us"]
        read = result["ceilings"]["read"]
        comp = compare_samples(s["base"], s["head"]) if s.get("base") else None
        hs = summarize(s["head"])
        head_bw = bandwidth_check(int(sp["bytes_per_step"]), hs["median"], hs["rel_iqr"], read["tbps"], CEILING_NOISE)
        verdict = "IMPOSSIBLE" if head_bw["impossible"] else (comp.verdict if comp else "AMBIGUOUS")
        bench_cases.append({
            "case_id": f"block/b{T}", "name": f"block batch {T}", "kernel": "block", "variant": {"batch": T},
            "batch": T, "bytes": sp["bytes_per_step"], "head": hs, "base": summarize(s["base"]) if s.get("base") else None,
            "change": comp.change if comp else None, "speedup": comp.speedup if comp else None,
            "p_value": comp.p_value if comp else None, "noise": comp.noise if comp else hs["rel_iqr"],
            "head_bandwidth": head_bw, "verdict": verdict, "reason": comp.reason if comp else "no base",
            "graph": True, "l2_rotated": True, "copies": sp["calls"],
            "torch": sp.get("torch"), "speedup_vs_torch": sp.get("speedup_vs_torch"), "ops": sp.get("ops"),
            "unique_experts_per_step": sp.get("unique_experts_per_step")})
    correctness = {"passed": bool(cases) and all(c["passed"] for c in cases), "policy": result.get("policy"),
                   "cases": cases}
    ok, why = benchmark_passed(bench_cases)
    benchmark = {"ceilings": {"read_tbps": (result.get("ceilings", {}).get("read") or {}).get("tbps"),
                              "copy_tbps": (result.get("ceilings", {}).get("copy") or {}).get("tbps")},
                 "cases": bench_cases, "passed": ok and bool(bench_cases), "baseline": {
                     "kind": "revision", "sha": plan["base"]["sha"], "ref": plan["base"]["ref"]},
                 "torch_baseline": result.get("baseline"),
                 "policy": {"min_effect": MIN_EFFECT, "alpha": ALPHA, "max_noise": MAX_NOISE,
                            "test": "two-sided Mann-Whitney U", "slow_fails": True}}
    reasons += why
    if not stage.get("ok", True):
        reasons.append(stage.get("reason") or "the block stage failed")
    defences = {"passed": correctness["passed"], "checks": [
        {"name": "determinism", "passed": all(
            (measured.get(str(c["batch"]), {}).get("numerics", {}).get("block", {}) or {}).get("deterministic", False)
            for c in cases if "error" not in measured.get(str(c["batch"]), {})), "applicable": True,
         "detail": "the block run twice per batch: bitwise identical", "cases": []},
        {"name": "poisoned_outputs", "passed": correctness["passed"], "applicable": True,
         "detail": "outputs NaN-poisoned before each judged run, checked finite and within the policy", "cases": []}]}
    not_covered += ["race.dynamic: the block's kernels are sanitized one by one on their mini variants (their bundles)",
                    "GPU-configuration axis: one configuration (the validating host's GPU) measured"]
    repo_root = Path(repo_root) if repo_root else Path(__file__).resolve().parent.parent
    vsha, vsrc = validator or B.validator_fingerprint_of_tree(repo_root)
    env = dict(result.get("environment") or {})
    env.update({"commit": plan["head"]["sha"], "validator_sha256": vsha, "validator_sources_sha256": vsrc,
                "stages": [stage]})
    change = {"kernel": "block", "base": plan["base"]["sha"], "base_ref": plan["base"]["ref"],
              "head": plan["head"]["sha"], "files": ["kernels/block.py"], "title": "validate block",
              "summary": "the LatentMoE block at every decode batch, head against the base revision"}
    return B.new_bundle(change=change, environment=env, binaries=binaries(plan), correctness=correctness,
                        defences=defences, race=None, benchmark=benchmark, not_covered=not_covered,
                        reasons_extra=reasons)


def validate_block(plan_path: Path, *, build_root: Path, out_dir: Path, timeout_s: float = RUN_TIMEOUT_S,
                   batches=None) -> dict:
    """GPU host: the block's plan in a child process with a timeout, then its bundle (written
    with report.html into `out_dir`)."""
    from .isolate import run_plan_stage, write_bundle_and_report

    plan = load_block_plan(plan_path, build_root)
    st, result = run_plan_stage("block", "validation.block_stage", plan_path, build_root, out_dir,
                                timeout_s=timeout_s, batches=batches)
    bundle = block_bundle(plan, result, st.to_dict())
    write_bundle_and_report(out_dir, bundle, "block")
    return bundle


def main(argv=None) -> int:
    from .isolate import plan_child_main

    return plan_child_main("python -m validation.block_stage", run, BlockError, "block", argv)


if __name__ == "__main__":
    sys.exit(main())
