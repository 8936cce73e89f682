"""Triton's CPU interpreter with its custom-combine reductions vectorized, for the interpreter tests' children.

The interpreter runs ``tl.reduce`` with a combine function of the kernel's own (``max_nan``) one element at a
time in Python: that loop was most of the interpreter tests' time (a 64 x 64 tile's row maxima are 4096 calls).
``vectorize_reductions`` folds whole slices along the reduced axis instead: the same combine function, the same
left-to-right order and the input's dtype after every step, so each output element is what the element loop
computes. Import this module only with ``TRITON_INTERPRET=1`` set, and vectorize before any kernel runs.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl
from triton.runtime import interpreter

from diffusers_trtllm.kernels.triton_quant import max_nan


def vectorize_reductions() -> None:
    ops = interpreter.ReduceOps
    if not all(hasattr(ops, name) for name in ("generic_reduce", "unravel", "to_tensor")):
        raise RuntimeError(f"triton {triton.__version__}'s interpreter changed: update tests/triton_interpreter.py")
    elementwise = ops.generic_reduce

    def generic_reduce(self, input):
        if self.axis is None:  # all elements at once: the kernels reduce along an axis only
            return elementwise(self, input)
        slices = [np.moveaxis(x.handle.data, self.axis, 0) for x in input]
        shape = slices[0].shape[1:]  # () for a vector's: a scalar tensor, as the interpreter returns

        def step(values):
            return [self.to_tensor(np.asarray(v).reshape(shape), x.dtype) for v, x in zip(values, input)]

        acc = step(s[0] for s in slices)
        for i in range(1, slices[0].shape[0]):
            ret = self.combine_fn.fn(*acc, *step(s[i] for s in slices))
            acc = step(r.handle.data for r in (ret if isinstance(ret, tuple) else (ret,)))
        if self.keep_dims:
            return [self.to_tensor(np.expand_dims(a.handle.data, self.axis), x.dtype) for a, x in zip(acc, input)]
        return acc

    ops.generic_reduce = generic_reduce


@triton.jit
def max_nan_kernel(x_ptr, rows_ptr, cols_ptr, top_ptr, M: tl.constexpr, N: tl.constexpr):
    """``max_nan`` of an ``[M, N]`` tile by row, by column and of it all (the reductions kernels make)."""
    x = tl.load(x_ptr + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :])
    tl.store(rows_ptr + tl.arange(0, M), max_nan(x, 1))
    tl.store(cols_ptr + tl.arange(0, N), max_nan(x, 0))
    tl.store(top_ptr, max_nan(max_nan(x, 1), 0))
