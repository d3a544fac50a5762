"""The run matrix's GPU configurations placed through Ray (validation/matrix.py), on a local
cluster on loopback whose 4 GPUs are declared, not real; skipped without ray."""

from __future__ import annotations

import pytest

from validation.ep_stage import GpuConfiguration
from validation.matrix import LocalExecutor, MatrixEntry, MatrixError, RayExecutor, placement_probe

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
    mp.undo()


def _entries(*degrees, device="cpu"):
    return [MatrixEntry("tiny", GpuConfiguration(n, 2), seed=i, steps=1, warmup=0, device=device)
            for i, n in enumerate(degrees)]


def test_each_configuration_gets_its_own_gpus(cluster):
    entries = _entries(2, 4, 1, 2)
    res = RayExecutor(runner=placement_probe).run(entries)
    assert [r["entry"] for r in res] == [e.name for e in entries]  # entries' order
    for e, r in zip(entries, res):
        assert len(r["gpu_ids"]) == e.gpu.ep_degree == len(set(r["gpu_ids"]))
        assert sorted(r["cuda_visible_devices"].split(",")) == sorted(r["gpu_ids"])


def test_a_configuration_wider_than_every_host_is_refused(cluster):
    with pytest.raises(MatrixError, match="ep8"):
        RayExecutor(runner=placement_probe).run(_entries(2, 8))


def test_a_configuration_runs_through_ray(cluster):
    """The real runner in a Ray task: gloo ranks on this host, the result back in the driver."""
    (res,) = RayExecutor().run(_entries(2))
    assert res["passed"] and res["c_bitwise_equal"]
    assert res["configuration"]["name"] == "ep2-b2" and len(res["timing"]["per_gpu"]) == 2


def test_local_executor_keeps_the_order():
    entries = _entries(2, 1)
    assert [r["entry"] for r in LocalExecutor(runner=lambda e: {"entry": e.name}).run(entries)] == \
        [e.name for e in entries]
