"""Old public names kept for one release: a module ``__getattr__`` that warns (PEP 562).

A module that renamed or moved a public name keeps the old one working with::

    __getattr__ = deprecated_names(__name__, {"old_name": "tvm_distx.where.new_name"})

Reading ``module.old_name`` (or ``from module import old_name``) then emits a
:class:`DeprecationWarning` that names the new path, and returns the object at
that path, which is loaded only then. The old names are in neither ``__all__``
nor ``dir(module)``. This module imports nothing of ``tvm_distx``: any layer may
use it.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Callable, Mapping

__all__ = ["deprecated_names", "resolve"]


def resolve(path: str):
    """The object at a dotted path ``"package.module.name"``, importing its module."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def deprecated_names(module: str, renamed: Mapping[str, str],
                     fallback: Callable[[str], object] | None = None) -> Callable[[str], object]:
    """A module ``__getattr__`` for the deprecated names of ``module``.

    Parameters
    ----------
    module : str
        The module's ``__name__``.
    renamed : mapping of str to str
        Each old name to the dotted path of the object it now is.
    fallback : callable, optional
        Called with any other name (for example the module's own lazy names);
        without it, such a name raises :class:`AttributeError`.

    Returns
    -------
    callable
        The function to assign to the module's ``__getattr__``.
    """
    table = dict(renamed)

    def __getattr__(name: str):
        new = table.get(name)
        if new is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release; "
                      f"use {new}", DeprecationWarning, stacklevel=2)
        return resolve(new)

    __getattr__.deprecated = table  # for tests and for the API reference
    return __getattr__
