"""Random Relax programs with random shardings, and their numpy answers.

The randomized equivalence tests (``test_random_programs.py``) draw a
:class:`Program` with :func:`generate`, build it as an annotated Relax module
with :func:`build_module`, compile and run it with :func:`tvm_distx.compile`,
and compare with :func:`reference`, which evaluates the same program with
numpy on one process.

A program is a small description, not Relax: a list of operations per
function (``main`` and private functions called from it), each naming its
operands by index. Both the Relax module and the numpy answer are built from
that one description, so they cannot disagree about what the program is.

Covered:

* operators: ``matmul`` (2-D, batched 3-D by 2-D, 3-D by 3-D), ``add``,
  ``multiply``, ``subtract`` (with broadcasting operands), ``exp``, ``tanh``,
  ``relu``, ``sum`` and ``max`` over one axis (``keepdims`` or not),
  ``reshape`` (two dimensions merged, or one split), ``permute_dims``,
  ``softmax``, and one half of ``split`` (a kernel with a tuple result);
* calls of private functions, once or twice (on other operands, or on the
  first call's result), and calls from one private function to another;
* meshes ``(2,)``, ``(4,)``, ``(2, 2)`` and ``(2, 4)``;
* placements of the inputs that divide their shapes, given either as
  ``R.dist.annotate_sharding`` in the module or as
  :class:`tvm_distx.ShardingRule` parameter rules applied with
  :class:`tvm_distx.passes.AnnotateSharding`;
* annotations of intermediate values (changes of placement, planned as
  redistributes), in ``main`` and inside private functions;
* functions with and without dataflow blocks.

The draws come from a :class:`Drawer`: :class:`HypothesisDrawer` lets
hypothesis choose (and shrink a failing program), :class:`SeededDrawer` makes
the program a function of one integer seed (for replays and stress runs).

The package, by concept: :mod:`.draw` (where the random choices come from),
:mod:`.program` (the description and its valid placements), :mod:`.generate`
(drawing a program), :mod:`.relax_module` (the description as Relax),
:mod:`.numpy_reference` (its numpy answer), :mod:`.check` (comparing, reporting,
running one case) and ``python -m randprog`` (the stress driver, from ``tests/``).
"""

from .check import ATOL, RTOL, compare, report, run_case
from .draw import Drawer, HypothesisDrawer, SeededDrawer
from .generate import MESHES, generate
from .numpy_reference import random_inputs, reference
from .program import Function, Input, Op, Program, is_double_split, valid_placements
from .relax_module import build_module

__all__ = [
    "MESHES", "Drawer", "HypothesisDrawer", "SeededDrawer", "Op", "Function", "Input",
    "Program", "generate", "build_module", "reference", "random_inputs", "valid_placements",
    "is_double_split", "compare", "report",
    "run_case", "RTOL", "ATOL",
]
