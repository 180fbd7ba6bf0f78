"""Memory per rank of a bfloat16 checkpoint served on 1 and 2 MPI ranks, and a 1.5B check.

Sharding a model is also a way to fit it: on ``p`` ranks each should hold ``1/p`` of
the weights. This benchmark saves a random-weight checkpoint in bfloat16 (the
dtype Hugging Face checkpoints ship in) with the shape of **Qwen2-0.5B** (hidden
896, 24 layers, 14 heads, 2 key/value heads, FFN 4864, vocabulary 151936, the LM
head tied to the token embedding), serves it with
``CausalLM.from_pretrained(dir, num_ranks=p)`` on 1 and 2 MPI ranks (each rank
reading its own blocks of the checkpoint, in bfloat16 as stored), generates a few
greedy tokens, and reports for each rank:

* its weight bytes (``lm.weight_bytes_per_rank``) against the model's bytes;
* its peak resident memory (``VmHWM``), against the 1-rank run's.

``--check-15b`` also saves a checkpoint of the shape of
**DeepSeek-R1-Distill-Qwen-1.5B** (hidden 1536, 28 layers, 12 heads, 2 key/value
heads, FFN 8960, vocabulary 151936, untied) in bfloat16 and checks that 2 ranks
generate transformers' greedy tokens (transformers in float32 on the same bfloat16
weights). Each job runs in its own process, one at a time; checkpoints are cached
in ``--cache``.

Usage::

    python scripts/bench/llm_memory.py                 # Qwen2-0.5B shape, 1 and 2 ranks
    python scripts/bench/llm_memory.py --check-15b     # and the 1.5B tokens check
    python scripts/bench/llm_memory.py --layers 2      # a quick run, 2 layers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import child_env, fmt_bytes, table  # noqa: E402

import numpy as np  # noqa: E402

SCRIPT = str(Path(__file__).resolve())

QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
             "tie_word_embeddings": True}
DEEPSEEK_15B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                "tie_word_embeddings": False}


def save(folder: Path, shape: dict) -> Path:
    """A random-weight bfloat16 Qwen2 checkpoint of ``shape`` (cached by its shape)."""
    import torch
    import transformers

    name = "qwen2-" + "-".join(f"{shape[k]}" for k in sorted(shape))
    path = folder / name
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**shape, max_position_embeddings=512,
                                      torch_dtype="bfloat16")
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    return path


def peak_rss(pid: int) -> int:
    """Peak resident bytes (``VmHWM``) of a process of this host."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def ours_job(path: str, out: str, ranks: int, new_tokens: int) -> None:
    """Serve the checkpoint on ``ranks`` MPI ranks; their weights and peak memory."""
    from tvm_distx.llm.causal_lm import CausalLM

    ids = np.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    with CausalLM.from_pretrained(path, num_ranks=ranks, max_length=ids.shape[1] + new_tokens,
                                  env={"TVM_NUM_THREADS": "1"}) as lm:
        tokens = lm.generate(ids, max_new_tokens=new_tokens)[0].tolist()
        rss = [peak_rss(r.pid) for r in lm.session.ranks]
        held = list(lm.weight_bytes_per_rank)
    Path(out).write_text(json.dumps({"tokens": tokens, "rss": rss, "weights": held}))


def hf_job(path: str, out: str, new_tokens: int) -> None:
    """transformers' greedy tokens, float32 arithmetic on the checkpoint's weights."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0].tolist()
    Path(out).write_text(json.dumps({"tokens": tokens}))


def run(args: list[str], timeout: float) -> dict:
    """One job in its own process; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        done = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out)],
                              env=child_env(), timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
            raise SystemExit(f"job {' '.join(args)} failed ({done.returncode})")
        return json.loads(out.read_text())


def model_bytes(path: Path) -> int:
    """The checkpoint's weight bytes (each tensor once, in its stored dtype)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="decoder layers (a quicker run)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--check-15b", action="store_true",
                        help="also check the 1.5B shape's tokens on 2 ranks against transformers")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "TVM_DISTX_BENCH_CACHE", Path.home() / ".cache" / "tvm-distx" / "bench")),
        help="where the checkpoints are kept")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    parser.add_argument("--ours-job", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hf-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.ours_job:
        ours_job(opts.path, opts.out, opts.ours_job, opts.new_tokens)
        return 0
    if opts.hf_job:
        hf_job(opts.path, opts.out, opts.new_tokens)
        return 0

    opts.cache.mkdir(parents=True, exist_ok=True)
    shape = dict(QWEN2_05B, **({"num_hidden_layers": opts.layers} if opts.layers else {}))
    path = save(opts.cache, shape)
    total = model_bytes(path)
    runs = {p: run(["--ours-job", str(p), "--path", str(path), "--new-tokens",
                    str(opts.new_tokens)], opts.timeout) for p in (1, 2)}
    if runs[1]["tokens"] != runs[2]["tokens"]:
        raise SystemExit(f"1 and 2 ranks disagree: {runs[1]['tokens']} != {runs[2]['tokens']}")
    base = max(runs[1]["rss"])
    rows = []
    for p, result in runs.items():
        for rank, (held, rss) in enumerate(zip(result["weights"], result["rss"])):
            rows.append((p, rank, fmt_bytes(held), f"{held / total:.3f}", fmt_bytes(rss),
                         f"{rss / base:.2f}"))
    print(f"## Memory per rank: Qwen2-0.5B shape, bfloat16 checkpoint "
          f"({shape['num_hidden_layers']} layers, {fmt_bytes(total)} of weights)\n")
    print(table(["ranks", "rank", "weight bytes", "of the model", "peak RSS",
                 "of the 1-rank peak"], rows))
    worst = max(runs[2]["weights"]) / total
    print(f"\n2 ranks: at most {worst:.3f} of the model's weight bytes per rank, peak RSS "
          f"{max(runs[2]['rss']) / base:.2f} of the 1-rank peak; tokens equal on 1 and 2 ranks.")

    if opts.check_15b:
        path = save(opts.cache, DEEPSEEK_15B)
        ours = run(["--ours-job", "2", "--path", str(path), "--new-tokens",
                    str(opts.new_tokens)], opts.timeout)
        want = run(["--hf-job", "--path", str(path), "--new-tokens", str(opts.new_tokens)],
                   opts.timeout)
        same = ours["tokens"] == want["tokens"]
        print(f"\n## DeepSeek-R1-Distill-Qwen-1.5B shape, bfloat16, 2 ranks\n\n"
              f"weights per rank {[fmt_bytes(b) for b in ours['weights']]} of "
              f"{fmt_bytes(model_bytes(path))}; tokens {'equal' if same else 'DIFFER from'} "
              f"transformers': {ours['tokens'][-opts.new_tokens:]}")
        if not same:
            print(f"transformers: {want['tokens'][-opts.new_tokens:]}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
