"""Helpers of the PropagateSharding tests (test_propagate_sharding, test_propagate_within_function)."""

from __future__ import annotations

from tvm import relax

from tvm_distx.passes import PropagateSharding


def propagate(mod):
    out = PropagateSharding()(mod)
    relax.analysis.well_formed(out)  # raises on an ill-formed module
    return out
