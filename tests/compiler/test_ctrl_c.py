"""A Ctrl-C that lands while TVM calls back into Python is an interruption, not a failure.

TVM's FFI hands a ``KeyboardInterrupt`` raised in a Python pass back to its caller as an
empty ``RuntimeError``; :class:`tvm_distx.ir.ctrl_c.CtrlCWatch` turns it back. The command
line's end-to-end case is in ``tests/cli/test_user_journey.py``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_distx.ir.ctrl_c import CtrlCWatch


@I.ir_module
class Small:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        return R.add(x, x)


@tvm.transform.module_pass(opt_level=0, name="PressCtrlC")
def _press_ctrl_c(mod, ctx):  # noqa: ARG001
    """A Python pass during which the user presses Ctrl-C."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.0)  # Python runs the handler here
    return mod


@pytest.fixture(autouse=True)
def _python_ctrl_c():
    """Python's own SIGINT handler, as in an interactive session (a background job has none)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_tvm_turns_the_interrupt_into_a_runtime_error():
    with pytest.raises(Exception) as caught:  # the reason for CtrlCWatch
        _press_ctrl_c(Small)
    assert not isinstance(caught.value, KeyboardInterrupt)


def test_the_watch_gives_the_interrupt_back():
    with pytest.raises(KeyboardInterrupt) as caught:
        with CtrlCWatch():
            _press_ctrl_c(Small)
    assert caught.value.__cause__ is not None  # TVM's error, kept for a debugger
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failure_without_ctrl_c_is_left_as_it_is():
    with pytest.raises(ValueError, match="not an interruption"):
        with CtrlCWatch() as watch:
            raise ValueError("not an interruption")
    assert not watch.pressed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_handler_no_watch():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with CtrlCWatch():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
