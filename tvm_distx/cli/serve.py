"""``tvm-distx serve``: an OpenAI-compatible HTTP server for a bundle, a checkpoint or a GGUF file.

``MODEL [-n N] [--backend mpi|disco|emulate] [--host 127.0.0.1] [--port 8000]
[--api-key KEY] [--max-length L] [--max-queue Q] [--model-name NAME]`` starts the ranks
(as ``tvm-distx generate`` does, on several hosts with ``--hostfile``), then serves
:mod:`tvm_distx.serving.openai_app` with uvicorn until Ctrl-C. It binds to 127.0.0.1
unless ``--host`` says otherwise, and prints the address it listens on (``--port 0``
picks a free port) once it is ready.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from tvm_distx.cli.generate import open_model
from tvm_distx.cli.inputs import EXIT_OK
from tvm_distx.errors import ArgumentError

__all__ = ["serve"]

logger = logging.getLogger(__name__)

#: The cache length of a checkpoint or GGUF file served without --max-length.
DEFAULT_MAX_LENGTH = 1024


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ArgumentError(f"cannot listen on {host}:{port}: {err.strerror}",
                            hint="choose another --port (0 picks a free one) or --host") \
            from None
    sock.listen(128)
    return sock


def serve(args: argparse.Namespace) -> int:
    """``tvm-distx serve``: run the server until Ctrl-C."""
    try:
        import uvicorn

        from tvm_distx.serving.openai_app import create_app
    except ImportError as err:
        raise ArgumentError(f"tvm-distx serve needs {err.name}, which is not installed",
                            hint="pip install 'tvm-distx[serve]'") from None
    from tvm_distx.llm.causal_lm import CausalLM
    from tvm_distx.generation.worker import GenerationWorker

    sock = _listen(args.host, args.port)  # a taken port is refused before the ranks start
    lm = open_model(args, DEFAULT_MAX_LENGTH, CausalLM)
    worker = None
    try:
        if lm.tokenizer is None:
            raise ArgumentError(f"{args.bundle} holds no tokenizer; the server takes text",
                                hint="put the tokenizer files (tokenizer.json, "
                                "tokenizer_config.json) beside the model")
        worker = GenerationWorker(lm, max_queue=args.max_queue)
        name = args.model_name or (args.bundle.name or args.bundle.resolve().name).removesuffix(
            ".gguf")
        app = create_app(worker, model_name=name, ranks=lm.session.manifest.num_ranks,
                         backend=args.backend,
                         api_key=args.api_key or os.environ.get("TVM_DISTX_API_KEY"))
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        host, port = sock.getsockname()[:2]
        sys.stderr.write(f"serving {name} at http://{host}:{port}/v1 ({args.backend}, "
                         f"Ctrl-C stops)\n")
        sys.stderr.flush()
        server.run(sockets=[sock])
    finally:
        if worker is not None:
            worker.close()
        lm.close()
        sock.close()
    return EXIT_OK
