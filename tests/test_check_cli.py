"""`fasttrack check`: exit 0 pass, 1 fail with the reason, 2 bad input; `--list`."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from validation.cli import main


@pytest.fixture
def impl_dir(tmp_path, monkeypatch):
    (tmp_path / "myimpl.py").write_text(textwrap.dedent("""
        import torch
        from kernels import reference as R

        def good(x, gamma, eps=1e-5):
            return R.rmsnorm(x, gamma, eps)

        def half_precision(x, gamma, eps=1e-5):
            # statistics in bf16: a precision downgrade
            xb = x.to(torch.bfloat16)
            ms = (xb * xb).mean(-1, keepdim=True)
            return (xb * torch.rsqrt(ms + eps) * gamma).to(x.dtype)

        not_callable = 3
    """))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("myimpl", None)


def test_list_prints_every_op_with_its_reference(capsys):
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm" in out and "kernels.reference:rmsnorm" in out
    assert "latent_down     kernels.reference:linear" in out


def test_passing_impl_exits_0_and_writes_json(impl_dir, capsys):
    assert main(["check", "--op", "rmsnorm", "--impl", "myimpl:good", "--quick",
                 "--json", str(impl_dir / "r.json")]) == 0
    assert "PASS" in capsys.readouterr().out
    rep = json.loads((impl_dir / "r.json").read_text())
    assert rep["passed"] and rep["defences"]["passed"]


def test_failing_impl_exits_1_with_reasons(impl_dir, capsys):
    assert main(["check", "--op", "rmsnorm", "--impl", "myimpl:half_precision", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "FAIL" in err and "relative error" in err


@pytest.mark.parametrize("argv, msg", [
    (["check", "--op", "nope", "--impl", "myimpl:good"], "unknown op"),
    (["check", "--op", "rmsnorm", "--impl", "nomodule_xyz:f"], "cannot import"),
    (["check", "--op", "rmsnorm", "--impl", "myimpl:missing"], "no attribute"),
    (["check", "--op", "rmsnorm", "--impl", "myimpl:not_callable"], "not callable"),
    (["check", "--op", "rmsnorm", "--impl", "myimpl"], "MODULE:CALLABLE"),
    (["check", "--op", "rmsnorm"], "--impl"),
    (["check", "--op", "rmsnorm", "--impl", "myimpl:good", "--preset", "huge"], "unknown config"),
])
def test_bad_input_exits_2_with_one_clear_line(impl_dir, capsys, argv, msg):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_cuda_without_a_gpu_is_bad_input(impl_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert main(["check", "--op", "rmsnorm", "--impl", "myimpl:good", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
