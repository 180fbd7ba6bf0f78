"""Token generation on ranks that stay up: :class:`CausalLM`.

``CausalLM.from_hf(model, num_ranks=2)`` takes a Hugging Face causal LM
through the whole stack once:

1. :func:`tvm_distx.export_decoder` imports it as ``prefill`` and ``decode``
   with the key-value cache as explicit state;
2. a plan (``presets.tensor_parallel()`` by default, or ``plan=``) shards both
   functions, the cache by heads like the attention that writes it;
3. :func:`tvm_distx.compile` builds the rank programs, and
   :meth:`tvm_distx.DistExecutable.session` launches the ranks once, each
   loading its weight shards once: MPI processes (``backend="mpi"``, the
   default), disco worker processes on this host (``"disco"``) or threads of
   this process (``"emulate"``).

:meth:`CausalLM.generate` then runs the prefill once and one decode per new
token, the caches staying on the ranks: a ``CausalLM`` is a
:class:`~tvm_distx.generation.generator.Generator`, the generation loop that needs
no TVM (a board runs the same one). Built with ``max_batch=``, it also holds
``prefill_batch`` and ``decode_batch``, and runs a batch of prompts of different
lengths left-padded, as one prefill and one decode per step
(:mod:`tvm_distx.generation.batch`); the batch-1 functions stay as they are for
single prompts.

The object holds a session: use it as a context manager, or :meth:`close` it.
:meth:`CausalLM.from_pretrained` serves a ``save_pretrained`` checkpoint directory
the same way, reading each rank's blocks of the weights from its safetensors files
without loading the whole model anywhere.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Callable
from pathlib import Path

import numpy as np

from tvm_distx.compiler.pipeline import compile as compile_module
from tvm_distx.compiler.targets import resolve_target
from tvm_distx.sources.checkpoint import open_checkpoint
from tvm_distx.sources.formats import QUANTIZED
from tvm_distx.sources.gguf import open_gguf
from tvm_distx.bundle.generation import GENERATION_FILE, GenerationInfo
from tvm_distx.bundle.manifest import read_manifest
from tvm_distx.bundle.signature import weight_bytes_per_rank
from tvm_distx.errors import ArgumentError, BundleError, DistxError
from tvm_distx.frontend.decoder import export_decoder
from tvm_distx.frontend.pytorch import relax_name
from tvm_distx.llm.compile_cache import (ENTRY_FILE, CacheKey, CompileCache, bytes_digest,
                                         file_identity)
from tvm_distx.plans.stages import pipeline_stages_of
from tvm_distx.llm.recipe import AS_STORED, Recipe, Traced, functions_of, only
from tvm_distx.reports.comm_report import comm_report
from tvm_distx.runtime.backends import check_backend, open_session
from tvm_distx.generation.generator import PREFILL_CHUNK, GenerationStats, Generator
from tvm_distx.generation.opened_bundle import OpenedBundle
from tvm_distx.generation.text import Tokenizer

__all__ = ["CausalLM", "GenerationStats", "GENERATION_FILE"]

logger = logging.getLogger(__name__)


class CausalLM(Generator):
    """A causal language model served on persistent ranks (see the module doc).

    Build it with :meth:`from_hf`; it holds the session until :meth:`close`.
    The generation methods (``generate``, ``stream``) are
    :class:`~tvm_distx.generation.generator.Generator`'s.
    """

    def __init__(self, cache, session, *, exe=None, weights=None, eos_token_id=None,
                 bytes_per_token: int = 0, batch_cache=None, pad_token_id=None,
                 prefill_chunk: int | None = PREFILL_CHUNK, tokenizer=None) -> None:
        super().__init__(cache, session, eos_token_id=eos_token_id,
                         bytes_per_token=bytes_per_token, batch_cache=batch_cache,
                         pad_token_id=pad_token_id, prefill_chunk=prefill_chunk,
                         tokenizer=tokenizer)
        #: the compiled program (None when opened from a bundle)
        self.exe = exe
        #: the global weights given to the session (to export them again)
        self.weights = weights
        #: the sharded global-view program (None when opened from a bundle)
        self.annotated = None
        #: how the model is traced and sharded again, to export what a compile cache
        #: bundle lacks (None when opened from a bundle alone)
        self.recipe: Recipe | None = None
        #: the bytes of the weights each rank holds, by rank
        self.weight_bytes_per_rank: list[int] = []
        #: the compile cache's bundle this model was started from or stored in, if any
        self.cached_bundle: Path | None = None

    @classmethod
    def from_hf(cls, model, num_ranks: int = 2, *, backend: str = "mpi", plan=None, stages=None,
                max_length: int = 256, prompt_length: int | None = None,
                max_batch: int | None = None, dtype: str | None = None,
                quantization: str | None = None, timeout: float = 300.0,
                tokenizer=None, compile_cache=True, **options) -> "CausalLM":
        """Export, shard, compile and launch ``model`` on ``num_ranks`` ranks.

        Parameters
        ----------
        model : transformers.PreTrainedModel
            A causal LM in eval mode (``AutoModelForCausalLM``), batch 1.
        num_ranks : int
            The ranks of the one tensor-parallel mesh.
        backend : {"mpi", "disco", "emulate"}
            Where the ranks run (:meth:`tvm_distx.DistExecutable.session`): MPI
            processes, disco worker processes on this host, or threads of this
            process. The tokens are the same on all three.
        plan : preset, optional
            ``presets.tensor_parallel()`` by default; any preset with
            ``.apply(mod, function)`` (``presets.from_hf(model)``, say).
        stages : int or list of int, optional
            Pipeline stages (:mod:`tvm_distx.plans.stages`): ``stages=S`` cuts the
            ranks into ``S`` consecutive blocks and the decoder's layers into ``S``
            runs of consecutive layers, the plan sharding each stage's layers over
            its block; ``stages=[10, 14]`` gives the layers of each stage. Each rank
            then holds its stage's weights and cache only. ``S`` must divide
            ``num_ranks``.
        max_length : int
            The static maximum of tokens per sequence (prompt included).
        prompt_length : int, optional
            A static prompt length, for plans that cannot move a symbolic one
            (see :func:`tvm_distx.export_decoder`); prompts must then have it.
        max_batch : int, optional
            Also compile batched functions for up to ``max_batch`` prompts, so
            that :meth:`generate` runs a batch as one prefill and one decode per
            step (:mod:`tvm_distx.generation.batch`). None: prompts run one by one; so
            they do, with a logged reason, when the model's masks do not export
            or its batched functions do not shard or compile.
        dtype : {"float32", "bfloat16", "float16"}, optional
            How the weights are stored on the ranks (float32 by default);
            arithmetic stays float32 (:func:`tvm_distx.quantize`).
        quantization : {"q8", "q4"}, optional
            Store the linear weights and the token table as int8 or int4 groups
            of 32 with a float16 scale each; the other weights take ``dtype``.
        timeout : float
            Seconds for the ranks to start and for each call.
        tokenizer : optional
            The model's tokenizer, for text prompts and chat: a transformers
            tokenizer, a :class:`~tvm_distx.generation.text.Tokenizer`, or a
            directory holding its files (``tokenizer.json``).
        compile_cache : bool or path
            Keep the compiled bundle in the compile cache and start from it
            next time (:mod:`tvm_distx.llm.compile_cache`; its key holds a hash
            of the weights' bytes): True for ``$TVM_DISTX_CACHE`` (default
            ``~/.cache/tvm-distx``), a directory, or False.
        **options
            the options of
            :class:`~tvm_distx.runtime.mpi.MPISession`: ``hostfile`` or
            ``hosts``, ``rsh``, ``dest``, ``shared_fs``, ``mpiexec``, ``env``
            for an MPI session.
        """

        check_backend(backend, options)  # before the export and the compile
        if num_ranks < 1:
            raise ArgumentError(f"CausalLM.from_hf(num_ranks={num_ranks}): need at least one "
                                "rank", hint="CausalLM.from_hf(model, num_ranks=2)")
        storage = _storage(dtype, quantization, "CausalLM.from_hf")
        _stages(stages, num_ranks, "CausalLM.from_hf")
        text = _tokenizer_of(tokenizer)  # before the export: a bad one fails at once

        def trace() -> Traced:
            logger.info("tracing %s", type(model).__name__)
            program = export_decoder(model, max_length=max_length, prompt_length=prompt_length,
                                     max_batch=max_batch)
            return Traced(program, program.weights, model)

        recipe = Recipe(trace, num_ranks, plan, storage, _stages(stages))

        def build():
            lm = cls._serve(recipe, backend=backend, timeout=timeout, **options)
            lm.tokenizer = text
            return lm

        def key() -> CacheKey | None:  # the weights are hashed only when the cache is on
            return _key(
                plan, num_ranks=num_ranks, stages=_stages(stages), max_length=max_length,
                prompt_length=prompt_length,
                max_batch=max_batch, storage=storage, tokenizer=text, kind="hf",
                model=type(model).__name__, config=model.config.to_json_string(use_diff=False),
                weights=bytes_digest((name, tensor.detach().cpu().numpy()) for name, tensor
                                     in sorted(model.state_dict().items())))

        return cls._cached(compile_cache, key, build, recipe, link_checkpoint=False,
                           backend=backend, timeout=timeout, **options)

    @classmethod
    def from_pretrained(cls, directory, num_ranks: int = 2, *, backend: str = "mpi",
                        plan=None, stages=None, max_length: int = 256, prompt_length: int | None = None,
                        max_batch: int | None = None, dtype: str | None = None,
                        quantization: str | None = None, timeout: float = 300.0,
                        compile_cache=True, **options) -> "CausalLM":
        """Serve a Hugging Face checkpoint directory, each rank's weights read from it lazily.

        The model is built from ``config.json`` without initialising its
        weights (their memory is never touched), traced, sharded and compiled
        as in :meth:`from_hf`. This process then reads no weight: each rank
        reads the blocks it holds from the checkpoint's memory-mapped
        safetensors files itself (:mod:`tvm_distx.sources.checkpoint`; the
        session's bundle links them, see ``link_checkpoint`` in
        :meth:`tvm_distx.DistExecutable.export`), so no process ever holds the
        whole model. Across hosts each host is sent its ranks' blocks, unless
        ``shared_fs=True`` says the checkpoint is at the same path on every host.
        :meth:`export` copies the blocks into a bundle instead.

        Parameters
        ----------
        directory : path
            Written by ``save_pretrained``: ``config.json`` and one or more
            ``*.safetensors`` files.
        dtype : {"float32", "bfloat16", "float16"}, optional
            How the weights are stored on the ranks. By default as in the
            checkpoint: a bfloat16 checkpoint stays bfloat16 (half the bytes of
            float32 per token); arithmetic is float32 either way.
        quantization : {"q8", "q4"}, optional
            As for :meth:`from_hf`: each rank quantizes its own slice as it
            reads it.
        compile_cache : bool or path
            As for :meth:`from_hf`; the key holds the checkpoint files' identity
            (path, size, modification time), and the cached bundle links them.
        num_ranks, backend, plan, stages, max_length, prompt_length, max_batch, timeout, **options
            As for :meth:`from_hf`.

        Raises
        ------
        ArgumentError
            If the directory is not a checkpoint, or lacks a weight the model
            needs, or holds one of another shape.
        """
        check_backend(backend, options)  # before the export and the compile
        root = Path(directory)
        if not (root / "config.json").is_file():
            raise ArgumentError(f"{root} is not a Hugging Face checkpoint (no config.json)",
                                hint="give the directory model.save_pretrained(...) wrote")
        if num_ranks < 1:
            raise ArgumentError(f"CausalLM.from_pretrained(num_ranks={num_ranks}): need at "
                                "least one rank",
                                hint="CausalLM.from_pretrained(directory, num_ranks=2)")
        _stages(stages, num_ranks, "CausalLM.from_pretrained")
        text = Tokenizer.from_directory(root)
        tensors = open_checkpoint(root, dtype="float32")
        storage = _storage(dtype if dtype is not None else _checkpoint_dtype(tensors),
                           quantization, "CausalLM.from_pretrained")

        def trace() -> Traced:
            import transformers  # a start from the compile cache needs no transformers

            model = _placeholder_model(transformers.AutoConfig.from_pretrained(root))
            logger.info("tracing %s", type(model).__name__)
            program = export_decoder(model, max_length=max_length, prompt_length=prompt_length,
                                     with_weights=False, max_batch=max_batch)
            weights = {name: tensor.astype(spec.dtype) for name, (tensor, spec) in
                       _program_weights(model, program, tensors, f"the checkpoint in {root}",
                                        "save the whole model with save_pretrained, in one "
                                        "directory").items()}
            return Traced(program, weights)  # the placeholders are dropped

        recipe = Recipe(trace, num_ranks, plan, storage, _stages(stages))

        def build():
            import transformers

            lm = cls._serve(recipe, backend=backend, timeout=timeout, **options)
            config = transformers.AutoConfig.from_pretrained(root)
            generation = (transformers.GenerationConfig.from_pretrained(root)
                          if (root / "generation_config.json").is_file() else config)
            lm.eos_token_id = getattr(generation, "eos_token_id", None)
            lm.pad_token_id = getattr(generation, "pad_token_id", None)
            lm.tokenizer = text
            return lm

        def key() -> CacheKey | None:
            return _key(
                plan, num_ranks=num_ranks, stages=_stages(stages), max_length=max_length,
                prompt_length=prompt_length,
                max_batch=max_batch, storage=storage, tokenizer=text, kind="pretrained",
                files=[file_identity(path) for path in sorted(root.iterdir())
                       if path.suffix in (".safetensors", ".json") and path.is_file()])

        return cls._cached(compile_cache, key, build, recipe, link_checkpoint=True,
                           backend=backend, timeout=timeout, **options)

    @classmethod
    def from_gguf(cls, path, num_ranks: int = 2, *, backend: str = "mpi", plan=None, stages=None,
                  max_length: int = 256, prompt_length: int | None = None,
                  max_batch: int | None = None, requantize: str | None = None,
                  timeout: float = 300.0, compile_cache=True, **options) -> "CausalLM":
        """Serve a llama.cpp GGUF file, each tensor in its stored format, each rank mapping its blocks.

        The architecture and the configuration come from the file's metadata
        (:func:`tvm_distx.sources.gguf.open_gguf`: llama, qwen2, qwen3). Every
        tensor is served as stored: ``F32``, ``F16``, ``BF16``, and ``Q8_0`` and
        ``Q4_0`` as the ``q8`` and ``q4`` formats (:mod:`tvm_distx.sources.formats`),
        never widened to float32 in memory; the kernels decode them in registers.
        This process reads no weight: each rank memory-maps the file and reads
        the blocks it holds.

        Parameters
        ----------
        path : path
            A ``.gguf`` file (one file, not a split model).
        requantize : {"q8", "q4", "f16", "bf16", "f32"}, optional
            The format for tensors of other types (``Q4_K``, ``Q6_K``...), which
            each rank then decodes and encodes as it reads its block; without it
            such a file is refused, naming the tensor.
        compile_cache : bool or path
            As for :meth:`from_hf`; the key holds the file's identity (path,
            size, modification time), and the cached bundle links it.
        num_ranks, backend, plan, stages, max_length, prompt_length, max_batch, timeout, **options
            As for :meth:`from_hf`.

        Raises
        ------
        ArgumentError
            If the file is not a GGUF file, its architecture or a tensor type is
            not supported, or a tensor does not fit its configuration.
        """
        check_backend(backend, options)  # before the export and the compile
        if num_ranks < 1:
            raise ArgumentError(f"CausalLM.from_gguf(num_ranks={num_ranks}): need at least one "
                                "rank", hint="CausalLM.from_gguf(path, num_ranks=2)")
        _stages(stages, num_ranks, "CausalLM.from_gguf")
        gguf = open_gguf(path, requantize=requantize)

        def trace() -> Traced:
            model = _placeholder_model(gguf.hf_config())
            logger.info("tracing %s", type(model).__name__)
            program = export_decoder(model, max_length=max_length, prompt_length=prompt_length,
                                     with_weights=False, max_batch=max_batch)
            found = _program_weights(model, program, gguf.tensors, f"the GGUF file {path}",
                                     "give a GGUF file of the whole model, as llama.cpp's "
                                     "converter writes it")
            return Traced(program, {name: tensor for name, (tensor, _) in found.items()})

        recipe = Recipe(trace, num_ranks, plan, (AS_STORED, None), _stages(stages))  # each tensor as in the file

        def build():
            lm = cls._serve(recipe, backend=backend, timeout=timeout, **options)
            lm.eos_token_id = gguf.tokenizer.eos_id
            lm.pad_token_id = gguf.tokenizer.pad_id
            lm.tokenizer = Tokenizer.from_gguf(path)
            return lm

        def key() -> CacheKey | None:
            return _key(
                plan, num_ranks=num_ranks, stages=_stages(stages), max_length=max_length,
                prompt_length=prompt_length,
                max_batch=max_batch, storage=requantize, tokenizer=None, kind="gguf",
                file=file_identity(path))

        return cls._cached(compile_cache, key, build, recipe, link_checkpoint=True,
                           backend=backend, timeout=timeout, **options)

    @classmethod
    def _cached(cls, compile_cache, key: Callable[[], CacheKey | None], build, recipe: Recipe,
                *, link_checkpoint: bool, backend: str, timeout: float,
                **options) -> "CausalLM":
        """``build()``, or the bundle the compile cache holds under ``key()``; a build is
        stored there (its weights linked to their files when ``link_checkpoint``). The key
        is made only when the cache is on (it may hash the weights). A model started from
        the cache keeps ``recipe``, for :meth:`export` to compile what the bundle lacks."""
        store = CompileCache.of(compile_cache)
        key = key() if store is not None else None
        if key is None:
            return build()
        hit = store.lookup(key)
        if hit is not None:
            logger.info("opening the compiled bundle from the compile cache")
            try:
                lm = cls.from_bundle(hit, backend=backend, timeout=timeout, **options)
            except BundleError as err:  # a file no longer matches its sha256
                logger.warning("compile cache: the entry %s is corrupt (%s); building it "
                               "again", hit, err.message.splitlines()[0])
                store.discard(key)
            else:
                logger.info("CausalLM: started from the compile cache (%s)", hit)
                lm.cached_bundle, lm.recipe = hit, recipe
                return lm
        lm = build()
        logger.info("storing the compiled bundle in the compile cache")
        try:
            lm.cached_bundle = store.store(key, lambda directory: lm._export(
                directory, link_checkpoint=link_checkpoint))
        except OSError as err:
            logger.warning("compile cache: cannot store the bundle in %s (%s)", store.root, err)
        return lm

    @classmethod
    def _serve(cls, recipe: Recipe, *, backend: str, timeout: float,
               **options) -> "CausalLM":
        """Follow ``recipe``, compile its program, and launch a session with its weights."""

        traced = recipe.trace()
        program, model = traced.program, traced.model
        logger.info("sharding and compiling for %d ranks", recipe.num_ranks)
        batch_cache, functions = program.batch_cache, functions_of(program.batch_cache)
        # a failure of the batch-1 functions is the model's, not the batch's
        annotated = recipe.shard(recipe.on_mesh(program), functions_of(None))
        exe = None
        if batch_cache is not None:
            try:
                stored, weights = recipe.store(
                    recipe.shard(annotated, functions[len(functions_of(None)):]),
                    traced.weights)
                exe, annotated = compile_module(stored), stored
            except DistxError as err:
                logger.warning("%s: the batched functions do not shard or compile (%s); "
                               "batches of prompts run one prompt after another",
                               type(model).__name__, str(err).splitlines()[0])
                batch_cache, functions = None, functions_of(None)
        if exe is None:
            annotated, weights = recipe.store(only(annotated, functions), traced.weights)
            exe = compile_module(annotated)
        # the bytes of the decode's collectives, from the compile's own local view
        per_token = sum(r.bytes_per_rank for r in comm_report(exe.local_view).rows
                        if r.function == "decode")
        logger.info("starting %d ranks (%s)", recipe.num_ranks, backend)
        session = exe.session(recipe.num_ranks, backend=backend, params=weights,
                              function=functions, timeout=timeout, **options)
        generation = getattr(model, "generation_config", None)
        logger.info("CausalLM: %s on %d ranks, up to %d tokens, %d bytes per rank per token%s",
                    type(model).__name__, recipe.num_ranks, program.cache.max_length,
                    per_token, f", batches of {batch_cache.batch}" if batch_cache else "")
        lm = cls(program.cache, session, exe=exe, weights=weights,
                 eos_token_id=getattr(generation, "eos_token_id", None),
                 pad_token_id=getattr(generation, "pad_token_id", None),
                 bytes_per_token=per_token, batch_cache=batch_cache)
        lm.annotated, lm.recipe = annotated, recipe  # compiled again by export(target=...)
        lm.weight_bytes_per_rank = weight_bytes_per_rank(
            exe.signatures, set(weights), exe.num_ranks)
        logger.info("CausalLM: weights per rank %s bytes", lm.weight_bytes_per_rank)
        return lm

    # ------------------------------------------------------------------ bundles
    def export(self, directory, *, target: str | None = None, **target_options) -> Path:
        """Write a bundle that ``tvm-distx generate`` (or :meth:`from_bundle`) serves.

        The bundle holds ``prefill`` and ``decode`` (and ``prefill_batch`` and
        ``decode_batch`` when compiled), each rank's weight shards once, and
        ``generation.json``: the caches' layouts and the model's end and pad
        tokens, and the tokenizer's files when it has one. Returns the bundle's path.

        A model started from the compile cache holds no compiled program: its
        bundle is copied when it is what is asked for (this host's target,
        the weights in it); otherwise the model is traced, sharded and compiled
        again as :meth:`from_hf` (or ``from_pretrained``, ``from_gguf``) would
        have, for the target asked.

        Parameters
        ----------
        directory : path
            Where the bundle goes.
        target : str, optional
            Compile the same sharded program for this target first (``"rvv"``: a
            bundle for RISC-V boards, which they run with ``./run.sh generate``
            and no TVM). None: the program this object runs.
        **target_options
            Options of that target (for ``"rvv"``: ``vlen``, ``cc``).

        Raises
        ------
        ArgumentError
            For a model opened with :meth:`from_bundle`: it has only its bundle,
            which is for one target.
        """
        if self.exe is None and self.cached_bundle is not None and target is None and \
                not read_manifest(self.cached_bundle).weight_links:
            # started from the compile cache, whose bundle holds its weights: a copy
            shutil.copytree(self.cached_bundle, directory, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(ENTRY_FILE))
            return Path(directory)
        if self.exe is None and self.recipe is None:
            raise ArgumentError(
                "CausalLM.export: this model was opened from a bundle, which holds its "
                "program compiled for one target and no model to compile again"
                + (f" for target {target!r}" if target is not None else
                   " with its weights copied in"),
                hint="copy the bundle directory itself, or start from the model with "
                "CausalLM.from_pretrained(...) (or from_hf, from_gguf) and export that")
        return self._export(directory, target=target, **target_options)

    def _export(self, directory, *, target: str | None = None, link_checkpoint: bool = False,
                **target_options) -> Path:
        exe, annotated, weights = self.exe, self.annotated, self.weights
        if exe is None:  # started from the compile cache: the recipe gives the program again
            logger.info("export: tracing and sharding the model again (it was started from "
                        "the compile cache)")
            annotated, weights = self.recipe.follow(functions_of(self.batch_cache))
        if exe is None or target is not None:
            exe = compile_module(annotated, **({"target": target} if target is not None
                                               else {}), **target_options)
        root = exe.export(directory, params=weights, function=functions_of(self.batch_cache),
                          link_checkpoint=link_checkpoint)
        GenerationInfo(self.cache, self.batch_cache, self.eos_token_id, self.pad_token_id,
                       self.stats.bytes_per_token).write(root)
        if self.tokenizer is not None:
            self.tokenizer.save(root)
        return Path(root)

    @classmethod
    def from_bundle(cls, directory, *, backend: str = "mpi", num_ranks: int | None = None,
                    timeout: float = 300.0, **options) -> "CausalLM":
        """Serve a bundle written by :meth:`export` on its ranks (a session).

        Parameters
        ----------
        directory : path or tvm_distx.generation.opened_bundle.OpenedBundle
            The bundle, or the bundle already read (its manifest, ``generation.json``
            and tokenizer are then not read again).
        backend : {"mpi", "disco", "emulate"}
            Where the ranks run (as for :meth:`from_hf`).
        num_ranks : int, optional
            The bundle fixes its rank count; when given, it must be that count.
        timeout : float
            Seconds for the ranks to start and for each call.
        **options
            the options of
            :class:`~tvm_distx.runtime.mpi.MPISession`: ``hostfile`` or
            ``hosts``, ``rsh``, ``dest``, ``shared_fs``, ``mpiexec``, ``env``
            for an MPI session.

        Raises
        ------
        BundleError
            If the directory is not a generation bundle.
        ArgumentError
            For an unknown backend, or a ``num_ranks`` the bundle was not built for.
        """
        check_backend(backend, options)
        bundle = directory if isinstance(directory, OpenedBundle) else \
            OpenedBundle.open(directory)
        bundle.check_ranks(num_ranks)
        manifest = bundle.manifest
        session = open_session(manifest, backend=backend, timeout=timeout, **options)
        lm = cls.on(bundle.generation, session, tokenizer=bundle.tokenizer)
        lm.weight_bytes_per_rank = weight_bytes_per_rank(
            manifest.functions, {n for names in manifest.weights.values() for n in names},
            manifest.num_ranks)
        return lm


def _key(plan, *, num_ranks: int, max_length: int, prompt_length, max_batch, storage,
         tokenizer: Tokenizer | None, stages=None, **model) -> CacheKey | None:
    """The compile cache's key of a model; None when the plan has no stable description."""
    described = "tensor_parallel()" if plan is None else repr(plan)
    if " at 0x" in described:  # an object without a stable repr: its program is unknown
        logger.info("compile cache: the plan %s has no stable repr; not cached", described)
        return None
    files = tokenizer.files if tokenizer is not None else {}
    if stages is not None:  # keys of one-stage models stay as they were
        model["stages"] = stages
    return CacheKey({**model, "plan": described, "num_ranks": num_ranks,
                     "max_length": max_length, "prompt_length": prompt_length,
                     "max_batch": max_batch, "storage": storage,
                     "target": str(resolve_target("x86").target),
                     "tokenizer": bytes_digest((name, np.frombuffer(data, np.uint8))
                                               for name, data in sorted(files.items()))})


def _stages(stages, num_ranks: int | None = None, where: str = "CausalLM"):
    """``stages=`` as the recipe and the cache key keep it: None for one stage, else an int or
    a tuple of layer counts; checked against ``num_ranks`` at once, and against the model's
    layers when it is traced (:func:`tvm_distx.plans.stages.pipeline_stages_of`)."""
    if stages is None or (isinstance(stages, int) and not isinstance(stages, bool)
                          and stages == 1):
        return None
    kept = tuple(stages) if isinstance(stages, (list, tuple)) else stages
    if num_ranks is not None:  # the layers are not known yet: as many as the stages ask
        layers = sum(kept) if isinstance(kept, tuple) else kept if isinstance(kept, int) else 1
        pipeline_stages_of(stages, num_ranks=num_ranks, num_layers=max(layers, 1), base=None,
                           where=where)
    return kept


def _tokenizer_of(tokenizer) -> Tokenizer | None:
    """A :class:`Tokenizer` of what ``from_hf(tokenizer=...)`` was given."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        found = Tokenizer.from_directory(tokenizer)
        if found is None:
            raise ArgumentError(f"from_hf(tokenizer={str(tokenizer)!r}): no tokenizer files "
                                "there", hint="give the directory of tokenizer.json, or a "
                                "transformers tokenizer")
        return found
    if hasattr(tokenizer, "save_pretrained"):
        return Tokenizer.from_transformers(tokenizer)
    raise ArgumentError(f"from_hf(tokenizer=...) got a {type(tokenizer).__name__}",
                        hint="give a transformers tokenizer, a tvm_distx Tokenizer or the "
                        "directory of its files")


def _placeholder_model(config):
    """A transformers causal LM of ``config`` whose weights are never initialised."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    with no_init_weights():  # placeholders: allocated, never written or read
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # skipped with the initialisation; ties are part of the graph
    return model.eval()


def _program_weights(model, program, tensors: dict, source, hint: str) -> dict:
    """Each program weight's tensor of ``tensors`` (by the model's parameter names) and spec.

    A program weight is a model tensor, known in ``tensors`` under one of the names
    it has in the model (tied weights have several).
    """
    aliases: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
    by_relax = {relax_name("model." + name): names for names in aliases.values()
                for name in names}
    weights = {}
    for name, spec in program.weights.items():
        names = by_relax.get(name, [])
        found = next((n for n in names if n in tensors), None)
        if found is None:
            raise ArgumentError(
                f"{source} has no tensor {' or '.join(names) or name}, which "
                f"{type(model).__name__} needs",
                hint=hint)
        if tuple(tensors[found].shape) != tuple(spec.shape):
            raise ArgumentError(
                f"tensor {found} of {source} has shape {list(tensors[found].shape)}, but the "
                f"configuration gives {type(model).__name__} {list(spec.shape)}",
                hint="use the configuration saved with these weights")
        weights[name] = (tensors[found], spec)
    return weights


#: ``dtype=`` values and the weight format each stores.
_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _storage(dtype, quantization, where: str) -> tuple[str, str | None] | None:
    """The ``(format, dtype)`` :func:`tvm_distx.quantize` takes, or None for float32 weights."""
    name = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}.get(dtype, dtype)
    if name is not None and name not in _DTYPES:
        raise ArgumentError(f"{where}(dtype={dtype!r}): not a weight dtype",
                            hint=f"{where}(..., dtype=\"bfloat16\"), or one of "
                            f"{', '.join(map(repr, _DTYPES))}")
    if quantization is not None and quantization not in QUANTIZED:
        raise ArgumentError(f"{where}(quantization={quantization!r}): not a quantization",
                            hint=f"{where}(..., quantization=\"q8\"), or one of "
                            f"{', '.join(map(repr, QUANTIZED))}")
    rest = _DTYPES[name] if name is not None else "f32"
    if quantization is not None:
        return quantization, rest if rest != "f32" else None
    return None if rest == "f32" else (rest, None)


def _checkpoint_dtype(tensors) -> str:
    """The dtype most of a checkpoint's floating-point bytes are stored in."""
    stored: dict[str, int] = {}
    for tensor in tensors.values():
        name = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(tensor.stored_dtype)
        if name is not None:
            stored[name] = stored.get(name, 0) + int(np.prod(tensor.shape, dtype=np.int64))
    return max(stored, key=stored.get) if stored else "float32"
