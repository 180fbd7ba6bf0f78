"""A checkpoint served across test hosts: each host is sent its ranks' blocks, or reads a shared one.

``CausalLM.from_pretrained`` links each rank's weights to blocks of the checkpoint's
files. Across hosts, the session copies each host only its ranks' blocks (the checkpoint
is in this machine's private ``/tmp``, which no test host sees), unless ``shared_fs=True``
says every host reads the checkpoint at the same path itself.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402

PROMPT = np.array([[5, 17, 99, 4]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama (grouped-query attention) saved in several files, and its greedy tokens."""
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory, max_shard_size="60KB")
    want = model.generate(torch.from_numpy(PROMPT), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    return directory, want


def _session_copies(test_hosts, host: str) -> list[str]:
    listing = test_hosts.run(host, "ls -d /tmp/tvm-distx-session-* 2>/dev/null", check=False)
    return listing.stdout.split()


def test_each_host_is_sent_only_its_ranks_blocks(checkpoint, test_hosts):
    directory, want = checkpoint
    first, second = test_hosts.names[:2]
    with CausalLM.from_pretrained(directory, num_ranks=2, max_length=20,
                                  hosts=[second, first], rsh=test_hosts.rsh) as lm:
        assert [(r.rank, r.host) for r in lm.session.ranks] == [(0, second), (1, first)]
        assert lm.generate(PROMPT, max_new_tokens=12)[0].tolist() == want
        for host, rank in ((second, 0), (first, 1)):
            (copy,) = _session_copies(test_hosts, host)
            files = test_hosts.run(host, f"ls {copy}/weights").stdout.split()
            assert files == [f"rank{rank}.safetensors"]  # the blocks, cut and copied
            manifest = json.loads(test_hosts.run(host, f"cat {copy}/manifest.json").stdout)
            mine = [w for w in manifest["weight_files"] if w["rank"] == rank]
            assert any(not held["name"].endswith("_vocab_offsets")
                       for w in mine for held in w["weights"])  # blocks, not only offsets
            assert mine and not [k for k in manifest.get("weight_links", ())
                                 if k["rank"] == rank]
            digest = test_hosts.run(host, f"sha256sum {copy}/weights/rank{rank}.safetensors")
            assert {w["sha256"] for w in mine} == {digest.stdout.split()[0]}
        assert lm.generate(PROMPT, max_new_tokens=12)[0].tolist() == want  # the same ranks
    for host in (first, second):
        assert _session_copies(test_hosts, host) == []


def test_a_checkpoint_every_host_sees_is_read_in_place(checkpoint, test_hosts):
    """``shared_fs=True``: each rank reads its blocks from the shared checkpoint itself."""
    directory, want = checkpoint
    shared = test_hosts.shared / "llama-checkpoint"
    shutil.copytree(directory, shared, dirs_exist_ok=True)
    first, second, third = test_hosts.names
    try:
        with CausalLM.from_pretrained(shared, num_ranks=2, max_length=20, hosts=[third, first],
                                      rsh=test_hosts.rsh, shared_fs=True) as lm:
            for host, rank in ((third, 0), (first, 1)):
                # the session's own bundle (here, in this machine's /tmp) is sent: library,
                # manifest and the little the bundle stores; every block stays a link
                (copy,) = _session_copies(test_hosts, host)
                manifest = json.loads(test_hosts.run(host, f"cat {copy}/manifest.json").stdout)
                links = [k for k in manifest["weight_links"] if k["rank"] == rank]
                assert links and all(k["checkpoint"].startswith(str(shared)) for k in links)
                assert all(held["name"].endswith("_vocab_offsets")
                           for w in manifest["weight_files"] for held in w["weights"])
            assert lm.generate(PROMPT, max_new_tokens=12)[0].tolist() == want
        for host in (first, third):
            assert _session_copies(test_hosts, host) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)
