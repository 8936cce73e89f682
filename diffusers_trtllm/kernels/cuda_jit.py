"""CUDA C++ kernels compiled at first use, and the few CUDA driver calls that run them.

A kernel source under ``kernels/csrc`` is compiled once per (source, flags, nvcc) with ``nvcc -cubin``
and cached on disk (``$DIFFUSERS_TRTLLM_CACHE`` or ``~/.cache/diffusers_trtllm``), as FlashInfer's JIT
does; no host compiler or Python extension is built. The cubin is loaded and launched through the
CUDA driver (``libcuda``, present wherever a GPU driver is) with ``ctypes``, on the current torch
stream, so launches are ordered with torch's own work and can be captured in CUDA graphs.

Without ``nvcc`` (``$DIFFUSERS_TRTLLM_NVCC``, ``$CUDA_HOME/bin/nvcc``, ``PATH``, ``/usr/local/cuda``)
:func:`compiler_missing` says so, and a route built on this module reports it as its reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CudaKernel", "TensorMap", "compiler_missing", "find_nvcc", "load_kernels", "source_path"]

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")

# Driver enums used here (cuda.h).
_ATTR_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_TMAP_UINT8 = 0  # CU_TENSOR_MAP_DATA_TYPE_UINT8: int8 and fp8 tiles are bytes to the copy engine
_SWIZZLE = {64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_64B / _128B, by the box's row bytes
_L2_PROMOTE_256B = 3


def source_path(name: str) -> Path:
    return CSRC / name


def find_nvcc() -> str | None:
    """The nvcc to compile with: ``$DIFFUSERS_TRTLLM_NVCC``, ``$CUDA_HOME/bin/nvcc``, ``PATH``, ``/usr/local/cuda``.

    Route selection asks this on every attention call, so the file-system search is remembered per value
    of those variables."""
    return _find_nvcc(*(os.environ.get(v) for v in ("DIFFUSERS_TRTLLM_NVCC", "CUDA_HOME", "CUDA_PATH", "PATH")))


@functools.lru_cache(maxsize=16)
def _find_nvcc(explicit: str | None, cuda_home: str | None, cuda_path: str | None, path: str | None) -> str | None:
    candidates = [explicit, *(str(Path(root) / "bin" / "nvcc") for root in (cuda_home, cuda_path) if root)]
    candidates += [shutil.which("nvcc", path=path), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def compiler_missing() -> str | None:
    """Why CUDA C++ kernels cannot be built here, or None."""
    if find_nvcc() is None:
        return ("needs nvcc (the CUDA toolkit's compiler) to build its kernel at first use: install the CUDA "
                "toolkit, or point DIFFUSERS_TRTLLM_NVCC or CUDA_HOME at one")
    return None


def _cache_dir() -> Path:
    root = os.environ.get("DIFFUSERS_TRTLLM_CACHE") or Path.home() / ".cache" / "diffusers_trtllm"
    return Path(root) / "cubin"


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


def compile_cubin(source: Path, arch: str, defines: tuple[str, ...] = ()) -> Path:
    """``nvcc -cubin`` of ``source`` for ``arch`` (e.g. ``"90a"``), cached by content, flags and compiler."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError(compiler_missing())
    flags = ["-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-std=c++17", "-Xptxas=-v",
             *(f"-D{d}" for d in defines)]
    key = hashlib.sha256("\0".join([source.read_text(), *flags, _nvcc_version(nvcc)]).encode()).hexdigest()[:20]
    target = _cache_dir() / f"{source.stem}-sm{arch}-{key}.cubin"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building %s for sm_%s with %s (once; cached in %s)", source.name, arch, nvcc, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        res = subprocess.run([nvcc, *flags, "-o", str(out), str(source)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed to build {source.name} for sm_{arch}:\n{res.stderr.strip()}")
        logger.debug("%s", res.stderr)
        os.replace(out, target)  # atomic: concurrent builders leave one complete file
    return target


# ---- the driver ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    vp, c_int, c_uint = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
    sigs = {
        "cuGetErrorString": [c_int, ctypes.POINTER(ctypes.c_char_p)],
        "cuCtxGetCurrent": [ctypes.POINTER(vp)],
        "cuCtxSetCurrent": [vp],
        "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), c_int],
        "cuModuleLoadData": [ctypes.POINTER(vp), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
        "cuModuleGetGlobal_v2": [ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_size_t), vp, ctypes.c_char_p],
        "cuMemcpyDtoH_v2": [vp, vp, ctypes.c_size_t],
        "cuFuncSetAttribute": [vp, c_int, c_int],
        "cuLaunchKernel": [vp, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, vp, ctypes.POINTER(vp), vp],
        "cuTensorMapEncodeTiled": [vp, c_int, c_uint, vp, ctypes.POINTER(ctypes.c_uint64),
                                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                                   ctypes.POINTER(ctypes.c_uint32), c_int, c_int, c_int, c_int],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver error {result} in {what}: {(msg.value or b'?').decode()}")


def _make_context_current(device: torch.device) -> None:
    """torch's (primary) context for ``device`` on this thread, which a thread torch never used may lack."""
    drv = _driver()
    ctx = ctypes.c_void_p()
    _check(drv.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check(drv.cuDeviceGet(ctypes.byref(dev), device.index), "cuDeviceGet")
        _check(drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class TensorMap:
    """A TMA descriptor (the driver's 128-byte, 64-byte aligned ``CUtensorMap``) of a 2-D byte tensor,
    for a kernel parameter passed by value."""

    def __init__(self) -> None:
        self._buffer = ctypes.create_string_buffer(128 + 64)
        self.address = (ctypes.addressof(self._buffer) + 63) & ~63

    @classmethod
    def tiles_2d(cls, x: torch.Tensor, box_cols: int, box_rows: int) -> "TensorMap":
        """Boxes of ``box_rows x box_cols`` bytes over a row-major 2-D tensor of 1-byte elements,
        swizzled by the box's row width (64 or 128 bytes), as the kernels' shared-memory layout reads them."""
        if x.dim() != 2 or x.element_size() != 1 or x.stride(1) != 1:
            raise ValueError(f"a TMA map needs a 2-D tensor of bytes with unit inner stride; got {tuple(x.shape)}")
        m = cls()
        dims = (ctypes.c_uint64 * 2)(x.shape[1], x.shape[0])
        strides = (ctypes.c_uint64 * 1)(x.stride(0))
        box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
        ones = (ctypes.c_uint32 * 2)(1, 1)
        _check(_driver().cuTensorMapEncodeTiled(ctypes.c_void_p(m.address), _TMAP_UINT8, 2, ctypes.c_void_p(x.data_ptr()),
                                                dims, strides, box, ones, 0, _SWIZZLE[box_cols], _L2_PROMOTE_256B, 0),
               f"cuTensorMapEncodeTiled({tuple(x.shape)}, box {box_rows}x{box_cols})")
        return m


def argument_address(arg: TensorMap | ctypes.Structure) -> int:
    """Where a kernel argument's bytes are, for ``cuLaunchKernel``'s parameter list."""
    return arg.address if isinstance(arg, TensorMap) else ctypes.addressof(arg)


@dataclass(frozen=True)
class CudaKernel:
    """One ``extern "C"`` entry point of a loaded cubin and the dynamic shared memory it needs."""

    function: int
    shared_bytes: int
    name: str

    def launch(self, grid: tuple[int, int, int], block: int, args: list[TensorMap | ctypes.Structure],
               stream: torch.cuda.Stream) -> None:
        params = (ctypes.c_void_p * len(args))(*[argument_address(a) for a in args])
        _check(_driver().cuLaunchKernel(ctypes.c_void_p(self.function), *grid, block, 1, 1, self.shared_bytes,
                                        ctypes.c_void_p(stream.cuda_stream), params, None), f"launch of {self.name}")


_lock = threading.Lock()
_modules: dict[tuple[str, int], dict[str, CudaKernel]] = {}


def load_kernels(cubin: Path, names: tuple[str, ...], device: torch.device) -> dict[str, CudaKernel]:
    """The named entry points of ``cubin`` on ``device``; each reads its shared-memory size from the
    ``<name>_smem`` constant the source defines beside it."""
    key = (str(cubin), device.index)
    with _lock:
        if key in _modules:
            return _modules[key]
        torch.cuda.init()
        _make_context_current(device)
        drv = _driver()
        module = ctypes.c_void_p()
        _check(drv.cuModuleLoadData(ctypes.byref(module), cubin.read_bytes()), f"loading {cubin.name}")
        kernels = {}
        for name in names:
            fn, ptr, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
            _check(drv.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), f"finding {name}")
            _check(drv.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), module, f"{name}_smem".encode()),
                   f"finding {name}_smem")
            smem = ctypes.c_int()
            _check(drv.cuMemcpyDtoH_v2(ctypes.byref(smem), ptr, ctypes.sizeof(smem)), f"reading {name}_smem")
            _check(drv.cuFuncSetAttribute(fn, _ATTR_MAX_DYNAMIC_SHARED, smem.value), f"shared memory of {name}")
            kernels[name] = CudaKernel(fn.value, smem.value, name)
        _modules[key] = kernels
        return kernels
