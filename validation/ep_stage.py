"""The GPU-configuration axis of the run matrix: the LatentMoE block expert-parallel over N GPUs.

A `GpuConfiguration` is (EP degree, tokens per GPU). `run_gpu_configurations` runs a list of
them for one model preset, each in its own process group of N processes (torch.multiprocessing
spawn; NCCL on GPUs, gloo on CPUs over loopback), and returns one result dict per configuration,
the entries of a bundle's `gpu_configurations` field:

  numerics   the whole block's output (all ranks' tokens, concatenated) against the one-GPU float64
             oracle on the same inputs and the same selection, the one-GPU bf16 block as yardstick
             (validation/numerics.py `compare_output`, the tolerance policy); beside it
             `c_bitwise_equal`: the EP combine (fp32 before its rounding, and c) equals
             `reference.expert_outputs` + `combine` on the gathered
             (z, ids, weights) bit for bit, the check that catches a dropped slot or a reordered
             combine which tolerances would let through; `ids` when the router chose.
  timing     per GPU: median us per phase (kernels/ep.py PHASES) and per step; end to end: the
             median over steps of the slowest rank's step; `comm_share`: the share of the
             end-to-end step the slowest rank spent in dispatch + return (waiting for a slower
             peer included: that is what the step pays).
  read       per GPU: the bytes a step must read (every dense weight, the selected local experts
             once) over its step time, as a fraction of that GPU's measured read ceiling (only
             where a ceiling is given or measured: a CPU has none).

`gpu_configurations_field(preset, configs, ...)` returns {"gpu_configurations": [...]}, the
field a bundle embeds. `python -m validation.ep_stage` is the GPU-host entry (docs/EXPERT_PARALLEL.md).

Imports torch and kernels only (the DSL-free GPU host runs it); NVLink multicast stays off in
every process it starts (kernels.ep.multicast_off_env).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels import ep
from kernels import reference as R
from kernels.config import ConfigError, get_config
from validation.numerics import ROUTINGS, compare_expert_ids, compare_output, load_policy, routing_ids

EP_ROUTINGS = ("router",) + ROUTINGS + ("one_rank",)
BACKENDS = ("gloo", "nccl")
EXPERT_PATHS = ("torch", "cubin")


class EPStageError(RuntimeError):
    """A configuration that could not run (bad request, a rank that failed): one clear message."""


@dataclass(frozen=True)
class GpuConfiguration:
    """One point of the GPU-configuration axis: EP degree N and tokens per GPU."""

    ep_degree: int
    tokens_per_gpu: int

    def __post_init__(self) -> None:
        for name in ("ep_degree", "tokens_per_gpu"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise EPStageError(f"{name} must be a positive integer, got {v!r}")

    @property
    def name(self) -> str:
        return f"ep{self.ep_degree}-b{self.tokens_per_gpu}"

    def to_dict(self) -> dict:
        return {**asdict(self), "name": self.name}


@dataclass(frozen=True)
class Scenario:
    """One measured case inside a process group: tokens per rank (may differ, may be 0), the
    routing (`router`: the router chooses; else a pinned pattern of validation.numerics, or
    `one_rank`: every token's experts on the last rank), steps, and a planted fault (MUTANTS)."""

    preset: str
    tokens: tuple[int, ...]
    routing: str = "router"
    seed: int = 0
    steps: int = 1
    warmup: int = 0
    mutant: str | None = None
    label: str = ""
    experts: str = "torch"  # "cubin": the moe_w13 / moe_w2 cubins found under build_root (GPU only)
    build_root: str | None = None


# ---------------------------------------------------------------------------------------------
# Planted faults: the checks must catch them (tests/test_ep.py)
# ---------------------------------------------------------------------------------------------


class _ReversedCombine(ep.EPBlock):
    """Sums the k expert outputs in reverse order: same value in exact arithmetic."""

    def combine(self, o, weights):
        T, K = weights.shape
        return R.combine(o.view(T, K, self.cfg.latent).flip(1), weights.flip(1), out_dtype=self.cd,
                         compute_dtype=self.cd)


class _DroppedSlot(ep.EPBlock):
    """Rank 0 loses the first slot it receives (its output comes back zero)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        inner = self.experts

        def experts(rec):
            o = inner(rec)
            if self.shard.rank == 0 and o.shape[0]:
                o[0] = 0
            return o

        self.experts = experts


MUTANTS = {"reversed_combine": _ReversedCombine, "dropped_slot": _DroppedSlot}


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


def _pinned_ids(s: Scenario, cfg, total: int, world: int) -> torch.Tensor | None:
    if s.routing == "router":
        return None
    gen = torch.Generator().manual_seed(1000 + s.seed)
    if s.routing == "one_rank":
        per = cfg.n_experts // world
        if cfg.top_k > per:
            raise EPStageError(f"one_rank: top_k {cfg.top_k} exceeds the {per} experts of a rank")
        ids = torch.stack([torch.randperm(per, generator=gen)[: cfg.top_k] for _ in range(total)]) + (world - 1) * per
        return ids.reshape(total, cfg.top_k).to(torch.int32)
    return routing_ids(total, cfg.n_experts, cfg.top_k, s.routing, gen, "cpu")


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def _rank_scenario(s: Scenario, rank: int, world: int, device: torch.device, weights_cache: dict, group) -> dict:
    cfg = get_config(s.preset)
    if len(s.tokens) != world:
        raise EPStageError(f"{s.label or s.preset}: {len(s.tokens)} token counts for {world} ranks")
    key = (s.preset, s.seed)
    if key not in weights_cache:
        weights_cache.clear()  # one model's weights at a time (k3: ~60 GB)
        weights_cache[key] = R.make_weights(cfg, device, s.seed)
    w = weights_cache[key]
    total = sum(s.tokens)
    x_all = R.make_hidden(cfg, total, device, s.seed)
    lo = sum(s.tokens[:rank])
    x = x_all[lo: lo + s.tokens[rank]]
    ids_all = _pinned_ids(s, cfg, total, world)
    ids = None if ids_all is None else ids_all[lo: lo + s.tokens[rank]].to(device)
    cls = MUTANTS[s.mutant] if s.mutant else ep.EPBlock
    shard = ep.ExpertShard(cfg.n_experts, world, rank)
    experts = None
    if s.experts == "cubin":
        local = ep.shard_weights(w, shard)
        experts = ep.CubinLocalExperts(cfg, shard, local.w13, local.w2, ep.cubin_batch(world, max(s.tokens)),
                                       root=Path(s.build_root) if s.build_root else None)
    block = cls(cfg, w, shard, group=group, experts=experts)
    phases = []
    for i in range(s.warmup + s.steps):
        tr = block.step(x, ids)
        if i >= s.warmup:
            phases.append(tr.phases_us)
    return {"out": tr.out.cpu(), "ids": tr.ids.cpu(), "weights": tr.weights.cpu(), "z": tr.z.cpu(),
            "c": tr.c.cpu(), "c_acc": tr.c_acc.cpu(), "experts_used": tr.experts_used, "phases": phases}


def _check(s: Scenario, world: int, parts: list[dict], device: torch.device, w, read_tbps) -> dict:
    """Rank 0: the whole block's numerics against the one-GPU oracle, and the timing summary."""
    cfg = get_config(s.preset)
    total = sum(s.tokens)
    x = R.make_hidden(cfg, total, device, s.seed)
    cat = {k: torch.cat([p[k] for p in parts]).to(device) for k in ("out", "ids", "weights", "z", "c", "c_acc")}
    oracle = R.moe_block(x, w, cfg, compute_dtype=R.F64, ids=cat["ids"], trace=True)
    one_gpu = R.moe_block(x, w, cfg, ids=cat["ids"], trace=True)
    policy = load_policy()
    numerics = {"out": compare_output("out", cat["out"], oracle.out, one_gpu.out, policy).to_dict()}
    if s.routing == "router":
        scores = torch.sigmoid(oracle.routing.logits) + w.bias.double()
        numerics["ids"] = compare_expert_ids("ids", cat["ids"], scores, one_gpu.routing.ids, policy).to_dict()
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    o = R.expert_outputs(cat["z"], cat["ids"], w.w13, w.w2, **kw)
    c_acc = R.combine(o, cat["weights"], out_dtype=R.F32)
    c_bad = int((cat["c_acc"] != c_acc).sum()) + int((cat["c"] != c_acc.to(cat["c"].dtype)).sum())
    passed = all(m["passed"] for m in numerics.values()) and c_bad == 0

    per_gpu = []
    dense_bytes = cfg.dense_params() * 2
    expert_bytes = cfg.routed_expert_params() * 2
    steps = len(parts[0]["phases"])
    step_times = [[sum(p["phases"][i].values()) for p in parts] for i in range(steps)]
    for r, p in enumerate(parts):
        ph = {name: _median([st[name] for st in p["phases"]]) for name in ep.PHASES}
        step_us = _median([sum(st.values()) for st in p["phases"]])
        comm_us = sum(ph[n] for n in ep.COMM_PHASES)
        read = dense_bytes + p["experts_used"] * expert_bytes
        tbps = read_tbps[r] if read_tbps else None
        frac = read / (step_us * 1e-6) / (tbps * 1e12) if tbps and step_us > 0 else None
        per_gpu.append({"rank": r, "tokens": s.tokens[r], "phases_us": ph, "step_us": step_us, "comm_us": comm_us,
                        "comm_share": comm_us / step_us if step_us else 0.0, "experts_used": p["experts_used"],
                        "read_bytes": read, "read_ceiling_tbps": tbps, "read_fraction": frac})
    slowest = [max(range(world), key=lambda r: st[r]) for st in step_times]
    e2e = _median([max(st) for st in step_times])
    comm_e2e = _median([sum(parts[r]["phases"][i][n] for n in ep.COMM_PHASES) / max(step_times[i][r], 1e-9)
                        for i, r in enumerate(slowest)])
    return {
        "label": s.label, "preset": s.preset, "routing": s.routing, "seed": s.seed, "mutant": s.mutant,
        "experts": s.experts,
        "configuration": {"ep_degree": world, "tokens_per_gpu": s.tokens[0] if len(set(s.tokens)) == 1 else None,
                          "tokens": list(s.tokens)},
        "passed": passed,
        "numerics": numerics,
        "c_bitwise_equal": c_bad == 0,
        "c_mismatches": c_bad,
        "out_equal_to_one_gpu": bool(torch.equal(cat["out"], one_gpu.out)),
        "out_max_abs_vs_one_gpu": float((cat["out"].double() - one_gpu.out.double()).abs().max()) if total else 0.0,
        "timing": {"steps": steps, "end_to_end_us": e2e, "comm_share": comm_e2e, "per_gpu": per_gpu},
    }


def _worker(rank: int, world: int, port: int, backend: str, device_kind: str, scenarios: list[Scenario],
            result_path: str, measure_ceiling: bool) -> None:
    import torch.distributed as dist

    ep.multicast_off_env()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # N processes share the host's cores
    kw = {"device_id": device} if device_kind == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    try:
        tbps = None
        if measure_ceiling and device_kind == "cuda":
            from benchmarks.common import read_bandwidth

            tbps = read_bandwidth()["tbps"]
        ceilings = [None] * world
        dist.all_gather_object(ceilings, tbps)
        cache: dict = {}
        results = []
        for s in scenarios:
            part = _rank_scenario(s, rank, world, device, cache, None)
            parts = [None] * world
            dist.all_gather_object(parts, part)
            if rank == 0:
                results.append(_check(s, world, parts, device, cache[(s.preset, s.seed)],
                                      ceilings if all(ceilings) else None))
            dist.barrier()
        if rank == 0:
            Path(result_path).write_text(json.dumps(results, default=_json_default))
    except Exception:
        Path(f"{result_path}.rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _json_default(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    raise TypeError(f"not JSON: {type(v).__name__}")


def free_port() -> int:
    """A free TCP port on loopback (the rendezvous of one process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenarios(scenarios: list[Scenario], world: int, *, backend: str = "gloo", device: str = "cpu",
                  measure_ceiling: bool = False) -> list[dict]:
    """Run `scenarios` in one process group of `world` spawned processes; one result each.
    Raises EPStageError (with the failing rank's last lines) when a rank fails."""
    import torch.multiprocessing as mp

    if backend not in BACKENDS:
        raise EPStageError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if device == "cuda" and torch.cuda.device_count() < world:
        raise EPStageError(f"EP degree {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
    for s in scenarios:
        try:
            cfg = get_config(s.preset)
            ep.ExpertShard(cfg.n_experts, world, 0)
        except (ConfigError, ep.EPError) as e:
            raise EPStageError(str(e)) from None
        if s.routing not in EP_ROUTINGS:
            raise EPStageError(f"unknown routing {s.routing!r}; known: {', '.join(EP_ROUTINGS)}")
        if s.mutant is not None and s.mutant not in MUTANTS:
            raise EPStageError(f"unknown mutant {s.mutant!r}; known: {', '.join(MUTANTS)}")
        if s.experts not in EXPERT_PATHS or (s.experts == "cubin" and device != "cuda"):
            raise EPStageError(f"experts {s.experts!r} on {device}: 'torch' anywhere, 'cubin' on cuda")
    ep.multicast_off_env()
    # CPU: a fork server that imported torch once forks every rank of every call (spawn would
    # import torch again per rank); CUDA: spawn, as CUDA requires of a parent that touched it
    method = "spawn" if device == "cuda" else "forkserver"
    if method == "forkserver":
        import multiprocessing.forkserver

        multiprocessing.forkserver.set_forkserver_preload(["torch", "validation.ep_stage"])
    with tempfile.TemporaryDirectory(prefix="ep_stage_") as tmp:
        path = os.path.join(tmp, "result.json")
        try:
            mp.start_processes(_worker, args=(world, free_port(), backend, device, list(scenarios), path,
                                              measure_ceiling), nprocs=world, start_method=method)
        except Exception as e:  # a rank raised: its traceback is in a file, one line goes up
            errs = [f.read_text().strip() for f in sorted(Path(tmp).glob("result.json.rank*.err"))]
            # the rank that failed first, not a peer that saw its connection close
            first = [t for t in errs if "Connection closed by peer" not in t] or errs
            tail = first[0].splitlines()[-1] if first else str(e).strip().splitlines()[-1]
            if os.environ.get("FASTTRACK_EP_DEBUG"):
                print("\n\n".join(errs), file=sys.stderr)
            raise EPStageError(f"EP degree {world}: a rank failed: {tail}") from None
        return json.loads(Path(path).read_text())


def run_gpu_configurations(preset: str, configs: list[GpuConfiguration], *, backend: str = "gloo",
                           device: str = "cpu", seed: int = 0, steps: int = 3, warmup: int = 1,
                           routing: str = "router", measure_ceiling: bool = False, experts: str = "torch",
                           build_root: str | None = None) -> list[dict]:
    """One result per configuration (module docstring); one process group per EP degree."""
    out: dict[GpuConfiguration, dict] = {}
    for n in sorted({c.ep_degree for c in configs}):
        mine = [c for c in configs if c.ep_degree == n]
        sc = [Scenario(preset, (c.tokens_per_gpu,) * n, routing, seed, steps, warmup, label=c.name,
                       experts=experts, build_root=build_root) for c in mine]
        for c, res in zip(mine, run_scenarios(sc, n, backend=backend, device=device, measure_ceiling=measure_ceiling)):
            out[c] = {**res, "configuration": c.to_dict()}
    return [out[c] for c in configs]


def gpu_configurations_field(preset: str, configs: list[GpuConfiguration], **kw) -> dict:
    """{"gpu_configurations": [result, ...]}: the field an evidence bundle embeds."""
    return {"gpu_configurations": run_gpu_configurations(preset, configs, **kw)}


# ---------------------------------------------------------------------------------------------
# GPU-host entry: python -m validation.ep_stage --out DIR
# ---------------------------------------------------------------------------------------------


def prepare_cubins(preset: str, configs: list[GpuConfiguration], root: Path, *, build=None) -> list[dict]:
    """Build (on a host with the DSL) the expert cubins the `cubin` path needs for `configs`
    under `root`, the folder to carry to the GPU host; one row per distinct variant."""
    if build is None:
        from kernels.build import build_variant as build
    cfg = get_config(preset)
    rows, seen = [], set()
    for c in configs:
        ep.ExpertShard(cfg.n_experts, c.ep_degree, 0)
        for name, shape, tun in ep.cubin_variants(cfg, cfg.n_experts // c.ep_degree,
                                                  ep.cubin_batch(c.ep_degree, c.tokens_per_gpu)):
            key = (name, json.dumps(shape, sort_keys=True), json.dumps(tun, sort_keys=True))
            if key not in seen:
                seen.add(key)
                try:
                    art = build(name, shape, tun, root=root)
                except RuntimeError as e:  # kernels.build.BuildError: it names the variant
                    raise EPStageError(f"building {name} for {c.name}: {e}") from None
                rows.append({"kernel": name, "shape": shape, "tunables": tun, "dir": str(getattr(art, "dir", ""))})
    return rows


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.ep_stage",
                                description="Run the expert-parallel LatentMoE block at each EP degree and "
                                            "batch per GPU; write ep_result.json under --out.")
    p.add_argument("--out", type=Path, help="where ep_result.json goes (needed unless --prepare)")
    p.add_argument("--config", default="k3")
    p.add_argument("--ep-degrees", type=_ints, default=None,
                   help="comma-separated; default: the visible GPU count (cuda) or 2 (cpu)")
    p.add_argument("--batches", type=_ints, default=[1, 8, 64], help="tokens per GPU (default 1,8,64)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=EP_ROUTINGS, default="router")
    p.add_argument("--no-ceiling", action="store_true", help="skip measuring each GPU's read ceiling")
    p.add_argument("--experts", choices=EXPERT_PATHS, default="torch",
                   help="routed experts: the torch reference path, or the moe_w13/moe_w2 cubins (cuda)")
    p.add_argument("--build-root", default=None, help="where the cubins are (--experts cubin, --prepare)")
    p.add_argument("--prepare", action="store_true",
                   help="build the expert cubins for these configurations under --build-root and exit "
                        "(a host with the DSL)")
    a = p.parse_args(argv)
    backend = "nccl" if a.device == "cuda" else "gloo"
    degrees = a.ep_degrees or ([torch.cuda.device_count()] if a.device == "cuda" else [2])
    try:
        configs = [GpuConfiguration(n, b) for n in degrees for b in a.batches]
        if a.prepare:
            if not a.build_root:
                raise EPStageError("--prepare needs --build-root (the folder to carry)")
            for row in prepare_cubins(a.config, configs, Path(a.build_root)):
                print(f"{row['kernel']} batch {row['shape']['batch']} experts {row['shape']['n_experts']}: {row['dir']}")
            return 0
        if a.out is None:
            raise EPStageError("--out is needed (the folder ep_result.json goes to)")
        if a.device == "cpu" and get_config(a.config).total_params() * 2 > (8 << 30):
            raise EPStageError(f"--config {a.config} needs a GPU per rank (over 8 GB of weights per rank)")
        results = run_gpu_configurations(a.config, configs, backend=backend, device=a.device, seed=a.seed,
                                         steps=a.steps, warmup=a.warmup, routing=a.routing,
                                         measure_ceiling=not a.no_ceiling and a.device == "cuda",
                                         experts=a.experts, build_root=a.build_root)
    except (EPStageError, ConfigError, ep.EPError) as e:
        print(f"ep_stage: {e}", file=sys.stderr)
        return 2
    env = {"device": a.device, "backend": backend, "torch": torch.__version__, "experts": a.experts,
           "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
           "multicast_off": dict(ep.MULTICAST_OFF)}
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "ep_result.json"
    path.write_text(json.dumps({"config": a.config, "environment": env, "gpu_configurations": results},
                               indent=1, default=_json_default) + "\n")
    for r in results:
        t = r["timing"]
        print(f"{r['configuration']['name']:>10}  {'PASS' if r['passed'] else 'FAIL'}  "
              f"e2e {t['end_to_end_us']:9.1f} us  comm {t['comm_share']:6.1%}  "
              f"rel_fro {float(r['numerics']['out']['rel_fro']):.3g}")
    print(f"wrote {path}")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    # through the imported module, so that what the ranks unpickle names validation.ep_stage,
    # not this __main__
    from validation import ep_stage

    sys.exit(ep_stage.main())
