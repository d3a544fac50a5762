"""What the GPU host does: it has no `nvidia-cutlass-dsl`, yet it imports every op module (to
plan a variant's tensors and launch) when it runs a proof or a validation. An op module that
touches the DSL at class-definition time (an annotation, a decorator) breaks every GPU run
after the build, so this is checked here, with the DSL made unimportable."""

from __future__ import annotations

import json
import subprocess
import sys

from kernels.manifest import REPO_ROOT

SCRIPT = r"""
import importlib, json, sys
sys.modules["cutlass"] = None  # `import cutlass` now raises ImportError, as on the GPU host
from kernels.manifest import load_manifest
out = {}
for name, spec in load_manifest().kernels.items():
    mod, _, cls = spec.op.partition(":")
    op_cls = getattr(importlib.import_module(mod), cls)
    extra = [{"pdl": 1}] if name == "gemv" else []
    n = 0
    for shape in spec.shapes:
        for tun in [{}] + extra:
            op = op_cls(dict(shape), **{**spec.tunable_defaults(), **tun})
            specs = {k: v.to_dict() for k, v in op.tensor_specs().items()}
            op.launch_config().to_dict()
            if name == "gemv" and op.wg:  # the warpgroup design reads x and w by TMA
                assert "tma" in specs["x"] and "tma" in specs["w"], specs
            n += 1
    out[name] = n
loaded = [m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == "cutlass"]
assert not loaded, loaded  # nothing of the DSL was loaded
print(json.dumps(out))
"""


def test_every_op_plans_its_variants_without_the_dsl():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts.get("gemv", 0) > 0 and len(counts) >= 5, counts
