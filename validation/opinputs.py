"""Inputs for every reference op, per case, and the flattening of its outputs into named tensors.

`OP_DEFS[name]` says, for an op of `kernels.reference.REFERENCE_OPS`: how to build its keyword
arguments for a `Case` on a model config (weights fan-in scaled, activations from the case's value
distribution, expert ids from its routing pattern), which arguments carry the token axis (so that
a reshuffle permutes them together), and whether the routing axis applies.

The candidate is called exactly like the reference, without `compute_dtype`; the bf16 reference
is the reference with float32 compute, the oracle the reference with float64 compute.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable

import torch

from kernels import reference as R
from kernels.config import ModelConfig

from .numerics import Case, fill_distribution, routing_ids

BF16 = torch.bfloat16


def case_generator(case: Case, name: str, device) -> torch.Generator:
    """A generator seeded from (case, tensor name): inputs never depend on the order they are made."""
    key = f"{case.case_id}:{name}".encode()
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
    return g


def _weight(case, name, shape, fan_in, device):
    g = case_generator(case, name, device)
    return (torch.randn(shape, generator=g, device=device) * fan_in ** -0.5).to(BF16)


def _gamma(case, name, n, device):
    g = case_generator(case, name, device)
    return (1.0 + 0.05 * torch.randn(n, generator=g, device=device)).to(BF16)


def _act(case, name, shape, device, dtype=BF16):
    return fill_distribution(shape, case.distribution, case_generator(case, name, device), device, dtype)


def _ids(case, cfg, device):
    # drawn on the CPU (randperm takes a generator of its own device), then moved
    return routing_ids(case.batch, cfg.n_experts, cfg.top_k, case.routing or "uniform",
                       case_generator(case, "ids", "cpu"), device)


def _combine_weights(case, shape, device):
    g = case_generator(case, "weights", device)
    w = torch.rand(shape, generator=g, device=device) + 0.05
    return w / w.sum(dim=-1, keepdim=True)


def _router_bias(case, cfg, device):
    """Routing patterns for the router itself, through its selection-only bias."""
    g = case_generator(case, "bias", device)
    b = 0.02 * torch.randn(cfg.n_experts, generator=g, device=device)
    if case.distribution == "ties":
        b = torch.zeros_like(b)  # tied logits stay tied scores
    if case.routing == "hot":
        b[: max(1, cfg.top_k // 2)] += 1.0
    elif case.routing == "same":
        b[: cfg.top_k] += 10.0
    return b


def _cfg(case: Case, base: ModelConfig) -> ModelConfig:
    """The model config of a case: the base preset, with any width the problem overrides."""
    over = {k: v for k, v in case.problem.items() if k in {f.name for f in fields(ModelConfig)}}
    if not over:
        return base
    d = base.to_dict()
    d.update(over)
    d["name"] = base.name + "*"
    return ModelConfig(**d)


@dataclass(frozen=True)
class OpDef:
    name: str
    build: Callable[[Case, ModelConfig, Any], dict]
    token_args: tuple[str, ...]  # arguments whose dim 0 is the token (batch) axis
    moe: bool = False  # the routing axis applies
    boundary: tuple[dict, ...] = ()  # extra problems at the edges (config overrides / n,k)

    @property
    def reference(self):
        return R.REFERENCE_OPS[self.name]


def _width(case, cfg):
    """Row width of the row-wise ops (rmsnorm, residual): the problem's `width`, else hidden."""
    return int(case.problem.get("width", cfg.hidden))


def _linear_build(case, cfg, dev):
    n = case.problem.get("n", cfg.latent)
    k = case.problem.get("k", cfg.hidden)
    out = case.problem.get("out_dtype", "bfloat16")
    return {"x": _act(case, "x", (case.batch, k), dev), "w": _weight(case, "w", (n, k), k, dev),
            "out_dtype": getattr(torch, out)}


def _expert_ffn_build(case, cfg, dev):
    L, I = cfg.latent, cfg.expert_inter
    return {"z": _act(case, "z", (case.batch, L), dev),
            "w13": _weight(case, "w13", (2 * I, L), L, dev),
            "w2": _weight(case, "w2", (L, I), I, dev),
            "gate_limit": cfg.situ_gate_limit, "up_limit": cfg.situ_up_limit}


def _experts_build(case, cfg, dev, with_weights):
    L, I, E = cfg.latent, cfg.expert_inter, cfg.n_experts
    d = {"z": _act(case, "z", (case.batch, L), dev), "ids": _ids(case, cfg, dev)}
    if with_weights:
        d["weights"] = _combine_weights(case, (case.batch, cfg.top_k), dev)
    d["w13"] = _weight(case, "w13", (E, 2 * I, L), L, dev)
    d["w2"] = _weight(case, "w2", (E, L, I), I, dev)
    d.update(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    return d


def _moe_block_build(case, cfg, dev):
    w = R.make_weights(cfg, device=dev, seed=case.seed)
    return {"x": _act(case, "x", (case.batch, cfg.hidden), dev), "w": w, "cfg": cfg,
            "ids": _ids(case, cfg, dev)}


_SMALL = {"hidden": 24, "latent": 8, "n_experts": 4, "top_k": 2, "expert_inter": 8, "shared_inter": 8}

OP_DEFS: dict[str, OpDef] = {
    "rmsnorm": OpDef("rmsnorm", lambda c, cfg, d: {
        "x": _act(c, "x", (c.batch, _width(c, cfg)), d), "gamma": _gamma(c, "gamma", _width(c, cfg), d),
        "eps": cfg.eps}, ("x",), boundary=({"width": 8}, {"width": 8200})),
    "linear": OpDef("linear", _linear_build, ("x",), boundary=(
        {"n": 8, "k": 8}, {"n": 24, "k": 72}, {"n": 40, "k": 64, "out_dtype": "float32"})),
    "latent_down": OpDef("latent_down", _linear_build, ("x",), boundary=({"n": 8, "k": 8},)),
    "router": OpDef("router", lambda c, cfg, d: {
        "h": _act(c, "h", (c.batch, cfg.hidden), d),
        "w_gate": _weight(c, "w_gate", (cfg.n_experts, cfg.hidden), cfg.hidden, d),
        "bias": _router_bias(c, cfg, d), "top_k": cfg.top_k, "scale": cfg.routed_scale},
        ("h",), moe=True, boundary=({"n_experts": 8, "top_k": 8},)),
    "route_logits": OpDef("route_logits", lambda c, cfg, d: {
        "logits": _act(c, "logits", (c.batch, cfg.n_experts), d, torch.float32),
        "bias": _router_bias(c, cfg, d), "top_k": cfg.top_k, "scale": cfg.routed_scale},
        ("logits",), moe=True, boundary=({"n_experts": 8, "top_k": 8},)),
    "expert_ffn": OpDef("expert_ffn", _expert_ffn_build, ("z",), boundary=(_SMALL,)),
    "expert_outputs": OpDef("expert_outputs", lambda c, cfg, d: _experts_build(c, cfg, d, False),
                            ("z", "ids"), moe=True, boundary=(_SMALL,)),
    "combine": OpDef("combine", lambda c, cfg, d: {
        "o": _act(c, "o", (c.batch, cfg.top_k, cfg.latent), d, torch.float32),
        "weights": _combine_weights(c, (c.batch, cfg.top_k), d), "out_dtype": BF16},
        ("o", "weights"), boundary=(_SMALL,)),
    "routed_experts": OpDef("routed_experts", lambda c, cfg, d: _experts_build(c, cfg, d, True),
                            ("z", "ids", "weights"), moe=True, boundary=(_SMALL,)),
    "latent_norm_up": OpDef("latent_norm_up", lambda c, cfg, d: {
        "c": _act(c, "c", (c.batch, cfg.latent), d), "gamma_latent": _gamma(c, "gl", cfg.latent, d),
        "w_up": _weight(c, "w_up", (cfg.hidden, cfg.latent), cfg.latent, d), "eps": cfg.eps},
        ("c",), boundary=(_SMALL,)),
    "shared_expert": OpDef("shared_expert", lambda c, cfg, d: {
        "h": _act(c, "h", (c.batch, cfg.hidden), d),
        "w_gate_up": _weight(c, "wgu", (2 * cfg.shared_inter, cfg.hidden), cfg.hidden, d),
        "w_down": _weight(c, "wd", (cfg.hidden, cfg.shared_inter), cfg.shared_inter, d),
        "gate_limit": cfg.situ_gate_limit, "up_limit": cfg.situ_up_limit}, ("h",), boundary=(_SMALL,)),
    "gated_situ": OpDef("gated_situ", lambda c, cfg, d: {
        "gu": _act(c, "gu", (c.batch, 2 * int(c.problem.get("width", cfg.shared_inter))), d, torch.float32),
        "gate_limit": cfg.situ_gate_limit, "up_limit": cfg.situ_up_limit}, ("gu",), boundary=({"width": 8},)),
    "residual": OpDef("residual", lambda c, cfg, d: {
        "x": _act(c, "x", (c.batch, _width(c, cfg)), d), "r": _act(c, "r", (c.batch, _width(c, cfg)), d),
        "shared": _act(c, "shared", (c.batch, _width(c, cfg)), d)}, ("x", "r", "shared"),
        boundary=({"width": 8},)),
    "moe_block": OpDef("moe_block", _moe_block_build, ("x", "ids"), moe=True, boundary=(_SMALL,)),
}


def op_def(name: str) -> OpDef:
    """The OpDef of reference op `name`; KeyError names the known ops."""
    try:
        return OP_DEFS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; ops: {', '.join(sorted(OP_DEFS))}") from None


def build_inputs(op: OpDef, case: Case, base_cfg: ModelConfig, device) -> dict:
    """Fresh keyword arguments for the reference op `op` on `case` (same case -> same values)."""
    return op.build(case, _cfg(case, base_cfg), torch.device(device))


def flatten_outputs(result) -> dict[str, torch.Tensor]:
    """An op's return value as named tensors: a tensor -> {"out"}; a dataclass -> its tensor fields."""
    if isinstance(result, torch.Tensor):
        return {"out": result}
    if is_dataclass(result):
        return {f.name: getattr(result, f.name) for f in fields(result)
                if isinstance(getattr(result, f.name), torch.Tensor)}
    if isinstance(result, dict):
        return {k: v for k, v in result.items() if isinstance(v, torch.Tensor)}
    if isinstance(result, (tuple, list)):
        return {f"out{i}": v for i, v in enumerate(result) if isinstance(v, torch.Tensor)}
    raise TypeError(f"the candidate returned {type(result).__name__}, not tensors")


def map_tensors(obj, fn):
    """Apply `fn` to every tensor inside obj (dicts, lists, tuples, dataclasses); others unchanged."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if is_dataclass(obj) and not isinstance(obj, type) and any(
            isinstance(getattr(obj, f.name), torch.Tensor) for f in fields(obj)):
        return type(obj)(**{f.name: map_tensors(getattr(obj, f.name), fn) for f in fields(obj)})
    return obj


def iter_tensors(obj, prefix=""):
    """(path, tensor) for every tensor inside obj."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "tensor", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}[{i}]")
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from iter_tensors(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
