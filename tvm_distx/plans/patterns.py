"""``Preset``: placements for a function's parameters chosen by glob patterns.

Every plan of this package (:func:`~tvm_distx.plans.presets.megatron`,
:func:`~tvm_distx.plans.tensor_parallel.tensor_parallel`, the expert and
Hugging Face plans) is a :class:`Preset`: an ordered list of
``(glob, placement, mesh)`` entries, later ones winning. ``apply`` turns it into
:class:`~tvm_distx.layout.rules.ShardingRule` objects for one module and annotates
the module with them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Sequence

import tvm

from tvm_distx.errors import RuleError
from tvm_distx.layout.rules import ShardingRule, pattern_entries, rules_for
from tvm_distx.passes import AnnotateSharding

__all__ = ["Preset"]


@dataclass(frozen=True)
class Preset:
    """Placements for parameters of ``main`` chosen by glob patterns (later ones win).

    Parameters
    ----------
    patterns : tuple of (str, str, str or None)
        ``(glob over parameter names, placement, mesh)``; mesh None means the
        module's only mesh.
    """

    patterns: tuple[tuple[str, str, str | None], ...] = field(default_factory=tuple)

    def override(self, patterns: dict[str, str], mesh: str | None = None) -> "Preset":
        """A preset with ``patterns`` (glob -> placement) added after these (they win)."""
        return Preset(self.patterns + pattern_entries(patterns, mesh))

    def placements(self, names: Sequence[str]) -> dict[str, tuple[str, str | None]]:
        """The placement (and mesh) each matching name gets."""
        chosen: dict[str, tuple[str, str | None]] = {}
        for glob, placement, mesh in self.patterns:
            for name in names:
                if fnmatch.fnmatchcase(name, glob):
                    chosen[name] = (placement, mesh)
        return chosen

    def rules(self, mod: tvm.IRModule, function: str = "main") -> list[ShardingRule]:
        """The sharding rules this preset gives ``mod``'s parameters.

        Raises
        ------
        RuleError
            If no pattern matches any parameter (a preset for another model).
        """
        names = [p.name for p in mod[function].params]
        chosen = self.placements(names)
        if not chosen:
            raise RuleError(f"no parameter of '{function}' matches the preset's patterns "
                            f"({', '.join(g for g, _, _ in self.patterns)})",
                            function=function,
                            hint=f"its parameters are {', '.join(names[:8])}...; override the "
                            "preset's patterns")
        return rules_for(chosen, function)

    def apply(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` annotated with :meth:`rules`."""
        return AnnotateSharding(self.rules(mod, function))(mod)
