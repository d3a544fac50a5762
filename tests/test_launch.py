"""The cubin launcher: argument packing and spec checks on CPU, the no-GPU message, a GPU launch."""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path

import pytest
import torch

from kernels import launch
from kernels.launch import CubinKernel, LaunchError, check_tensor, pack_args, param_pointer_array

PREBUILT = Path(__file__).parent / "fixtures" / "prebuilt" / "scale"


def _params():
    """Parameters as kernels.build records them for tests/fixtures/scale_op.py (4x96 fp32)."""
    def tensor(i, name, direction):
        return {"index": i, "name": name, "role": "activation", "direction": direction,
                "ptx_name": f"k_param_{i}", "ptx_type": "b8", "size": 8, "align": 8,
                "spec": {"kind": "tensor", "shape": [4, 96], "dtype": "float32"}}
    return [
        tensor(0, "x", "in"),
        {"index": 1, "name": "alpha", "role": "scalar", "direction": "in", "ptx_name": "k_param_1",
         "ptx_type": "f32", "size": 4, "align": 4, "spec": {"kind": "scalar", "dtype": "float32", "value": 2.0}},
        {"index": 2, "name": "n", "role": "scalar", "direction": "in", "ptx_name": "k_param_2",
         "ptx_type": "u32", "size": 4, "align": 4, "spec": {"kind": "scalar", "dtype": "int32", "value": 4}},
        tensor(3, "y", "out"),
    ]


def _cpu_pack(*args):
    return pack_args(_params(), list(args), device_type="cpu")


def test_pack_args_bytes_follow_ptx_types():
    x, y = torch.zeros(4, 96), torch.empty(4, 96)
    values, types = _cpu_pack(x, 1.5, -3, y)
    assert types == [ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_uint64]
    raw = [bytes(v) for v in values]
    assert raw[0] == struct.pack("<Q", x.data_ptr())
    assert raw[1] == struct.pack("<f", 1.5)
    assert raw[2] == struct.pack("<i", -3)  # int32 spec in a .u32 slot: the same 4 bytes
    assert raw[3] == struct.pack("<Q", y.data_ptr())
    # ints are accepted for float scalars
    values, _ = _cpu_pack(x, 2, 0, y)
    assert bytes(values[1]) == struct.pack("<f", 2.0)


def test_param_pointer_array_points_at_each_value():
    x, y = torch.zeros(4, 96), torch.empty(4, 96)
    values, _ = _cpu_pack(x, 1.5, 7, y)
    arr = param_pointer_array(values)
    assert [int(p) for p in arr] == [ctypes.addressof(v) for v in values]
    # Reading back through the pointers gives the packed bytes (what the driver will copy).
    assert ctypes.c_uint64.from_address(arr[0]).value == x.data_ptr()
    assert ctypes.c_float.from_address(arr[1]).value == 1.5
    assert ctypes.c_int32.from_address(arr[2]).value == 7


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.zeros(4, 96, dtype=torch.bfloat16), "dtype bfloat16, the kernel was built for float32"),
        (lambda: torch.zeros(4, 95), "shape [4, 95]"),
        (lambda: torch.zeros(96, 4), "shape [96, 4]"),
        (lambda: torch.zeros(96, 4).t(), "not compact row-major"),
        (lambda: torch.zeros(4, 192)[:, ::2], "not compact row-major"),
        (lambda: torch.zeros(4 * 96 + 1)[1:].view(4, 96), "not 16-byte aligned"),
        (lambda: [[0.0] * 96] * 4, "expected a torch tensor"),
    ],
)
def test_buffer_spec_mismatch_is_a_clear_error(make, message):
    with pytest.raises(LaunchError, match="parameter 'x'") as ei:
        _cpu_pack(make(), 1.0, 1, torch.empty(4, 96))
    assert message in str(ei.value)


def test_size_one_dims_may_have_any_stride():
    params = _params()
    for p in (params[0], params[3]):
        p["spec"]["shape"] = [1, 96]
    row = torch.zeros(8, 96)[2:3]  # stride (96, 1): the row stride is never used
    pack_args(params, [row, 1.0, 1, torch.empty(1, 96)], device_type="cpu")


def test_device_is_checked():
    with pytest.raises(LaunchError, match="parameter 'x': tensor is on cpu, expected a cuda tensor"):
        pack_args(_params(), [torch.zeros(4, 96), 1.0, 1, torch.empty(4, 96)])


@pytest.mark.parametrize(
    "alpha, n, message",
    [
        (1.0, 2**31, "does not fit int32"),
        (1.0, 1.5, "expected an int"),
        (1.0, True, "expected a Python int"),
        ("2", 1, "expected a float"),
        (torch.tensor(1.0), 1, "expected a Python float"),
    ],
)
def test_bad_scalars(alpha, n, message):
    with pytest.raises(LaunchError, match=message):
        _cpu_pack(torch.zeros(4, 96), alpha, n, torch.empty(4, 96))


def test_argument_count_and_ptx_size_mismatch():
    with pytest.raises(LaunchError, match=r"expected 4 arguments \(x, alpha, n, y\), got 3"):
        _cpu_pack(torch.zeros(4, 96), 1.0, 1)
    params = _params()
    params[0]["size"] = 16
    with pytest.raises(LaunchError, match="one 8-byte pointer"):
        pack_args(params, [torch.zeros(4, 96), 1.0, 1, torch.empty(4, 96)], device_type="cpu")
    params = _params()
    params[1]["ptx_type"], params[1]["size"] = "f64", 8
    with pytest.raises(LaunchError, match=r"does not match the PTX parameter \.f64"):
        pack_args(params, [torch.zeros(4, 96), 1.0, 1, torch.empty(4, 96)], device_type="cpu")


def _meta():
    return {"kernel": "scale", "entry": "k", "params": _params(),
            "launch": {"grid": [6, 1, 1], "block": [64, 1, 1], "smem_bytes": 0, "cooperative": False}}


def test_bind_by_name_and_position():
    k = CubinKernel(b"\0", _meta())
    x, y = object(), object()
    assert k.bind(x, 1.0, n=4, y=y) == [x, 1.0, 4, y]
    with pytest.raises(LaunchError, match="missing arguments: y"):
        k.bind(x, 1.0, 4)
    with pytest.raises(LaunchError, match="no parameter 'z'"):
        k.bind(x, 1.0, 4, y, z=1)
    with pytest.raises(LaunchError, match="given twice"):
        k.bind(x, 1.0, 4, y, x=x)


def test_from_dir_checks_the_cubin_hash(tmp_path):
    meta = _meta()
    meta["hashes"] = {"cubin_sha256": "0" * 64}
    (tmp_path / "kernel.cubin").write_bytes(b"not the cubin")
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LaunchError, match="does not match the metadata"):
        CubinKernel.from_dir(tmp_path)
    with pytest.raises(LaunchError, match="cannot read build folder"):
        CubinKernel.from_dir(tmp_path / "missing")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without a GPU")
def test_no_gpu_is_one_clear_error():
    k = CubinKernel(b"\0", _meta())
    with pytest.raises(LaunchError, match="^no CUDA device"):
        k(torch.zeros(4, 96), 1.0, 4, torch.empty(4, 96))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_launch_prebuilt_fixture_on_gpu():
    """The committed build of tests/fixtures/scale_op.py computes y = x * alpha + n."""
    k = CubinKernel.from_dir(PREBUILT)
    x = torch.randn(4, 96, device="cuda")
    y = torch.full_like(x, float("nan"))
    k(x, 0.5, 4, y)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 0.5 + 4, rtol=0, atol=0)
    # A second kernel object with the same cubin reuses the process's module.
    k2 = CubinKernel.from_dir(PREBUILT)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y2 = torch.empty_like(x)
        k2(x=x, alpha=-1.0, n=0, y=y2, stream=s)
    s.synchronize()
    torch.testing.assert_close(y2, -x, rtol=0, atol=0)
    assert len([key for key in launch._modules if key[1] == k.sha256]) == 1
    with pytest.raises(LaunchError, match="shape"):
        k(x[:2], 0.5, 4, y)


class _FakeDriver:
    """Records the driver calls the launcher makes; fails the one named in `fail`."""

    def __init__(self, fail=None):
        from cuda.bindings import driver as real

        self.CUresult = real.CUresult
        self.CUfunction_attribute = real.CUfunction_attribute
        self.CUlaunchConfig = real.CUlaunchConfig
        self.CUlaunchAttribute = real.CUlaunchAttribute
        self.CUlaunchAttributeID = real.CUlaunchAttributeID
        self.CUstream = lambda h: ("stream", int(h))
        self.calls = []
        self.fail = fail

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            if name in ("cuLaunchKernel", "cuLaunchCooperativeKernel"):
                # What the real driver does during the call: copy each parameter's bytes.
                ptrs = (ctypes.c_void_p * 4).from_address(args[9])
                self.param_bytes = [ctypes.string_at(p, 8) for p in ptrs]
            if name == "cuLaunchKernelEx":
                ptrs = (ctypes.c_void_p * 4).from_address(args[2])
                self.param_bytes = [ctypes.string_at(p, 8) for p in ptrs]
            if name == self.fail:
                return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
            if name == "cuGetErrorString":
                return (self.CUresult.CUDA_SUCCESS, b"invalid argument")
            if name in ("cuInit", "cuCtxSetCurrent", "cuFuncSetAttribute", "cuLaunchKernel",
                        "cuLaunchCooperativeKernel", "cuLaunchKernelEx"):
                return (self.CUresult.CUDA_SUCCESS,)
            return (self.CUresult.CUDA_SUCCESS, {"cuCtxGetCurrent": 0}.get(name, 1000 + len(self.calls)))

        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    """The launch path on CPU: a recording driver and a torch that claims one device."""
    monkeypatch.setattr(launch, "_contexts", {})
    monkeypatch.setattr(launch, "_modules", {})
    monkeypatch.setattr(launch, "_torch_ready", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 77})())

    def install(fail=None):
        drv = _FakeDriver(fail)
        monkeypatch.setattr(launch, "_driver", lambda: drv)
        return drv

    return install


def _cpu_kernel(meta):
    k = CubinKernel(b"cubin-bytes", meta)
    k.device_type = "cpu"
    return k


def test_launch_sequence_on_a_recording_driver(fake_cuda):
    drv = fake_cuda()
    k = _cpu_kernel(_meta())
    x, y = torch.zeros(4, 96), torch.empty(4, 96)
    k(x, 0.5, 4, y)
    k(x, 0.5, 4, y)
    names = [c[0] for c in drv.calls]
    # Context and module once; a launch per call, on torch's current stream.
    assert names == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent", "cuCtxSetCurrent",
                     "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel",
                     "cuCtxGetCurrent", "cuCtxSetCurrent", "cuLaunchKernel"]
    assert drv.calls[5][1] == (b"cubin-bytes",)
    assert drv.calls[6][1][1] == b"k"
    fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra = drv.calls[7][1]
    assert (gx, gy, gz, bx, by, bz, smem, stream, extra) == (6, 1, 1, 64, 1, 1, 0, ("stream", 77), 0)
    assert isinstance(params, int)  # the address of a void*[] (the form every cuda-bindings takes)
    assert drv.param_bytes[0] == struct.pack("<Q", x.data_ptr())
    assert drv.param_bytes[1][:4] == struct.pack("<f", 0.5)
    assert drv.param_bytes[2][:4] == struct.pack("<i", 4)
    assert drv.param_bytes[3] == struct.pack("<Q", y.data_ptr())
    # Another kernel object with the same cubin shares the loaded module.
    _cpu_kernel(_meta())(x, 0.5, 4, y)
    assert [c[0] for c in drv.calls].count("cuModuleLoadData") == 1


def test_large_smem_and_cooperative_launch(fake_cuda):
    drv = fake_cuda()
    meta = _meta()
    meta["launch"].update(smem_bytes=100 * 1024, cooperative=True)
    _cpu_kernel(meta)(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96), stream=5)
    calls = dict((c[0], c[1]) for c in drv.calls)
    fn, attr, value = calls["cuFuncSetAttribute"]
    assert attr == drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES and value == 100 * 1024
    assert "cuLaunchKernel" not in calls
    args = calls["cuLaunchCooperativeKernel"]
    assert args[7] == 100 * 1024 and args[8] == ("stream", 5)


@pytest.mark.parametrize("call", ["cuModuleLoadData", "cuLaunchKernel", "cuInit"])
def test_failed_driver_call_is_named(fake_cuda, call):
    fake_cuda(fail=call)
    with pytest.raises(LaunchError, match=f"^{call} failed: CUDA_ERROR_INVALID_VALUE: invalid argument$"):
        _cpu_kernel(_meta())(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96))


def test_bad_argument_launches_nothing(fake_cuda):
    drv = fake_cuda()
    with pytest.raises(LaunchError, match="shape"):
        _cpu_kernel(_meta())(torch.zeros(4, 95), 0.5, 4, torch.empty(4, 96))
    assert "cuLaunchKernel" not in [c[0] for c in drv.calls]


def test_pdl_launch_uses_launch_kernel_ex_with_the_attribute(fake_cuda):
    from cuda.bindings import driver as real

    drv = fake_cuda()
    drv.CUstream = real.CUstream  # the launch config holds a real stream handle
    meta = _meta()
    meta["launch"].update(pdl=True, smem_bytes=512)
    x, y = torch.zeros(4, 96), torch.empty(4, 96)
    _cpu_kernel(meta)(x, 0.5, 4, y, stream=5)
    calls = dict((c[0], c[1]) for c in drv.calls)
    assert "cuLaunchKernel" not in calls and "cuLaunchCooperativeKernel" not in calls
    config, fn, params, extra = calls["cuLaunchKernelEx"]
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (6, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (64, 1, 1)
    assert config.sharedMemBytes == 512 and int(config.hStream) == 5 and extra == 0
    assert config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    # The parameters are packed exactly as for cuLaunchKernel.
    assert drv.param_bytes[0] == struct.pack("<Q", x.data_ptr())
    assert drv.param_bytes[1][:4] == struct.pack("<f", 0.5)
    assert drv.param_bytes[3] == struct.pack("<Q", y.data_ptr())


def test_pdl_without_the_flag_is_a_plain_launch(fake_cuda):
    drv = fake_cuda()
    meta = _meta()
    meta["launch"]["pdl"] = False
    _cpu_kernel(meta)(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96))
    names = [c[0] for c in drv.calls]
    assert "cuLaunchKernel" in names and "cuLaunchKernelEx" not in names


def test_pdl_and_cooperative_together_is_refused(fake_cuda):
    drv = fake_cuda()
    meta = _meta()
    meta["launch"].update(pdl=True, cooperative=True)
    with pytest.raises(LaunchError, match="both cooperative and pdl"):
        _cpu_kernel(meta)(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96))
    assert not any(c[0].startswith("cuLaunch") for c in drv.calls)


def test_a_written_buffer_must_not_alias_another_argument():
    x = torch.zeros(4, 96)
    with pytest.raises(LaunchError, match="'x' and 'y' overlap"):
        _cpu_pack(x, 1.5, 4, x)  # in-place through the output: the kernel's contract is separate buffers
    big = torch.zeros(8 * 96)
    with pytest.raises(LaunchError, match="overlap"):
        _cpu_pack(big[:384].view(4, 96), 1.5, 4, big[256:640].view(4, 96))  # partial overlap
    # Adjacent, non-overlapping views of one allocation are fine.
    values, _ = _cpu_pack(big[:384].view(4, 96), 1.5, 4, big[384:].view(4, 96))
    assert len(values) == 4


def test_cluster_launch_sets_the_cluster_dimension(fake_cuda):
    """A launch with `cluster` goes through cuLaunchKernelEx with the cluster-dimension
    attribute (and the pdl attribute beside it when both are set)."""
    from cuda.bindings import driver as real

    drv = fake_cuda()
    drv.CUstream = real.CUstream
    meta = _meta()
    meta["launch"].update(grid=[6, 1, 1], cluster=[2, 1, 1])
    _cpu_kernel(meta)(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96), stream=5)
    calls = dict((c[0], c[1]) for c in drv.calls)
    assert "cuLaunchKernel" not in calls
    config = calls["cuLaunchKernelEx"][0]
    assert config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z) == (2, 1, 1)
    drv.calls.clear()
    meta["launch"]["pdl"] = True
    _cpu_kernel(meta)(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96), stream=5)
    config = dict((c[0], c[1]) for c in drv.calls)["cuLaunchKernelEx"][0]
    assert [a.id for a in config.attrs[:config.numAttrs]] == [
        real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION]


def test_a_cluster_that_does_not_divide_the_grid_is_refused(fake_cuda):
    drv = fake_cuda()
    meta = _meta()
    meta["launch"].update(grid=[6, 1, 1], cluster=[4, 1, 1])
    with pytest.raises(LaunchError, match=r"cluster \[4, 1, 1\] does not divide the grid \[6, 1, 1\]"):
        _cpu_kernel(meta)(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96))
    meta["launch"]["cluster"] = [0, 1, 1]
    with pytest.raises(LaunchError, match=r"cluster \[0, 1, 1\] does not divide"):
        _cpu_kernel(meta)(torch.zeros(4, 96), 0.5, 4, torch.empty(4, 96))
    assert not any(c[0].startswith("cuLaunch") for c in drv.calls)


# -- tensor maps (TMA) -------------------------------------------------------------------------


def _map_param(i=0, name="w", shape=(256, 192), box=(64, 128), swizzle=128, size=128, align=64, l2=None):
    tma = {"box": list(box), "swizzle": swizzle, **({} if l2 is None else {"l2_promotion": l2})}
    return {"index": i, "name": name, "role": "static", "direction": "in", "ptx_name": f"k_param_{i}",
            "ptx_type": "b8", "size": size, "align": align,
            "spec": {"kind": "tensor", "shape": list(shape), "dtype": "bfloat16",
                     "tma": tma}}


def test_tensor_map_args_name_the_dims_innermost_first():
    args = launch.tensor_map_args(_map_param(), 0x7f0000001000)
    assert args == {"dtype": "bfloat16", "rank": 2, "address": 0x7f0000001000, "dims": [192, 256],
                    "pitches": [384], "box": [64, 128], "element_strides": [1, 1], "swizzle": 128,
                    "l2_promotion": 256}


@pytest.mark.parametrize("change, message", [
    (dict(box=(64, 512)), r"box \[64, 512\] must be 1..256 per dim"),
    (dict(box=(64,)), "a tensor map of rank 2 needs a box of as many dims"),
    (dict(box=(128, 64)), r"inner extent \(256 B\) exceeds the 128-byte swizzle"),
    (dict(swizzle=48), "swizzle 48 not in"),
    (dict(shape=(256, 196), box=(8, 64), swizzle=0), "16-byte aligned rows"),
    (dict(box=(4, 64), swizzle=0), r"inner extent \(8 B\) is not a multiple of 16 bytes"),
    (dict(l2=32), "L2 promotion 32 not in"),
])
def test_tensor_maps_the_hardware_refuses_are_clear_errors(change, message):
    with pytest.raises(LaunchError, match=message):
        launch.tensor_map_args(_map_param(**change), 0x1000)


def test_pack_args_passes_the_encoded_map_by_value():
    w = torch.zeros(256, 192, dtype=torch.bfloat16)
    seen = []
    raw = bytes(range(128))
    values, types = pack_args([_map_param()], [w], device_type="cpu",
                              encode_map=lambda a: seen.append(a) or raw)
    assert bytes(values[0]) == raw and ctypes.sizeof(types[0]) == 128
    assert seen == [launch.tensor_map_args(_map_param(), w.data_ptr())]
    # the tensor is checked like any buffer before anything is encoded
    with pytest.raises(LaunchError, match="shape"):
        pack_args([_map_param()], [torch.zeros(256, 64, dtype=torch.bfloat16)], device_type="cpu",
                  encode_map=lambda a: raw)
    # a map must land in a 128-byte, 64-aligned parameter
    with pytest.raises(LaunchError, match="a tensor map must be a 128-byte parameter aligned to 64"):
        pack_args([_map_param(size=8, align=8)], [w], device_type="cpu", encode_map=lambda a: raw)


class _MapDriver:
    """cuTensorMapEncodeTiled as cuda-bindings exposes it, recording its arguments."""

    def __init__(self):
        from cuda.bindings import driver as real

        self.real = real
        self.calls = []
        self._keep = []

    def __getattr__(self, name):
        if name == "cuTensorMapEncodeTiled":
            def encode(*args):
                self.calls.append(args)
                buf = (ctypes.c_uint8 * 128)(*range(128))
                self._keep.append(buf)
                return (self.real.CUresult.CUDA_SUCCESS, type("M", (), {"getPtr": lambda s: ctypes.addressof(buf)})())
            return encode
        return getattr(self.real, name)


def test_encode_tensor_map_calls_the_driver_with_the_map(monkeypatch):
    drv = _MapDriver()
    monkeypatch.setattr(launch, "_driver", lambda: drv)
    args = launch.tensor_map_args(_map_param(), 0x10000)
    assert launch.encode_tensor_map(args) == bytes(range(128))
    (dtype, rank, addr, dims, pitches, box, estr, inter, swz, l2, oob), = drv.calls
    e = drv.real
    assert dtype == e.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 and rank == 2 and addr == 0x10000
    assert [int(v) for v in dims] == [192, 256] and [int(v) for v in pitches] == [384]
    assert [int(v) for v in box] == [64, 128] and [int(v) for v in estr] == [1, 1]
    assert swz == e.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    assert inter == e.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    assert l2 == e.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B
    assert oob == e.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
    launch.encode_tensor_map(launch.tensor_map_args(_map_param(l2=0), 0x10000))
    assert drv.calls[-1][9] == e.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE


def test_a_kernel_encodes_each_map_once(fake_cuda, monkeypatch):
    """Through a launch: the map reaches the kernel as its 128 bytes, is encoded once per
    buffer (a second launch on the same tensor reuses it), and the cache stays bounded."""
    drv = fake_cuda()
    maps = _MapDriver()
    monkeypatch.setattr(drv, "cuTensorMapEncodeTiled", maps.cuTensorMapEncodeTiled, raising=False)
    for name in ("CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle", "CUtensorMapL2promotion",
                 "CUtensorMapFloatOOBfill", "cuuint64_t", "cuuint32_t"):
        monkeypatch.setattr(drv, name, getattr(maps.real, name), raising=False)
    out = {"index": 1, "name": "y", "role": "activation", "direction": "out", "ptx_name": "k_param_1",
           "ptx_type": "b8", "size": 8, "align": 8, "spec": {"kind": "tensor", "shape": [4], "dtype": "float32"}}
    params = [_map_param()] + [dict(out, index=i, name=n, ptx_name=f"k_param_{i}") for i, n in ((1, "y"), (2, "z"), (3, "q"))]
    k = _cpu_kernel({"kernel": "t", "entry": "k", "params": params, "launch": {"grid": [1, 1, 1], "block": [32, 1, 1]}})
    w = torch.zeros(256, 192, dtype=torch.bfloat16)
    y, z, q = (torch.zeros(4) for _ in range(3))
    k(w, y, z, q)
    k(w, y, z, q)
    assert len(maps.calls) == 1 and [c[0] for c in drv.calls].count("cuLaunchKernel") == 2
    assert drv.param_bytes[0] == bytes(range(8))  # the map's first bytes, by value
    w2 = torch.zeros(256, 192, dtype=torch.bfloat16)
    k(w2, y, z, q)
    assert len(maps.calls) == 2
    monkeypatch.setattr(launch, "MAP_CACHE", 2)
    for _ in range(3):
        k._tensor_map(launch.tensor_map_args(k.params[0], w.data_ptr() + 4096 * (len(maps.calls) + 1)))
    assert len(k._maps) == 2
