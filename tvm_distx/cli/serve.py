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
from pathlib import Path

from tvm_distx.cli.arguments import add_backend_argument, add_stages_argument, positive
from tvm_distx.cli.generate import open_model
from tvm_distx.cli.hosts import add_host_arguments
from tvm_distx.cli.inputs import EXIT_OK
from tvm_distx.errors import ArgumentError

__all__ = ["add_parser", "serve"]

logger = logging.getLogger(__name__)

#: The cache length of a checkpoint or GGUF file served without --max-length.
DEFAULT_MAX_LENGTH = 1024


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser, added to ``sub``."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                       "/v1/chat/completions) for a bundle, a checkpoint or a GGUF file")
    p.add_argument("bundle", type=Path, metavar="MODEL",
                   help="a directory written by CausalLM.export, a checkpoint directory "
                   "written by save_pretrained, or a llama.cpp .gguf file; its tokenizer "
                   "files sit beside it")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: %(default)s, this host only)")
    p.add_argument("--port", type=int, default=8000,
                   help="the port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: "
                   "$TVM_DISTX_API_KEY, or none)")
    p.add_argument("--model-name", help="the model's id in the API (default: the file or "
                   "directory name)")
    p.add_argument("--max-queue", type=positive(int), default=16,
                   help="requests that may wait while one runs; more get 503 (default: "
                   "%(default)s)")
    add_backend_argument(p)
    p.add_argument("-n", "--ranks", type=positive(int), default=None,
                   help="the rank count (2 for a checkpoint or a GGUF file); a bundle fixes it")
    add_stages_argument(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="a checkpoint's weights on the ranks (default: as stored)")
    p.add_argument("--quantization", choices=("q8", "q4"),
                   help="store a checkpoint's linear weights as int8 or int4 groups of 32")
    p.add_argument("--max-length", type=positive(int), default=None,
                   help="a checkpoint's or GGUF file's context: prompt and reply tokens "
                   "(default: 1024)")
    p.add_argument("--timeout", type=positive(float), default=300.0,
                   help="seconds for the ranks to start and for each step")
    p.add_argument("--no-cache", action="store_true",
                   help="compile a checkpoint or GGUF file again, and keep no copy "
                   "(default: reuse and fill the compile cache)")
    add_host_arguments(p)
    p.set_defaults(handler=serve)
    return p


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
