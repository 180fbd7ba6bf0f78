"""Time to first token of a random-weight Llama: ours on 1 and 2 ranks against llama.cpp and torch.

The model is ``llm_decode.py``'s: a ``LlamaForCausalLM`` built from a config in
code (no download), hidden 1024, FFN 4096, 24 layers, 16 query heads and 8 KV
heads, vocabulary 32000, untied LM head: 443M parameters, saved in float32 by
``save_pretrained``. ``--small`` keeps 4 layers. Prompts of ``--tokens``
lengths (default 16, 128, 512 and 2048 random token ids, batch 1) are
prefilled one after the other in every contender's process; the time to first
token is the call that takes the prompt and gives the first greedy token.

Contenders, each in its own processes (imports, compilation and loading are
not timed; every contender first prefills the shortest prompt once, untimed):

* **ours, p ranks** (p = 1, 2): :class:`tvm_distx.llm.causal_lm.CausalLM` as users
  serve a checkpoint, ``CausalLM.from_pretrained(checkpoint, num_ranks=p,
  max_length=...)`` exported as a bundle and served by
  ``CausalLM.from_bundle`` on ``mpiexec -n p`` ranks that stay up, one TVM
  thread per rank. One bundle serves every prompt length (its ``max_length`` is
  the longest prompt plus one). The time is ``generate(ids,
  max_new_tokens=1)``'s prefill as :attr:`~tvm_distx.llm.causal_lm.CausalLM.stats`
  has it: the call of the session as the caller sees it, the argmax included.
* **llama.cpp, t threads** (t = 1, 2): ``llama-cpp-python`` from
  ``llm_decode.py``'s cached environment (``_llama_cpp.py``), on the
  checkpoint's GGUF files of each format; ``Llama.eval`` of the prompt in one
  batch (``n_batch`` = the prompt, the library's default micro-batch) and the
  argmax of the last logits. Left out, and said so, where the environment is
  not built (``llm_decode.py --build-llama-cpp``).
* **transformers, t threads**: one forward of the checkpoint in torch eager
  (``use_cache=True``, as ``generate`` prefills) on ``t`` threads, and the
  argmax of the last position's logits.

``--formats`` also runs ours and llama.cpp on 16-bit or quantized weights (f16,
q8, q4: our ``dtype=``/``quantization=`` and llama.cpp's F16, Q8_0, Q4_0).
Each job prefills every prompt ``--samples`` times and keeps the fastest; each
round launches every contender once, in an order that rotates from round to
round; the tables give medians over rounds and ratios as medians of per-round
ratios (min-max). Every float32 contender's first token is checked against
transformers' on 1 thread at every length.

Memory: the peak resident size of each of our ranks after the longest prompt
(``VmHWM``), beside what the rank holds: its weight files and its share of the
key-value cache (the bundle's manifest and cache layout).

Usage::

    python scripts/bench/llm_prefill.py                       # 443M, 2 rounds
    python scripts/bench/llm_prefill.py --tokens 128 512 --rounds 3
    python scripts/bench/llm_prefill.py --small --tokens 16 128 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llama_cpp  # noqa: E402
import llm_decode  # noqa: E402
from _common import (child_env, fmt_bytes, llama_parameters, median, run_job,  # noqa: E402
                     spread, table)

import numpy as np  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def contenders(ranks: list[int], threads: list[int], formats: list[str],
               llama: list[str]) -> list[tuple[str, str, str, int, str]]:
    """``(key, label, kind, ranks or threads, format)`` of every contender of this run."""
    def n_threads(t: int) -> str:
        return f"{t} thread{'s' if t > 1 else ''}"

    rows = [(f"hf{t}", f"transformers forward, torch eager, {n_threads(t)}", "hf", t, "f32")
            for t in threads]
    for fmt in formats:
        name = "ours" if fmt == "f32" else f"ours {fmt}"
        rows += [(llm_decode.key_of("ours", p, fmt),
                  f"{name}, {p} rank{'s' if p > 1 else ''} over MPI (1 thread each)",
                  "ours", p, fmt) for p in ranks]
    for fmt in llama:
        rows += [(llm_decode.key_of("llama", t, fmt),
                  f"llama.cpp {_llama_cpp.GGUF_TYPES[fmt]}, {n_threads(t)}", "llama", t, fmt)
                 for t in threads]
    return rows


def held_bytes(bundle: Path, ranks: int) -> list[int]:
    """Per rank: the bytes of its weight files and of its share of the key-value cache."""
    from tvm_distx.bundle.generation import read_generation
    from tvm_distx.bundle.manifest import read_manifest

    manifest = read_manifest(bundle)
    cache = read_generation(bundle).cache
    cache_bytes = sum(math.prod(shape) * np.dtype(cache.dtype).itemsize
                      for shape in cache.shapes)
    return [sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize for w in manifest.files_of(r))
            + cache_bytes // ranks for r in range(ranks)]


# ---------------------------------------------------------------------- inside the jobs
def prompts(data: str, lengths: list[int]) -> dict[int, np.ndarray]:
    """The first ``n`` ids of the saved prompt, for each ``n``."""
    ids = np.load(Path(data) / "ids.npy")
    return {n: ids[:, :n] for n in lengths}


def timed_prompts(first_token, lengths: list[int], data: str, samples: int) -> dict:
    """``first_token(ids) -> (token, seconds)`` for every prompt: fastest time, token."""
    by_length = prompts(data, lengths)
    first_token(by_length[min(lengths)])  # warm-up
    times, tokens = {}, {}
    for n in lengths:
        runs = [first_token(by_length[n]) for _ in range(samples)]
        times[n] = min(seconds for _, seconds in runs)
        tokens[n] = runs[0][0]
    return {"times": times, "tokens": tokens}


def hf_job(data: str, out: str, threads: int, lengths: list[int], samples: int) -> None:
    """transformers: one forward per prompt on ``threads`` torch threads."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        Path(data) / "model", dtype=torch.float32).eval()

    def first_token(ids: np.ndarray) -> tuple[int, float]:
        started = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids), use_cache=True).logits
        token = int(logits[0, -1].argmax())
        return token, time.perf_counter() - started

    got = timed_prompts(first_token, lengths, data, samples)
    Path(out).write_text(json.dumps({**got, "rss": [llm_decode.peak_rss()]}))


def ours_job(data: str, out: str, ranks: int, lengths: list[int], samples: int,
             fmt: str) -> None:
    """A session on our generation bundle of ``fmt``, one TVM thread per rank."""
    from tvm_distx.llm.causal_lm import CausalLM

    with CausalLM.from_bundle(Path(data) / f"bundle_{fmt}_{ranks}",
                              env={"TVM_NUM_THREADS": "1"}) as lm:
        def first_token(ids: np.ndarray) -> tuple[int, float]:
            token = int(lm.generate(ids, max_new_tokens=1)[0, -1])
            return token, lm.stats.prefill_seconds

        got = timed_prompts(first_token, lengths, data, samples)
        rss = [llm_decode.peak_rss(r.pid) for r in lm.session.ranks]
    Path(out).write_text(json.dumps({**got, "rss": rss}))


# ---------------------------------------------------------------------- the controller
def launch(kind: str, arg: int, fmt: str, folder: Path, lengths: list[int], samples: int,
           timeout: float, gguf: str | None = None) -> dict:
    """Run one contender's job; returns its JSON (times and tokens keyed by prompt length)."""
    key = llm_decode.key_of(kind, arg, fmt)
    out = folder / f"{key}.json"
    out.unlink(missing_ok=True)
    common = ["--data", str(folder), "--out", str(out), "--samples", str(samples),
              "--tokens", *[str(n) for n in lengths]]
    if kind == "llama":
        command = [str(_llama_cpp.python(_llama_cpp.cache_dir())), _llama_cpp.__file__,
                   "--prefill-job", gguf, "--threads", str(arg), *common]
    else:
        command = [sys.executable, SCRIPT, f"--{kind}-job", str(arg), "--format", fmt, *common]
    threads = "1" if kind == "ours" else str(arg)
    got = run_job(key, command, child_env(OMP_NUM_THREADS=threads, TVM_NUM_THREADS="1"), out,
                  timeout)
    return {what: {int(n): v for n, v in got[what].items()} if what != "rss" else got[what]
            for what in got}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 layers: a quick run")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 2048],
                        help="prompt lengths (default: %(default)s)")
    parser.add_argument("--formats", default="f32",
                        help="weight formats, comma-separated, of f32, f16, q8, q4 "
                        "(default: %(default)s)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--rounds", type=int, default=2, help="launches of every contender")
    parser.add_argument("--samples", type=int, default=2,
                        help="prefills of each prompt per launch (the fastest counts)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2], help="our rank counts")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2],
                        help="threads of the transformers and llama.cpp contenders")
    parser.add_argument("--hidden", type=int, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, help="decoder layers")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    parser.add_argument("--json", help="also write the per-round figures to this JSON file")
    parser.add_argument("--hf-job", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ours-job", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--format", default="f32", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    lengths = sorted(set(opts.tokens))
    if opts.hf_job:
        hf_job(opts.data, opts.out, opts.hf_job, lengths, opts.samples)
        return 0
    if opts.ours_job:
        ours_job(opts.data, opts.out, opts.ours_job, lengths, opts.samples, opts.format)
        return 0

    config = dict(llm_decode.MODEL)
    if opts.small:
        config["num_hidden_layers"] = 4
    if opts.hidden:
        heads = max(4, opts.hidden // 64)
        config.update(hidden_size=opts.hidden, num_attention_heads=heads,
                      num_key_value_heads=max(2, heads // 2), intermediate_size=4 * opts.hidden,
                      vocab_size=max(64, opts.hidden * 32))
    if opts.layers:
        config["num_hidden_layers"] = opts.layers
    formats = [f.strip() for f in opts.formats.split(",") if f.strip()]
    if unknown := sorted(set(formats) - set(llm_decode.FORMATS)):
        raise SystemExit(f"unknown formats {unknown}: choose from {', '.join(llm_decode.FORMATS)}")
    llama, note = _llama_cpp.select(formats, opts.no_llama_cpp, False)
    rows = contenders(opts.ranks, opts.threads, formats, llama)
    longest = lengths[-1]
    started = time.perf_counter()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-") as tmp:
        folder = Path(tmp)
        model = llm_decode.cached_checkpoint(config, max(512, longest + 1)) if llama else None
        # one bundle per format and rank count, max_length = the longest prompt + 1
        llm_decode.build(folder, config, longest, 1, opts.ranks, formats, model)
        held = {llm_decode.key_of("ours", p, fmt): held_bytes(folder / f"bundle_{fmt}_{p}", p)
                for fmt in formats for p in opts.ranks}
        gguf = _llama_cpp.gguf_files(model, llama, _llama_cpp.cache_dir(),
                                     config["vocab_size"]) if llama else {}
        runs: dict[str, list[dict]] = {key: [] for key, *_ in rows}
        for r in range(opts.rounds):
            order = rows[r % len(rows):] + rows[:r % len(rows)]
            for key, _, kind, arg, fmt in order:
                got = launch(kind, arg, fmt, folder, lengths, opts.samples, opts.timeout,
                             gguf.get(fmt, {}).get("path"))
                runs[key].append(got)
                print(f"  round {r + 1}: {key} " + ", ".join(
                    f"{n}: {got['times'][n] * 1e3:.0f} ms" for n in lengths),
                    file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    load.append(os.getloadavg()[0])
    report(opts, config, lengths, rows, runs, held, elapsed, load, note)
    return 0


def report(opts, config: dict, lengths: list[int], rows, runs: dict, held: dict,
           elapsed: float, load: list[float], note: str) -> None:
    """Print the tables (and write the JSON) of a finished run."""
    times = {key: {n: [run["times"][n] for run in runs[key]] for n in lengths} for key in runs}
    reference = runs["hf1"][0]["tokens"] if "hf1" in runs else None
    lines = []
    for key, label, kind, arg, fmt in rows:
        same = "-"
        if reference is not None and fmt == "f32":
            equal = all(run["tokens"][n] == reference[n] for run in runs[key] for n in lengths)
            same = "yes" if equal else "NO"
        lines.append([label, *[f"{median(times[key][n]) * 1e3:,.0f}" for n in lengths],
                      f"{lengths[-1] / median(times[key][lengths[-1]]):,.0f}", same])
    print(f"Llama time to first token, {llama_parameters(config) / 1e6:.0f}M parameters "
          f"({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, FFN "
          f"{config['intermediate_size']}, vocabulary {config['vocab_size']}), checkpoint in "
          f"float32, batch 1, {os.cpu_count()} cores (load average {load[0]:.1f} before, "
          f"{load[1]:.1f} after), {opts.rounds} round{'s' if opts.rounds > 1 else ''} x "
          f"fastest of {opts.samples} ({elapsed:.0f} s)\n\n{note}\n")
    print(table(["contender", *[f"{n} tokens ms" for n in lengths],
                 f"tokens/s at {lengths[-1]}", "first token = transformers 1 thread"], lines))

    comparisons = []

    def ratio(label: str, slow: str, fast: str) -> None:
        if slow in times and fast in times:
            cells = []
            for n in lengths:
                values = [a / b for a, b in zip(times[slow][n], times[fast][n])]
                cells.append(f"**{median(values):.2f}** ({spread(values)})")
            comparisons.append([label, *cells])

    ratio("ours 2 ranks vs ours 1 rank (1-rank time / 2-rank time)", "ours1", "ours2")
    for fmt in [f for f in ("f32", "f16", "q8", "q4") if f in {r[4] for r in rows}]:
        for p in opts.ranks:
            ratio(f"ours {fmt} {p} vs llama.cpp {_llama_cpp.GGUF_TYPES[fmt]} {p} thread"
                  f"{'s' if p > 1 else ''} (theirs / ours)", llm_decode.key_of("llama", p, fmt),
                  llm_decode.key_of("ours", p, fmt))
    for p in opts.ranks:
        ratio(f"ours {p} vs transformers {p} thread{'s' if p > 1 else ''} (theirs / ours)",
              f"hf{p}", f"ours{p}")
    if comparisons:
        print()
        print(table(["comparison (median of per-round ratios, min-max)",
                     *[f"{n} tokens" for n in lengths]], comparisons))
    memory = []
    for key, label, kind, arg, fmt in rows:
        if kind == "ours":
            rss = [max(run["rss"][r] for run in runs[key]) for r in range(arg)]
            memory.append([label, " / ".join(fmt_bytes(v) for v in rss),
                           " / ".join(fmt_bytes(v) for v in held[key]),
                           f"{max(a / b for a, b in zip(rss, held[key])):.2f}"])
    if memory:
        print(f"\nMemory of our ranks after the {lengths[-1]}-token prompt: peak resident "
              "size (VmHWM) against the rank's weight files and its share of the cache:\n")
        print(table(["contender", "peak RSS per rank", "weights + cache per rank",
                     "peak / (weights + cache), largest"], memory))
    if opts.json:
        Path(opts.json).write_text(json.dumps({
            "labels": {key: label for key, label, *_ in rows}, "times": times,
            "held": held, "parameters": llama_parameters(config),
            "rss": {k: [run["rss"] for run in v] for k, v in runs.items()}}))


if __name__ == "__main__":
    sys.exit(main())
