"""``module_pass``: TVM's module-pass decorator, keeping our errors intact.

A Python exception raised inside a TVM pass crosses TVM's C++ pass
infrastructure on its way back to the caller, and arrives as a generic
``RuntimeError`` with only its text. Users must be able to ``except
tvm_distx.ShardingError`` and read ``err.function`` and ``err.var``, so:

- every :class:`~tvm_distx.errors.ShardingError` class is registered with
  tvm-ffi, so that its type survives any crossing (for example inside a
  ``tvm.transform.Sequential``);
- a pass decorated here re-raises the original exception object, with all its
  fields and its traceback, when it is called directly.
"""

from __future__ import annotations

import functools
import threading

import tvm
import tvm_ffi

from .errors import ShardingError

__all__ = ["module_pass"]

_raised = threading.local()


def _register_errors(cls: type = ShardingError) -> None:
    tvm_ffi.register_error(cls.__name__, cls)
    for sub in cls.__subclasses__():
        _register_errors(sub)


_register_errors()


def module_pass(name: str, opt_level: int = 0):
    """Decorate a class with ``transform_module`` as a TVM module pass.

    Parameters
    ----------
    name : str
        The pass name, shown by TVM's pass instruments (``"tvm_distx.X"``).
    opt_level : int, default 0
        TVM's optimisation level; 0 means the pass always runs.
    """

    def decorate(cls):
        transform = cls.transform_module

        @functools.wraps(transform)
        def transform_module(self, mod, ctx):
            try:
                return transform(self, mod, ctx)
            except ShardingError as err:
                _raised.error = err
                raise

        cls.transform_module = transform_module
        pass_cls = tvm.transform.module_pass(opt_level=opt_level, name=name)(cls)
        run = pass_cls.__call__

        def __call__(self, mod):
            _raised.error = None
            try:
                return run(self, mod)
            except ShardingError as err:
                original = getattr(_raised, "error", None)
                if original is not None and type(original) is type(err):
                    raise original from None
                raise
            finally:
                _raised.error = None

        pass_cls.__call__ = __call__
        return pass_cls

    return decorate
