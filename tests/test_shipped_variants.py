"""The variants that ship: each manifest variant at the manifest defaults under the block plan's
per-batch choices (kernels.block.shipped_tunables), as the scope compares them, the validator
builds them and the evidence binds them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gate_fixtures import commit, make_repo, write  # noqa: E402

from kernels.block import BLOCK_PLAN, load_block_plan, plan_in_tree, shipped_tunables  # noqa: E402
from kernels.manifest import load_manifest  # noqa: E402


def _variant(spec, batch):
    return next(dict(s) for s in spec.shapes if s["batch"] == batch)


def test_the_block_plans_choices_override_the_defaults_at_their_batches():
    man = load_manifest()
    w13, w2, norm = man.kernel("moe_w13"), man.kernel("moe_w2"), man.kernel("rmsnorm")
    assert w13.tunable_defaults()["wg"] == 0
    for batch in (1, 2, 4, 8):
        assert shipped_tunables(w13, _variant(w13, batch))["wg"] == 0
    for batch in (16, 32, 64):  # the warpgroup design from batch 16 (kernels/block_plan.toml)
        assert shipped_tunables(w13, _variant(w13, batch)) == {**w13.tunable_defaults(), "wg": 1}
    assert shipped_tunables(w2, _variant(w2, 1))["wg"] == 0
    assert shipped_tunables(w2, _variant(w2, 2))["wg"] == 1
    for batch in (1, 64):  # a kernel the plan sets nothing for ships its defaults
        assert shipped_tunables(norm, _variant(norm, batch)) == norm.tunable_defaults()
    assert BLOCK_PLAN[16]["tunables"]["moe_w13"] == {"wg": 1}


def test_choices_a_kernel_does_not_declare_are_dropped_and_an_empty_plan_gives_the_defaults():
    w13 = load_manifest().kernel("moe_w13")
    v = _variant(w13, 16)
    plan = {16: {"tunables": {"moe_w13": {"wg": 1, "no_such_tunable": 3}}}}
    assert shipped_tunables(w13, v, plan) == {**w13.tunable_defaults(), "wg": 1}
    assert shipped_tunables(w13, v, {}) == w13.tunable_defaults()


def test_plan_in_tree_reads_a_revisions_own_plan_or_says_it_has_none(tmp_path):
    assert plan_in_tree(tmp_path) is None
    write(tmp_path, "kernels/block_plan.toml", '[batch.8]\nrouter = "gemv"\noutput = "gemv"\n'
          'tunables.alpha = { threads = 256 }\n')
    assert plan_in_tree(tmp_path) == {8: {"router": "gemv", "output": "gemv", "tunables": {"alpha": {"threads": 256}}}}
    assert plan_in_tree(Path(__file__).resolve().parent.parent) == load_block_plan()


def test_the_scope_compares_each_variant_at_its_shipped_tunables_on_both_sides(tmp_path):
    """A change to a design that only the block plan selects (alpha's threads=256 at batch 8) is
    compared at that design: the requests carry the plan's choice, the base's from head's plan
    where the base declares none."""
    from validation.scope import compare_code, compute_scope

    root = tmp_path / "repo"
    base = make_repo(root)
    write(root, "kernels/block_plan.toml", '[batch.8]\nrouter = "gemv"\noutput = "gemv"\n'
          'tunables.alpha = { threads = 256 }\n')
    write(root, "kernels/ops/alpha.py", (root / "kernels/ops/alpha.py").read_text() + "EXTRA = 1\n")
    head = commit(root, "alpha: a change")
    seen = []

    class Result:
        cubin_code_sha256 = cubin_sha256 = "same"

    def build(reqs):
        seen.extend(reqs)
        return [Result() for _ in reqs]

    scope = compute_scope(base, head, repo=root)
    compare_code(scope, repo=root, build=build, kernels=["alpha"])
    assert len(seen) == 4  # two variants, both sides
    assert sorted((r.shape["batch"], r.tunables["threads"]) for r in seen) == [(1, 128), (1, 128), (8, 256), (8, 256)]


def _fake_revision(root: Path, block_py: str | None) -> None:
    """A revision's tree with a kernels/build.py that records what it is asked to build."""
    write(root, "kernels/__init__.py", "")
    write(root, "kernels/build.py", "from types import SimpleNamespace\n"
          "def build_kernel(kernel, shapes, tunables, root, repo_root):\n"
          "    return [SimpleNamespace(shape=s, tunables=tunables, key='k', dir=root, cubin_sha256='c',"
          " meta={'sources': {}}) for s in shapes]\n")
    if block_py is not None:
        write(root, "kernels/block.py", block_py)


def _run_base_script(root: Path, reqs) -> list[dict]:
    import json
    import subprocess
    import sys

    from validation.validate import _BASE_BUILD_SCRIPT

    r = subprocess.run([sys.executable, "-c", _BASE_BUILD_SCRIPT, str(root), "moe_w2", str(root), json.dumps(reqs)],
                       cwd=root, capture_output=True, text=True, check=True)
    line = next(x for x in r.stdout.splitlines() if x.startswith("@@ARTIFACTS@@"))
    return json.loads(line[len("@@ARTIFACTS@@"):])


def test_a_base_without_a_block_plan_builds_what_its_own_block_launched(tmp_path):
    # 83f6b15's kernels/block.py chose moe_w2's warpgroup design as {"stream": 0, "wg": 1}; head's
    # plan says {"wg": 1}, which that revision builds as its stream design
    _fake_revision(tmp_path, "def block_tunables(kernel, batch):\n"
                   "    return {'stream': 0, 'wg': 1} if batch >= 2 else {'stream': 1}\n")
    got = _run_base_script(tmp_path, [[{"batch": 1}, {"wg": 0}, True], [{"batch": 2}, {"wg": 1}, True],
                                      [{"batch": 4}, {"wg": 1}, False]])
    assert [a["tunables"] for a in got] == [{"stream": 1}, {"stream": 0, "wg": 1}, {"wg": 1}]


def test_a_base_with_no_block_tables_takes_the_tunables_it_is_given(tmp_path):
    _fake_revision(tmp_path, None)
    got = _run_base_script(tmp_path, [[{"batch": 2}, {"wg": 1}, True]])
    assert [a["tunables"] for a in got] == [{"wg": 1}]


def test_a_variant_without_a_batch_keeps_its_tunables_at_such_a_base(tmp_path):
    # prodcons' shapes (producers, consumers) have no batch: the block never launches them, and
    # 83f6b15's block_tunables compared None with an int
    _fake_revision(tmp_path, "def block_tunables(kernel, batch):\n"
                   "    return {'stream': 1} if batch <= 16 else {}\n")
    got = _run_base_script(tmp_path, [[{"producers": 2, "consumers": 4}, {"spin": 1}, True],
                                      [{"batch": 2}, {"wg": 1}, True]])
    assert [a["tunables"] for a in got] == [{"spin": 1}, {"stream": 1}]
