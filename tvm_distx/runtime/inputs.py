"""A run's inputs as the command lines name them: ``-i x.npy`` in order, ``-i NAME=w.npy`` by name.

``tvm-distx run`` and a board's ``./run.sh run`` read their ``-i`` items here, so both
take and refuse the same things, before any rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from tvm_distx.errors import ArgumentError

__all__ = ["load_array", "read_inputs", "split_item"]


def load_array(path: str | Path, what: str) -> np.ndarray:
    """The ``.npy`` array at ``path``; a missing file, a directory or another format is refused.

    Raises
    ------
    ArgumentError
        Naming ``what`` (``"input file"``, ``"--input file"``) and the path.
    """
    path = Path(path)
    if path.is_dir():
        raise ArgumentError(f"{what} {path} is a directory, not a file",
                            hint=f"give the {what} itself")
    if not path.is_file():
        raise ArgumentError(f"{what} {path} does not exist")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ArgumentError(f"{what} {path} is not a .npy array ({err})",
                            hint="write it with numpy.save") from None


def split_item(item: str) -> tuple[str | None, str]:
    """``(name, path)`` of one ``-i`` item: ``NAME=PATH`` names a parameter, else ``(None, item)``.

    An existing file whose name holds ``=`` is a path, not a name.
    """
    name, sep, path = str(item).partition("=")
    if not sep or Path(item).is_file() or not name.isidentifier():
        return None, str(item)
    return name, path


def read_inputs(items: Sequence[str]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """The arrays of ``-i`` items: those in parameter order, and those named.

    Raises
    ------
    ArgumentError
        For a file that cannot be read, an unnamed input after named ones, or a name
        given twice.
    """
    inputs, named = [], {}
    for item in items:
        name, path = split_item(item)
        value = load_array(path, "input file")
        if name is None:
            if named:
                raise ArgumentError(f"input {item} comes after named inputs",
                                    hint="give the inputs in order first, then NAME=PATH ones")
            inputs.append(value)
        elif name in named:
            raise ArgumentError(f"input '{name}' is given twice", hint="give each input once")
        else:
            named[name] = value
    return inputs, named
