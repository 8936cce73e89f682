"""Whether this machine has a CUDA GPU, asked of the NVIDIA driver with ``ctypes``: no torch import, so the command
line refuses ``--model`` on a machine without one in its argument check, before the slow imports."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["cuda_device_count"]

_DRIVER = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


def cuda_device_count() -> int:
    """The CUDA devices the driver shows this process (``CUDA_VISIBLE_DEVICES`` applies); 0 without a driver."""
    try:
        driver = ctypes.CDLL(_DRIVER)
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
