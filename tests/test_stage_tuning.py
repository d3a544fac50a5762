"""Tuning one stage of a persistent kernel: the manifest's stage tunables, the tuner's `--stage`
grid and CLI, the tune measurements' host-planned and shared inputs, and the megakernel's routed
stages' item tunables (kernels/ops/megakernel.py `w13_cols`, `w2_rows`)."""

from __future__ import annotations

import json
import tomllib

import pytest
from agent_helpers import MANIFEST, FakeBackends, git, make_repo

from agent import cli
from agent.proposers.tuner import sources_sha256, stage_tunables, tunable_grid
from kernels.config import get_config
from kernels.manifest import ManifestError, load_manifest, parse_manifest
from test_agent_tuner import _load_tune_measure, measurements_doc

STAGED = MANIFEST.replace('''[kernels.toy.shapes]''', '''[[kernels.toy.stages]]
name = "load"
sources = ["kernels/ops/toy.py"]
tunables = ["unroll"]
[[kernels.toy.stages]]
name = "store"
sources = ["kernels/ops/toy.py"]
[kernels.toy.shapes]''', 1)


def test_megakernel_stages_own_their_item_tunables():
    spec = load_manifest().kernel("megakernel")
    assert spec.stage("w13").tunables == ("w13_cols",)
    assert spec.stage("w2").tunables == ("w2_rows",)
    assert spec.stage("out").tunables == ()
    assert spec.stage_of_tunable("watchdog") is None and spec.stage_of_tunable("stream_cta_kib") is None
    assert spec.stage_of_tunable("ring_slots") is None
    with pytest.raises(ManifestError, match="no stage 'nosuch'"):
        spec.stage("nosuch")


@pytest.mark.parametrize("edit,message", [
    (('tunables = ["unroll"]', 'tunables = ["unrol"]'), "tunable 'unrol' is not among the kernel's tunables"),
    (('name = "store"\nsources = ["kernels/ops/toy.py"]',
      'name = "store"\nsources = ["kernels/ops/toy.py"]\ntunables = ["unroll"]'),
     "tunable 'unroll' already belongs to stage 'load'"),
    (('tunables = ["unroll"]', 'tunables = "unroll"'), "tunables must be a list of strings"),
])
def test_stage_tunables_are_checked(edit, message):
    assert edit[0] in STAGED
    with pytest.raises(ManifestError, match=message):
        parse_manifest(STAGED.replace(*edit, 1))


def test_a_stage_grid_varies_only_that_stages_tunables():
    spec = parse_manifest(STAGED).kernel("toy")
    grid = tunable_grid(spec, "load")
    assert grid == [{"threads": 128, "unroll": 2}, {"threads": 128, "unroll": 1}, {"threads": 128, "unroll": 4}]
    assert len(tunable_grid(spec)) == 9
    with pytest.raises(ValueError, match="declares no tunables of its own .*stages with tunables: load"):
        stage_tunables(spec, "store")
    with pytest.raises(ValueError, match="no stage 'fetch'"):
        tunable_grid(spec, "fetch")
    mega = load_manifest().kernel("megakernel")
    w13 = tunable_grid(mega, "w13")
    name = "w13_cols"
    declared = next(t.choices for t in mega.tunables if t.name == name)
    assert sorted(c[name] for c in w13) == sorted(declared) and w13[0] == mega.tunable_defaults()  # defaults first
    others = {k: v for k, v in mega.tunable_defaults().items() if k != name}
    assert all({k: v for k, v in c.items() if k != name} == others for c in w13)


def _staged_repo(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "kernels" / "manifest.toml").write_text(STAGED)
    git(repo, "commit", "-qam", "stages")
    return repo


def test_the_tuner_changes_only_the_named_stages_tunables(tmp_path):
    """Measured best overall: threads 256, unroll 4; with --stage load only unroll may change,
    so the commit sets unroll 4 and leaves threads at its default."""
    repo = _staged_repo(tmp_path)
    spec = parse_manifest(STAGED).kernel("toy")
    m = tmp_path / "m.json"
    m.write_text(json.dumps(measurements_doc(sources=sources_sha256(repo, spec.sources))))
    rc = cli.main(["--kernel", "toy", "--proposer", "tuner", "--stage", "load", "--measurements", str(m),
                   "--repo", str(repo), "--no-progress"], backends=FakeBackends())
    assert rc == 0
    (run_dir,) = list((repo / ".fasttrack" / "runs").iterdir())
    s = json.loads((run_dir / "summary.json").read_text())
    text = git(repo, "show", f"{s['branch']}:kernels/manifest.toml")
    assert parse_manifest(text).kernel("toy").tunable_defaults() == {"threads": 128, "unroll": 4}
    rfc = tomllib.loads(git(repo, "show", f"{s['branch']}:evidence_reports/{s['run_id']}/rfc.toml"))
    assert "toy stage load" in rfc["title"] and "of stage load" in rfc["design"]
    tuning = json.loads(git(repo, "show", f"{s['branch']}:evidence_reports/{s['run_id']}/tuning.json"))
    assert tuning["stage"] == "load" and all(c["tunables"]["threads"] == 128
                                             for r in tuning["rounds"] for c in r["candidates"])


@pytest.mark.parametrize("args,message", [
    (["--proposer", "tuner", "--stage", "fetch"], "--stage fetch: kernel 'toy' has no stage 'fetch'"),
    (["--proposer", "tuner", "--stage", "store"], "declares no tunables of its own"),
    (["--proposer", "replay", "--stage", "load"], "--stage is a tuner option"),
])
def test_a_bad_stage_is_refused_before_the_run(tmp_path, capsys, args, message):
    repo = _staged_repo(tmp_path)
    m = tmp_path / "m.json"
    m.write_text("{}")
    rc = cli.main(["--kernel", "toy", *args, "--measurements", str(m), "--repo", str(repo), "--no-progress"],
                  backends=FakeBackends())
    assert rc == 2 and message in capsys.readouterr().err
    assert not (repo / ".fasttrack").exists()


def test_measure_inputs_fill_host_planned_params_and_share_the_random_ones():
    """A task table comes from the op's host plan, not the random fill; a second setting of the
    same shape gets the same random weight tensor, not a copy; outputs are poisoned; a draw
    larger than one chunk fills the whole tensor."""
    import torch

    tm = _load_tune_measure()
    params = [
        {"index": 0, "name": "w", "role": "static", "spec": {"kind": "tensor", "dtype": "bfloat16", "shape": [3, 40]}},
        {"index": 1, "name": "tasks", "role": "static", "spec": {"kind": "tensor", "dtype": "int32", "shape": [2, 2]}},
        {"index": 2, "name": "counters", "role": "sync", "direction": "inout",
         "spec": {"kind": "tensor", "dtype": "int32", "shape": [4]}},
        {"index": 3, "name": "y", "role": "activation", "direction": "out",
         "spec": {"kind": "tensor", "dtype": "float32", "shape": [3]}},
    ]
    tm.RANDOM_CHUNK = 7
    shared: dict = {}
    a = tm._make_inputs(params, seed=5, shared=shared, host={"tasks": [[1, 2], [3, 4]]}, device="cpu")
    b = tm._make_inputs(params, seed=5, shared=shared, host={"tasks": [[5, 6], [7, 8]]}, device="cpu")
    assert a["w"] is b["w"] and bool(torch.isfinite(a["w"].float()).all()) and float(a["w"].float().abs().max()) > 0
    assert a["tasks"].tolist() == [[1, 2], [3, 4]] and b["tasks"].tolist() == [[5, 6], [7, 8]]
    assert not a["counters"].any() and bool(torch.isnan(a["y"]).all())
    with pytest.raises(ValueError, match="host-planned tasks has shape"):
        tm._make_inputs(params, seed=5, host={"tasks": [[1, 2, 3]]}, device="cpu")


def test_megakernel_plans_its_task_table_for_the_host_and_sizes_the_routed_items_by_their_tunables():
    from kernels.megablock import megakernel_shape
    from kernels.ops.megakernel import MegakernelOp, MegaStages

    k3 = get_config("k3")
    shape = megakernel_shape(k3, 1)
    op = MegakernelOp(shape)
    assert op.host_params() == {"tasks": op.table}
    small = MegakernelOp(shape, w13_cols=1, w2_rows=2)
    assert small.stages.cols["w13"] == 1 and small.stages.cols["w2"] == 2
    for stage in ("w13", "w2"):  # half the rows per item: twice the items, half the bytes each
        assert len(small.graph.stage_tasks(stage)) == 2 * len(op.graph.stage_tasks(stage))
        assert 2 * small.stages.item_bytes[stage] == op.stages.item_bytes[stage]
    assert small.table != op.table  # the schedule follows the items
    with pytest.raises(ValueError, match="w13_cols 3"):
        MegaStages(k3, 1, 32, w13_cols=3)


@pytest.mark.slow
def test_the_routed_stages_smaller_items_audit_clean():
    """The static audit of the megakernel with the routed stages' non-default items at batch 2
    (a group's token count is read, not fixed) is clean."""
    from validation.race.artifacts import audit_kernel

    spec = load_manifest().kernel("megakernel")
    shape = next(s for s in spec.shapes if s["batch"] == 2)
    rep = audit_kernel("megakernel", shape=shape, tunables={"w13_cols": 1, "w2_rows": 2})
    assert rep.clean and not [f for f in rep.findings if f.severity == "error"], [str(f) for f in rep.findings]
