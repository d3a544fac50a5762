"""GPU timing foundations: CUDA-event timing behind a GPU-side backlog, L2 rotation, measured
bandwidth ceilings and the facts of the host a figure was measured on.

Runs on the GPU host, which has torch (CUDA) and triton but no `nvidia-cutlass-dsl`: nothing here
imports the DSL, and torch/triton are imported inside the functions that need them, so the module
imports anywhere.

How a kernel is timed (`time_launches`):
  * every launch reads its own copy of the inputs (`rotation`), cycling through enough copies that
    the bytes between two reads of one copy exceed several times the L2 (60 MB on an H200), so a
    repeated run streams from DRAM as a real decode step does;
  * a warm-up first (module load, clocks, allocator), then a device-wide synchronize;
  * a `torch.cuda._sleep` kernel is queued ahead of the timed launches so that the host enqueues
    them all while the GPU is still busy: the events then time back-to-back kernels on the GPU,
    not the host's launch overhead (a starved stream times the enqueue gap);
  * one event before and after each launch, read after a device-wide synchronize; the statistic
    is the median, with the spread reported beside it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

L2_ROTATION_FACTOR = 4  # rotated bytes at least this many times the L2
DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200; used when the device does not report it


@dataclass(frozen=True)
class Timing:
    """Per-launch times of one measured case, in microseconds."""

    samples_us: tuple[float, ...]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    def quantile_us(self, q: float) -> float:
        s = sorted(self.samples_us)
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    def summary(self) -> dict:
        """median, p10, p90, min (us) and the sample count, for JSON."""
        return {
            "median_us": self.median_us,
            "p10_us": self.quantile_us(0.10),
            "p90_us": self.quantile_us(0.90),
            "min_us": min(self.samples_us),
            "n": len(self.samples_us),
        }


def rotation_count(bytes_per_launch: int, l2_bytes: int | None = None, *, factor: int = L2_ROTATION_FACTOR,
                   minimum: int = 2) -> int:
    """How many input copies to cycle through so that one pass over them exceeds `factor` x L2."""
    l2 = l2_bytes or DEFAULT_L2_BYTES
    need = -(-factor * l2 // max(1, bytes_per_launch))
    return max(minimum, need)


def l2_bytes() -> int:
    """The current device's L2 size in bytes (DEFAULT_L2_BYTES if torch does not report it)."""
    import torch

    return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
               or DEFAULT_L2_BYTES)


def _sleep_cycles_per_us() -> float:
    import torch

    # torch.cuda._sleep spins for a number of clock cycles; ~2 GHz on an H200 under load.
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    mhz = getattr(props, "clock_rate", 0) / 1000 if getattr(props, "clock_rate", 0) else 1980.0
    return mhz


def time_launches(launch: Callable[[int], None], *, reps: int = 200, warmup: int = 20,
                  enqueue_us_hint: float = 50.0) -> Timing:
    """Time `launch(i)` (i = 0, 1, ... picks the rotated input copy) with CUDA events.

    Promises: `warmup` untimed launches and a device-wide synchronize first; then a GPU backlog
    long enough for the host to enqueue all `reps` launches before the GPU reaches them, one event
    pair per launch on the current stream, and a device-wide synchronize before reading. Returns
    per-launch GPU times (us). `launch` must enqueue its work on torch's current stream only.
    """
    import torch

    for i in range(warmup):
        launch(i)
    torch.cuda.synchronize()

    # Measure the host's enqueue cost once to size the backlog (x2 margin, at least 2 ms).
    t0 = time.perf_counter()
    for i in range(4):
        launch(warmup + i)
    torch.cuda.synchronize()
    per = max(enqueue_us_hint, (time.perf_counter() - t0) / 4 * 1e6)
    backlog_us = max(2000.0, 2.0 * per * reps)

    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda._sleep(int(backlog_us * _sleep_cycles_per_us()))
    events[0].record()
    for i in range(reps):
        launch(i)
        events[i + 1].record()
    torch.cuda.synchronize()
    samples = tuple(events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(reps))
    return Timing(samples)


def time_graph(launch: Callable[[int], None], *, launches: int = 20, replays: int = 30,
               warmup: int = 3) -> Timing:
    """Time `launch(i)` under CUDA-graph replay, the way a decode step runs in a serving stack
    (one graph per step): `launches` calls (i = 0 .. launches-1, each on its rotated input copy)
    are captured into one graph; after `warmup` replays, each of `replays` replays is timed with
    an event pair and contributes one sample, its time divided by `launches` (us per launch).

    Promises: the launches are warmed up (module loads, allocator) before capture; every replay
    is bracketed by events on the current stream and read after a device-wide synchronize.
    """
    import torch

    for i in range(launches):
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(launches):
            launch(i)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    events[0].record()
    for r in range(replays):
        graph.replay()
        events[r + 1].record()
    torch.cuda.synchronize()
    samples = tuple(events[r].elapsed_time(events[r + 1]) * 1e3 / launches for r in range(replays))
    del graph
    return Timing(samples)


def launch_floor() -> dict:
    """The smallest per-launch time of this stack: a one-element fill, back to back, timed both
    ways (stream events behind a backlog, and graph replay). Every kernel's time includes it."""
    import torch

    t = torch.empty(1, device="cuda")

    def launch(_i):
        t.fill_(1.0)

    return {"stream_us": time_launches(launch, reps=200).median_us,
            "graph_us": time_graph(launch, launches=50, replays=20).median_us}


# -- ceilings ---------------------------------------------------------------------------------


def read_bandwidth(nbytes: int = 8 << 30, *, reps: int = 30, warmup: int = 5) -> dict:
    """Read-only streaming ceiling: TB/s of a kernel that reads `nbytes` once and writes almost
    nothing, on a buffer far past the L2. Two readers are measured and the faster one is the
    ceiling, so that a weak reader cannot flatter the kernels judged against it: a Triton kernel
    (16-byte register loads, an int32 sum per program) and a cp.async.bulk reader (32 KiB chunks
    into shared memory, 4 in flight per SM), the path the TMA-fed kernels stream through. A reader
    that cannot run here is recorded with its error and left out. The buffer is 8 GiB: a launch's
    ramp and tail then cost under 0.2% (2 GiB read 1% slower, benchmarks/read_ceiling.py)."""
    import torch
    import triton

    from benchmarks.read_kernel import bulk_reader, read_sum_kernel

    n = nbytes // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    block, iters = 8192, 4
    grid = (triton.cdiv(n, block * iters),)
    partial = torch.empty(grid[0], dtype=torch.int32, device="cuda")

    readers = {"triton read-sum (int32)": lambda _i: read_sum_kernel[grid](src, partial, n, BLOCK=block,
                                                                            ITERS=iters, num_warps=8)}
    results = {}
    try:
        readers["cp.async.bulk (32 KiB x 4)"] = bulk_reader(src, chunk=32 << 10, stages=4)
    except Exception as e:  # no cupy or NVRTC on this host: the other reader sets the ceiling
        results["cp.async.bulk (32 KiB x 4)"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for name, launch in readers.items():
        t = time_launches(launch, reps=reps, warmup=warmup)
        results[name] = {**t.summary(), "tbps": n * 4 / t.median_us / 1e6}
    best = max((k for k in results if "tbps" in results[k]), key=lambda k: results[k]["tbps"])
    del src, partial, readers
    return {"bytes": n * 4, "tbps": results[best]["tbps"], "kernel": best, "readers": results}


def copy_bandwidth(nbytes: int = 1 << 30, *, reps: int = 30, warmup: int = 5) -> dict:
    """Device-to-device copy ceiling: TB/s counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)

    def launch(_i):
        dst.copy_(src)

    t = time_launches(launch, reps=reps, warmup=warmup)
    out = {"bytes": 2 * nbytes, **t.summary(), "tbps": 2 * nbytes / t.median_us / 1e6, "kernel": "torch copy_"}
    del src, dst
    return out


# -- cases: inputs, numerics, timing against torch -----------------------------------------

# Relative Frobenius error floors (validation/tolerances.toml's rel_fro_floor) and the allowed
# ratio to the bf16 torch path's own error against the same float64 oracle.
REL_FRO_FLOOR = {"bfloat16": 2.0**-9, "float32": 2.0**-16}
MAX_ERROR_RATIO = 2.0


def draw(shape, dtype, kind: str = "normal", scale: float = 1.0):
    """Fresh random CUDA tensor: `normal` (randn) or `uniform` in [-1, 1), times `scale`; never zeros."""
    import torch

    if kind == "normal":
        t = torch.randn(shape, dtype=torch.float32, device="cuda")
    elif kind == "uniform":
        t = torch.rand(shape, dtype=torch.float32, device="cuda") * 2 - 1
    else:
        raise ValueError(f"unknown input distribution {kind!r}")
    return (t * scale).to(dtype)


def errors(out, oracle) -> dict:
    """max |out - oracle| and ||out - oracle|| / ||oracle|| (Frobenius), computed in float64."""
    import torch

    o = oracle.double()
    d = out.double() - o
    ref = torch.linalg.vector_norm(o).item()
    return {"max_abs": d.abs().max().item(),
            "rel_fro": torch.linalg.vector_norm(d).item() / ref if ref else float("inf")}


def _bits(t):
    import torch

    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


class BenchCase:
    """One op at one shape: how its parameters are drawn, what the oracle and the torch path
    compute, how many bytes a launch must move. Subclasses live in benchmarks/benchmark_<op>.py.

    `specs` maps parameter name -> (shape, torch dtype) in launch order; the output is `y`.
    """

    kernel = ""
    out_dtype = "bfloat16"

    def __init__(self, shape: dict):
        self.shape = dict(shape)
        self.specs: dict = {}
        self.static_bytes = 0  # weights read per launch
        self.act_bytes = 0  # activations read + outputs written per launch

    def inputs(self, kind: str = "normal") -> dict:  # every parameter but y
        raise NotImplementedError

    def oracle(self, t: dict):
        raise NotImplementedError

    def torch_path(self, t: dict):
        """The yardstick: what a bf16 serving stack computes for the same inputs."""
        raise NotImplementedError

    def torch_launch(self):
        """(make_out, launch(t, out)) that runs the torch baseline for timing."""
        raise NotImplementedError

    def new_output(self, fill: float | None = None):
        import torch

        shape, dtype = self.specs["y"]
        if fill is None:
            return torch.empty(shape, dtype=dtype, device="cuda")
        return torch.full(shape, fill, dtype=dtype, device="cuda")


def check_numerics(launch, case: BenchCase, trials=("normal", "uniform")) -> dict:
    """Run `launch(**inputs, y=out)` on fresh inputs per trial with `out` poisoned (NaN) and check:
    every element written and finite, relative Frobenius error against the float64 oracle at most
    max(MAX_ERROR_RATIO x the torch path's, REL_FRO_FLOOR), and a second run on the same inputs
    bitwise identical. Returns the per-trial figures and `passed`."""
    import torch

    res = {"trials": [], "passed": True}
    for kind in trials:
        t = case.inputs(kind)
        y = case.new_output(float("nan"))
        launch(**t, y=y)
        torch.cuda.synchronize()
        unwritten = int((~torch.isfinite(y)).sum().item())
        oracle = case.oracle(t)
        mine = errors(y, oracle)
        yard = errors(case.torch_path(t), oracle)
        limit = max(MAX_ERROR_RATIO * yard["rel_fro"], REL_FRO_FLOOR[case.out_dtype])
        y2 = case.new_output(float("nan"))
        launch(**t, y=y2)
        torch.cuda.synchronize()
        deterministic = bool(torch.equal(_bits(y), _bits(y2)))
        ok = unwritten == 0 and mine["rel_fro"] <= limit and deterministic
        res["trials"].append({"inputs": kind, "unwritten": unwritten, "kernel": mine, "torch_path": yard,
                              "rel_fro_limit": limit, "deterministic": deterministic, "passed": ok})
        res["passed"] &= ok
    return res


def time_against_torch(launch, case: BenchCase, *, reps: int = 100, rounds: int = 2,
                       with_torch: bool = True) -> dict:
    """Median per-launch times of `launch(**inputs, y=out)` and of the torch baseline, each launch
    on its own rotated copy of every input (copies totalling >= 4x L2), in `rounds` interleaved
    rounds (kernel, torch, kernel, torch ...), measured two ways: `graph` (CUDA-graph replay, the
    serving condition) and `stream` (per-launch events behind a GPU backlog). Returns bytes per
    launch and, per way, the kernel's and torch's summaries."""
    import torch

    per_launch = case.static_bytes + case.act_bytes
    copies = rotation_count(per_launch, l2_bytes())
    sets = [case.inputs("normal") for _ in range(copies)]
    outs = [case.new_output() for _ in range(copies)]
    make_out, t_launch = case.torch_launch()
    t_outs = [make_out() for _ in range(copies)]

    def mine(i):
        launch(**sets[i % copies], y=outs[i % copies])

    def theirs(i):
        t_launch(sets[i % copies], t_outs[i % copies])

    launches = max(copies, 20)
    ours = {"graph": [], "stream": []}
    base = {"graph": [], "stream": []}
    for _ in range(rounds):
        ours["graph"] += time_graph(mine, launches=launches).samples_us
        if with_torch:
            base["graph"] += time_graph(theirs, launches=launches).samples_us
        ours["stream"] += time_launches(mine, reps=reps).samples_us
        if with_torch:
            base["stream"] += time_launches(theirs, reps=reps).samples_us
    out = {"copies": copies, "bytes": per_launch}
    for way in ("graph", "stream"):
        out[way] = {"kernel": Timing(tuple(ours[way])).summary()}
        if with_torch:
            out[way]["torch"] = Timing(tuple(base[way])).summary()
    del sets, outs, t_outs
    torch.cuda.synchronize()
    return out


# -- host facts ---------------------------------------------------------------------------------


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _nvcc_version() -> str | None:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [l for l in out.stdout.splitlines() if "release" in l]
    return lines[0].strip() if lines else None


def gpu_environment() -> dict:
    """Facts of the GPU host a figure was measured on: GPU name, SM count, L2, driver, CUDA
    runtime (torch's build) and toolkit (nvcc), torch, Python, a hash of the host name."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "gpu_count": torch.cuda.device_count(),
        "sm_count": props.multi_processor_count,
        "l2_bytes": l2_bytes(),
        "memory_bytes": props.total_memory,
        "driver": _nvidia_smi("driver_version"),
        "clocks_sm_max_mhz": _nvidia_smi("clocks.max.sm"),
        "cuda_runtime": torch.version.cuda,
        "cuda_toolkit": _nvcc_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hostname_hash": hashlib.sha256(platform.node().encode()).hexdigest()[:16],
        "pid": os.getpid(),
    }


def fraction(value: float, ceiling: float) -> float | None:
    return value / ceiling if ceiling else None


def as_dict(obj) -> dict:
    return asdict(obj)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table: `columns` are (key, header, format spec) ('' for str())."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None else (format(v, fmt) if fmt else str(v)))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) for i in range(len(columns))) for c in cells)
