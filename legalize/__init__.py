"""Legalization of redistributions (installed as ``tvm_distx.legalize``).

Planned: a cached redistribution planner and an N-D ``LegalizeRedistribute``
(see the project's issue tracker). Nothing is exported yet.
"""

__all__: list[str] = []
