"""Time every tunable setting of a kernel, for the tuner (`propose-optimization --proposer tuner`).

Two steps, on two hosts:

  prepare (a CPU host with nvidia-cutlass-dsl): build the settings to time and write the plan next
  to the builds. By default: every combination of the kernel's declared tunable choices on the few
  shapes of the tuner's first successive-halving round; `--all-shapes`: on every validation shape;
  `--request FILE`: the settings x shapes a later round asked for (the tuner writes that file when
  its measurements run out, so the search crosses hosts round by round):

      python scripts/tune_measure.py prepare --kernel gemv            # -> build/tune/gemv.plan.json

  measure (the GPU host: PYTHONPATH=., torch with CUDA, cuda-bindings; no DSL, no anthropic, no
  gitpython): find each planned build (verified against today's sources by kernels.build's
  find_artifact), launch it with kernels.launch on fresh random inputs, check its outputs are fully
  written and agree with the current defaults' outputs (and its sync counters are back to zero),
  time it as CUDA-graph replays with benchmarks.common.time_graph (the way a decode step runs, so
  the gaps between stream launches do not dilute the differences; inputs rotated past the L2;
  the settings of one shape timed interleaved over several rounds, so drift hits them alike;
  medians), and write one JSON:

      PYTHONPATH=. python scripts/tune_measure.py measure --plan build/tune/gemv.plan.json \\
          --out $OUT/tune_gemv.json

  Carry `build` to the GPU host (it holds the cubins and the plan). Then, back here:

      propose-optimization --kernel gemv --proposer tuner --measurements tune_gemv.json

  (repeat --measurements for every file measured so far when the tuner asked for another round).

The measurements record the command, GPU, driver, CUDA runtime and toolkit, torch, the commit, the
sha256 of the kernel's sources (the tuner refuses timings of other sources) and of every cubin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

PLAN_SCHEMA = "fasttrack.tune-plan/1"
MEASUREMENTS_SCHEMA = "fasttrack.tune-measurements/1"
MAX_ROTATION_COPIES = 64
ROTATION_BYTES_CAP = 16 << 30  # never allocate more than this for rotated input copies
AGREEMENT_RTOL = 2e-2  # outputs vs the defaults', relative to the defaults' largest magnitude
MIN_GRAPH_LAUNCHES = 20  # launches captured per graph (at least one per rotated input copy)


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def sources_sha256(root: Path, sources) -> dict[str, str]:
    return {s: hashlib.sha256((Path(root) / s).read_bytes()).hexdigest() for s in sources}


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# -- prepare (CPU host) -----------------------------------------------------------------------

def prepare(kernel: str, root: Path, plan_path: Path, *, request: Path | None, all_shapes: bool,
            eta: int, stage: str | None = None) -> dict:
    """Build the settings x shapes to measure: a tuner's request, every shape (`all_shapes`), or by
    default the tuner's first successive-halving round (every setting on its few screening shapes);
    with `stage`, the settings of that stage's own tunables only (the tuner's `--stage`)."""
    from agent.proposers.tuner import schedule, spread_pick, tunable_grid  # the tuner's own grid
    from kernels.build import BuildError, build_kernel  # compiles in child processes (the DSL lives there)
    from kernels.manifest import load_manifest

    spec = load_manifest().kernel(kernel)
    shapes = list(spec.shapes)
    try:
        configs = tunable_grid(spec, stage)
    except ValueError as e:
        raise SystemExit(f"tune_measure: {e}") from None
    if request is not None:
        req = json.loads(Path(request).read_text())
        if req.get("kernel") != kernel:
            raise SystemExit(f"tune_measure: the request is for kernel {req.get('kernel')!r}, not {kernel!r}")
        configs, shapes = req["configs"], req["shapes"]
    elif not all_shapes:
        shapes = spread_pick(shapes, schedule(len(configs), len(shapes), eta)[0])
    default = spec.tunable_defaults()
    if default not in configs:  # every round compares with the defaults on the same shapes
        configs = [default, *configs]
    entries = []
    for cfg in configs:
        print(f"building {kernel} {cfg} x {len(shapes)} shapes", file=sys.stderr)
        try:
            arts = build_kernel(kernel, shapes=shapes, tunables=cfg, root=root)
        except BuildError as e:
            entries += [{"tunables": cfg, "variant": sh, "error": f"BuildError: {e}"[:500]} for sh in shapes]
            continue
        entries += [{"tunables": a.tunables, "variant": a.shape, "cubin_sha256": a.cubin_sha256} for a in arts]
    plan = {"schema": PLAN_SCHEMA, "kernel": kernel, "commit": git_commit(_repo_root()),
            "sources_sha256": sources_sha256(_repo_root(), spec.sources),
            "default": default, "root": str(root), "entries": entries}
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_text(json.dumps(plan, indent=1))
    return plan


# -- measure (GPU host) -----------------------------------------------------------------------

def _make_inputs(params: list[dict], seed: int, shared: dict | None = None, host: dict | None = None,
                 device: str = "cuda"):
    """Fresh random buffers for one shape: {name: tensor or scalar}; outputs poisoned (NaN).
    `shared` ({(name, dtype, shape): tensor}) holds the random inputs of the shape's settings
    measured so far: the same seed draws the same values, so a setting reuses them rather than
    holding its own copy (a model's weights fit on the GPU once, not once per setting). `host`:
    the op's host-planned parameters (`OpBase.host_params`, e.g. a task table), filled in as
    given instead of random."""
    import torch

    shared = {} if shared is None else shared
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    values = {}
    for p in params:
        spec = p["spec"]
        name = p.get("name", f"arg{p['index']}")
        if spec["kind"] == "scalar":
            values[name] = spec["value"]
            continue
        dtype = getattr(torch, spec["dtype"])
        shape = tuple(spec["shape"])
        role, direction = p.get("role", "activation"), p.get("direction", "in")
        if host and name in host:
            t = torch.tensor(host[name], dtype=dtype).to(device)
            if tuple(t.shape) != shape:
                raise ValueError(f"host-planned {name} has shape {tuple(t.shape)}, the build's parameter {shape}")
        elif role in ("sync", "scratch"):
            t = torch.zeros(shape, dtype=dtype, device=device)  # counters start at zero
        elif direction != "in":
            t = torch.full(shape, float("nan"), dtype=dtype, device=device) if dtype.is_floating_point else \
                torch.full(shape, -1, dtype=dtype, device=device)
        elif (name, spec["dtype"], shape) in shared:
            t = shared[(name, spec["dtype"], shape)]
        else:
            t = _random(shape, dtype, role, g, device)
            shared[(name, spec["dtype"], shape)] = t
        values[name] = t
    return values


RANDOM_CHUNK = 1 << 28  # elements drawn at a time: a 40 GB bf16 weight never needs 80 GB of fp32 at once


def _random(shape: tuple, dtype, role: str, g, device: str):
    """A random input: floats N(0, 1), fan-in scaled for static weights; integers in 0..3."""
    import torch

    if not dtype.is_floating_point:
        return torch.randint(0, 4, shape, generator=g, device=device, dtype=dtype)
    scale = shape[-1] ** -0.5 if role == "static" and shape else 1.0
    t = torch.empty(shape, dtype=dtype, device=device)
    flat = t.view(-1)
    for i in range(0, flat.numel(), RANDOM_CHUNK):
        n = min(RANDOM_CHUNK, flat.numel() - i)
        flat[i:i + n] = (torch.randn(n, generator=g, device=device) * scale).to(dtype)
    return t


def _is_rotated(p: dict) -> bool:
    return p["spec"]["kind"] == "tensor" and p.get("direction", "in") == "in" and p.get("role") in ("static", "activation")


def _outputs(params, values) -> dict:
    """The op's outputs (not the kernel's own scratch and counters, whose shapes follow the tunables)."""
    return {p.get("name"): values[p.get("name")] for p in params
            if p["spec"]["kind"] == "tensor" and p.get("direction", "in") != "in"
            and p.get("role") not in ("scratch", "sync")}


def _sync_buffers(params, values) -> dict:
    return {p.get("name"): values[p.get("name")] for p in params
            if p["spec"]["kind"] == "tensor" and p.get("role") == "sync"}


def _compare(out: dict, ref: dict | None, sync: dict | None = None) -> str | None:
    """A reason the outputs are wrong (not fully written, far from the defaults', or a sync counter
    left non-zero, which would break the next launch, e.g. of a graph replay), else None."""
    import torch

    for name, t in (sync or {}).items():
        if bool((t != 0).any()):
            return f"sync buffer {name} left non-zero after a launch (the kernel must reset its counters)"
    for name, t in out.items():
        if t.dtype.is_floating_point and torch.isnan(t.float()).any():
            return f"output {name} not fully written (NaN poison left)"
        if ref is not None:
            r = ref[name].float()
            err = (t.float() - r).abs().max().item()
            scale = max(r.abs().max().item(), 1e-6)
            if not math.isfinite(err) or err > AGREEMENT_RTOL * scale:
                return f"output {name} differs from the defaults' by {err:.3g} (scale {scale:.3g})"
    return None


def time_interleaved(launchers: dict, *, rounds: int, timer) -> dict:
    """Samples (us per launch) per key of `launchers` ({key: (launch(i), launches per graph)}):
    `rounds` rounds, each timing every setting once with `timer(launch, launches=n)` (a
    benchmarks.common.Timing), the order rotated and reversed between rounds so that drift and
    position effects hit every setting alike. A setting whose timing raises gets the exception."""
    keys = list(launchers)
    samples: dict = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)] if keys else []
        if r % 2:
            order.reverse()
        for key in order:
            if isinstance(samples[key], Exception):
                continue
            launch, n = launchers[key]
            try:
                samples[key] += list(timer(launch, launches=n).samples_us)
            except Exception as ex:  # a failed capture or launch eliminates this setting, not the run
                samples[key] = ex
    return samples


def measure(plan: dict, *, replays: int, rounds: int, root: Path | None) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tune_measure measure: no CUDA device on this host")
    from benchmarks.common import Timing, gpu_environment, l2_bytes, rotation_count, time_graph
    from kernels.build import BuildError, find_artifact
    from kernels.launch import CubinKernel, LaunchError
    kernel = plan["kernel"]
    from kernels.manifest import load_manifest, resolve

    spec = load_manifest().kernel(kernel)
    build_root = Path(root or plan.get("root") or "build")
    default = plan["default"]
    by_shape: dict[str, list[dict]] = {}
    for e in plan["entries"]:
        by_shape.setdefault(json.dumps(e["variant"], sort_keys=True), []).append(e)
    results = []
    l2 = l2_bytes()

    def timer(launch, launches):
        return time_graph(launch, launches=launches, replays=replays)

    op_class = resolve(spec.op)  # the op class (its host plan imports without the DSL)

    def measure_shape(si: int, entries: list[dict]) -> list[dict]:
        """One shape's settings, timed interleaved. A function of its own so that nothing of
        the shape (its inputs: a model's weights) outlives it: the next shape allocates its own,
        and the GPU holds one shape's at a time."""
        entries.sort(key=lambda e: e["tunables"] != default)  # the defaults first: the others agree with them
        ref_out = None
        shared: dict = {}  # the shape's random inputs, one copy for all its settings
        rows, launchers, held = [], {}, []
        for e in entries:
            row = {"tunables": e["tunables"], "variant": e["variant"], "cubin_sha256": e.get("cubin_sha256"),
                   "error": e.get("error")}
            rows.append(row)
            if row["error"]:  # did not build: recorded, so the tuner eliminates it with the reason
                continue
            try:
                art = find_artifact(kernel, e["variant"], e["tunables"], root=build_root)
                row["cubin_sha256"] = art.cubin_sha256
                k = CubinKernel.from_dir(art.dir)
                k.load()  # before any graph capture
                # Same seed for every setting: the same inputs; its own outputs, scratch and counters.
                host = op_class(dict(e["variant"]), **dict(e["tunables"])).host_params()
                values = _make_inputs(k.params, seed=1000 + si, shared=shared, host=host)
                k(**values)
                torch.cuda.synchronize()
                out = _outputs(k.params, values)
                wrong = _compare(out, ref_out, _sync_buffers(k.params, values))
                if e["tunables"] == default and wrong is None:
                    ref_out = {n: t.clone() for n, t in out.items()}
                if wrong:
                    row["error"] = wrong
                    continue
                rotated = [p for p in k.params if _is_rotated(p)]
                bytes_in = sum(values[p["name"]].numel() * values[p["name"]].element_size() for p in rotated)
                budget = ROTATION_BYTES_CAP // max(1, len(entries))  # every setting of the shape is held at once
                copies = min(MAX_ROTATION_COPIES, rotation_count(bytes_in, l2), max(1, budget // max(1, bytes_in)))
                sets = [values] + [{**values, **{p["name"]: values[p["name"]].clone() for p in rotated}}
                                   for _ in range(copies - 1)]
                arg_lists = [k.bind(**s) for s in sets]
                held.append((k, sets, arg_lists))
                n = max(MIN_GRAPH_LAUNCHES, copies)
                launchers[len(rows) - 1] = ((lambda i, k=k, a=arg_lists: k(*a[i % len(a)])), n)
                row.update({"rotation_copies": copies, "timing": "cuda_graph", "launches_per_graph": n})
            except (BuildError, LaunchError) as ex:
                row["error"] = f"{type(ex).__name__}: {ex}"
            except torch.cuda.OutOfMemoryError as ex:
                row["error"] = f"out of memory: {ex}"
                torch.cuda.empty_cache()
        for i, samples in time_interleaved(launchers, rounds=rounds, timer=timer).items():
            if isinstance(samples, Exception):
                rows[i]["error"] = f"timing failed: {type(samples).__name__}: {samples}"[:500]
            else:
                rows[i].update(Timing(tuple(samples)).summary())
        return rows

    for si, (_, entries) in enumerate(sorted(by_shape.items())):
        rows = measure_shape(si, entries)
        torch.cuda.empty_cache()  # the shape's inputs went with measure_shape's frame
        for row in rows:
            results.append(row)
            print(f"{kernel} {row['variant']} {row['tunables']}: "
                  + (f"{row['median_us']:.2f} us" if row.get("median_us") else row["error"]), file=sys.stderr)
    # The commit the timed code is: the plan's when this tree's kernel sources are the plan's (a
    # GPU host's copy of the tree may carry a stale or no git history), else this tree's own.
    here = sources_sha256(_repo_root(), spec.sources)
    commit = plan.get("commit") if plan.get("sources_sha256") == here else git_commit(_repo_root())
    return {
        "schema": MEASUREMENTS_SCHEMA, "kernel": kernel,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "commit": commit, "plan_commit": plan.get("commit"),
        "sources_sha256": here,
        "plan_sources_sha256": plan.get("sources_sha256"),
        "environment": gpu_environment(), "timing": "cuda_graph", "replays": replays, "rounds": rounds,
        "default": default, "results": results,
    }


def format_table(doc: dict) -> str:
    lines = [f"{'variant':40s} {'tunables':45s} {'median us':>10s} {'vs default':>10s}"]
    base = {json.dumps(r["variant"], sort_keys=True): r.get("median_us") for r in doc["results"]
            if r["tunables"] == doc["default"]}
    for r in doc["results"]:
        b = base.get(json.dumps(r["variant"], sort_keys=True))
        med = r.get("median_us")
        rel = f"{med / b:10.3f}" if med and b else f"{'-':>10s}"
        med_text = f"{med:10.2f}" if med else f"{'ERROR':>10s}"
        lines.append(f"{json.dumps(r['variant'])[:40]:40s} {json.dumps(r['tunables'])[:45]:45s} "
                     f"{med_text} {rel}" + (f"  {r['error']}" if r.get("error") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build every tunable setting (CPU host with the DSL)")
    p.add_argument("--kernel", required=True)
    p.add_argument("--root", type=Path, default=Path("build"))
    p.add_argument("--plan", type=Path)
    p.add_argument("--request", type=Path, help="a tune_request_round*.json written by the tuner")
    p.add_argument("--all-shapes", action="store_true", help="every setting on every validation shape")
    p.add_argument("--eta", type=int, default=2, help="the tuner's eta (sets the screening shapes)")
    p.add_argument("--stage", help="only this stage's own tunables (a persistent kernel's; the tuner's --stage)")
    m = sub.add_parser("measure", help="time the prebuilt cubins (GPU host)")
    m.add_argument("--plan", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--root", type=Path, help="build root (default: the plan's)")
    m.add_argument("--replays", type=int, default=30, help="timed graph replays per setting and round")
    m.add_argument("--rounds", type=int, default=3, help="interleaved rounds over a shape's settings")
    args = ap.parse_args(argv)
    # The repository's own packages (kernels, benchmarks), whether or not PYTHONPATH names it.
    sys.path.insert(0, str(_repo_root()))
    if args.cmd == "prepare":
        suffix = f".{args.request.stem}" if args.request else ""
        plan_path = args.plan or args.root / "tune" / f"{args.kernel}{suffix}.plan.json"
        t0 = time.monotonic()
        plan = prepare(args.kernel, args.root, plan_path, request=args.request, all_shapes=args.all_shapes,
                       eta=args.eta, stage=args.stage)
        print(f"{len(plan['entries'])} builds in {time.monotonic() - t0:.0f} s; plan: {plan_path}")
        return 0
    try:
        plan = json.loads(args.plan.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"tune_measure: cannot read plan {args.plan}: {e}", file=sys.stderr)
        return 2
    if plan.get("schema") != PLAN_SCHEMA:
        print(f"tune_measure: {args.plan} is not a tune plan ({PLAN_SCHEMA})", file=sys.stderr)
        return 2
    doc = measure(plan, replays=args.replays, rounds=args.rounds, root=args.root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(format_table(doc))
    return 0 if any(r.get("median_us") for r in doc["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
