"""Batched generation: a batch of 4 prompts as one forward per step, against 4 prompts in turn.

A random-weight ``LlamaForCausalLM`` built in code (no download; hidden 512,
8 layers, 8 query heads and 4 KV heads, FFN 1536, vocabulary 8000; ``--small``
for 2 layers) is served by :class:`tvm_distx.llm.causal_lm.CausalLM` on ``--ranks`` MPI
ranks with ``max_batch=4``. Four prompts of different lengths each get
``--new-tokens`` greedy tokens:

* **batched**: ``generate(prompts)``: one left-padded ``prefill_batch`` and one
  ``decode_batch`` per step for all four;
* **sequential**: the same session's batch-1 ``prefill`` and ``decode``, one
  prompt after another (what ``generate`` does without ``max_batch``).

Both must give the same tokens. Reported: wall time, new tokens per second
(all rows), and the decode steps' tokens per second. The batch-1 path of a
``CausalLM`` built without ``max_batch`` is timed too (one prompt), to show
the batched functions leave it as it was. Medians of ``--repeats`` runs after
a warm-up each, the runs taking turns.

Usage::

    python scripts/bench/llm_batch.py            # 2 ranks
    python scripts/bench/llm_batch.py --small --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def _model(layers: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1536,
                                      num_hidden_layers=layers, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def _timed(runs: dict, new_tokens: int, repeats: int) -> dict:
    """Per run name ``(lm, prompts)``: median wall seconds, median decode tokens/s, rows.

    One warm-up each, then the runs take turns, so that a change in the host's load
    falls on all of them.
    """
    walls = {name: [] for name in runs}
    rates = {name: [] for name in runs}
    rows = {name: lm.generate(prompts, max_new_tokens=new_tokens)
            for name, (lm, prompts) in runs.items()}
    for _ in range(repeats):
        for name, (lm, prompts) in runs.items():
            started = time.perf_counter()
            rows[name] = lm.generate(prompts, max_new_tokens=new_tokens)
            walls[name].append(time.perf_counter() - started)
            rates[name].append(lm.stats.decode_tokens_per_second)
    return {name: (statistics.median(walls[name]), statistics.median(rates[name]), rows[name])
            for name in runs}


def main() -> int:
    from tvm_distx.llm.causal_lm import CausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 layers: a quick run")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = _model(2 if args.small else 8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 8000, n, dtype=np.int64) for n in (12, 16, 9, 14)]
    total = len(prompts) * args.new_tokens
    # one session at a time: waiting ranks of another session could take CPU
    with CausalLM.from_hf(model, num_ranks=args.ranks, max_length=64, max_batch=4) as lm:
        one_by_one = CausalLM(lm.cache, lm.session)  # the batch-1 functions only
        times = _timed({"batched": (lm, prompts), "sequential": (one_by_one, prompts),
                        "one": (one_by_one, prompts[:1])}, args.new_tokens, args.repeats)
    with CausalLM.from_hf(model, num_ranks=args.ranks, max_length=64) as plain:
        times.update(_timed({"alone": (plain, prompts[:1])}, args.new_tokens, args.repeats))
    batched, sequential, one, alone = (times[k] for k in ("batched", "sequential", "one",
                                                          "alone"))
    same = all(np.array_equal(a, b) for a, b in zip(batched[2], sequential[2]))
    out = sys.stdout
    out.write(f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
              f"{args.ranks} MPI ranks, 4 prompts of {[len(p) for p in prompts]} tokens, "
              f"{args.new_tokens} new tokens each (median of {args.repeats})\n\n")
    out.write("| run | wall s | new tokens/s | decode tokens/s |\n|---|---|---|---|\n")
    for name, (wall, rate, _) in (("batch of 4 (one forward per step)", batched),
                                  ("4 prompts one after another", sequential)):
        out.write(f"| {name} | {wall:.3f} | {total / wall:.1f} | {rate:.1f} |\n")
    out.write(f"\nbatched / sequential: {sequential[0] / batched[0]:.2f}x; "
              f"same tokens: {same}\n")
    out.write(f"one prompt, batch-1 path: {one[1]:.1f} decode tokens/s with the batched "
              f"functions beside it, {alone[1]:.1f} without\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
