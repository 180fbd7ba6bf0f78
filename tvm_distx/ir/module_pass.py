"""``module_pass``: TVM's module-pass decorator, keeping our errors intact.

A Python exception raised inside a TVM pass crosses TVM's C++ pass
infrastructure on its way back to the caller, and arrives as a generic
``RuntimeError`` with only its text. Users must be able to ``except
tvm_distx.errors.ShardingError`` and read ``err.function`` and ``err.var``, so:

- every :class:`~tvm_distx.errors.ShardingError` class is registered with
  tvm-ffi, so that its type survives any crossing (for example inside a
  ``tvm.transform.Sequential``);
- a pass decorated here re-raises the original exception object, with all its
  fields and its traceback, when it is called directly, however many times the
  error crossed the FFI on its way (passes call Python visitors from C++).
"""

from __future__ import annotations

import tvm
import tvm_ffi

from tvm_distx.errors import ShardingError, latest_error

__all__ = ["module_pass"]


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
        pass_cls = tvm.transform.module_pass(opt_level=opt_level, name=name)(cls)
        run = pass_cls.__call__

        def __call__(self, mod):
            try:
                return run(self, mod)
            except ShardingError as err:
                original = latest_error()
                if original is not None and original is not err and (
                    type(original) is type(err) and str(original) == str(err)
                ):
                    raise original from None
                raise

        pass_cls.__call__ = __call__
        return pass_cls

    return decorate
