"""How compile time grows with model depth: our interprocedural pipeline against TVM's.

The model is decoder-style with **one private Relax function per layer**
(``layer_0`` ... ``layer_{L-1}``), called in a chain by ``main``, which takes
the input and every layer's weights. A layer is layer-norm free: attention-ish
projections ``q, k, v = x @ wq, x @ wk, x @ wv``, a gate ``relu(q) * k * v`` in
place of softmax attention, the output projection ``@ wo`` and a residual, then
an MLP ``relu(x1 @ w1) @ w2`` and a residual (tokens 64, hidden 256, FFN 1024,
float32). The tensor-parallel annotations live **inside the layer functions**:
``ShardingRule(param=...)`` rules put ``wq``, ``wk``, ``wv`` and ``w1`` on
``S[1]`` (column parallel) and ``wo`` and ``w2`` on ``S[0]`` (row parallel) on a
``(2,)`` mesh, in every function with such a parameter, that is every layer.

Timed, per depth (8, 16, 32, 64 layers), from the annotated module:

* ``PropagateSharding``: ours (:class:`tvm_distx.passes.PropagateSharding`) on
  the module after ``LegalizeOps``, as :func:`tvm_distx.lower_to_ranks` runs it,
  against TVM's ``tvm.relax.distributed.transform.PropagateSharding`` on the same
  module after ``relax.transform.InlinePrivateFunctions()`` (TVM gives calls of
  Relax functions no propagation rule, so inlining is the only way it handles
  this model; the annotations made in the callees end up in ``main``). The
  inlining is timed separately and is *not* part of the ratio.
* the whole pipeline: :func:`tvm_distx.lower_to_ranks` against TVM's own
  sequence ``LegalizeOps``, ``InlinePrivateFunctions``, ``PropagateSharding``,
  ``LowerGlobalViewToLocalView``, ``LegalizeRedistribute``, ``LowerDistIR``
  (which handles this 1-D tensor-parallel model).

The layers are alike, as in a real decoder. Our propagation solves every layer
function (its time grows linearly with depth), and since all layers end up
with the same typed body, the module's BlockBuilder keeps one function for
them, which the later stages then lower once; TVM's stages work on the one
inlined ``main`` of all layers.

Times are CPU seconds of the benchmark process (``time.process_time``): every
contender runs on one thread, and CPU time is much less disturbed than wall
time by other jobs on the machine's shared cores. Each round times every
contender once, in alternating order, after a ``gc.collect()``; ours is timed
cold: the Python caches of our passes
(PrimFunc signatures, planner) are cleared before each of its runs. The tables
give medians over the rounds, the ratio ours / TVM (median of the per-round
ratios) and the growth factor from 32 to 64 layers (also from the fastest of
the rounds). As a check, the placement
of every parameter of ``main`` must be the same after both propagations.

Usage::

    python scripts/bench/compile_scaling.py                 # 8 16 32 64 layers, 7 rounds
    python scripts/bench/compile_scaling.py --layers 8 16 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, spread, table  # noqa: E402 - the path above comes first

import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.distributed import transform as tvm_dist  # noqa: E402

import tvm_distx as td  # noqa: E402
from tvm_distx import ShardingRule  # noqa: E402
from tvm_distx.passes import AnnotateSharding, PropagateSharding  # noqa: E402

TOKENS, HIDDEN, FFN = 64, 256, 1024
WEIGHTS = [("wq", (HIDDEN, HIDDEN)), ("wk", (HIDDEN, HIDDEN)), ("wv", (HIDDEN, HIDDEN)),
           ("wo", (HIDDEN, HIDDEN)), ("w1", (HIDDEN, FFN)), ("w2", (FFN, HIDDEN))]
#: Tensor parallelism, Megatron style, inside every layer function.
RULES = ([ShardingRule(param=p, result="S[1]") for p in ("wq", "wk", "wv", "w1")]
         + [ShardingRule(param=p, result="S[0]") for p in ("wo", "w2")])
LAYERS = [8, 16, 32, 64]


def decoder_script(layers: int) -> str:
    """TVMScript of the decoder: one private function per layer, chained by ``main``."""

    def ty(shape) -> str:
        return f'R.Tensor({tuple(shape)}, "float32")'

    act = ty((TOKENS, HIDDEN))
    lines = ["from tvm.script import ir as I", "from tvm.script import relax as R", "", "",
             "@I.ir_module", "class Decoder:", '    I.module_attrs({"device_num": 2})',
             '    I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})']
    params = ", ".join([f"x: {act}"] + [f"{name}: {ty(shape)}" for name, shape in WEIGHTS])
    body = ["q = R.matmul(x, wq)", "k = R.matmul(x, wk)", "v = R.matmul(x, wv)",
            "g = R.multiply(R.nn.relu(q), k)", "a = R.multiply(g, v)", "o = R.matmul(a, wo)",
            "x1 = R.add(x, o)", "u = R.nn.relu(R.matmul(x1, w1))", "d = R.matmul(u, w2)",
            "y = R.add(x1, d)", "R.output(y)"]
    for i in range(layers):
        lines += ["", "    @R.function(private=True)", f"    def layer_{i}({params}) -> {act}:",
                  "        with R.dataflow():"]
        lines += [f"            {stmt}" for stmt in body]
        lines.append("        return y")
    main_params = [f"x: {act}"] + [f"{name}_{i}: {ty(shape)}"
                                   for i in range(layers) for name, shape in WEIGHTS]
    lines += ["", "    @R.function", f"    def main({', '.join(main_params)}) -> {act}:",
              "        cls = Decoder", "        with R.dataflow():", "            h0 = x"]
    for i in range(layers):
        args = ", ".join([f"h{i}"] + [f"{name}_{i}" for name, _ in WEIGHTS])
        lines.append(f"            h{i + 1} = cls.layer_{i}({args})")
    lines += [f"            R.output(h{layers})", f"        return h{layers}", ""]
    return "\n".join(lines)


def annotated_decoder(layers: int) -> tvm.IRModule:
    """The decoder with its tensor-parallel annotations (inside the layer functions)."""
    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-") as tmp:
        path = Path(tmp) / f"decoder_{layers}.py"
        path.write_text(decoder_script(layers))
        mod = td.load_module(path)
    return AnnotateSharding(RULES)(mod)


def _clear_our_caches() -> None:
    """Forget what our passes memoised in earlier runs (PrimFunc signatures, plans)."""
    import importlib

    for name in ("tvm_distx.passes.op_signatures", "tvm_distx.passes.tir_access",
                 "tvm_distx.legalize.planner"):
        module = importlib.import_module(name)
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def tvm_pipeline(mod: tvm.IRModule) -> tvm.IRModule:
    """TVM's own DistIR pipeline, with the inlining it needs for this model."""
    mod = relax.transform.LegalizeOps()(mod)
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = tvm_dist.PropagateSharding()(mod)
    mod = tvm_dist.LowerGlobalViewToLocalView()(mod)
    mod = tvm_dist.LegalizeRedistribute()(mod)
    return tvm_dist.LowerDistIR()(mod)


def _timed(fn, *args):
    """CPU seconds of ``fn(*args)`` in this process, and its result."""
    gc.collect()
    start = time.process_time()
    out = fn(*args)
    return time.process_time() - start, out


def _placements(mod: tvm.IRModule) -> list[str]:
    return [str(p.ty) for p in mod["main"].params]


def bench(layers: int, rounds: int) -> dict:
    """Time every contender ``rounds`` times on the ``layers``-deep decoder."""
    annotated = annotated_decoder(layers)
    legalized = relax.transform.LegalizeOps()(annotated)
    ours_prop = PropagateSharding(require_legalized=True)

    def ours_propagate():
        _clear_our_caches()
        return ours_prop(legalized)

    def tvm_inline():
        return relax.transform.InlinePrivateFunctions()(legalized)

    def ours_distribute():
        _clear_our_caches()
        return td.lower_to_ranks(annotated)

    inlined = tvm_inline()
    # a warm-up of everything (imports, TVM's op tables), and the placement check
    if _placements(ours_propagate()) != _placements(tvm_dist.PropagateSharding()(inlined)):
        raise SystemExit(f"{layers} layers: ours and TVM's propagation disagree on main")
    tvm_pipeline(annotated)
    ours_distribute()

    times = {k: [] for k in ("ours_prop", "tvm_inline", "tvm_prop", "ours_dist", "tvm_dist")}
    contenders = [("ours_prop", ours_propagate), ("tvm_inline", tvm_inline),
                  ("tvm_prop", lambda: tvm_dist.PropagateSharding()(inlined)),
                  ("ours_dist", ours_distribute), ("tvm_dist", lambda: tvm_pipeline(annotated))]
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for key, fn in order:
            times[key].append(_timed(fn)[0])
    prop_ratios = [a / b for a, b in zip(times["ours_prop"], times["tvm_prop"])]
    dist_ratios = [a / b for a, b in zip(times["ours_dist"], times["tvm_dist"])]
    row = {k: median(v) for k, v in times.items()}
    row.update({f"{k}_min": min(v) for k, v in times.items()})
    row.update(layers=layers, prop_ratio=median(prop_ratios), prop_spread=spread(prop_ratios),
               dist_ratio=median(dist_ratios), dist_spread=spread(dist_ratios))
    return row


def report(rows: list[dict]) -> str:
    """The markdown tables of :func:`bench` rows."""
    body = [(r["layers"], f"{r['ours_prop']:.3f}", f"{r['tvm_prop']:.3f}",
             f"{r['prop_ratio']:.2f} ({r['prop_spread']})", f"{r['tvm_inline']:.3f}",
             f"{r['ours_dist']:.3f}", f"{r['tvm_dist']:.3f}",
             f"{r['dist_ratio']:.2f} ({r['dist_spread']})") for r in rows]
    out = [table(["layers", "ours PropagateSharding (s)", "TVM PropagateSharding (s)",
                  "ours / TVM (min-max)", "TVM inlining (s)", "ours distribute (s)",
                  "TVM pipeline (s)", "ours / TVM (min-max)"], body)]
    by = {r["layers"]: r for r in rows}
    pairs = [(a, b) for a, b in ((32, 64), (16, 32), (8, 16)) if a in by and b in by]
    if pairs:
        growth = []
        keys = ("ours_prop", "tvm_prop", "ours_dist", "tvm_dist")
        for a, b in pairs:
            growth.append((f"{a} -> {b} layers", *(
                f"{by[b][k] / by[a][k]:.2f} ({by[b][k + '_min'] / by[a][k + '_min']:.2f})"
                for k in keys)))
        out.append("Growth of the time with depth: ratio of the medians (in parentheses, of "
                   "the fastest runs, the least disturbed by other jobs):")
        out.append(table(["growth", "ours PropagateSharding", "TVM PropagateSharding",
                          "ours distribute", "TVM pipeline"], growth))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=LAYERS)
    parser.add_argument("--rounds", type=int, default=7, help="alternating timing rounds")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    opts = parser.parse_args(argv)
    logging.getLogger("tvm_distx").setLevel(logging.ERROR)

    print(f"decoder: one private function per layer, tokens {TOKENS}, hidden {HIDDEN}, "
          f"FFN {FFN}; TP on a (2,) mesh; CPU seconds, medians of {opts.rounds} rounds\n",
          flush=True)
    rows = []
    for layers in opts.layers:
        rows.append(bench(layers, opts.rounds))
        print(f"  {layers} layers done", file=sys.stderr, flush=True)
    print(report(rows))
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
