"""The generation engine of one base: many concurrent `stream` callers served by ONE background decode loop with
continuous batching (requests join the running batch between steps, finished ones leave), one batch mixing rows of
different adapters and of the base. The loop runs in its own thread, so the caller's event loop stays free."""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from moetune.api.environment import ENV_S3_ENDPOINT_URL
from moetune.workers.generate import cache as batch_cache
from moetune.workers.generate.adapters import AdapterStore
from moetune.workers.generate.decoding import DecodeBatch, Row, new_row
from moetune.workers.generate.loading import LoadedBase, load_base
from moetune.workers.generate.requests import (
    BASE,
    AdapterLoadError,
    ContextLengthError,
    GenerationRequest,
    InvalidRequestError,
    TokenEvent,
)
from moetune.workers.lora.row_slots import RowSelection


def _failed(error: Exception) -> RuntimeError:
    return RuntimeError(f"generation failed: {type(error).__name__}: {error}")


def use_device(device: torch.device) -> torch.device:
    """Makes `device` the calling thread's current CUDA device; the device the thread now computes on. CUDA's current
    device is per thread and a new thread starts on cuda:0: without this, a replica's decode thread on another GPU
    would allocate its scratch and launch its kernels' streams on cuda:0. On CPU nothing changes."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(eq=False)
class _Job:
    request: GenerationRequest
    emit: object  # thread-safe: puts a TokenEvent or an exception on the caller's queue
    cancelled: bool = False
    row: Row | None = None
    submitted: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(self, base: LoadedBase, selection: RowSelection, store: AdapterStore, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.tokenizer, self.context_length = base.model, base.tokenizer, base.context_length
        self.base, self.store, self.max_batch = base, store, max_batch
        self.batch = DecodeBatch(self.model, selection)
        self.device = self.batch.device
        self.decode_device: torch.device | None = None  # the decode thread's device, once it runs
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._waiting: collections.deque[_Job] = collections.deque()
        self._jobs: list[_Job] = []  # the running batch's jobs, in row order
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.counts = collections.Counter(requests=0, prompt_tokens=0, tokens_generated=0, peak_batch=0)

    @classmethod
    def from_uri(cls, base_uri: str, *, s3_endpoint_url: str | None = None, max_adapters: int = 8,
                 max_batch: int = 16, device: str = "cpu", weights_cache_dir: str | None = None) -> "Engine":
        """The base at `base_uri` (a checkpoint directory: config.json, safetensors, tokenizer), loaded once.
        `s3_endpoint_url`: the S3-compatible endpoint of s3:// URIs (base and adapters; it becomes this process's
        MOETUNE_S3_ENDPOINT_URL, as on a training worker)."""
        if s3_endpoint_url:
            os.environ[ENV_S3_ENDPOINT_URL] = s3_endpoint_url
        selection = RowSelection()
        base = load_base(base_uri, torch.device(device), selection, max_adapters + 1, weights_cache_dir)
        store = AdapterStore(base.model, selection, base.experts, max_adapters, base.dtype, torch.device(device))
        return cls(base, selection, store, max_batch)

    # ------------------------------------------------------------------ callers (any thread, any event loop)

    def check(self, request: GenerationRequest) -> None:
        """The request's errors a client can fix (InvalidRequestError, a ValueError: HTTP 400)."""
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if len(prompt) + params.max_new_tokens > self.context_length:
            raise ContextLengthError(
                f"this model's maximum context length is {self.context_length} tokens; {len(prompt)} in the prompt "
                f"plus {params.max_new_tokens} to generate is {len(prompt) + params.max_new_tokens}", "max_tokens")

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The request's tokens as they are made, then one event with the finish reason. Raises the request's
        errors (see `check`) before anything runs, AdapterLoadError when its adapter cannot be loaded."""
        self.check(request)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def emit(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone: nobody listens any more
                job.cancelled = True

        job = _Job(request, emit)
        self._submit(job)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled = True  # a caller that stops listening frees its row at the next step

    def stats(self) -> dict:
        base_bytes = sum(p.nbytes for p in self.model.parameters()) + sum(b.nbytes for b in self.model.buffers())
        cache = batch_cache.cache_bytes(self.batch.cache, self.base.layer_types) if self.batch.cache else {}
        return {**self.store.stats(), "base_loads": 1, "base_bytes": base_bytes,
                "base_load_seconds": self.base.load_seconds, "base_bytes_from_storage": self.base.bytes_from_storage,
                "cache_bytes": cache, "running": len(self._jobs), "waiting": len(self._waiting),
                "decode_steps": self.batch.steps, **self.counts}

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ the decode loop (its own thread)

    def _submit(self, job: _Job) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moetune-decode", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        self.decode_device = use_device(self.device)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._closed and not self._waiting and not self._jobs:
                        self._wake.wait()
                    if self._closed:
                        return
                try:
                    self._admit()
                    if self._jobs:
                        self._decode()
                except Exception as e:  # a failed forward fails the running requests, not the engine
                    for job in self._jobs:
                        job.emit(_failed(e))
                        self._release(job)
                    self._jobs, self.batch.rows, self.batch.cache = [], [], None

    def _admit(self) -> None:
        """Prefills waiting requests into the batch (up to max_batch), oldest first."""
        while len(self._jobs) < self.max_batch:
            with self._wake:
                job = self._waiting.popleft() if self._waiting else None
            if job is None:
                return
            if job.cancelled:
                continue
            request = job.request
            try:
                slot = 0 if request.adapter in (None, BASE) else self.store.acquire(request.adapter)
            except AdapterLoadError as e:
                job.emit(e)
                continue
            if slot is None:  # every adapter slot is held by running requests: wait for one to finish
                with self._wake:
                    self._waiting.appendleft(job)
                return
            job.row = new_row(request.prompt_ids, request.params, self.base.stop_ids, self.device, slot=slot)
            try:
                token, cache = self.batch.prefill(job.row)
            except Exception as e:  # this request fails; the running batch goes on
                job.emit(_failed(e))
                self._release(job)
                continue
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += len(request.prompt_ids)
            if self._take(job, token):
                self._finish(job)
            else:
                self.batch.join(job.row, cache)
                self._jobs.append(job)

    def _decode(self) -> None:
        self.counts["peak_batch"] = max(self.counts["peak_batch"], len(self._jobs))
        tokens = self.batch.step()
        finished = [self._take(job, token) for job, token in zip(self._jobs, tokens, strict=True)]
        if any(finished):
            self.batch.keep([i for i, done in enumerate(finished) if not done])
            left = [job for job, done in zip(self._jobs, finished, strict=True) if done]
            self._jobs = [job for job, done in zip(self._jobs, finished, strict=True) if not done]
            for job in left:  # told only once their rows have left the batch (and its cache)
                self._finish(job)

    def _take(self, job: _Job, token: int) -> bool:
        """Emits the row's new token; True when the row is finished (or its caller went away)."""
        if job.cancelled:
            return True
        finished = job.row.take(token)
        if job.row.finish_reason != "stop":
            job.emit(TokenEvent(token, None))
            self.counts["tokens_generated"] += 1
        return finished

    def _finish(self, job: _Job) -> None:
        if not job.cancelled:
            job.emit(TokenEvent(None, job.row.finish_reason))
        self._release(job)

    def _release(self, job: _Job) -> None:
        if job.row is not None and job.row.slot:
            self.store.release(job.row.slot)
            job.row.slot = 0
