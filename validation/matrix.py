"""The run matrix's GPU configurations, placed on GPU hosts: one task per configuration.

A `MatrixEntry` is one point (model preset, `GpuConfiguration`, seed, steps); `run_entry` runs it
on the GPUs this process sees (validation/ep_stage.py: N ranks, NCCL on GPUs, gloo on a CPU) and
returns its result, an entry of a bundle's `gpu_configurations`. Two executors run a list:

  LocalExecutor  one entry after another on this host;
  RayExecutor    one Ray task per entry with its N GPUs reserved (`num_gpus=N`): Ray places it on
                 a host with N free GPUs and sets CUDA_VISIBLE_DEVICES to them, so the entry's
                 ranks see exactly its GPUs and entries share a host only on disjoint GPUs.
                 An entry wider than every host is refused before anything is submitted (Ray
                 would queue it forever).

ray is an optional extra (`pip install -e '.[ray]'`), imported only by RayExecutor. Results come
back in the entries' order whatever order the tasks finish in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from validation.ep_stage import GpuConfiguration, run_gpu_configurations


class MatrixError(RuntimeError):
    """A matrix that cannot be placed (no Ray, no host wide enough): one clear message."""


@dataclass(frozen=True)
class MatrixEntry:
    preset: str
    gpu: GpuConfiguration
    seed: int = 0
    steps: int = 10
    warmup: int = 2
    routing: str = "router"
    device: str = "cuda"  # "cpu": gloo ranks on the host's cores (tests, hosts without GPUs)

    @property
    def name(self) -> str:
        return f"{self.preset}/{self.gpu.name}/s{self.seed}"


def run_entry(entry: MatrixEntry) -> dict:
    """One configuration on the GPUs visible here (module docstring)."""
    backend = "nccl" if entry.device == "cuda" else "gloo"
    (res,) = run_gpu_configurations(entry.preset, [entry.gpu], backend=backend, device=entry.device,
                                    seed=entry.seed, steps=entry.steps, warmup=entry.warmup,
                                    routing=entry.routing, measure_ceiling=entry.device == "cuda")
    return {**res, "entry": entry.name}


def placement_probe(entry: MatrixEntry) -> dict:
    """Where an entry landed, without running it: the GPU ids Ray gave it and what its ranks see."""
    import ray

    return {"entry": entry.name, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "node": ray.get_runtime_context().get_node_id()}


@dataclass
class LocalExecutor:
    runner: Callable[[MatrixEntry], dict] = run_entry

    def run(self, entries: list[MatrixEntry]) -> list[dict]:
        return [self.runner(e) for e in entries]


@dataclass
class RayExecutor:
    """`address`: a running cluster ("auto", "ray://host:10001"); None: the cluster this process
    is connected to, or a local one started here. `init` is passed to ray.init."""

    address: str | None = None
    runner: Callable[[MatrixEntry], dict] = run_entry
    init: dict = field(default_factory=dict)

    def _connect(self):
        try:
            import ray
        except ImportError:
            raise MatrixError("the Ray executor needs ray: pip install -e '.[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=self.address, **self.init)
        return ray

    def run(self, entries: list[MatrixEntry]) -> list[dict]:
        ray = self._connect()
        widest = max((int(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
        too_wide = [e.name for e in entries if e.gpu.ep_degree > widest]
        if too_wide:
            raise MatrixError(f"no host has enough GPUs for {', '.join(too_wide)} (widest host: {widest} GPUs)")
        task = ray.remote(self.runner)
        refs = [task.options(num_gpus=e.gpu.ep_degree, name=e.name).remote(e) for e in entries]
        return ray.get(refs)
