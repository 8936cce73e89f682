"""CUDA C++ kernels compiled at first use, and the few CUDA driver calls that run them.

A kernel source under ``kernels/csrc`` is compiled to a cubin once per (source, defines, compiler) and cached on
disk (``$DIFFUSERS_TRTLLM_CACHE`` or ``~/.cache/diffusers_trtllm``), as FlashInfer's JIT does. The compiler is
NVRTC, the runtime-compilation library that torch's CUDA wheels install (``nvidia-cuda-nvrtc``), so a plain
``pip install`` needs no CUDA toolkit; ``nvcc`` is used where ``$DIFFUSERS_TRTLLM_NVCC`` names one, or where no
NVRTC is found. No host compiler or Python extension is built. The cubin is loaded and launched through the
CUDA driver (``libcuda``, present wherever a GPU driver is) with ``ctypes``, on the current torch stream, so
launches are ordered with torch's own work and can be captured in CUDA graphs.

Where neither compiler is found, :func:`compiler_missing` says what to install, and a route built on this
module reports it as its reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .._logging import logger

__all__ = ["CudaKernel", "Nvcc", "Nvrtc", "TensorMap", "cache_dir", "compile_cubin", "compiler_missing",
           "current_stream", "find_compiler", "find_nvcc", "find_nvrtc", "load_kernels", "source_path"]

CSRC = Path(__file__).with_name("csrc")

# Driver enums used here (cuda.h).
_ATTR_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_TMAP_UINT8 = 0  # CU_TENSOR_MAP_DATA_TYPE_UINT8: int8 and fp8 tiles are bytes to the copy engine
_SWIZZLE = {64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_64B / _128B, by the box's row bytes
_L2_PROMOTE_256B = 3


def source_path(name: str) -> Path:
    return CSRC / name


def cache_dir() -> Path:
    """Where built cubins live: ``$DIFFUSERS_TRTLLM_CACHE/cubin``, by default ``~/.cache/diffusers_trtllm/cubin``."""
    root = os.environ.get("DIFFUSERS_TRTLLM_CACHE") or Path.home() / ".cache" / "diffusers_trtllm"
    return Path(root) / "cubin"


# ---- the compilers ------------------------------------------------------------------------------------

class Compiler(Protocol):
    """What :func:`compile_cubin` needs of a compiler: a name and version for the cache key, and a build."""

    name: str
    version: str

    def cubin(self, source: Path, arch: str, defines: tuple[str, ...]) -> bytes: ...


class CompileError(RuntimeError):
    pass


@dataclass(frozen=True)
class Nvcc:
    """The CUDA toolkit's compiler, run as ``nvcc -cubin``."""

    path: str
    name: str = "nvcc"

    @functools.cached_property
    def version(self) -> str:
        lines = subprocess.run([self.path, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()
        release = next((x for x in lines if "release" in x), lines[-1] if lines else "unknown")  # "... release 13.0, V13.0.88"
        return f"nvcc ({release.strip()}; {lines[-1].strip() if lines else ''})"

    def cubin(self, source: Path, arch: str, defines: tuple[str, ...]) -> bytes:
        flags = ["-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-std=c++17", "-Xptxas=-v",
                 *(f"-D{d}" for d in defines)]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "kernel.cubin"
            res = subprocess.run([self.path, *flags, "-o", str(out), str(source)], capture_output=True, text=True)
            if res.returncode != 0:
                raise CompileError(f"nvcc failed to build {source.name} for sm_{arch}:\n{res.stderr.strip()}")
            logger.debug("%s", res.stderr)
            return out.read_bytes()


class Nvrtc:
    """NVRTC through its C API (``nvrtcCreateProgram`` ... ``nvrtcGetCUBIN``): the source in, a cubin out."""

    name = "nvrtc"

    def __init__(self, path: str) -> None:
        self.path = path
        # NVRTC opens its builtins library by name at each compile; one beside a libnvrtc found by path (a
        # wheel's) is not on the loader's path, so it is loaded first, and the name then resolves to it.
        for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")) if os.sep in path else ():
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self._lib = ctypes.CDLL(path)
        vp, c_int, c_char_p = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
        sigs = {
            "nvrtcVersion": [ctypes.POINTER(c_int), ctypes.POINTER(c_int)],
            "nvrtcCreateProgram": [ctypes.POINTER(vp), c_char_p, c_char_p, c_int, vp, vp],
            "nvrtcCompileProgram": [vp, c_int, ctypes.POINTER(c_char_p)],
            "nvrtcGetProgramLogSize": [vp, ctypes.POINTER(ctypes.c_size_t)],
            "nvrtcGetProgramLog": [vp, c_char_p],
            "nvrtcGetCUBINSize": [vp, ctypes.POINTER(ctypes.c_size_t)],
            "nvrtcGetCUBIN": [vp, c_char_p],
            "nvrtcDestroyProgram": [ctypes.POINTER(vp)],
            "nvrtcGetErrorString": [c_int],
        }
        for fn_name, args in sigs.items():
            fn = getattr(self._lib, fn_name)
            fn.argtypes, fn.restype = args, c_int
        self._lib.nvrtcGetErrorString.restype = c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"NVRTC {major.value}.{minor.value} ({Path(path).name})"

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise CompileError(f"{what}: {self._lib.nvrtcGetErrorString(result).decode()}")

    def cubin(self, source: Path, arch: str, defines: tuple[str, ...]) -> bytes:
        lib = self._lib
        options = [f"--gpu-architecture=sm_{arch}", "--std=c++17", "--ptxas-options=-v",
                   "--device-as-default-execution-space", *(f"-D{d}" for d in defines)]
        prog = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = lib.nvrtcCompileProgram(prog, len(options), argv)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            if result != 0:
                raise CompileError(f"NVRTC failed to build {source.name} for sm_{arch}:\n"
                                   f"{log.value.decode(errors='replace').strip()}")
            logger.debug("%s", log.value.decode(errors="replace"))
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_nvcc() -> str | None:
    """nvcc, where one is installed: ``$DIFFUSERS_TRTLLM_NVCC``, ``$CUDA_HOME/bin/nvcc``, ``PATH``,
    ``/usr/local/cuda``. Route selection asks this on every attention call, so the search is remembered
    per value of those variables."""
    return _find_nvcc(*(os.environ.get(v) for v in ("DIFFUSERS_TRTLLM_NVCC", "CUDA_HOME", "CUDA_PATH", "PATH")))


@functools.lru_cache(maxsize=16)
def _find_nvcc(explicit: str | None, cuda_home: str | None, cuda_path: str | None, path: str | None) -> str | None:
    candidates = [explicit, *(str(Path(root) / "bin" / "nvcc") for root in (cuda_home, cuda_path) if root)]
    candidates += [shutil.which("nvcc", path=path), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _cuda_majors() -> tuple[int, ...]:
    """The CUDA major versions whose NVRTC fits this torch: its own first (CPU builds: 13, then 12)."""
    own = torch.version.cuda
    return (int(own.split(".")[0]),) if own else (13, 12)


def find_nvrtc() -> str | None:
    """The NVRTC library to compile with: ``$DIFFUSERS_TRTLLM_NVRTC``, else the copy an ``nvidia-cuda-nvrtc``
    wheel (a dependency of torch's CUDA wheels) put under ``site-packages/nvidia`` (``cu13/lib`` for CUDA 13,
    ``cuda_nvrtc/lib`` for CUDA 12), else ``$CUDA_HOME``'s, else ``libnvrtc.so.<major>`` as torch itself loads
    it (the dynamic loader); the CUDA major version is torch's own."""
    return _find_nvrtc(os.environ.get("DIFFUSERS_TRTLLM_NVRTC"), os.environ.get("CUDA_HOME"), tuple(sys.path))


@functools.lru_cache(maxsize=16)
def _find_nvrtc(explicit: str | None, cuda_home: str | None, search_path: tuple[str, ...]) -> str | None:
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for major in _cuda_majors():
        soname = f"libnvrtc.so.{major}"
        wheel_dirs = [Path(p) / "nvidia" / sub / "lib" for p in search_path if p for sub in (f"cu{major}", "cuda_nvrtc")]
        home_dirs = [Path(cuda_home) / lib for lib in ("lib64", "lib")] if cuda_home else []
        found = next((d / soname for d in wheel_dirs + home_dirs if (d / soname).is_file()), None)
        if found:
            return str(found)
        try:
            ctypes.CDLL(soname)
        except OSError:
            continue
        return _loaded_path(soname) or soname
    return None


def _loaded_path(soname: str) -> str | None:
    """Where the dynamic loader found an already loaded library (``/proc/self/maps``), for its neighbours."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    return next((line.split()[-1] for line in maps if line.endswith("/" + soname)), None)


def find_compiler() -> Compiler | None:
    """The nvcc ``$DIFFUSERS_TRTLLM_NVCC`` names (None if it names no executable: never another in its place);
    else NVRTC; else an installed nvcc; else None."""
    explicit = os.environ.get("DIFFUSERS_TRTLLM_NVCC")
    if explicit:
        named = _named_nvcc(explicit)
        return _nvcc(named) if named else None
    nvrtc = find_nvrtc()
    if nvrtc:
        return _nvrtc(nvrtc)
    nvcc = find_nvcc()
    return _nvcc(nvcc) if nvcc else None


@functools.lru_cache(maxsize=16)
def _named_nvcc(name: str) -> str | None:
    """The executable ``$DIFFUSERS_TRTLLM_NVCC`` names (a path, or a name on ``PATH``), remembered: route selection
    asks on every attention call."""
    return shutil.which(name)


@functools.lru_cache(maxsize=None)
def _nvcc(path: str) -> Nvcc:
    return Nvcc(path)


@functools.lru_cache(maxsize=None)
def _nvrtc(path: str) -> Nvrtc:
    return Nvrtc(path)


def compiler_missing() -> str | None:
    """Why CUDA C++ kernels cannot be built here, or None."""
    explicit = os.environ.get("DIFFUSERS_TRTLLM_NVCC")
    if explicit and _named_nvcc(explicit) is None:
        return f"DIFFUSERS_TRTLLM_NVCC={explicit} is not an executable nvcc: point it at one, or unset it to use NVRTC"
    if find_compiler() is None:
        major = _cuda_majors()[0]
        return (f"needs NVRTC or nvcc to build its kernel at first use, and found neither: install NVRTC "
                f"(pip install nvidia-cuda-nvrtc{'' if major >= 13 else '-cu12'}; torch's CUDA wheels bring it), "
                "or point DIFFUSERS_TRTLLM_NVRTC at a libnvrtc.so, or DIFFUSERS_TRTLLM_NVCC / CUDA_HOME at a CUDA toolkit")
    return None


def compile_cubin(source: Path, arch: str, defines: tuple[str, ...] = (), what: str | None = None,
                  compiler: Compiler | None = None, announce: bool = True) -> Path:
    """``source`` built for ``arch`` (e.g. ``"90a"``) with ``-D`` ``defines`` by ``compiler`` (None:
    :func:`find_compiler`'s), cached by source, defines and compiler. A build blocks its caller for seconds, so
    each one is announced at WARNING level (``what`` names what is built) unless ``announce`` is False (a build
    the user asked for); a cached cubin returns silently."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise RuntimeError(compiler_missing())
    key = hashlib.sha256("\0".join([source.read_text(), arch, *defines, compiler.name, compiler.version]).encode())
    target = cache_dir() / f"{source.stem}-sm{arch}-{key.hexdigest()[:20]}.cubin"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    what = what or source.name
    if announce:
        logger.warning("diffusers-trtllm: building %s for sm_%s with %s (a few seconds, once; cached in %s; "
                       "`python -m diffusers_trtllm build-kernels` builds every kernel ahead of time)",
                       what, arch, compiler.version, target.parent)
    start = time.perf_counter()
    cubin = compiler.cubin(source, arch, defines)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=target.stem, suffix=".tmp", delete=False) as tmp:
        tmp.write(cubin)
    os.replace(tmp.name, target)  # atomic: concurrent builders leave one complete file
    logger.info("built %s in %.1f s: %s", what, time.perf_counter() - start, target)
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
    """A TMA descriptor (the driver's 128-byte, 64-byte aligned ``CUtensorMap``) of a 2-D array of bytes,
    for a kernel parameter passed by value."""

    def __init__(self) -> None:
        self._buffer = ctypes.create_string_buffer(128 + 64)
        self.address = (ctypes.addressof(self._buffer) + 63) & ~63

    @classmethod
    def bytes_2d(cls, address: int, rows: int, cols: int, row_stride: int, box_cols: int, box_rows: int) -> "TensorMap":
        """Boxes of ``box_rows x box_cols`` bytes over a row-major ``rows x cols`` array of bytes at ``address``
        (``row_stride`` bytes apart), swizzled by the box's row width (64 or 128 bytes), as the kernels'
        shared-memory layout reads them."""
        m = cls()
        dims = (ctypes.c_uint64 * 2)(cols, rows)
        strides = (ctypes.c_uint64 * 1)(row_stride)
        box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
        ones = (ctypes.c_uint32 * 2)(1, 1)
        _check(_driver().cuTensorMapEncodeTiled(ctypes.c_void_p(m.address), _TMAP_UINT8, 2, ctypes.c_void_p(address),
                                                dims, strides, box, ones, 0, _SWIZZLE[box_cols], _L2_PROMOTE_256B, 0),
               f"cuTensorMapEncodeTiled(({rows}, {cols}), box {box_rows}x{box_cols})")
        return m

    @classmethod
    def cached_bytes_2d(cls, address: int, rows: int, cols: int, row_stride: int, box_cols: int,
                        box_rows: int) -> "TensorMap":
        """``bytes_2d``, reused while the address, shape, stride and box are the same: a descriptor holds nothing
        else (addresses are unique across devices: CUDA's unified addressing), and torch's caching allocator
        hands a layer's tensors of one shape the same memory call after call, so a call of a known shape mostly
        skips the driver's encoding."""
        key = (address, rows, cols, row_stride, box_cols, box_rows)
        found = _TENSOR_MAPS.get(key)
        if found is None:
            found = cls.bytes_2d(*key)
            with _lock:  # (a hit reads without it: one dict lookup is atomic)
                if len(_TENSOR_MAPS) >= _TENSOR_MAPS_MAX:
                    _TENSOR_MAPS.pop(next(iter(_TENSOR_MAPS)), None)
                _TENSOR_MAPS[key] = found
        return found


#: ``TensorMap.cached_bytes_2d``'s descriptors by what they describe, oldest first.
_TENSOR_MAPS: dict[tuple, TensorMap] = {}
_TENSOR_MAPS_MAX = 256


@dataclass(frozen=True)
class CudaKernel:
    """One ``extern "C"`` entry point of a loaded cubin and the dynamic shared memory it needs."""

    function: int
    shared_bytes: int
    name: str

    def launch(self, grid: tuple[int, int, int], block: int, arguments: ctypes.Array, stream: int) -> None:
        """Launch on the raw CUDA ``stream``; ``arguments`` holds each argument's address (a ``TensorMap``'s
        ``address``, a parameter block's), as ``cuLaunchKernel`` takes them. The driver copies the arguments at
        the launch, so their memory may be reused as soon as this returns."""
        result = _driver().cuLaunchKernel(self.function, *grid, block, 1, 1, self.shared_bytes, stream, arguments, None)
        if result:
            _check(result, f"launch of {self.name}")


def current_stream(device: torch.device) -> int:
    """The raw handle of torch's current stream on a CUDA ``device``, in one C call (no ``torch.cuda.Stream``
    object), as Triton reads it."""
    return torch._C._cuda_getCurrentRawStream(device.index)


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
