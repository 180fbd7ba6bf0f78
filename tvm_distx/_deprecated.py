"""Old public names kept for one release: a module ``__getattr__`` that warns (PEP 562).

A module that moved keeps its old import path working through :class:`MovedModules`, an
import finder: ``import tvm_distx.presets`` (or ``from tvm_distx import presets``) warns and
gives ``tvm_distx.plans.presets`` itself.

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
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Callable, Mapping

__all__ = ["MovedModules", "deprecated_names", "resolve"]


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


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import finder for modules that moved: the old name warns and is the new module.

    Parameters
    ----------
    moved : mapping of str to str
        Each old module name to the module it now is (``"tvm_distx.presets"`` to
        ``"tvm_distx.plans.presets"``). The new module object is returned as it is, so
        ``old.name is new.name`` for everything in it.
    """

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(self, name, path=None, target=None):
        """A spec loaded by this finder for an old name; None for any other."""
        if name not in self.moved:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        """The new module, imported now, after a :class:`DeprecationWarning`."""
        new = self.moved[spec.name]
        warnings.warn(f"module {spec.name} is deprecated and will be removed in the next "
                      f"release; use {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the new module ran when it was imported."""

    def install(self) -> "MovedModules":
        """Put this finder on ``sys.meta_path`` once (after the regular finders)."""
        if not any(isinstance(f, MovedModules) and f.moved == self.moved for f in sys.meta_path):
            sys.meta_path.append(self)
        return self
