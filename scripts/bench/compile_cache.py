"""Start-up with the compile cache: a cold start (trace, shard, compile, launch) against a warm one.

The model is a random checkpoint of Qwen2-0.5B's shape (hidden 896, FFN 4864, 24 layers,
14 query heads and 2 key/value heads, vocabulary 151936, tied embeddings: 494M
parameters), built from a config in code (no download) and saved in bfloat16 by
``save_pretrained`` once, under ``--workdir``. ``--small`` keeps 2 layers and a vocabulary
of 4096.

Each start is a fresh Python process, as a user's ``tvm-distx generate`` or ``serve`` is:
``CausalLM.from_pretrained(checkpoint, num_ranks=2, max_length=64, compile_cache=dir)``
on 2 MPI ranks, then ``generate(ids, max_new_tokens=1)`` of a 16-token prompt. The time to
first token is the process's time from before the import of tvm_distx to that token.

* **cold**: an empty cache directory: everything is done, and the bundle is stored;
* **warm**: the directory a cold start filled: the bundle is opened and the ranks start.

Each round runs one cold and one warm start, in an order that rotates; the table gives
medians over rounds, and the ratio cold / warm as the median of per-round ratios
(min-max). Both starts' first tokens must be equal (the script exits non-zero otherwise).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import child_env, median, spread, table  # noqa: E402

START = """
import json, sys, time
started = time.perf_counter()
import numpy as np
from tvm_distx.llm.causal_lm import CausalLM
lm = CausalLM.from_pretrained(sys.argv[1], num_ranks=2, max_length=64,
                              compile_cache=sys.argv[2])
opened = time.perf_counter()
ids = np.random.default_rng(0).integers(0, int(sys.argv[3]), 16)
token = int(lm.generate(ids, max_new_tokens=1)[0, -1])
done = time.perf_counter()
hit = lm.exe is None
lm.close()
print(json.dumps({"start_s": opened - started, "first_token_s": done - started,
                  "token": token, "hit": hit}))
"""


def _checkpoint(workdir: Path, small: bool) -> tuple[Path, int]:
    """The random Qwen2-0.5B-shaped checkpoint (built once); its vocabulary size."""
    import torch
    import transformers

    vocab = 4096 if small else 151936
    path = workdir / ("qwen2-small-random" if small else "qwen2-0.5b-random")
    if (path / "config.json").is_file():
        return path, vocab
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=2 if small else 24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True, torch_dtype="bfloat16")
    print(f"building the random checkpoint in {path} (once)", file=sys.stderr)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            elif name.endswith("bias"):
                parameter.zero_()
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    scratch = Path(tempfile.mkdtemp(dir=workdir))
    model.save_pretrained(scratch)
    scratch.rename(path)
    return path, vocab


def _start(checkpoint: Path, cache: Path, vocab: int, timeout: float) -> dict:
    done = subprocess.run([sys.executable, "-c", START, str(checkpoint), str(cache),
                           str(vocab)], capture_output=True, text=True, env=child_env(),
                          timeout=timeout)
    if done.returncode != 0:
        sys.exit(f"a start failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 layers, vocabulary 4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path,
                        default=Path("/var/cache/tvm-distx/bench/compile_cache"))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint, vocab = _checkpoint(args.workdir, args.small)
    warm_dir = Path(tempfile.mkdtemp(prefix="warm-", dir=args.workdir))
    try:
        filled = _start(checkpoint, warm_dir, vocab, args.timeout)  # fills the warm cache
        assert not filled["hit"]
        rows = {"cold": [], "warm": []}
        for round_ in range(args.rounds):
            order = ["cold", "warm"] if round_ % 2 == 0 else ["warm", "cold"]
            for kind in order:
                cache = warm_dir if kind == "warm" else Path(tempfile.mkdtemp(
                    prefix="cold-", dir=args.workdir))
                try:
                    result = _start(checkpoint, cache, vocab, args.timeout)
                finally:
                    if kind == "cold":
                        shutil.rmtree(cache, ignore_errors=True)
                if result["hit"] != (kind == "warm") or result["token"] != filled["token"]:
                    sys.exit(f"{kind} start: hit {result['hit']}, token {result['token']} "
                             f"(the first start gave {filled['token']})")
                rows[kind].append(result)
    finally:
        shutil.rmtree(warm_dir, ignore_errors=True)
    ratios = [c["first_token_s"] / w["first_token_s"] for c, w in zip(rows["cold"], rows["warm"])]
    name = "Qwen2 shape, 2 layers" if args.small else "Qwen2-0.5B shape (494M, bfloat16)"
    print(f"## Start-up with the compile cache: {name}, 2 MPI ranks\n")
    print(table(["start", "ranks up (s)", "first token (s)", "first token, min-max"],
                [[kind, f"{median(r['start_s'] for r in rows[kind]):.1f}",
                  f"{median(r['first_token_s'] for r in rows[kind]):.1f}",
                  spread([r["first_token_s"] for r in rows[kind]])]
                 for kind in ("cold", "warm")]))
    print(f"\ncold / warm time to first token: {median(ratios):.1f}x ({spread(ratios)}), "
          f"{args.rounds} rounds; the same first token from every start")


if __name__ == "__main__":
    main()
