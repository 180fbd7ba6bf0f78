"""One thread that owns the model's ranks and runs the requests one after another.

A session runs one call at a time, so requests are queued: :class:`GenerationWorker`
takes :class:`Job` objects from a queue (at most ``max_queue`` waiting; one more is
refused with :class:`~tvm_distx.errors.ServerBusyError`, so a client learns at once that
the server is busy) and runs each on the generator, handing its text pieces to the
caller as they come. A caller that goes away
cancels its job; the worker stops it before the next token, and the next request starts
with its own prefill, so nothing of the cancelled one is left on the ranks. A rank failure
ends the session: the job gets the error, and every later one is refused with it.

This module imports neither TVM nor the web framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import logging
import queue
import threading
from typing import Any, Callable, Sequence

from tvm_distx.errors import ArgumentError, DistxError, LaunchError, ServerBusyError

__all__ = ["GenerationWorker", "Job", "Result"]

logger = logging.getLogger(__name__)


@dataclass
class Result:
    """What a finished job produced.

    Attributes
    ----------
    text : str
        The new text.
    prompt_tokens, completion_tokens : int
        Token counts, as OpenAI's ``usage`` reports them.
    finish_reason : str
        ``"stop"`` (end token or stop string) or ``"length"`` (``max_tokens`` reached).
    """

    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "length"


@dataclass
class Job:
    """One request: a prompt text or chat messages, and how to generate.

    ``emit(piece)`` is called from the worker thread with each text piece, then
    ``done(result_or_error)`` once.
    """

    prompt: str | Sequence[dict]
    max_tokens: int
    options: dict[str, Any]
    stop: list[str]
    emit: Callable[[str], None]
    done: Callable[[Result | BaseException], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class GenerationWorker:
    """Runs :class:`Job` objects on ``lm`` (a :class:`~tvm_distx.generation.generator.Generator`
    with a tokenizer), one at a time, in its own thread.

    Parameters
    ----------
    lm : Generator
        The model on its ranks; the worker is its only user from now on.
    max_queue : int
        Jobs that may wait; :meth:`submit` refuses more with :class:`Busy`.
    """

    def __init__(self, lm, max_queue: int = 16) -> None:
        if max_queue < 1:
            raise ArgumentError(f"max_queue={max_queue}: at least 1 request must be able to "
                                "wait", hint="max_queue=16", cli_hint="--max-queue 16")
        self.lm = lm
        self.failure: DistxError | None = None
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="tvm-distx-generation",
                                        daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Jobs in the queue, not yet started."""
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises
        ------
        ServerBusyError
            If ``max_queue`` jobs are waiting already.
        DistxError
            If the ranks have failed (the failure that ended them).
        """
        if self.failure is not None:
            raise self.failure
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise ServerBusyError(f"{self._jobs.maxsize} requests are waiting",
                                  hint="try again later, or serve with a larger max_queue",
                                  cli_hint="try again later, or serve with a larger "
                                  "--max-queue") from None

    def close(self) -> None:
        """Finish the job running, refuse the waiting ones, and stop the thread."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.done(ArgumentError("the server is shutting down"))
        self._jobs.put(None)
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            if self.failure is not None:
                job.done(self.failure)
                continue
            try:
                job.done(self._generate(job))
            except LaunchError as err:  # the ranks are gone: nothing more can run
                self.failure = err
                logger.error("the ranks failed: %s", err.message)
                job.done(err)
            except Exception as err:  # noqa: BLE001 - handed to the request, logged there
                job.done(err)

    def _generate(self, job: Job) -> Result:
        lm = self.lm
        result = Result()
        pieces = lm.stream_text(job.prompt, job.max_tokens, stop_strings=job.stop or None,
                                **job.options)
        try:
            for piece in pieces:
                result.text += piece
                job.emit(piece)
                if job.cancelled.is_set():
                    logger.info("a request was cancelled after %d tokens",
                                lm.text_stats.completion_tokens)
                    break
        finally:
            pieces.close()
        stats = lm.text_stats
        result.prompt_tokens = stats.prompt_tokens
        result.completion_tokens = stats.completion_tokens
        result.finish_reason = stats.finish_reason
        return result
