"""The served model of the serving tests: a tiny Llama with a tokenizer trained in the test,
exported as a bundle once, and ``tvm-distx serve`` of it on 2 MPI ranks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest


@pytest.fixture(scope="package")
def exported(tmp_path_factory):
    """(transformers model and tokenizer, the CausalLM on emulated ranks, its bundle)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tvm_distx.llm.causal_lm import CausalLM

    import tiny_text

    root = tmp_path_factory.mktemp("serve")
    hf = tiny_text.hf_tokenizer(tiny_text.write_tokenizer(root / "tokenizer"))
    model = tiny_text.llama(len(hf))
    with CausalLM.from_hf(model, num_ranks=2, max_length=96, backend="emulate",
                          tokenizer=hf) as lm:
        yield model, hf, lm, lm.export(root / "tiny-llama")


@pytest.fixture(scope="package")
def start_server():
    """``start_server(bundle, *flags)``: a context manager running ``tvm-distx serve`` of
    ``bundle`` on 2 MPI ranks on a free port; it gives (the process, its base URL) and
    stops the server and its ranks at the end, even when a test fails."""

    @contextlib.contextmanager
    def serve(bundle, *flags):
        server = subprocess.Popen(
            [sys.executable, "-m", "tvm_distx", "serve", str(bundle), "--port", "0", "-n", "2",
             "--max-queue", "8", *flags], stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            yield server, _wait_for_address(server)
        finally:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()

    return serve


def _wait_for_address(server) -> str:
    deadline = time.monotonic() + 300
    seen = []
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        if not line and server.poll() is not None:
            break
        seen.append(line)
        found = re.search(r"at (http://\S+/v1)", line)
        if found:
            return found.group(1)
    raise AssertionError("the server did not start:\n" + "".join(seen))
