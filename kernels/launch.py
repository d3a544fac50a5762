"""Launch an AOT-built cubin through the CUDA driver API with torch tensors.

The GPU host needs neither the DSL nor a compiler: `kernels/build` wrote `kernel.cubin` and
`meta.json` (entry name, parameters in launch order with their PTX types and tensor specs, launch
configuration); this module loads the cubin with `cuda.bindings.driver` and launches it.

Kernels compiled with static layouts trust every pointer they get: a wrong shape, dtype, stride
or alignment reads or writes out of bounds silently. So every buffer argument is checked against
the spec recorded at build time before anything is launched, and every driver call is checked.

Importing this module needs only the standard library; torch and cuda-bindings are imported
when a kernel is loaded or launched.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Sequence

# Dynamic shared memory above this needs an explicit opt-in per function (CUDA's default cap).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
POINTER_ALIGNMENT = 16  # kernels are compiled assuming 16-byte aligned buffers (vector loads)
TENSOR_MAP_BYTES = 128  # a CUtensorMap: by value in the parameter space, 64-byte aligned
TENSOR_MAP_ALIGN = 64
TENSOR_MAP_SWIZZLES = (0, 32, 64, 128)
TENSOR_MAP_L2_PROMOTIONS = (0, 64, 128, 256)
MAP_CACHE = 256  # encoded tensor maps a kernel keeps (one per buffer address and box)
_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "uint32": 4, "int64": 8}

# PTX parameter type -> ctypes type of the by-value argument.
_PTX_SCALAR_CTYPES = {
    "u8": ctypes.c_uint8, "s8": ctypes.c_int8, "b8": ctypes.c_uint8,
    "u16": ctypes.c_uint16, "s16": ctypes.c_int16, "b16": ctypes.c_uint16,
    "u32": ctypes.c_uint32, "s32": ctypes.c_int32, "b32": ctypes.c_uint32,
    "u64": ctypes.c_uint64, "s64": ctypes.c_int64, "b64": ctypes.c_uint64,
    "f32": ctypes.c_float, "f64": ctypes.c_double,
}
# Spec dtype of a scalar -> (ctypes type, Python kind, (min, max) for integers).
_SCALAR_DTYPES = {
    "int32": (ctypes.c_int32, int, (-(2**31), 2**31 - 1)),
    "uint32": (ctypes.c_uint32, int, (0, 2**32 - 1)),
    "int64": (ctypes.c_int64, int, (-(2**63), 2**63 - 1)),
    "float32": (ctypes.c_float, float, None),
    "float64": (ctypes.c_double, float, None),
}


class LaunchError(RuntimeError):
    """A kernel cannot be loaded or launched: no device, bad arguments, or a failed driver call."""


# -- argument packing (pure, CPU-testable) -----------------------------------------------------


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def check_tensor(param: dict, tensor, *, device_type: str = "cuda") -> None:
    """Raise LaunchError unless `tensor` matches the buffer spec recorded for `param`.

    Checked: it is a torch tensor of the recorded dtype and exact shape, row-major contiguous
    (strides equal the compact row-major strides), on a `device_type` device, and its data
    pointer is 16-byte aligned.
    """
    name = param.get("name", f"#{param.get('index')}")
    spec = param["spec"]
    if not hasattr(tensor, "data_ptr") or not hasattr(tensor, "dtype"):
        raise LaunchError(f"parameter {name!r}: expected a torch tensor, got {type(tensor).__name__}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype != spec["dtype"]:
        raise LaunchError(f"parameter {name!r}: dtype {dtype}, the kernel was built for {spec['dtype']}")
    shape = tuple(tensor.shape)
    if shape != tuple(spec["shape"]):
        raise LaunchError(
            f"parameter {name!r}: shape {list(shape)}, the kernel was built for {list(spec['shape'])}"
        )
    # A size-1 dim's stride is never used to address memory, so torch leaves it free.
    expected = _row_major_strides(shape)
    if any(n > 1 and st != ex for n, st, ex in zip(shape, tensor.stride(), expected)):
        raise LaunchError(
            f"parameter {name!r}: strides {list(tensor.stride())} are not compact row-major "
            f"{list(expected)} (call .contiguous())"
        )
    if tensor.device.type != device_type:
        raise LaunchError(f"parameter {name!r}: tensor is on {tensor.device}, expected a {device_type} tensor")
    ptr = tensor.data_ptr()
    if ptr % POINTER_ALIGNMENT:
        raise LaunchError(
            f"parameter {name!r}: data pointer {ptr:#x} is not {POINTER_ALIGNMENT}-byte aligned "
            "(a view with an offset? pass a fresh contiguous tensor)"
        )


def _scalar_value(param: dict, value: Any):
    name = param.get("name", f"#{param.get('index')}")
    spec = param["spec"]
    ctype, kind, bounds = _SCALAR_DTYPES[spec["dtype"]]
    if isinstance(value, bool) or hasattr(value, "data_ptr"):
        raise LaunchError(f"parameter {name!r}: expected a Python {kind.__name__}, got {type(value).__name__}")
    if kind is int:
        if not isinstance(value, int):
            raise LaunchError(f"parameter {name!r}: expected an int ({spec['dtype']}), got {value!r}")
        lo, hi = bounds
        if not lo <= value <= hi:
            raise LaunchError(f"parameter {name!r}: {value} does not fit {spec['dtype']}")
    else:
        if not isinstance(value, (int, float)):
            raise LaunchError(f"parameter {name!r}: expected a float ({spec['dtype']}), got {value!r}")
        value = float(value)
    ptx_ctype = _PTX_SCALAR_CTYPES.get(param["ptx_type"])
    if ptx_ctype is None or ctypes.sizeof(ptx_ctype) != ctypes.sizeof(ctype) or param["size"] != ctypes.sizeof(ctype):
        raise LaunchError(
            f"parameter {name!r}: spec dtype {spec['dtype']} does not match the PTX parameter "
            f".{param['ptx_type']} ({param['size']} bytes)"
        )
    return ctype(value), ctype


def tensor_map_args(param: dict, ptr: int) -> dict:
    """The `cuTensorMapEncodeTiled` arguments for a buffer parameter read by TMA, as plain values
    (pure: CPU-testable). The tensor is the spec's row-major buffer at `ptr`; the map names its
    dims innermost first, with the byte pitch of every dim past the first, and the spec's box
    and swizzle. Raises LaunchError on a map the hardware refuses."""
    name = param.get("name", f"#{param.get('index')}")
    spec = param["spec"]
    tma = spec["tma"]
    shape = [int(v) for v in spec["shape"]]
    esize = _ELEMENT_BYTES[spec["dtype"]]
    dims = list(reversed(shape))
    box = [int(v) for v in tma["box"]]
    swizzle = int(tma.get("swizzle", 0))
    if len(box) != len(dims) or not 1 <= len(dims) <= 5:
        raise LaunchError(f"parameter {name!r}: a tensor map of rank {len(dims)} needs a box of as many "
                          f"dims (1..5), got {box}")
    if any(not 1 <= b <= 256 or b > d for b, d in zip(box, dims)):
        raise LaunchError(f"parameter {name!r}: box {box} must be 1..256 per dim and within the dims {dims}")
    if swizzle not in TENSOR_MAP_SWIZZLES:
        raise LaunchError(f"parameter {name!r}: swizzle {swizzle} not in {TENSOR_MAP_SWIZZLES}")
    if swizzle and box[0] * esize > swizzle:
        raise LaunchError(f"parameter {name!r}: the box's inner extent ({box[0] * esize} B) exceeds the "
                          f"{swizzle}-byte swizzle")
    if (box[0] * esize) % 16:
        raise LaunchError(f"parameter {name!r}: the box's inner extent ({box[0] * esize} B) is not a "
                          "multiple of 16 bytes")
    pitches, acc = [], esize
    for d in dims[:-1]:
        acc *= d
        pitches.append(acc)
    if any(p % 16 for p in pitches) or ptr % 16:
        raise LaunchError(f"parameter {name!r}: TMA needs 16-byte aligned rows and base address "
                          f"(pitches {pitches}, address {ptr:#x})")
    l2 = int(tma.get("l2_promotion", 256))
    if l2 not in TENSOR_MAP_L2_PROMOTIONS:
        raise LaunchError(f"parameter {name!r}: L2 promotion {l2} not in {TENSOR_MAP_L2_PROMOTIONS}")
    return {"dtype": spec["dtype"], "rank": len(dims), "address": int(ptr), "dims": dims,
            "pitches": pitches, "box": box, "element_strides": [1] * len(dims), "swizzle": swizzle,
            "l2_promotion": l2}


def encode_tensor_map(args: dict) -> bytes:
    """The 128-byte CUtensorMap for `tensor_map_args`' values, from the driver
    (`cuTensorMapEncodeTiled`: needs the CUDA driver, not a device context)."""
    driver = _driver()
    dtype = {"bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
             "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32", "int32": "CU_TENSOR_MAP_DATA_TYPE_INT32",
             "uint32": "CU_TENSOR_MAP_DATA_TYPE_UINT32", "int64": "CU_TENSOR_MAP_DATA_TYPE_INT64"}[args["dtype"]]
    swz = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}[args["swizzle"]]
    l2 = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}[args["l2_promotion"]]
    e = driver
    tmap = _check(
        driver.cuTensorMapEncodeTiled(
            getattr(e.CUtensorMapDataType, dtype), args["rank"], args["address"],
            [e.cuuint64_t(v) for v in args["dims"]], [e.cuuint64_t(v) for v in args["pitches"]],
            [e.cuuint32_t(v) for v in args["box"]], [e.cuuint32_t(v) for v in args["element_strides"]],
            e.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(e.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swz}"),
            getattr(e.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" + l2),
            e.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled")
    raw = bytes((ctypes.c_char * TENSOR_MAP_BYTES).from_address(int(tmap.getPtr())))
    if len(raw) != TENSOR_MAP_BYTES:
        raise LaunchError(f"cuTensorMapEncodeTiled returned {len(raw)} bytes, expected {TENSOR_MAP_BYTES}")
    return raw


def pack_args(meta_params: Sequence[dict], args: Sequence[Any], *, device_type: str = "cuda",
              encode_map=encode_tensor_map):
    """Pack launch arguments the way the cubin's parameters expect them.

    `meta_params` is meta.json's "params" (launch order); `args` has one value per parameter:
    a torch tensor for a buffer (checked with `check_tensor`, passed as its u64 device address,
    or, when the spec has a tensor map, as the 128-byte map `encode_map` makes of
    `tensor_map_args`), a Python int/float for a scalar (passed as the 4- or 8-byte value of its
    spec dtype). Returns `(values, types)`: ctypes instances and their ctypes types, in
    parameter order.
    """
    if len(args) != len(meta_params):
        names = [p.get("name", "?") for p in meta_params]
        raise LaunchError(f"expected {len(meta_params)} arguments ({', '.join(names)}), got {len(args)}")
    values, types = [], []
    for param, arg in zip(meta_params, args):
        kind = param["spec"]["kind"]
        if kind == "tensor" and param["spec"].get("tma") is not None:
            if (param["size"], param.get("align")) != (TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN):
                raise LaunchError(
                    f"parameter {param.get('name')!r}: a tensor map must be a {TENSOR_MAP_BYTES}-byte "
                    f"parameter aligned to {TENSOR_MAP_ALIGN}, the PTX parameter is {param['size']} bytes"
                )
            check_tensor(param, arg, device_type=device_type)
            raw = encode_map(tensor_map_args(param, arg.data_ptr()))
            if len(raw) != TENSOR_MAP_BYTES:
                raise LaunchError(f"parameter {param.get('name')!r}: tensor map of {len(raw)} bytes")
            value = (ctypes.c_uint8 * TENSOR_MAP_BYTES).from_buffer_copy(raw)
            values.append(value)
            types.append(type(value))
        elif kind == "tensor":
            if param["size"] != 8:
                raise LaunchError(
                    f"parameter {param.get('name')!r}: a buffer must be one 8-byte pointer in the cubin, "
                    f"the PTX parameter is {param['size']} bytes"
                )
            check_tensor(param, arg, device_type=device_type)
            values.append(ctypes.c_uint64(arg.data_ptr()))
            types.append(ctypes.c_uint64)
        elif kind == "scalar":
            v, t = _scalar_value(param, arg)
            values.append(v)
            types.append(t)
        else:
            raise LaunchError(f"parameter {param.get('name')!r}: unknown kind {kind!r} in metadata")
    _check_no_aliasing(meta_params, args)
    return values, types


def _check_no_aliasing(meta_params: Sequence[dict], args: Sequence[Any]) -> None:
    """Refuse a written buffer that overlaps any other buffer argument.

    Static weights are read through the non-coherent path on the promise that nothing writes them
    during the launch, and a kernel's outputs are written on the promise that they are its own:
    one tensor passed as both breaks the kernel's contract silently, so it is an error here.
    """
    spans = []
    for param, arg in zip(meta_params, args):
        if param["spec"]["kind"] != "tensor":
            continue
        start = arg.data_ptr()
        spans.append((param.get("name", "?"), param.get("direction", "in"), start,
                      start + arg.numel() * arg.element_size()))
    for i, (name_a, dir_a, a0, a1) in enumerate(spans):
        for name_b, dir_b, b0, b1 in spans[i + 1:]:
            if "out" not in (dir_a + dir_b):
                continue
            if a0 < b1 and b0 < a1:
                raise LaunchError(
                    f"parameters {name_a!r} and {name_b!r} overlap in memory; a buffer the kernel "
                    "writes must not alias any other argument"
                )


def param_pointer_array(values: Sequence[ctypes._SimpleCData]) -> ctypes.Array:
    """The `void*[]` that cuLaunchKernel's kernelParams expects: the address of each value.

    We pass its address as an int, the form every cuda-bindings version accepts; the caller keeps
    `values` and the array alive until the launch call returns (the driver copies them then).
    """
    arr_t = ctypes.c_void_p * max(len(values), 1)
    return arr_t(*[ctypes.addressof(v) for v in values])


# -- driver ------------------------------------------------------------------------------------


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise LaunchError(f"cuda-bindings is not installed ({e}); pip install cuda-bindings") from None
    return driver


def _check(result, call: str):
    """Unwrap a cuda-bindings return tuple; raise LaunchError naming `call` on failure."""
    driver = _driver()
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != driver.CUresult.CUDA_SUCCESS:
        name = getattr(err, "name", str(err))
        try:
            r, desc = driver.cuGetErrorString(err)
            detail = f": {desc.decode()}" if r == driver.CUresult.CUDA_SUCCESS and desc else ""
        except Exception:  # the description is a courtesy; the name is the error
            detail = ""
        raise LaunchError(f"{call} failed: {name}{detail}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def ex_launch_config(driver, grid, block, smem: int, stream, *, pdl: bool = False, cluster=None):
    """A `CUlaunchConfig` for cuLaunchKernelEx.

    `pdl`: programmatic stream serialization allowed: the launch may begin before the previous
    kernel in `stream` completes (programmatic dependent launch); the kernel must
    `griddepcontrol.wait` before it reads anything the previous kernel writes. Stream capture
    turns it into a programmatic graph edge.
    `cluster` (x, y, z): thread block clusters of that shape, which must divide the grid.
    Returns (config, attributes); the caller keeps both alive until the launch call returns."""
    attrs = []
    if pdl:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cluster is not None:
        dims = [int(v) for v in cluster]
        if len(dims) != 3 or min(dims) < 1 or any(g % c for g, c in zip(grid, dims)):
            raise LaunchError(f"cluster {dims} does not divide the grid {list(grid)}")
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = dims
        attrs.append(attr)
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = (int(v) for v in grid)
    config.blockDimX, config.blockDimY, config.blockDimZ = (int(v) for v in block)
    config.sharedMemBytes = int(smem)
    config.hStream = stream
    config.attrs = attrs
    config.numAttrs = len(attrs)
    return config, attrs


_init_lock = threading.Lock()
_contexts: dict[int, Any] = {}  # device ordinal -> retained primary context
_torch_ready = False


def _ensure_context():
    """Make torch's primary context of the current device current; return (device ordinal, ctx)."""
    global _torch_ready
    try:
        import torch
    except ImportError:
        raise LaunchError("torch is not installed") from None
    if not _torch_ready:
        if not torch.cuda.is_available():
            raise LaunchError("no CUDA device: torch.cuda.is_available() is False (a CPU-only host can "
                              "build kernels but not launch them)")
        # Initialise torch's CUDA state first so the primary context we retain is the one torch uses.
        torch.cuda.init()
        _torch_ready = True
    dev = torch.cuda.current_device()
    driver = _driver()
    with _init_lock:
        ctx = _contexts.get(dev)
        if ctx is None:
            try:
                _check(driver.cuInit(0), "cuInit")
            except LaunchError:
                raise
            except Exception as e:  # driver library missing
                raise LaunchError(f"no CUDA device: cannot load the CUDA driver ({e})") from None
            cudev = _check(driver.cuDeviceGet(dev), "cuDeviceGet")
            ctx = _check(driver.cuDevicePrimaryCtxRetain(cudev), "cuDevicePrimaryCtxRetain")
            _contexts[dev] = ctx
    current = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if current is None or int(current) != int(ctx):
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev, ctx


_modules: dict[tuple[int, str], Any] = {}  # (device, cubin sha256) -> CUmodule, one per process


def _load_module(dev: int, cubin: bytes, sha: str):
    key = (dev, sha)
    with _init_lock:
        mod = _modules.get(key)
        if mod is None:
            mod = _check(_driver().cuModuleLoadData(cubin), "cuModuleLoadData")
            _modules[key] = mod
    return mod


def _stream_handle(stream):
    driver = _driver()
    if stream is None:
        import torch

        return driver.CUstream(torch.cuda.current_stream().cuda_stream)
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return driver.CUstream(stream.cuda_stream)
    if isinstance(stream, int):
        return driver.CUstream(stream)
    return stream  # a driver.CUstream already


class CubinKernel:
    """One AOT-built kernel: its cubin and metadata, launchable with torch tensors.

    Loading is lazy (first call), once per process and device, keyed by the cubin's sha256.
    """

    device_type = "cuda"  # what buffers must live on; tests of the launch path set "cpu"

    def __init__(self, cubin: bytes, meta: dict):
        self.cubin = bytes(cubin)
        self.meta = meta
        self.sha256 = hashlib.sha256(self.cubin).hexdigest()
        recorded = meta.get("hashes", {}).get("cubin_sha256")
        if recorded and recorded != self.sha256:
            raise LaunchError(
                f"{meta.get('kernel', 'kernel')}: cubin sha256 {self.sha256[:12]} does not match the "
                f"metadata's {recorded[:12]} (stale or tampered build folder)"
            )
        for key in ("entry", "params", "launch"):
            if key not in meta:
                raise LaunchError(f"metadata has no {key!r}: not written by kernels.build?")
        self.entry: str = meta["entry"]
        self.params: list[dict] = list(meta["params"])
        self.launch: dict = meta["launch"]
        self._functions: dict[int, Any] = {}
        self._maps: dict[tuple, bytes] = {}  # tensor maps by their encoding arguments, oldest first

    @classmethod
    def from_dir(cls, build_dir) -> "CubinKernel":
        """Read `kernel.cubin` and `meta.json` from a build folder written by kernels.build."""
        d = Path(build_dir)
        try:
            cubin = (d / "kernel.cubin").read_bytes()
            meta = json.loads((d / "meta.json").read_text())
        except OSError as e:
            raise LaunchError(f"cannot read build folder {d}: {e.strerror} ({e.filename})") from None
        except json.JSONDecodeError as e:
            raise LaunchError(f"{d / 'meta.json'}: not valid JSON ({e})") from None
        return cls(cubin, meta)

    def _tensor_map(self, args: dict) -> bytes:
        """`encode_tensor_map`, once per distinct map (same buffer, same box) per kernel; the
        MAP_CACHE most recently used maps are kept."""
        key = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(args.items()))
        raw = self._maps.pop(key, None)
        if raw is None:
            raw = encode_tensor_map(args)
        self._maps[key] = raw  # most recent last
        while len(self._maps) > MAP_CACHE:
            self._maps.pop(next(iter(self._maps)))
        return raw

    @property
    def param_names(self) -> list[str]:
        return [p.get("name", f"arg{p['index']}") for p in self.params]

    def load(self) -> None:
        """Load the module on the current device now, e.g. before CUDA-graph capture (where
        module loading is not allowed); launches load it on first use otherwise."""
        self._function()

    def _function(self):
        dev, _ = _ensure_context()
        fn = self._functions.get(dev)
        if fn is None:
            driver = _driver()
            mod = _load_module(dev, self.cubin, self.sha256)
            fn = _check(driver.cuModuleGetFunction(mod, self.entry.encode()), "cuModuleGetFunction")
            smem = int(self.launch.get("smem_bytes", 0))
            if smem > DEFAULT_DYNAMIC_SMEM_LIMIT:
                _check(
                    driver.cuFuncSetAttribute(
                        fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
                    ),
                    "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                )
            carveout = self.launch.get("smem_carveout")
            if carveout is not None:
                _check(
                    driver.cuFuncSetAttribute(
                        fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                        int(carveout)
                    ),
                    "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)",
                )
            self._functions[dev] = fn
        return dev, fn

    def bind(self, *args, **kwargs) -> list:
        """Arguments in parameter order, from positional and/or keyword (parameter name) values."""
        names = self.param_names
        if len(args) > len(names):
            raise LaunchError(f"{self.meta.get('kernel')}: {len(args)} arguments for {len(names)} parameters")
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise LaunchError(f"{self.meta.get('kernel')}: no parameter {k!r}; parameters: {', '.join(names)}")
            if k in bound:
                raise LaunchError(f"{self.meta.get('kernel')}: parameter {k!r} given twice")
            bound[k] = v
        missing = [n for n in names if n not in bound]
        if missing:
            raise LaunchError(f"{self.meta.get('kernel')}: missing arguments: {', '.join(missing)}")
        return [bound[n] for n in names]

    def __call__(self, *args, stream=None, **kwargs) -> None:
        """Launch asynchronously on `stream` (default: torch's current stream).

        Arguments follow the metadata's parameter order (or are given by name): torch CUDA
        tensors for buffers, Python numbers for scalars. Raises LaunchError on a bad argument
        (nothing launched) or a failed driver call.
        """
        ordered = self.bind(*args, **kwargs)
        dev, fn = self._function()  # first: a host without a GPU hears exactly that
        values, _types = pack_args(self.params, ordered, device_type=self.device_type,
                                   encode_map=self._tensor_map)
        for p, a in zip(self.params, ordered):
            if self.device_type == "cuda" and p["spec"]["kind"] == "tensor" and a.device.index != dev:
                raise LaunchError(f"parameter {p.get('name')!r} is on cuda:{a.device.index}, "
                                  f"the current device is cuda:{dev}")
        ptrs = param_pointer_array(values)
        grid = [int(v) for v in self.launch["grid"]]
        block = [int(v) for v in self.launch["block"]]
        smem = int(self.launch.get("smem_bytes", 0))
        driver = _driver()
        h_stream = _stream_handle(stream)
        cluster = self.launch.get("cluster")
        if self.launch.get("pdl") or cluster:
            if self.launch.get("cooperative"):
                raise LaunchError(f"{self.meta.get('kernel')}: a launch cannot be both cooperative and "
                                  "pdl or clustered")
            config, _attrs = ex_launch_config(driver, grid, block, smem, h_stream,
                                              pdl=bool(self.launch.get("pdl")), cluster=cluster)
            _check(driver.cuLaunchKernelEx(config, fn, ctypes.addressof(ptrs), 0), "cuLaunchKernelEx")
        elif self.launch.get("cooperative"):
            _check(
                driver.cuLaunchCooperativeKernel(fn, *grid, *block, smem, h_stream, ctypes.addressof(ptrs)),
                "cuLaunchCooperativeKernel",
            )
        else:
            _check(
                driver.cuLaunchKernel(fn, *grid, *block, smem, h_stream, ctypes.addressof(ptrs), 0),
                "cuLaunchKernel",
            )
        # `values` and `ptrs` stay referenced until here: the driver has copied the parameters.
        del values, ptrs
