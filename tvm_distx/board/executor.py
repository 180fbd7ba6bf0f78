"""Run a rank plan with numpy and ctypes: the VM's program, with no TVM (PROTOTYPE, issue 31).

A plan (:mod:`tvm_distx.build.board_plan`) is the per-rank Relax program the VM would run,
as data. :class:`Executor` runs its functions: storage is numpy byte arrays, tensors are
numpy views of it, kernels are called through the tvm-ffi C ABI (``__tvm_ffi_<kernel>``,
the arguments as ``TVMFFIAny`` holding ``DLTensor`` pointers, as ``rvv_harness.c`` does),
and every ``tvm_distx.ccl.*`` call goes to ``collective(name, args)``.

This module imports numpy, ctypes and the standard library only: it is meant to run on a
board that has Debian's python3-numpy and nothing of TVM.
"""

from __future__ import annotations

import ctypes
import os
import logging

import numpy as np

__all__ = ["Executor", "Kernels", "PlanError"]

logger = logging.getLogger(__name__)

_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 1}
_DL_TENSOR_PTR = 7  # kTVMFFIDLTensorPtr
_DL_INT = 1  # kTVMFFIInt


class PlanError(RuntimeError):
    """The plan asks for something this executor cannot do, or a check of the program failed."""


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Any(ctypes.Structure):
    _fields_ = [("type_index", ctypes.c_int32), ("zero_padding", ctypes.c_uint32),
                ("v_int64", ctypes.c_int64)]


_SAFE_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Any), ctypes.c_int32,
                              ctypes.POINTER(_Any))
_PARALLEL_BODY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class _ParallelEnv(ctypes.Structure):
    _fields_ = [("sync_handle", ctypes.c_void_p), ("num_task", ctypes.c_int32)]


class Kernels:
    """A kernel library opened with ctypes, its backend hooks filled (one task, malloc'd scratch)."""

    def __init__(self, path: str) -> None:
        # lazy binding: the error reporter the kernels import (TVMFFIErrorSetRaisedFromCStrParts)
        # lives in TVM's runtime, absent here; it is only called when a kernel fails.
        # Local scope: every kernel library defines the same hook and entry names, and a
        # global one would interpose them on each library loaded after it (TVM's included).
        self.lib = ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        self._keep = []  # callbacks must outlive the library's use of them
        self._scratch: dict[int, np.ndarray] = {}

        @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
        def launch(body, cdata, num_task):
            env = _ParallelEnv(None, 1)
            return _PARALLEL_BODY(body)(0, ctypes.addressof(env), cdata)

        @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                          ctypes.c_int, ctypes.c_int)
        def alloc(device_type, device_id, size, code, bits):
            block = np.empty(max(int(size), 1) + 64, np.uint8)
            address = (block.ctypes.data + 63) // 64 * 64
            self._scratch[address] = block
            return address

        @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
        def free(device_type, device_id, pointer):
            self._scratch.pop(pointer, None)
            return 0

        for name, hook in (("__TVMBackendParallelLaunch", launch),
                           ("__TVMBackendAllocWorkspace", alloc),
                           ("__TVMBackendFreeWorkspace", free)):
            self._keep.append(hook)
            try:
                slot = ctypes.c_void_p.in_dll(self.lib, name)
            except ValueError:  # the kernels never need it
                continue
            slot.value = ctypes.cast(hook, ctypes.c_void_p).value
        self._kernels: dict[str, _SAFE_CALL] = {}

    def call(self, name: str, arrays: list) -> None:
        """Call kernel ``name`` on numpy arrays (outputs written in place) or integers."""
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = _SAFE_CALL(("__tvm_ffi_" + name, self.lib))
        args = (_Any * len(arrays))()
        keep = []
        for i, value in enumerate(arrays):
            if isinstance(value, np.ndarray):
                tensor = _dl_tensor(value)
                keep.append(tensor)
                args[i].type_index, args[i].v_int64 = _DL_TENSOR_PTR, ctypes.addressof(tensor[0])
            else:
                args[i].type_index, args[i].v_int64 = _DL_INT, int(value)
        result = _Any(0, 0, 0)
        if kernel(None, args, len(arrays), ctypes.byref(result)) != 0:
            raise PlanError(f"kernel {name} failed")


def _dl_tensor(array: np.ndarray):
    if not array.flags.c_contiguous:
        raise PlanError("kernels take contiguous arrays")
    shape = (ctypes.c_int64 * max(array.ndim, 1))(*array.shape)
    dtype = _DLDataType(_DL_CODES[array.dtype.kind], array.dtype.itemsize * 8, 1)
    tensor = _DLTensor(array.ctypes.data, _DLDevice(1, 0), array.ndim, dtype, shape, None, 0)
    return tensor, shape


class Executor:
    """Runs the functions of one rank's plan.

    Parameters
    ----------
    plan : dict
        A rank plan (``rank_plan``).
    kernels : Kernels
        The plan's kernel library.
    collective : callable
        ``collective(name, args)`` for every ``tvm_distx.ccl.*`` call (the arrays and
        integers as the plan gives them; the output buffer last).
    """

    def __init__(self, plan: dict, kernels: Kernels, collective) -> None:
        self.plan, self.kernels, self.collective = plan, kernels, collective

    def run(self, function: str, *args):
        """Run ``function`` on numpy arrays; returns its result."""
        code = self.plan["functions"].get(function)
        if code is None:
            raise PlanError(f"the plan has no function '{function}'")
        registers: list = [None] * code["registers"]
        for index, value in zip(code["params"], args):
            registers[index] = value
        for instruction in code["body"]:
            registers[instruction["dst"]] = self._step(instruction, registers)
        return self._value(code["result"], registers)

    def _value(self, operand: dict, registers: list):
        (kind, value), = operand.items()
        if kind == "var":
            return registers[value]
        if kind == "shape":
            return tuple(registers[d["var"]] if isinstance(d, dict) else d for d in value)
        if kind == "tuple":
            return tuple(self._value(v, registers) for v in value)
        return value  # int, float, str, dtype, null

    def _step(self, instruction: dict, registers: list):
        op = instruction["op"]
        args = [self._value(a, registers) for a in instruction["args"]]
        if op == "null":
            return None
        if op == "alias":
            return args[0]
        if op == "kill":
            return None
        if op == "alloc_storage":
            (size,), _, _, _ = args
            return np.zeros(size + 64, np.uint8)
        if op == "alloc_tensor":
            storage, offset, shape, dtype, _ = args
            base = (-storage.ctypes.data) % 64 + offset
            count = int(np.prod(shape, dtype=np.int64))
            return storage[base:base + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
        if op == "kernel":
            self.kernels.call(instruction["name"], args)
            return None
        if op == "call":
            return self.run(instruction["name"], *args)
        if op == "builtin":
            return self._builtin(instruction["name"], args)
        raise PlanError(f"unknown instruction {op}")

    def _builtin(self, name: str, args: list):
        if name.startswith("tvm_distx.ccl."):
            return self.collective(name, args)
        if name == "vm.builtin.check_tensor_info":
            value, ndim, dtype, context = args
            if value.ndim != ndim or str(value.dtype) != dtype:
                raise PlanError(f"{context.strip()}: got {value.dtype}{list(value.shape)}")
            return None
        if name == "vm.builtin.match_shape":
            value, _heap, ndim, *rest = args
            context = rest[-1]
            for axis, (mode, expected) in enumerate(zip(rest[:-1:2], rest[1:-1:2])):
                if mode == 0 and value.shape[axis] != expected:
                    raise PlanError(f"{context.strip()}: dimension {axis} is {value.shape[axis]}")
                if mode != 0:
                    raise PlanError(f"match_shape mode {mode} (symbolic extents) is not run yet")
            return None
        raise PlanError(f"the builtin {name} is not run by the board executor yet")
