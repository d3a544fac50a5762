"""Run under compute-sanitizer on the GPU host: one staged-design cubin of the plan per argument
(index into the plan's cases), checked against the float64 oracle (one trial, run twice)."""
import json
import sys

from benchmarks.benchmark_gemv import GemvCase
from benchmarks.common import check_numerics
from kernels.launch import CubinKernel

plan = json.load(open(sys.argv[1]))
for i in map(int, sys.argv[2:]):
    c = plan["cases"][i]
    res = check_numerics(CubinKernel.from_dir(c["dir"]), GemvCase(c["shape"], c["tunables"]), trials=("normal",))
    print("case", i, c["shape"], {k: v for k, v in c["tunables"].items() if k.startswith("staged") or k == "pdl"},
          "passed" if res["passed"] else f"FAILED {res}", flush=True)
