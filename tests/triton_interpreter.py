"""Triton's CPU interpreter with its custom-combine reductions vectorized, for the interpreter tests' children.

The interpreter runs ``tl.reduce`` with a combine function of the kernel's own (``max_nan``) one element at a
time in Python: that loop was most of the interpreter tests' time (a 64 x 64 tile's row maxima are 4096 calls).
``vectorize_reductions`` combines the two halves of the reduced axis instead, whole slices at a time, until one
is left: log2(n) calls of the same combine function, in the tree order a GPU reduces in (``tl.reduce`` asks for
an associative combine; ``max_nan``'s is exact in any order), the input's dtype kept after every step as the
element loop keeps it. Import this module only with ``TRITON_INTERPRET=1`` set, and vectorize before any
kernel runs.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl
from triton.runtime import interpreter

from diffusers_trtllm.kernels.triton_quant import max_nan


def vectorize_reductions() -> None:
    ops = interpreter.ReduceOps
    if not all(hasattr(ops, name) for name in ("generic_reduce", "to_tensor")):
        raise RuntimeError(f"triton {triton.__version__}'s interpreter changed: update tests/triton_interpreter.py")
    elementwise = ops.generic_reduce

    def generic_reduce(self, input):
        if self.axis is None:  # all elements at once: the kernels reduce along an axis only
            return elementwise(self, input)
        data = [np.moveaxis(x.handle.data, self.axis, 0) for x in input]

        def tensors(arrays):
            return [self.to_tensor(a, x.dtype) for a, x in zip(arrays, input)]

        while len(data[0]) > 1:
            half = len(data[0]) // 2
            ret = self.combine_fn.fn(*tensors(d[:half] for d in data), *tensors(d[half:2 * half] for d in data))
            data = [np.concatenate([r.handle.data.astype(d.dtype), d[2 * half:]])
                    for r, d in zip(ret if isinstance(ret, tuple) else (ret,), data)]
        if self.keep_dims:
            return tensors(np.expand_dims(d[0], self.axis) for d in data)
        return tensors(np.asarray(d[0]) for d in data)  # a vector's: 0-d, so a scalar tensor

    ops.generic_reduce = generic_reduce


@triton.jit
def max_nan_kernel(x_ptr, rows_ptr, cols_ptr, top_ptr, M: tl.constexpr, N: tl.constexpr):
    """``max_nan`` of an ``[M, N]`` tile by row, by column and of it all (the reductions kernels make)."""
    x = tl.load(x_ptr + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :])
    tl.store(rows_ptr + tl.arange(0, M), max_nan(x, 1))
    tl.store(cols_ptr + tl.arange(0, N), max_nan(x, 0))
    tl.store(top_ptr, max_nan(max_nan(x, 1), 0))
