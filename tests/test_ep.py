"""Expert parallelism (kernels/ep.py, validation/ep_stage.py) on CPU.

The bookkeeping in one process (plan_dispatch, an exchange simulated between ranks, the cubins'
grouping of the received rows), then the block itself in process groups of 2 and 4 gloo
processes on loopback, against the one-GPU reference block and its float64 oracle: the router's
own routing, a hot expert, every token on one rank's experts, ranks without tokens, and two
planted faults (a reversed combine, a dropped slot) that the checks must catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import ep
from kernels import reference as R
from kernels.config import get_config
from validation import ep_stage
from validation.ep_stage import GpuConfiguration, Scenario


# ---------------------------------------------------------------------------------------------
# In one process
# ---------------------------------------------------------------------------------------------


def _ids(T, cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(cfg.n_experts, generator=g)[: cfg.top_k] for _ in range(T)]).to(torch.int32)


def test_shard_layout_and_refusals():
    s = ep.ExpertShard(16, 4, 2)
    assert (s.per_rank, s.first) == (4, 8)
    assert s.owner(torch.tensor([0, 3, 4, 15])).tolist() == [0, 0, 1, 3]
    with pytest.raises(ep.EPError, match="divide"):
        ep.ExpertShard(16, 3, 0)
    with pytest.raises(ep.EPError, match="rank"):
        ep.ExpertShard(16, 4, 4)


def test_multicast_stays_off_whatever_was_set():
    env = {"NCCL_NVLS_ENABLE": "1", "OTHER": "x"}
    ep.multicast_off_env(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                   "OTHER": "x"}


@pytest.mark.parametrize("world", [2, 4])
def test_plan_dispatch_accounts_for_every_slot(world):
    cfg = get_config("mini")
    T, K = 7, cfg.top_k
    ids = _ids(T, cfg)
    shard = ep.ExpertShard(cfg.n_experts, world, 0)
    p = ep.plan_dispatch(ids, shard)
    flat = ids.reshape(-1).long()
    assert sorted(p.order.tolist()) == list(range(T * K))
    assert p.slot_counts.sum() == T * K
    dest = shard.owner(flat[p.order])
    assert torch.equal(dest, torch.sort(dest).values)  # by destination
    tok_start = torch.cumsum(p.token_counts, 0) - p.token_counts
    # each slot's row names its own token, its local expert its own expert
    assert torch.equal(p.token_rows[tok_start[dest] + p.slot_row], p.order // K)
    assert torch.equal(p.slot_expert + dest * shard.per_rank, flat[p.order])
    for d in range(world):  # a token goes to a rank once, however many of its experts are there
        rows = p.token_rows[tok_start[d]: tok_start[d] + p.token_counts[d]]
        assert rows.tolist() == sorted(set((p.order[dest == d] // K).tolist()))


def _simulated_receive(cfg, zs, plans, d):
    """What rank d receives from every source (the exchange of kernels.ep.dispatch, in memory)."""
    z, rows, experts, slot_counts, tok_counts, base = [], [], [], [], [], 0
    for z_src, p in zip(zs, plans):
        ts = torch.cumsum(p.token_counts, 0) - p.token_counts
        ss = torch.cumsum(p.slot_counts, 0) - p.slot_counts
        nt, ns = int(p.token_counts[d]), int(p.slot_counts[d])
        z.append(z_src[p.token_rows[ts[d]: ts[d] + nt]])
        rows.append(p.slot_row[ss[d]: ss[d] + ns] + base)
        experts.append(p.slot_expert[ss[d]: ss[d] + ns])
        slot_counts.append(ns)
        tok_counts.append(nt)
        base += nt
    return ep.Received(torch.cat(z), torch.cat(rows), torch.cat(experts), slot_counts, tok_counts)


def _kernel_contract(rec, g, w13, w2, cfg, max_rows):
    """What moe_w13 + moe_w2 compute from their routing inputs (kernels/ops/moe_experts.py's
    references): each group's slots in order, o written at the slot."""
    K = cfg.top_k
    z = torch.zeros(max_rows, cfg.latent, dtype=rec.z.dtype)
    z[: rec.z.shape[0]] = rec.z
    o = torch.full((max_rows * K, cfg.latent), float("nan"))
    for u in range(int(g["n_groups"][0])):
        e = int(g["group_expert"][u])
        slots = g["sorted_slots"][g["group_start"][u]: g["group_start"][u + 1]].long()
        o[slots] = R.expert_ffn(z[slots // K], w13[e], w2[e], gate_limit=cfg.situ_gate_limit,
                                up_limit=cfg.situ_up_limit)
    return o[g["slot"]]


@pytest.mark.parametrize("world,routing", [(2, "uniform"), (4, "uniform"), (4, "hot"), (4, "same")])
def test_exchange_and_grouping_give_the_one_gpu_expert_outputs(world, routing):
    """Simulated exchange: every rank's received slots, run by the reference path and by the
    cubins' contract over `local_grouping`, give the one-GPU expert outputs bit for bit."""
    from validation.numerics import routing_ids

    cfg = get_config("tiny")
    w = R.make_weights(cfg)
    tokens = [3, 0, 5, 2][:world]
    ids = routing_ids(sum(tokens), cfg.n_experts, cfg.top_k, routing, torch.Generator().manual_seed(3), "cpu")
    z = R.linear(R.rmsnorm(R.make_hidden(cfg, sum(tokens)), w.gamma_pre), w.w_down)
    one_gpu = R.expert_outputs(z, ids, w.w13, w.w2).reshape(-1, cfg.latent)
    bounds = torch.tensor([0] + tokens).cumsum(0).tolist()
    zs = [z[a:b] for a, b in zip(bounds, bounds[1:])]
    plans = [ep.plan_dispatch(ids[a:b], ep.ExpertShard(cfg.n_experts, world, r))
             for r, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    back = [[] for _ in range(world)]
    for d in range(world):
        shard = ep.ExpertShard(cfg.n_experts, world, d)
        sw = ep.shard_weights(w, shard)
        rec = _simulated_receive(cfg, zs, plans, d)
        o = ep.TorchLocalExperts(sw.w13, sw.w2, cfg)(rec)
        g = ep.local_grouping(rec.rows, rec.experts, sum(tokens), cfg.top_k, shard.per_rank)
        assert sorted(g["sorted_slots"].tolist()) == list(range(sum(tokens) * cfg.top_k))
        assert torch.equal(_kernel_contract(rec, g, sw.w13, sw.w2, cfg, sum(tokens)), o)
        at = 0
        for s, n in enumerate(rec.slot_counts):
            back[s].append(o[at: at + n])
            at += n
    for r, p in enumerate(plans):  # the return: each rank's slots back in slot order
        o = torch.empty(p.order.numel(), cfg.latent)
        o[p.order] = torch.cat(back[r])
        assert torch.equal(o, one_gpu[bounds[r] * cfg.top_k: bounds[r + 1] * cfg.top_k])


def test_local_grouping_matches_the_routers_grouping():
    """One rank holding every expert: the grouping is the router's own (kernels/ops/router.py)."""
    from kernels.ops.router import routing_groups_ref

    cfg = get_config("tiny")
    ids = _ids(6, cfg, seed=1)
    p = ep.plan_dispatch(ids, ep.ExpertShard(cfg.n_experts, 1, 0))
    g = ep.local_grouping(p.slot_row, p.slot_expert, 6, cfg.top_k, cfg.n_experts)
    ref = routing_groups_ref(ids, cfg.n_experts)
    for k in ref:
        assert torch.equal(g[k], ref[k]), k
    assert torch.equal(g["slot"], torch.arange(6 * cfg.top_k))


class _FakeCubin:
    """A stand-in for a loaded moe_w13 / moe_w2 cubin: the kernels' contract in torch, called
    with the launcher's positional arguments (kernels/block.py's order)."""

    def __init__(self, name, cfg):
        self.name, self.cfg, self.loaded = name, cfg, False
        self.meta = {"params": [{"name": "counters", "spec": {"shape": [4], "dtype": "int32"}}]}

    def load(self):
        self.loaded = True

    def __call__(self, *a):
        cfg, K, I = self.cfg, self.cfg.top_k, self.cfg.expert_inter
        lim = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
        if self.name == "moe_w13":
            z, w13, ng, ge, gs, ss, act = a
        else:
            act, w2, weights, ng, ge, gs, ss, o, counters, c = a
        for u in range(int(ng[0])):
            e, pos = int(ge[u]), torch.arange(int(gs[u]), int(gs[u + 1]))
            slots = ss[pos].long()
            if self.name == "moe_w13":
                gu = z[slots // K].float() @ w13[e].float().T
                act[pos] = R.situ(gu[:, :I], gu[:, I:], **lim).to(act.dtype)
            else:
                o[slots] = act[pos].float() @ w2[e].float().T


def test_cubin_hook_wires_the_kernels_as_the_reference_path():
    """CubinLocalExperts with stand-in kernels gives the reference path's outputs bit for bit:
    buffers, argument order, padding of z and the per-slot read of o."""
    cfg = get_config("tiny")
    w = R.make_weights(cfg)
    world, tokens = 2, [3, 4]
    ids = _ids(sum(tokens), cfg, seed=5)
    z = R.linear(R.rmsnorm(R.make_hidden(cfg, sum(tokens)), w.gamma_pre), w.w_down)
    plans = [ep.plan_dispatch(ids[:3], ep.ExpertShard(cfg.n_experts, world, 0)),
             ep.plan_dispatch(ids[3:], ep.ExpertShard(cfg.n_experts, world, 1))]
    for d in range(world):
        shard = ep.ExpertShard(cfg.n_experts, world, d)
        sw = ep.shard_weights(w, shard)
        rec = _simulated_receive(cfg, [z[:3], z[3:]], plans, d)
        fakes = {n: _FakeCubin(n, cfg) for n in ("moe_w13", "moe_w2")}
        hook = ep.CubinLocalExperts(cfg, shard, sw.w13, sw.w2, max_rows=world * max(tokens), kernels=fakes)
        assert all(f.loaded for f in fakes.values())
        o = hook(rec)
        assert torch.equal(o, ep.TorchLocalExperts(sw.w13, sw.w2, cfg)(rec))
        # past the cubins' batch the rows go in chunks: same outputs (rows are independent)
        chunked = ep.CubinLocalExperts(cfg, shard, sw.w13, sw.w2, max_rows=2, kernels=fakes)(rec)
        torch.testing.assert_close(chunked, o, rtol=1e-6, atol=1e-6)
        assert chunked.shape == o.shape and torch.isfinite(chunked).all()


def test_cubin_variants_follow_the_kernels_limit():
    cfg = get_config("k3")
    assert [ep.cubin_batch(n, t) for n, t in ((2, 1), (2, 8), (8, 8), (8, 64))] == [2, 16, 64, 64]
    (w13, s13, _), (w2, s2, t2) = ep.cubin_variants(cfg, 112, 16)
    assert (w13, w2) == ("moe_w13", "moe_w2") and s13 == s2
    assert s13 == {"batch": 16, "n_experts": 112, "latent": 3584, "expert_inter": 3072, "top_k": 16}
    assert t2 == {"wg": 1}  # the block's choice at batch 16 (kernels/block_plan.toml)


def test_local_grouping_refuses_rows_past_the_kernels_batch():
    with pytest.raises(ep.EPError, match="batch"):
        ep.local_grouping(torch.tensor([0, 5]), torch.tensor([0, 1]), 4, 2, 4)
    with pytest.raises(ep.EPError, match="top_k"):
        ep.local_grouping(torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]), 4, 2, 4)


# ---------------------------------------------------------------------------------------------
# Process groups of gloo ranks on loopback
# ---------------------------------------------------------------------------------------------

SCENARIOS = {
    2: [Scenario("tiny", (3, 5), label="router"),
        Scenario("tiny", (4, 4), "hot", label="hot"),
        Scenario("tiny", (3, 3), "one_rank", label="one_rank"),
        Scenario("tiny", (5, 0), label="empty_rank"),
        Scenario("mini", (8, 8), steps=2, label="mini"),
        Scenario("mini", (8, 8), mutant="reversed_combine", label="reversed_combine"),
        Scenario("tiny", (4, 4), mutant="dropped_slot", label="dropped_slot")],
    4: [Scenario("tiny", (2, 3, 1, 2), label="router"),
        Scenario("tiny", (2, 2, 2, 2), "one_rank", label="one_rank"),
        Scenario("tiny", (0, 4, 0, 3), "hot", label="empty_rank"),
        Scenario("mini", (4, 4, 4, 4), label="mini"),
        Scenario("mini", (4, 4, 4, 4), "distinct", label="mini_distinct"),
        Scenario("mini", (4, 4, 4, 4), mutant="reversed_combine", label="reversed_combine")],
}


@pytest.fixture(scope="module", params=[2, 4])
def group(request):
    n = request.param
    return n, {r["label"]: r for r in ep_stage.run_scenarios(SCENARIOS[n], n)}


GOOD = ("router", "one_rank", "empty_rank", "mini")


def test_block_equals_the_one_gpu_block(group):
    n, res = group
    for label in GOOD + (("hot",) if n == 2 else ("mini_distinct",)):
        r = res[label]
        assert r["passed"], (label, r["numerics"])
        assert r["c_bitwise_equal"], label
        assert r["numerics"]["out"]["passed"], label
        if r["routing"] == "router":
            assert r["numerics"]["ids"]["passed"], label


def test_uneven_routings_reach_the_right_ranks(group):
    n, res = group
    used = [g["experts_used"] for g in res["one_rank"]["timing"]["per_gpu"]]
    assert used[:-1] == [0] * (n - 1) and used[-1] > 0
    empty = res["empty_rank"]["timing"]["per_gpu"]
    assert [g["tokens"] for g in empty] == list(res["empty_rank"]["configuration"]["tokens"])
    assert any(g["tokens"] == 0 for g in empty)


def test_timing_and_read_fields(group):
    n, res = group
    t = res["mini"]["timing"]
    assert len(t["per_gpu"]) == n and t["steps"] == next(s.steps for s in SCENARIOS[n] if s.label == "mini")
    assert 0 <= t["comm_share"] <= 1 and t["end_to_end_us"] > 0
    for g in t["per_gpu"]:
        assert set(g["phases_us"]) == set(ep.PHASES)
        assert g["read_fraction"] is None  # no ceiling on a CPU
        cfg = get_config("mini")
        assert g["read_bytes"] == 2 * (cfg.dense_params() + g["experts_used"] * cfg.routed_expert_params())
    json.dumps(res["mini"])  # embeddable as it is


def test_planted_faults_are_caught(group):
    n, res = group
    rc = res["reversed_combine"]
    assert not rc["passed"] and not rc["c_bitwise_equal"]
    assert rc["numerics"]["out"]["passed"]  # within tolerance: only the exact check sees it
    if n == 2:
        ds = res["dropped_slot"]
        assert not ds["passed"] and not ds["c_bitwise_equal"]
        assert not ds["numerics"]["out"]["passed"]


def test_cli_writes_the_configurations(tmp_path):
    """The GPU-host entry as the lead runs it (python -m), in its CPU/gloo mode."""
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-m", "validation.ep_stage", "--device", "cpu", "--config", "tiny",
                        "--ep-degrees", "2", "--batches", "1,3", "--steps", "1", "--warmup", "0",
                        "--out", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ep2-b1" in p.stdout and "PASS" in p.stdout
    doc = json.loads((tmp_path / "ep_result.json").read_text())
    assert [c["configuration"]["name"] for c in doc["gpu_configurations"]] == ["ep2-b1", "ep2-b3"]
    assert doc["environment"]["multicast_off"]["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("argv,msg", [(["--ep-degrees", "3"], "must divide"), (["--batches", "0"], "positive"),
                                      (["--config", "nope"], "unknown config"),
                                      (["--config", "k3"], "needs a GPU"),
                                      (["--experts", "cubin"], "'cubin' on cuda"),
                                      (["--prepare"], "needs --build-root")])
def test_cli_bad_input_is_one_message(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as ex:
        sys_exit = ep_stage.main(["--device", "cpu", "--config", "tiny", "--out", str(tmp_path), *argv])
        raise SystemExit(sys_exit)
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
    assert not (tmp_path / "ep_result.json").exists()


def test_configuration_is_validated():
    assert GpuConfiguration(4, 8).name == "ep4-b8"
    with pytest.raises(ep_stage.EPStageError):
        GpuConfiguration(0, 8)


def test_prepare_builds_each_expert_variant_once(tmp_path):
    calls = []

    def build(name, shape, tun, root):
        calls.append((name, shape["batch"], shape["n_experts"], root))
        return type("Artifact", (), {"dir": root / name})()

    configs = [GpuConfiguration(n, b) for n in (2, 8) for b in (1, 8, 64)]
    rows = ep_stage.prepare_cubins("k3", configs, tmp_path, build=build)
    # ep8 at 8 and 64 tokens per GPU share the 64-row variant (the kernels' largest batch)
    assert sorted({(c[1], c[2]) for c in calls}) == [(2, 448), (8, 112), (16, 448), (64, 112), (64, 448)]
    assert len(calls) == 2 * 5 == len(rows) and all(c[3] == tmp_path for c in calls)
