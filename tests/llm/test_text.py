"""Text in and text out: the checkpoint's tokenizer, chat, streamed text, stop strings.

A byte-level BPE tokenizer is trained in the test (``tiny_text``), and a tiny random Llama
uses its vocabulary. On 2 MPI ranks ``lm.generate(text)`` equals transformers' decoded
greedy output, ``lm.chat`` equals transformers' ``apply_chat_template`` then ``generate``,
the streamed pieces join to the same text and never split a character; the bundle carries
the tokenizer, and the command line prints text.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.generation.text import TextStream, Tokenizer  # noqa: E402

import tiny_text  # noqa: E402

NEW = 16
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    directory = tiny_text.write_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    hf = tiny_text.hf_tokenizer(directory)
    model = tiny_text.llama(len(hf))
    with CausalLM.from_hf(model, num_ranks=2, max_length=64, tokenizer=hf) as lm:
        yield model, hf, lm


def _transformers_text(model, hf, ids: list[int]) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=hf.pad_token_id)
    return hf.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.mark.parametrize("prompt", ["hello world", "the lazy dog sat", "héllo € 😀"])
def test_text_equals_transformers_decoded_greedy_output(text_model, prompt):
    model, hf, lm = text_model
    want = _transformers_text(model, hf, hf(prompt).input_ids)
    assert lm.generate(prompt, max_new_tokens=NEW) == want
    pieces = list(lm.stream_text(prompt, max_new_tokens=NEW))
    assert "".join(pieces) == want
    assert lm.generate([prompt, "hello"], max_new_tokens=NEW)[0] == want


def test_chat_equals_transformers_chat_template_then_generate(text_model):
    model, hf, lm = text_model
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert lm.tokenizer.encode_chat(MESSAGES) == list(ids)
    assert lm.chat(MESSAGES, max_new_tokens=NEW) == _transformers_text(model, hf, list(ids))


def test_streamed_text_never_splits_a_character(text_model):
    _, _, lm = text_model
    text = "é€😀 and 漢字"
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # the characters take several byte tokens each
    stream = TextStream(lm.tokenizer)
    pieces = [stream.push(token) for token in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert "" in pieces[:-1]  # a piece waited for the rest of its character
    assert not any("\ufffd" in piece for piece in pieces)


def test_generation_stops_at_a_stop_string_and_at_the_end_token(text_model):
    _, _, lm = text_model
    full = lm.generate("hello world", max_new_tokens=NEW)
    stop = full[3:5]
    cut = lm.generate("hello world", max_new_tokens=NEW, stop_strings=[stop, "never here"])
    assert cut == full[:full.index(stop) + len(stop)]
    # the end token ends the text and is not part of it
    ids = lm.tokenizer.encode("hello world")
    tokens = lm.generate(np.asarray(ids), max_new_tokens=NEW)[0, len(ids):]
    first = int(tokens[0])
    ended = lm.generate("hello world", max_new_tokens=NEW, eos_token_id=first)
    assert ended == ""
    with pytest.raises(td.errors.ArgumentError, match="stop_strings"):
        lm.generate("hello", max_new_tokens=2, stop_strings=[""])


def test_ids_outside_the_vocabulary_are_refused_before_any_call(text_model):
    _, hf, lm = text_model
    with pytest.raises(td.errors.ArgumentError, match=f"token id {len(hf) + 5} is outside the "
                       f"vocabulary \\(0 to {len(hf) - 1}\\)"):
        lm.generate(np.array([3, 14, len(hf) + 5]), max_new_tokens=2)
    with pytest.raises(td.errors.ArgumentError, match="token id -1"):
        list(lm.stream(np.array([-1, 3]), 2))


def test_a_model_without_tokenizer_says_how_to_give_one(text_model):
    _, _, lm = text_model
    kept, lm.tokenizer = lm.tokenizer, None
    try:
        with pytest.raises(td.errors.ArgumentError, match="no tokenizer") as err:
            lm.generate("hello", max_new_tokens=2)
        assert "tokenizer=" in err.value.hint
    finally:
        lm.tokenizer = kept


def test_a_tokenizer_without_chat_template_refuses_chat(text_model, tmp_path):
    _, _, lm = text_model
    lm.tokenizer.save(tmp_path)
    plain = Tokenizer.from_directory(tmp_path)
    plain.chat_template = None
    with pytest.raises(td.errors.ArgumentError, match="no chat template"):
        plain.render_chat(MESSAGES)
    with pytest.raises(td.errors.ArgumentError, match="non-empty list"):
        lm.tokenizer.render_chat([{"content": "no role"}])


@pytest.fixture(scope="module")
def text_bundle(text_model, tmp_path_factory):
    return text_model[2].export(tmp_path_factory.mktemp("text") / "bundle")


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "tvm_distx", "generate", *map(str, argv)],
                          capture_output=True, text=True, timeout=300)


def test_the_bundle_carries_the_tokenizer_and_the_command_line_prints_text(
        text_model, text_bundle):
    model, hf, lm = text_model
    assert (text_bundle / "tokenizer.json").is_file()
    with CausalLM.from_bundle(text_bundle, backend="emulate") as served:
        assert served.generate("hello world", max_new_tokens=NEW) == lm.generate(
            "hello world", max_new_tokens=NEW)
    done = _cli(text_bundle, "--prompt", "hello world", "--max-new-tokens", NEW)
    assert done.returncode == 0, done.stderr
    assert done.stdout == lm.generate("hello world", max_new_tokens=NEW) + "\n"
    done = _cli(text_bundle, "--chat", "hello", "--system", "be brief", "--max-new-tokens", NEW)
    assert done.returncode == 0, done.stderr
    assert done.stdout == lm.chat(MESSAGES, max_new_tokens=NEW) + "\n"


def test_the_command_line_refuses_ids_outside_the_vocabulary_in_one_line(text_bundle):
    # before any rank starts: the ranks would go to a host that cannot be reached
    done = _cli(text_bundle, "--ids", 3, 14, 999, "--max-new-tokens", 2,
                "--hosts", "203.0.113.9:2", "--rsh", "false")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "tvm-distx: error: [argument] token id 999 is outside the vocabulary " \
        "(0 to 319)", lines
    assert lines[1].startswith("hint: --ids takes ids from 0 to 319") and len(lines) == 2


def test_a_terminal_shows_the_stages_and_the_times_and_a_pipe_shows_nothing(text_bundle):
    """On a terminal: the spinner's stages, the time the start took, and the first token's
    time after the text; stderr that is not a terminal stays empty."""
    import os
    import pty

    main, follower = pty.openpty()
    argv = [sys.executable, "-m", "tvm_distx", "generate", str(text_bundle), "--prompt",
            "hello world", "--max-new-tokens", "4", "--backend", "emulate"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, text=True,
                            env=dict(os.environ, COLUMNS="200", TERM="xterm"))
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(timeout=300)
    os.close(main)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    assert proc.returncode == 0, shown
    assert "starting the ranks" in shown and re.search(r"\(emulate\): \S*\d+\.\d s", shown)
    assert "first token after" in shown and "tokens/s" in shown
    quiet = _cli(text_bundle, "--prompt", "hello world", "--max-new-tokens", 4,
                 "--backend", "emulate")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_too_many_new_tokens_for_the_bundle_are_refused_before_any_rank_starts(text_bundle):
    done = _cli(text_bundle, "--ids", 3, 14, "--max-new-tokens", 100, "--backend", "mpi")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[0] == ("tvm-distx: error: [argument] a 2-token prompt and --max-new-tokens 100 "
                        f"need 101 cache positions; the bundle {text_bundle} holds 64"), lines
    assert lines[1:] == ["hint: --max-new-tokens 63 at most"]
    fits = _cli(text_bundle, "--ids", 3, 14, "--max-new-tokens", 63, "--backend", "emulate")
    assert fits.returncode == 0, fits.stderr


def test_the_command_line_reads_a_bundle_once_and_its_ranks_give_the_text(
        text_model, text_bundle, monkeypatch, capsys):
    """``tvm-distx generate BUNDLE`` (in this process, on 2 MPI ranks) reads the bundle's
    manifest, ``generation.json`` and tokenizer once each, for all of its checks, its
    tokenizer, its session and its ranks' launch."""
    from pathlib import Path

    from tvm_distx.bundle import generation
    from tvm_distx.cli.main import main

    generation._read.cache_clear()  # as in a fresh process (earlier tests read this bundle)
    reads = {"manifest.json": 0, "generation.json": 0, "tokenizer.json": 0}
    read_text, read_bytes = Path.read_text, Path.read_bytes

    def counted(original):
        def read(self, *args, **kwargs):
            if self.name in reads and self.parent.resolve() == text_bundle.resolve():
                reads[self.name] += 1
            return original(self, *args, **kwargs)
        return read

    monkeypatch.setattr(Path, "read_text", counted(read_text))
    monkeypatch.setattr(Path, "read_bytes", counted(read_bytes))
    code = main(["generate", str(text_bundle), "--prompt", "hello world", "--max-new-tokens",
                 str(NEW), "--ranks", "2", "--backend", "mpi"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out == text_model[2].generate("hello world", max_new_tokens=NEW) + "\n"
    assert reads == {"manifest.json": 1, "generation.json": 1, "tokenizer.json": 1}
