"""Model configurations: the presets, and invalid configs rejected with a clear message."""

from __future__ import annotations

import dataclasses

import pytest

from kernels.config import DECODE_BATCH_SIZES, PRESETS, ConfigError, ModelConfig, get_config


def test_k3_has_the_real_latentmoe_widths():
    k3 = get_config("k3")
    assert (k3.hidden, k3.latent, k3.n_experts, k3.top_k, k3.expert_inter, k3.shared_inter) == (
        7168, 3584, 896, 16, 3072, 6144,
    )
    assert k3.eps == 1e-5 and k3.routed_scale == 1.0
    assert (k3.situ_gate_limit, k3.situ_up_limit) == (4.0, 25.0)
    # About 60 GB of bf16 weights: it must fit one H200 (~141 GB) with room for rotation copies.
    gb = 2 * k3.total_params() / 1e9
    assert 55 < gb < 65


def test_every_preset_is_valid_and_smaller_ones_keep_the_structure():
    assert set(PRESETS) >= {"tiny", "mini", "k3"}
    for name, cfg in PRESETS.items():
        assert cfg.name == name
        assert ModelConfig(**cfg.to_dict()) == cfg  # round-trips through its dict
        assert cfg.top_k < cfg.n_experts and cfg.latent < cfg.hidden
    assert PRESETS["tiny"].total_params() < PRESETS["mini"].total_params() < PRESETS["k3"].total_params()
    assert DECODE_BATCH_SIZES == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden": 0}, "tiny: hidden must be a positive integer, got 0"),
        ({"top_k": -1}, "top_k must be a positive integer, got -1"),
        ({"n_experts": 4.0}, "n_experts must be a positive integer, got 4.0"),
        ({"latent": True}, "latent must be a positive integer, got True"),
        ({"eps": 0.0}, "eps must be a positive number, got 0.0"),
        ({"routed_scale": "1"}, "routed_scale must be a positive number, got '1'"),
        ({"top_k": 17}, "top_k (17) exceeds the number of experts (16)"),
        ({"expert_inter": 20}, "expert_inter (20) must be a multiple of 8"),
        ({"hidden": 68}, "hidden (68) must be a multiple of 8"),
        ({"latent": 128}, "latent (128) must not exceed hidden (64)"),
        ({"eps": 0.5}, "eps (0.5) is implausibly large"),
        ({"name": ""}, "config name must be a non-empty string"),
    ],
)
def test_invalid_config_is_rejected_with_a_clear_message(change, message):
    with pytest.raises(ConfigError) as ei:
        dataclasses.replace(PRESETS["tiny"], **change)
    assert message in str(ei.value)


def test_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError, match="unknown config 'k2'; presets are: k3, mini, tiny"):
        get_config("k2")


def test_configs_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["k3"].hidden = 1
