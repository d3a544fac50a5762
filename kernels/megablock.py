"""The LatentMoE block as one launch of the prebuilt megakernel (kernels/ops/megakernel.py).

GPU host only and DSL-free, like kernels/block.py: the cubin is found with
`kernels.build.find_artifact` (verified against today's sources) or read from a build folder,
and launched cooperatively through `kernels.launch.CubinKernel`. The task table is made on the
host from the variant the metadata records (`MegakernelOp(variant, **tunables).table`, the
graph's `task_table`), checked against the table parameter's recorded shape, and uploaded once.
The counters (every sync-role parameter) are zeroed once; every launch leaves them zero (the
kernel's last worker resets them). Scratch and intermediate buffers are allocated once per object, from the
parameter specs in the metadata.
"""

from __future__ import annotations

from pathlib import Path

from kernels.build import DEFAULT_ROOT, find_artifact
from kernels.config import ModelConfig

KERNEL = "megakernel"
WEIGHTS = ("gamma_pre", "w_gate", "bias", "w_down", "w_shared_gate_up", "w13", "w2", "gamma_latent", "w_up",
           "w_shared_down")


class MegaBlockError(ValueError):
    """A build whose metadata does not describe the megakernel this module launches."""


def megakernel_shape(cfg: ModelConfig, batch: int) -> dict:
    """The manifest shape of the megakernel at `batch` for the widths of `cfg`."""
    return {"batch": batch, "hidden": cfg.hidden, "latent": cfg.latent, "n_experts": cfg.n_experts,
            "top_k": cfg.top_k, "expert_inter": cfg.expert_inter, "shared_inter": cfg.shared_inter}


def host_table(meta: dict):
    """The task table (nested lists, int32 values) of the variant `meta` records, checked
    against the shape its `tasks` parameter was built with."""
    from kernels.ops.megakernel import MegakernelOp

    op = MegakernelOp(dict(meta["variant"]), **dict(meta.get("tunables", {})))
    spec = next((p["spec"] for p in meta["params"] if p.get("name") == "tasks"), None)
    want = [len(op.table), len(op.table[0]), len(op.table[0][0])]
    if spec is None or list(spec["shape"]) != want:
        raise MegaBlockError(f"{KERNEL}: the build's tasks parameter is {spec and spec['shape']}, the host's "
                             f"table {want}: not the variant this host plans")
    return op.table


def allocate_buffers(meta: dict, device, table=None) -> dict:
    """Every parameter buffer of the build `meta` but the weights, x and out, zeroed on
    `device`, with the task table filled in: `table` (a plan's, made by the tree that built the
    cubin), else `host_table`."""
    import torch

    bufs = {}
    for p in meta["params"]:
        name, spec = p["name"], p["spec"]
        if name not in WEIGHTS and name not in ("x", "out"):
            bufs[name] = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
    want = host_table(meta) if table is None else table
    t = torch.tensor(want, dtype=torch.int32)
    if list(t.shape) != list(bufs["tasks"].shape):
        raise MegaBlockError(f"{KERNEL}: a task table of shape {list(t.shape)} for a tasks parameter of "
                             f"{list(bufs['tasks'].shape)}")
    bufs["tasks"].copy_(t)
    return bufs


def launch_args(weights, x, out, bufs: dict) -> dict:
    """The launch's arguments by parameter name: the block's weights (kernels.reference
    BlockWeights fields), x, out and the buffers of `allocate_buffers`."""
    return {"x": x, "out": out, **{n: getattr(weights, n) for n in WEIGHTS}, **bufs}


class MegaBlock:
    """One batch size of the block as the megakernel: its cubin, weights, table and buffers;
    `launch(x, out)` enqueues one decode step. `table`: the task table to upload (a validation
    plan's, planned by the revision that built `build_dir`), else this host's plan of it."""

    def __init__(self, cfg: ModelConfig, batch: int, weights, *, root: Path = DEFAULT_ROOT,
                 build_dir: Path | None = None, tunables: dict | None = None, table=None):
        from kernels.launch import CubinKernel

        if build_dir is None:
            build_dir = find_artifact(KERNEL, megakernel_shape(cfg, batch), tunables, root=root).dir
        self.k = CubinKernel.from_dir(build_dir)
        if self.k.meta.get("kernel") != KERNEL or int(self.k.meta["variant"]["batch"]) != batch:
            raise MegaBlockError(f"{build_dir}: not the {KERNEL} at batch {batch}")
        self.cfg, self.batch, self.w = cfg, batch, weights
        self.buf = allocate_buffers(self.k.meta, weights.w_gate.device, table)
        self.k.load()  # before any graph capture

    def launch(self, x, out) -> None:
        """Enqueue out = block(x) on torch's current stream (one cooperative launch)."""
        self.k(**launch_args(self.w, x, out, self.buf))

    def intermediates(self) -> dict:
        """The stage outputs of the last launch (h, logits, the routing, z, a_shared, act, o, c,
        n), for per-stage numerics against the chain's ops."""
        sync = self._sync_names()
        return {k: v for k, v in self.buf.items() if k not in ("tasks", "stamps") and k not in sync}

    def stage_weight_bytes(self) -> dict[str, int]:
        """The weight bytes each stage streamed in the last launch (kernels/ops/megakernel.py
        `stage_weight_bytes`, at that launch's n_groups and this build's tunables and workers)."""
        from kernels.ops.megakernel import stage_weight_bytes

        workers = int(self.buf["tasks"].shape[0])
        return stage_weight_bytes(self.cfg, self.batch, int(self.buf["n_groups"].reshape(-1)[0].item()),
                                  self.k.meta.get("tunables") or {}, workers)

    def stamps(self):
        """The in-kernel timeline of the last launch (int64 [workers][stages][2], ns), or None
        for a build without a `stamps` parameter."""
        return self.buf.get("stamps")

    def counters_clean(self) -> bool:
        """Whether every counter is back at zero (after a synchronize): the launch's own
        bookkeeping, checked by stress runs."""
        return not any(bool(self.buf[n].any()) for n in self._sync_names())

    def _sync_names(self) -> list[str]:
        """The build's sync-role parameters (its counters), as its metadata declares them."""
        return [p["name"] for p in self.k.meta["params"] if p.get("role") == "sync"]
