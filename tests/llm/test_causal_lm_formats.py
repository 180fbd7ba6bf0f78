"""CausalLM with weights as users ship them: bfloat16, float16, q8 and q4 on 2 and 4 MPI ranks.

Each format must give the logits and the greedy tokens of transformers run on the
same weights decoded to float32 (the quantized formats change the weights, not the
arithmetic). A bfloat16 checkpoint stays bfloat16 on the ranks; each rank reads and
encodes only its own blocks of the checkpoint; each holds 1/p of the weight bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tvm_distx.sources import checkpoint, formats  # noqa: E402
from tvm_distx.sources.formats import numpy_dtype  # noqa: E402
from tvm_distx.frontend.pytorch import relax_name  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.passes.quantize import weight_formats  # noqa: E402

PROMPT = np.array([[5, 17, 99, 4, 250]])
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Llama (grouped-query attention, untied head) saved in float32 and in bfloat16."""
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    saved = {}
    for dtype in ("float32", "bfloat16"):
        saved[dtype] = tmp_path_factory.mktemp(dtype)
        model.to(getattr(torch, dtype)).save_pretrained(saved[dtype])
    return saved


def _reference(directory, lm) -> "transformers.PreTrainedModel":
    """transformers on the checkpoint's weights as the ranks hold them, decoded to float32."""
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    stored = weight_formats(lm.annotated)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fmt = stored.get(relax_name("model." + name))
            if fmt is not None:
                values = param.numpy()
                param.copy_(torch.from_numpy(formats.decode(formats.encode(values, fmt), fmt)))
    return model


CASES = [("bf16", 2), ("bf16", 4), ("f16", 2), ("f16", 4), ("q8", 2), ("q8", 4), ("q4", 2),
         ("q4", 4)]


@pytest.mark.parametrize("fmt, ranks", CASES, ids=[f"{f}-{r}ranks" for f, r in CASES])
def test_each_format_gives_transformers_logits_and_tokens_on_mpi_ranks(
        checkpoints, fmt, ranks, monkeypatch):
    reads = []
    original = checkpoint.LazyTensor.read

    def recording(self):
        reads.append(self.key)
        return original(self)

    monkeypatch.setattr(checkpoint.LazyTensor, "read", recording)
    if fmt == "bf16":  # a bfloat16 checkpoint keeps its dtype, unasked
        directory, options = checkpoints["bfloat16"], {}
    else:
        directory = checkpoints["float32"]
        options = {"dtype": "float16"} if fmt == "f16" else {"quantization": fmt}
    with CausalLM.from_pretrained(directory, num_ranks=ranks, max_length=16, **options) as lm:
        names = lm.cache.names
        (logits,) = lm.session.run(PROMPT, np.arange(PROMPT.shape[1]), function="prefill",
                                   state={n: n for n in names},
                                   keep={i + 1: n for i, n in enumerate(names)})
        tokens = lm.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        manifest = lm.session.manifest
        held = lm.weight_bytes_per_rank
        signature = lm.exe.signatures["decode"]
        weights = set(lm.weights)
    assert reads == []  # this process read no weight: each rank reads its own blocks

    model = _reference(directory, lm)
    with torch.no_grad():
        want = model(torch.from_numpy(PROMPT)).logits.numpy()[:, -1:]
        want_tokens = model.generate(torch.from_numpy(PROMPT), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
    logits = np.asarray(logits)
    assert np.abs(logits - want).max() <= 1e-4 * np.abs(want).max()
    assert tokens[0].tolist() == want_tokens[0].tolist()

    # the weights are stored in the format on the ranks, read from the checkpoint by them
    links = {(link.rank, link.tensor, link.part): link for link in manifest.weight_links}
    q = "model.layers.0.self_attn.q_proj.weight"
    data = links[0, q, "data"]
    assert numpy_dtype(data.dtype) == formats.weight_format(fmt).part_dtype("data")
    # 16-bit: the rank reads its block in that dtype; q8, q4: it encodes its block
    assert data.encoding == (fmt if fmt in ("q8", "q4") else None)
    if fmt in ("q8", "q4"):  # rows split: each rank encodes its rows, scales by rows
        assert [links[r, q, "scale"].start[0] for r in range(ranks)] == [
            r * 128 // ranks for r in range(ranks)]
    # each rank holds 1/p of the weight bytes, but the norms (and, on 4 ranks, the two
    # key/value heads each rank reads whole)
    total = sum(int(np.prod(s.shape)) * numpy_dtype(s.dtype).itemsize
                for s in signature.params if s.name in weights)
    whole = sum(int(np.prod(s.shape)) * numpy_dtype(s.dtype).itemsize
                for s in signature.params if s.name in weights and (
                    s.name.endswith("norm_weight") or (ranks == 4 and (
                        "k_proj" in s.name or "v_proj" in s.name))))
    assert len(held) == ranks
    assert max(held) <= (total - whole) / ranks + whole
    assert max(held) < total / 2 + whole
