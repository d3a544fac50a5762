"""Model configurations for the Kimi-K3-style LatentMoE decode block.

`k3` carries the real widths (see ARCHITECTURE.md); `mini` and `tiny` keep the structure
(latent projection, sigmoid router with selection-only bias, top-k, gated SiTU experts,
shared expert) at sizes that run on a CPU in seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class ConfigError(ValueError):
    """A model configuration that cannot describe a LatentMoE block."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int  # model width (x, h, block output)
    latent: int  # latent width the routed experts work in
    n_experts: int
    top_k: int
    expert_inter: int  # routed expert intermediate width (gate and up each)
    shared_inter: int  # shared expert intermediate width
    eps: float = 1e-5  # both RMSNorms
    routed_scale: float = 1.0  # multiplies the renormalised routing weights
    situ_gate_limit: float = 4.0  # SiTU: limit * tanh(g / limit) * sigmoid(g) ...
    situ_up_limit: float = 25.0  # ... * limit_u * tanh(u / limit_u)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "name":
                if not isinstance(v, str) or not v:
                    raise ConfigError("config name must be a non-empty string")
                continue
            if f.type in ("int", int):
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ConfigError(f"{self.name}: {f.name} must be a positive integer, got {v!r}")
            else:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                    raise ConfigError(f"{self.name}: {f.name} must be a positive number, got {v!r}")
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"{self.name}: top_k ({self.top_k}) exceeds the number of experts ({self.n_experts})"
            )
        # 16-byte vector loads of bf16 need every width a multiple of 8 elements.
        for f in ("hidden", "latent", "expert_inter", "shared_inter"):
            if getattr(self, f) % 8:
                raise ConfigError(
                    f"{self.name}: {f} ({getattr(self, f)}) must be a multiple of 8 "
                    "(16-byte bf16 vectors)"
                )
        if self.latent > self.hidden:
            raise ConfigError(
                f"{self.name}: latent ({self.latent}) must not exceed hidden ({self.hidden})"
            )
        if self.eps >= 1e-2:
            raise ConfigError(f"{self.name}: eps ({self.eps}) is implausibly large for an RMSNorm")

    def to_dict(self) -> dict:
        return asdict(self)

    # Parameter counts (elements), used for byte accounting in benchmarks.
    def routed_expert_params(self) -> int:
        return 2 * self.expert_inter * self.latent + self.latent * self.expert_inter

    def dense_params(self) -> int:
        return (
            self.hidden  # gamma_pre
            + self.n_experts * self.hidden  # router
            + self.latent * self.hidden  # down
            + self.latent  # gamma_latent
            + self.hidden * self.latent  # up
            + 2 * self.shared_inter * self.hidden  # shared gate_up
            + self.hidden * self.shared_inter  # shared down
        )

    def total_params(self) -> int:
        return self.dense_params() + self.n_experts * self.routed_expert_params()


PRESETS: dict[str, ModelConfig] = {
    "k3": ModelConfig(
        name="k3",
        hidden=7168,
        latent=3584,
        n_experts=896,
        top_k=16,
        expert_inter=3072,
        shared_inter=6144,
    ),
    "mini": ModelConfig(
        name="mini",
        hidden=1024,
        latent=512,
        n_experts=64,
        top_k=8,
        expert_inter=384,
        shared_inter=768,
    ),
    "tiny": ModelConfig(
        name="tiny",
        hidden=64,
        latent=32,
        n_experts=16,
        top_k=4,
        expert_inter=24,
        shared_inter=48,
    ),
}


def get_config(name: str) -> ModelConfig:
    """The preset called `name`; a clear error naming the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown config {name!r}; presets are: {', '.join(sorted(PRESETS))}") from None
