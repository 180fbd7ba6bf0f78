"""llama.cpp for the LLM benchmarks: its cached environment, the checkpoint's GGUF files, its jobs.

Not a benchmark itself (``_common.py`` style helper). Three parts:

* **The environment.** ``llama-cpp-python`` (:data:`VERSION`) built from its
  source distribution into a virtual environment of its own, once, and reused:
  ``$TVM_DISTX_LLAMA_CPP`` or ``/var/cache/tvm-distx/bench/llama-cpp`` (where
  writable; else ``~/.cache/tvm-distx/bench/llama-cpp``). The build compiles
  llama.cpp with ``GGML_NATIVE=ON`` (``-march=native``: the host's AVX-512
  here) and without the multimodal library (``LLAVA_BUILD=OFF``: not used),
  under ``nice -n 19`` with ``CMAKE_BUILD_PARALLEL_LEVEL`` (default 2) jobs:
  about 10 minutes on a 2-core machine. Only
  ``llm_decode.py --build-llama-cpp`` (or ``python _llama_cpp.py --build``)
  builds it; the test suite never does. Beside the venv, ``convert/`` holds
  the sdist's converter (``vendor/llama.cpp``: ``convert_hf_to_gguf.py``,
  ``conversion/``, ``gguf-py/``) and ``convert/site`` the one package it needs
  that the project's environment lacks (``sentencepiece``); the converter runs
  on the project's Python (torch, transformers).
* **The GGUF files.** :func:`gguf_files` converts a ``save_pretrained``
  checkpoint to F32 and F16 with llama.cpp's converter and quantizes the F32
  file to Q8_0 and Q4_0 with ``llama_cpp.llama_model_quantize`` (``pure``:
  every 2-D weight in that type, as ours; llama.cpp's default would keep
  ``output.weight`` in Q6_K for Q4_0). The converter needs a tokenizer:
  :func:`save_tokenizer` writes a made-up one (Llama-style BPE with byte
  fallback, the model's vocabulary size, no download). The files are cached
  beside the checkpoint, with the bytes a decode step reads.
* **The job** (:func:`job`, run by the venv's Python): ``llama_cpp.Llama`` on
  ``n_threads`` threads (batch threads too), ``n_ctx`` = prompt + new tokens,
  the library's defaults otherwise (float16 KV cache, no flash attention). It
  evaluates the prompt in one batch (the prefill), then one token at a time
  with ``Llama.eval``; the next token is the argmax of the last logits
  (``llama_get_logits_ith``), in numpy. Each decode step is timed as the
  caller sees it, eval and argmax, as our steps are. A 4-token generation
  warms it up first. :func:`prefill_job` (for ``llm_prefill.py``) times the
  prompt's evaluation alone, for several prompt lengths.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, spread, table  # noqa: E402

#: The ``llama-cpp-python`` release the benchmark builds.
VERSION = "0.3.36"
#: Environment variable naming the folder of the cached environment.
ENV_VAR = "TVM_DISTX_LLAMA_CPP"
#: CMake options of the build (``GGML_NATIVE`` is llama.cpp's default; stated anyway).
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
#: What the converter needs beyond the project's environment (its own requirement).
CONVERTER_EXTRA = "sentencepiece>=0.1.98,<0.3.0"
#: Our format name -> llama.cpp's name of the GGUF type.
GGUF_TYPES = {"f32": "F32", "f16": "F16", "q8": "Q8_0", "q4": "Q4_0"}
#: ``llama_ftype`` of the quantized types (llama.h).
_FTYPES = {"Q8_0": 7, "Q4_0": 2}


def cache_dir() -> Path:
    """The folder of the cached environment (:data:`ENV_VAR` overrides it)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    system = Path("/var/cache/tvm-distx/bench/llama-cpp")
    parent = next(p for p in (system, *system.parents) if p.exists())
    if os.access(parent, os.W_OK):
        return system
    return Path.home() / ".cache" / "tvm-distx" / "bench" / "llama-cpp"


def python(folder: Path) -> Path:
    """The venv's interpreter."""
    return folder / "venv" / "bin" / "python"


def stamp(folder: Path) -> dict | None:
    """What the finished build recorded (version, CMake options, llama.cpp's system info)."""
    path = folder / "stamp.json"
    if not path.exists():
        return None
    got = json.loads(path.read_text())
    return got if got.get("version") == VERSION and python(folder).exists() else None


def build(folder: Path, sdist: str | None = None, jobs: int | None = None) -> dict:
    """Build the environment in ``folder`` (each step skipped when already done); its stamp.

    ``sdist``: a local ``llama_cpp_python-VERSION.tar.gz``; by default pip
    fetches it from the package index. The build log is ``folder/build.log``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    py, pip = python(folder), [str(python(folder)), "-m", "pip"]

    def run(command: list[str], **env: str) -> None:
        print(f"  llama.cpp environment: {' '.join(command)}", file=sys.stderr, flush=True)
        with open(log, "a") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                  env={**{k: v for k, v in os.environ.items()
                                          if k != "SOURCE_DATE_EPOCH"}, **env})
        if done.returncode != 0:
            raise SystemExit(f"building llama.cpp's environment failed: see {log}")

    if not py.exists():
        run([sys.executable, "-m", "venv", str(folder / "venv")])
    archive = folder / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.exists():
        archive.parent.mkdir(exist_ok=True)
        if sdist:
            shutil.copyfile(sdist, archive)
        else:
            run([*pip, "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={VERSION}", "-d", str(archive.parent)])
    if subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode:
        # llama.cpp's CMake turns GGML_NATIVE off when SOURCE_DATE_EPOCH is set (run drops it)
        run(["nice", "-n", "19", *pip, "install", "-v", "--no-binary", "llama-cpp-python",
             str(archive)], CMAKE_ARGS=CMAKE_ARGS,
            CMAKE_BUILD_PARALLEL_LEVEL=str(jobs or os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", 2)))
    convert = folder / "convert"
    if not (convert / "convert_hf_to_gguf.py").exists():
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "LICENSE", "conversion/", "gguf-py/")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(keep)]
            for m in members:
                m.name = m.name[len(prefix):]
            shutil.rmtree(folder / "convert.part", ignore_errors=True)
            tar.extractall(folder / "convert.part", members=members, filter="data")
        run([*pip, "install", "--no-deps", "--target", str(folder / "convert.part" / "site"),
             CONVERTER_EXTRA])
        (folder / "convert.part").rename(convert)
    info = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__); "
                           "print(llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    got = {"version": info[0], "cmake_args": CMAKE_ARGS, "system_info": info[1]}
    (folder / "stamp.json").write_text(json.dumps(got, indent=1))
    return got


# ---------------------------------------------------------------------- the files
def save_tokenizer(vocab_size: int, folder: Path) -> None:
    """A made-up Llama-style tokenizer of ``vocab_size`` tokens, saved in ``folder``.

    BPE with byte fallback (``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens
    ``<0x00>``..``<0xFF>``, then ``▁`` and the letters and their merges, level
    by level, up to the size), the normalizer and decoder of Llama 2's
    ``tokenizer.json``: what llama.cpp's converter reads as a ``llama``
    vocabulary. The benchmark's prompts are token ids; only the converter
    needs it.
    """
    import itertools
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    letters = ["\u2581", *string.ascii_lowercase]
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *letters]
    seen, merges, level = set(pieces), [], letters
    while len(pieces) < vocab_size and level:
        grown = []
        for left, right in itertools.product(level, letters):
            if len(pieces) == vocab_size:
                break
            if left + right not in seen:
                seen.add(left + right)
                pieces.append(left + right)
                merges.append((left, right))
                grown.append(left + right)
        level = grown
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges,
                                     unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                 normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                           decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def weight_bytes(path: Path) -> tuple[int, dict[str, int]]:
    """Bytes of a GGUF file's tensors that a decode step reads; the count of each type.

    Every tensor but the token embedding (of which a step reads one row).
    """
    import gguf

    reader = gguf.GGUFReader(path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight"), types


def gguf_files(model: Path, formats: list[str], env: Path, vocab_size: int) -> dict[str, dict]:
    """The checkpoint ``model`` as GGUF files of ``formats`` (cached beside it), by format.

    Each entry: ``path``, ``type`` (llama.cpp's name), ``bytes`` (read per decode
    step, :func:`weight_bytes`) and ``types`` (tensor count by type).
    """
    convert = env / "convert"
    out = {}
    if not (model / "tokenizer.json").exists():
        save_tokenizer(vocab_size, model)
    for fmt in ["f32", *[f for f in formats if f != "f32"]]:
        kind = GGUF_TYPES[fmt]
        path = model.parent / f"{model.name}-{kind}.gguf"
        side = path.with_suffix(".json")
        if not side.exists():
            started = time.perf_counter()
            part = path.with_suffix(".part")
            if kind in ("F32", "F16"):
                command = [sys.executable, str(convert / "convert_hf_to_gguf.py"), str(model),
                           "--outfile", str(part), "--outtype", kind.lower()]
                environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(convert / "gguf-py"), str(convert / "site")])}
            else:
                command = [str(python(env)), __file__, "--quantize", str(out["f32"]["path"]),
                           str(part), kind]
                environ = dict(os.environ)
            done = subprocess.run(command, env=environ, capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
                raise SystemExit(f"making the {kind} GGUF file failed")
            part.rename(path)
            nbytes, types = weight_bytes(path)
            side.write_text(json.dumps({"bytes": nbytes, "types": types}))
            print(f"  {path.name}: {kind} in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
        out[fmt] = {"path": str(path), "type": kind, **json.loads(side.read_text())}
    return {f: out[f] for f in formats}


def quantize(source: str, target: str, kind: str) -> None:
    """``llama_model_quantize`` of ``source`` into ``target``, every 2-D weight in ``kind``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPES[kind]
    params.pure = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params)):
        raise SystemExit(f"llama_model_quantize to {kind} failed")


# ---------------------------------------------------------------------- in llm_decode.py
def select(formats: list[str], leave_out: bool, build_it: bool,
           sdist: str | None = None) -> tuple[list[str], str]:
    """llama.cpp's formats in this run (none when left out or not built) and a line on why.

    ``build_it`` builds the environment when it is absent (:func:`build`).
    """
    folder = cache_dir()
    if leave_out:
        return [], "llama.cpp: not run (--no-llama-cpp)."
    built = stamp(folder)
    if built is None and build_it:
        built = build(folder, sdist)
    if built is None:
        print(f"llama.cpp: no environment in {folder}; left out (build it once with "
              "`llm_decode.py --build-llama-cpp`, 10-20 minutes)", file=sys.stderr)
        return [], (f"llama.cpp: not run (no environment in {folder}; "
                    "`llm_decode.py --build-llama-cpp` builds it).")
    return formats, (f"llama.cpp: llama-cpp-python {built['version']} built from its sdist "
                     f"({built['cmake_args']}) in {folder}; its system info: "
                     f"{built['system_info'].strip()}")


def agreeing(tokens: list[int], reference: list[int], prompt: int) -> int:
    """How many generated tokens (after the ``prompt``) agree with ``reference``'s, leading."""
    count = 0
    for a, b in zip(tokens[prompt:], reference[prompt:]):
        if a != b:
            break
        count += 1
    return count


def against_ours(prompt: int, new_tokens: int, rows, runs: dict, step: dict, about: dict,
                 key_of) -> str:
    """Ours against llama.cpp, format by format: decode times, ratios and token agreement.

    ``rows``, ``runs`` and ``step`` (the median step of each run) as
    ``llm_decode.report`` has them; ``about`` its formats (``formats``, ``ours``,
    ``gguf``); ``key_of(kind, count, format)`` its contender keys.
    """
    lines = []
    counts = sorted({arg for _, _, kind, arg, _ in rows if kind == "llama"})
    for fmt in about["formats"]:
        cells = [f"{fmt} / {about['gguf'][fmt]['type']}"]
        for n in counts:
            theirs, ours = key_of("llama", n, fmt), key_of("ours", n, fmt)
            cells.append(f"{median(step[theirs]) * 1e3:.1f}")
            if ours in step:
                ratios = [t / o for t, o in zip(step[theirs], step[ours])]
                agree = min(agreeing(a["tokens"], b["tokens"], prompt)
                            for a, b in zip(runs[ours], runs[theirs]))
                cells += [f"{median(step[ours]) * 1e3:.1f}",
                          f"**{median(ratios):.2f}** ({spread(ratios)})",
                          f"{agree} of {new_tokens}"]
            else:
                cells += ["-", "-", "-"]
        lines.append(cells)
    headers = ["format (ours / GGUF)"]
    for n in counts:
        headers += [f"llama.cpp {n} thread{'s' if n > 1 else ''} ms/token",
                    f"ours {n} rank{'s' if n > 1 else ''} ms/token",
                    f"ours / llama.cpp speed, {n} (their time / ours, min-max)",
                    f"greedy tokens ours = llama.cpp, {n}"]
    missing = [f for f in about["formats"] if f not in about["ours"]]
    note = (f" Ours in {', '.join(missing)}: not run (this checkout's "
            "`CausalLM.from_pretrained` has no `dtype=`/`quantization=`)." if missing else "")
    return ("Ours against llama.cpp, format by format (medians of per-round ratios; "
            f"above 1: ours faster).{note}\n\n" + table(headers, lines))


# ---------------------------------------------------------------------- the job
def job(model: str, data: str, out: str, threads: int, new_tokens: int) -> None:
    """Greedy decode with llama.cpp on ``threads`` threads; writes the job's JSON to ``out``."""
    import llama_cpp

    ids = np.load(Path(data) / "ids.npy")[0].tolist()
    llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(ids) + new_tokens, n_batch=max(len(ids), 32),
                          logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def step(tokens: list[int]) -> int:
        llm.eval(tokens)
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                         shape=(vocab,)).argmax())

    def generate(count: int) -> tuple[list[int], float, list[float]]:
        llm.reset()  # the next eval drops the cache past position 0
        started = time.perf_counter()
        tokens = [step(ids)]
        stamps = [time.perf_counter()]
        for _ in range(count - 1):
            tokens.append(step([tokens[-1]]))
            stamps.append(time.perf_counter())
        return tokens, stamps[0] - started, list(np.diff(stamps))

    generate(4)  # warm-up
    tokens, prefill, steps = generate(new_tokens)
    rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            rss = int(line.split()[1]) * 1024
    Path(out).write_text(json.dumps({"tokens": ids + tokens, "prefill": prefill, "steps": steps,
                                     "rss": [rss]}))


def prefill_job(model: str, data: str, out: str, threads: int, lengths: list[int],
                samples: int) -> None:
    """Time to first token with llama.cpp on ``threads`` threads, for prompts of ``lengths``.

    ``Llama.eval`` of the first ``n`` ids of the saved prompt in one batch and the
    argmax of the last logits; the fastest of ``samples`` per length. Writes
    ``times`` and ``tokens`` (by length) and ``rss`` to ``out``.
    """
    import llama_cpp

    ids = np.load(Path(data) / "ids.npy")[0].tolist()
    longest = max(lengths)
    llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads,
                          n_ctx=longest + 1, n_batch=longest, logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def first_token(n: int) -> tuple[int, float]:
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids[:n])
        token = int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                          shape=(vocab,)).argmax())
        return token, time.perf_counter() - started

    first_token(min(lengths))  # warm-up
    times, tokens = {}, {}
    for n in lengths:
        runs = [first_token(n) for _ in range(samples)]
        times[n], tokens[n] = min(t for _, t in runs), runs[0][0]
    rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            rss = int(line.split()[1]) * 1024
    Path(out).write_text(json.dumps({"times": times, "tokens": tokens, "rss": [rss]}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build the cached environment")
    parser.add_argument("--sdist", help="a local llama_cpp_python sdist (default: the index)")
    parser.add_argument("--jobs", type=int, help="CMAKE_BUILD_PARALLEL_LEVEL (default 2)")
    parser.add_argument("--quantize", nargs=3, metavar=("SOURCE", "TARGET", "TYPE"))
    parser.add_argument("--job", help="decode with this GGUF file (the venv's Python)")
    parser.add_argument("--prefill-job", help="time to first token with this GGUF file")
    parser.add_argument("--tokens", type=int, nargs="*", default=[16], help="prompt lengths")
    parser.add_argument("--samples", type=int, default=1, help="prefills per prompt length")
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    opts = parser.parse_args(argv)
    if opts.quantize:
        quantize(*opts.quantize)
    elif opts.prefill_job:
        prefill_job(opts.prefill_job, opts.data, opts.out, opts.threads, opts.tokens,
                    opts.samples)
    elif opts.job:
        job(opts.job, opts.data, opts.out, opts.threads, opts.new_tokens)
    elif opts.build:
        print(json.dumps(build(cache_dir(), opts.sdist, opts.jobs), indent=1))
    else:
        print(json.dumps({"folder": str(cache_dir()), "stamp": stamp(cache_dir())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
