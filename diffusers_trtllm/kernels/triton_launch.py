"""Triton launches without ``JITFunction.run``'s per-call work (issue 57).

``kernel[grid](...)`` costs ~50 us of CPU on every call (Triton 3.6 on an H100 host): it binds the arguments,
specializes each one, reads Triton's settings from the environment, builds its cache key as a string and
finds the compiled kernel, before the launch itself. A served attention call makes several launches, and on
an idle GPU that host time is the call's. :func:`launch` makes the first launch of each specialization the
normal way and keeps the ``CompiledKernel`` it returns, under a key of what that specialization depends on;
a repeat call computes the key (a few Python operations per argument) and calls the compiled kernel's
launcher directly, as ``JITFunction.run`` itself ends: ``run(grid0, grid1, grid2, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *every bound argument)``, the same on Triton 3.6,
3.7 and 3.9 (the launcher skips the constexpr arguments).

The key holds the current device, the launch options (``num_warps``, ``num_stages``, ...), every constexpr's
value, and for every other argument what Triton specializes it on (``_specialization``: a tensor's dtype and
16-byte alignment, an int's class, ...). An argument of any other type, a callable grid, Triton's interpreter
(``TRITON_INTERPRET=1``: the kernel is no ``JITFunction``), launch hooks (a profiler's), pre-run hooks and
pipeline-inspection hooks all take the normal path. Triton's environment settings (``TRITON_DEBUG``, ...) are
read at a specialization's first launch, not on every call, and the check that the kernel's global constants
are unchanged is not repeated.

:class:`BoundLaunch` goes one step further for a caller that repeats a whole call (the quantizer's plan per call
shape): every argument but the tensors is bound once, and a repeat checks only its tensors' dtypes and alignment.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["BoundLaunch", "cdiv", "launch", "launch_key"]

_REQUIRED = inspect.Parameter.empty
_TENSOR = torch.Tensor


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for grids and tile counts on the host: ``triton.cdiv`` is a ``constexpr_function``
    there, about 5 us of CPU a call from Python (Triton 3.9)."""
    return -(-a // b)


class _Unkeyed(Exception):
    """An argument whose specialization the key does not model: the call takes Triton's own path."""


class _Kernel:
    """A ``JITFunction``'s parameters (which are constexpr, their defaults), how each form of call binds to them,
    and its launchers by key."""

    __slots__ = ("fn", "names", "defaults", "constexprs", "runtime", "forms", "launchers")

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn  # keeps the kernel, whose id keys _KERNELS, alive
        self.names = tuple(p.name for p in fn.params)
        self.defaults = {n: fn.signature.parameters[n].default for n in self.names}
        self.constexprs = _getter([p.num for p in fn.params if p.is_constexpr])
        self.runtime = _getter([p.num for p in fn.params if not p.is_constexpr])
        self.forms: dict[tuple, tuple] = {}
        self.launchers: dict[tuple, tuple] = {}

    def bind(self, args: tuple, kwargs: dict) -> tuple[list, tuple, tuple]:
        """Every parameter's value in order (defaults applied), and the launch options' names and values."""
        form = (len(args), tuple(kwargs))
        found = self.forms.get(form)
        if found is None:
            found = self.forms[form] = self._form(len(args), kwargs)
        tail, fill, options = found
        values = [*args, *map((kwargs if not fill else {**fill, **kwargs}).__getitem__, tail)]
        return values, options, tuple(map(kwargs.__getitem__, options))

    def _form(self, n: int, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """For a call of ``n`` positional arguments and these keywords: the parameters after the positional ones,
        the defaults it leaves, and the keywords that are launch options."""
        tail = self.names[n:]
        fill = {name: self.defaults[name] for name in tail if name not in kwargs}
        if n > len(self.names) or _REQUIRED in fill.values() or set(self.names[:n]) & set(kwargs):
            raise _Unkeyed  # Triton's own path raises the TypeError
        return tail, fill, tuple(k for k in kwargs if k not in self.defaults)


def _getter(indices: list[int]) -> Callable[[list], tuple]:
    """The values at ``indices`` of a list, as a tuple (``itemgetter`` alone returns one value bare)."""
    if len(indices) == 1:
        return lambda values: (values[indices[0]],)
    return operator.itemgetter(*indices) if indices else lambda values: ()


def _specialization(x: Any) -> Any:
    """What Triton specializes a non-constexpr argument on: a tensor's dtype and 16-byte alignment; an int's
    class (1, a constant; divisible by 16; its 32-, 64- or unsigned 64-bit type); a host tensor descriptor's dtype,
    block, rank and padding; a float's, bool's, None's type."""
    t = type(x)
    if t is _TENSOR:
        return x.dtype, not x.data_ptr() & 15
    if t is int:
        if x == 1:
            return 1
        return (0 if -0x80000000 <= x <= 0x7FFFFFFF else (2 if x < 0x8000000000000000 else 4)) + (0 if x & 15 else 8)
    if t is float or t is bool or x is None:
        return t
    if t is TensorDescriptor:
        return t, x.base.dtype, tuple(x.block_shape), len(x.shape), x.padding, getattr(x, "round_f32_to_tf32", False)
    raise _Unkeyed


def _key(kernel: _Kernel, values: list, option_names: tuple, option_values: tuple, device: int) -> tuple:
    return (device, option_names, option_values, kernel.constexprs(values),
            *map(_specialization, kernel.runtime(values)))


def launch_key(kernel: JITFunction, *args: Any, **kwargs: Any) -> tuple | None:
    """The key :func:`launch` files this call's compiled kernel under (device 0), or None where it takes the
    normal path: for tests and for seeing why two calls share a compiled kernel or not."""
    spec = _kernel(kernel)
    if spec is None:
        return None
    try:
        return _key(spec, *spec.bind(args, kwargs), 0)
    except _Unkeyed:
        return None


def _kernel(kernel: Any) -> _Kernel | None:
    """``kernel``'s parameters, or None for what is no ``JITFunction`` (the interpreter's, an autotuner)."""
    spec = _KERNELS.get(id(kernel))
    if spec is None and isinstance(kernel, JITFunction):
        spec = _KERNELS[id(kernel)] = _Kernel(kernel)
    return spec


def _hooked(kernel: JITFunction) -> bool:
    """Whether anything observes launches (a profiler's launch hooks) or runs before them: the normal path."""
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # HookChain (3.6+) is empty unless hooks were added
            return True
    return bool(kernel.pre_run_hooks) or getattr(rt, "add_stages_inspection_hook", None) is not None


def launch(kernel: JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; a call whose specialization launched before calls its compiled kernel's
    launcher directly (module docstring)."""
    _launch(kernel, grid, args, kwargs)


def _launch(kernel: JITFunction, grid: tuple[int, ...], args: tuple, kwargs: dict) -> tuple | None:
    """``launch``; returns what a repeat of the call can launch with (``BoundLaunch``): the compiled kernel's
    launcher, function and metadata, every bound argument's value and the device, or None where Triton's own path
    ran and nothing was kept."""
    spec = _kernel(kernel)
    if spec is None or callable(grid) or _hooked(kernel):
        kernel[grid](*args, **kwargs)
        return None
    get_device, get_stream = _driver_calls()
    device = get_device()
    try:
        values, option_names, option_values = spec.bind(args, kwargs)
        key = _key(spec, values, option_names, option_values, device)
        found = spec.launchers.get(key)
    except (_Unkeyed, TypeError):  # TypeError: an unhashable constexpr
        kernel[grid](*args, **kwargs)
        return None
    if found is None:
        compiled = kernel[grid](*args, **kwargs)
        if not isinstance(compiled, CompiledKernel):  # a future of an asynchronous compile
            return None
        found = spec.launchers[key] = (compiled.run, compiled.function, compiled.packed_metadata)
    else:
        run, function, metadata = found
        run(*_grid3(grid), get_stream(device), function, metadata, None, None, None, *values)
    return (*found, values, device)


class BoundLaunch:
    """``kernel[grid](*args, **kwargs)`` made once, then again with other tensors in the places of ``args``' tensors
    (positional, in order): for a caller that repeats a call whose other arguments hold, as the quantizer's plan per
    call shape does. A repeat whose tensors have the first call's dtypes and 16-byte alignment, on its device, calls
    the compiled kernel's launcher with no key computed (``launch`` computes one for every argument, ~8 us of CPU a
    launch on an H200's host); any other takes ``launch``."""

    __slots__ = ("kernel", "grid", "args", "kwargs", "slots", "found")

    def __init__(self, kernel: JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        self.kernel, self.kwargs = kernel, kwargs
        self.grid = _grid3(grid)
        self.slots = tuple(i for i, x in enumerate(args) if isinstance(x, _TENSOR))
        self.args = tuple(None if i in self.slots else x for i, x in enumerate(args))  # no tensor kept alive
        self.found: tuple | None = None  # launcher, function, metadata, values, device, each tensor's (dtype, aligned)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if len(tensors) != len(self.slots):
            raise TypeError(f"this launch takes {len(self.slots)} tensors (its bound tensors' places); got {len(tensors)}")
        found = self.found
        if found is not None and not _hooked(self.kernel):
            run, function, metadata, values, device, kinds = found
            get_device, get_stream = _driver_calls()
            if get_device() == device and all(
                    (t.dtype, not t.data_ptr() & 15) == kind for t, kind in zip(tensors, kinds)):
                values = values.copy()
                for i, t in zip(self.slots, tensors):
                    values[i] = t
                run(*self.grid, get_stream(device), function, metadata, None, None, None, *values)
                return
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        found = _launch(self.kernel, self.grid, tuple(args), self.kwargs)
        if found is not None:
            *launcher, values, device = found
            values = [None if i in self.slots else x for i, x in enumerate(values)]
            self.found = (*launcher, values, device, tuple((t.dtype, not t.data_ptr() & 15) for t in tensors))


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    """A grid of one to three dimensions as the launcher takes it: three, the missing ones 1."""
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


def _driver_calls():
    """The active driver's current device and stream, as ``JITFunction.run`` reads them."""
    global _DRIVER_CALLS
    if _DRIVER_CALLS is None:
        _DRIVER_CALLS = (driver.active.get_current_device, driver.active.get_current_stream)
    return _DRIVER_CALLS


_DRIVER_CALLS = None
_KERNELS: dict[int, _Kernel] = {}
