"""The manifest's `points_to` (task-table slot roles) and `stages` (a persistent kernel's scope
units): parsed, validated, errors naming the kernel and the slot or stage."""

from __future__ import annotations

import pytest

from kernels.manifest import ManifestError, Stage, load_manifest, parse_manifest

HEAD = """\
[kernels.mega]
op = "kernels.ops.mega:MegaOp"
reference = "kernels.reference:mega"
sources = ["kernels/ops/mega.py", "kernels/ops/mega_attn.py", "kernels/ops/mega_moe.py"]
params = [
  { name = "tasks", role = "static" },
  { name = "x", role = "activation" },
  { name = "counters", role = "sync", direction = "inout" },
  { name = "n", role = "scalar" },
]
[kernels.mega.shapes]
batch = [1]
"""

POINTS_TO = """
[kernels.mega.points_to.tasks]
stride = 32
slots = { "0" = "activation", "8" = "static", "16" = "sync", "24" = "scalar" }
"""

STAGES = """
[[kernels.mega.stages]]
name = "attn"
sources = ["kernels/ops/mega_attn.py"]
reads = ["x"]
writes = ["h"]
protocol = "counters"

[[kernels.mega.stages]]
name = "moe"
sources = ["kernels/ops/mega_moe.py"]
reads = ["h"]
writes = ["y"]
protocol = "counters"
"""


def test_points_to_offsets_become_integer_byte_offsets():
    spec = parse_manifest(HEAD + POINTS_TO).kernel("mega")
    assert spec.points_to == {"tasks": {"stride": 32, "slots": {0: "activation", 8: "static", 16: "sync", 24: "scalar"}}}
    assert "points_to" not in spec.extra and "stages" not in spec.extra
    assert parse_manifest(HEAD).kernel("mega").points_to is None


def test_points_to_is_what_the_audit_reads():
    # validation/race/artifacts.py hands spec.points_to to audit_ptx, whose table resolver takes it.
    from validation.race.audit import _resolve_tables

    spec = parse_manifest(HEAD + POINTS_TO).kernel("mega")
    disp = {i: p.name for i, p in enumerate(spec.params)}
    tables, slot_roles, names = _resolve_tables(spec.points_to, disp, {i: p.role for i, p in enumerate(spec.params)})
    assert tables == {0: 32} and sorted(slot_roles.values()) == ["activation", "scalar", "static", "sync"]
    assert sorted(names.values()) == ["tasks[+0]", "tasks[+16]", "tasks[+24]", "tasks[+8]"]


@pytest.mark.parametrize("table, message", [
    ('stride = 32\nslots = { "0" = "activation", "8" = "weights" }',
     "kernel 'mega': points_to 'tasks' slot '8': role 'weights' is not a role"),
    ('stride = 32\nslots = { "zero" = "activation" }',
     "kernel 'mega': points_to 'tasks' slot 'zero': the offset must be a non-negative integer"),
    ('stride = 32\nslots = { "32" = "activation" }',
     "kernel 'mega': points_to 'tasks' slot '32': a slot is 8 aligned bytes inside one 32-byte entry"),
    ('stride = 32\nslots = { "4" = "activation" }', "slot '4': a slot is 8 aligned bytes"),
    ('stride = 0\nslots = { "0" = "activation" }', "kernel 'mega': points_to 'tasks': stride must be"),
    ('stride = 32\nslots = {}', "kernel 'mega': points_to 'tasks': slots must be a non-empty table"),
    ('stride = 32\nslots = { "0" = "static" }\nentries = 4', "unknown key(s) entries"),
])
def test_points_to_errors_name_the_kernel_and_the_slot(table, message):
    with pytest.raises(ManifestError) as e:
        parse_manifest(HEAD + "\n[kernels.mega.points_to.tasks]\n" + table + "\n")
    assert message in str(e.value)


@pytest.mark.parametrize("param, message", [
    ("table", "kernel 'mega': points_to 'table': not a parameter of the kernel"),
    ("n", "kernel 'mega': points_to 'n': the parameter is a scalar"),
])
def test_points_to_names_a_buffer_parameter(param, message):
    with pytest.raises(ManifestError, match=message):
        parse_manifest(HEAD + f'\n[kernels.mega.points_to.{param}]\nstride = 8\nslots = {{ "0" = "static" }}\n')


def test_stages_are_parsed():
    spec = parse_manifest(HEAD + STAGES).kernel("mega")
    assert spec.stages == (Stage("attn", ("kernels/ops/mega_attn.py",), ("x",), ("h",), "counters"),
                           Stage("moe", ("kernels/ops/mega_moe.py",), ("h",), ("y",), "counters"))
    assert spec.stages_of("kernels/ops/mega_moe.py") == ["moe"] and spec.stages_of("kernels/ops/mega.py") == []


@pytest.mark.parametrize("edit, message", [
    (('sources = ["kernels/ops/mega_attn.py"]', 'sources = ["kernels/ops/other.py"]'),
     "kernel 'mega': stage 'attn': source kernels/ops/other.py is not among the kernel's declared sources"),
    (('sources = ["kernels/ops/mega_attn.py"]', 'sources = []'), "kernel 'mega': stage 'attn': sources must be a non-empty"),
    (('name = "moe"', 'name = "attn"'), "kernel 'mega': stage 'attn': declared twice"),
    (('protocol = "counters"\n\n', 'protocol = "counters"\nlatency = 3\n\n'), "stage 'attn': unknown key(s) latency"),
    (('writes = ["h"]', 'writes = ["h", "h"]'), "stage 'attn': writes names 'h' twice"),
    (('reads = ["x"]', 'reads = "x"'), "stage 'attn': reads must be a list of strings"),
    (('protocol = "counters"\n\n', 'protocol = 3\n\n'), "stage 'attn': protocol must be a string"),
    (('name = "attn"', 'name = ""'), "kernel 'mega': stages[0]: name must be a non-empty string"),
])
def test_stage_errors_name_the_kernel_and_the_stage(edit, message):
    with pytest.raises(ManifestError) as e:
        parse_manifest(HEAD + STAGES.replace(*edit, 1))
    assert message in str(e.value)


def test_the_repositorys_manifest_still_parses():
    m = load_manifest()
    assert all(isinstance(k.stages, tuple) for k in m.kernels.values())
