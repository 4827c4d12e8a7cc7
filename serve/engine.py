"""The decoding worker: one thread that owns the model and decodes the admitted requests in one continuous batch,
each request's tokens turned into text deltas and reported to its asyncio queue. The same thread builds and fits the
model (:class:`TorchThread`)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from medusa_lite import MedusaModel
from medusa_lite._hf import context_length
from medusa_lite.decode import prefill_chunks
from medusa_lite.decode.batch import PREFILL_TOKENS

from .metrics import Metrics, speculative_stats
from .schemas import APIError

log = logging.getLogger("medusa_lite.serve")


class TorchThread:
    """The one thread that runs all of the server's torch work: building the model, fitting it, decoding. torch's CPU
    kernels share work through OpenMP, whose thread pools belong to the thread that starts them: a process where one
    thread built and fitted the model and another decoded ran every parallel region through a second pool, which cost
    about a third of a batched step's throughput (docs/serving.md). A daemon: a server that never closes its engine
    still exits."""

    def __init__(self, name: str = "medusa-worker"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)

    def submit(self, fn) -> concurrent.futures.Future:
        """Run ``fn()`` on the thread after the work already given it; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def run(self, fn):
        """``fn()`` run on the thread: its result (or its exception, raised here)."""
        return self.submit(fn).result()


def _report_stop(worker: concurrent.futures.Future) -> None:
    if not worker.cancelled() and worker.exception() is not None:
        log.error("the decoding worker stopped", exc_info=worker.exception())


class Cancelled(Exception):
    """Raised inside ``generate`` (from the streamer) when a request is cancelled."""


@dataclass(eq=False)  # identity semantics: jobs are found in the queue by identity
class Job:
    """One completion of an admitted request (a request with ``n`` > 1 is ``n`` jobs); the worker reports to
    ``events`` (an asyncio queue of (index, kind, payload)) via ``emit``."""

    prompt_ids: list[int]
    max_tokens: int
    gen_kwargs: dict[str, Any]  # generate()'s: sampling, the stop rule's conditions, token masks
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token: float | None = None
    seq: Any = None          # its row in the running batch (medusa_lite.decode.Sequence), once admitted
    detok: Any = None
    index: int = 0           # its choice among the request's ``n`` (which share ``events``)
    logprobs: int | None = None  # report tokens' log-probs with this many alternatives (None: none)
    ids_as_tokens: bool = False  # log-prob entries name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    priority: int = 0        # lower first (vLLM's); equal priorities keep their arrival order

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, payload))
        except RuntimeError:  # the event loop is closed: the server is gone, nobody listens
            pass


class Detokenizer:
    """A row's text as deltas whose concatenation is its final text: the text of the row's stop rule
    (:class:`medusa_lite.decode.Stopper`, which decodes it and says where it ends). While the row runs, text that might
    still become (the start of) a stop string, or an incomplete UTF-8 sequence, is held back."""

    def __init__(self, tokenizer, lock: threading.Lock, ids_as_tokens: bool = False):
        self.tok, self.lock, self.ids_as_tokens = tokenizer, lock, ids_as_tokens
        self.stopper = None  # the row's, once its sequence is made
        self.sent = ""

    def _text(self) -> str:
        text, finish = self.stopper.text(), self.stopper.finish
        return text if finish is None or finish.text_end is None else text[:finish.text_end]

    def add(self) -> str:
        """The delta after the row's newest tokens."""
        text = self._text()
        if self.stopper.finish is None:
            hold = max((len(s) for s in self.stopper.rule.strings), default=1) - 1
            text = (text[:len(text) - hold] if hold else text).rstrip("\ufffd")
        return self._advance(text)

    def finish(self) -> str:
        """The last delta."""
        return self._advance(self._text())

    def logprobs(self, ids: list[int], entries: list) -> list[dict]:
        """Tokens with their log-probs (``Sequence.token_logprobs`` entries) as
        ``{"token", "bytes", "logprob", "top": [{"token", "bytes", "logprob"}]}``, each token's own text (or
        ``token_id:<id>``)."""
        with self.lock:
            def piece(i: int, lp: float) -> dict:
                text = f"token_id:{i}" if self.ids_as_tokens else self.tok.decode([i])
                return {"token": text, "bytes": list(text.encode()), "logprob": lp}

            return [{**piece(i, lp), "top": [piece(t, v) for t, v in top]} for i, (lp, top) in zip(ids, entries)]

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (or a tokenizer that re-spells earlier text: keep what was sent)
        delta, self.sent = text[len(self.sent):], text
        return delta


class LockedTokenizer:
    """The tokenizer's ``decode`` under the engine's lock (fast tokenizers must not be used from two threads at once):
    what the worker's stop rules decode with, while the event loop tokenizes requests."""

    def __init__(self, tokenizer, lock: threading.Lock):
        self.tok, self.lock = tokenizer, lock

    def decode(self, ids: list[int], **kwargs) -> str:
        with self.lock:
            return self.tok.decode(ids, **kwargs)


class _JobStreamer:
    """transformers-style streamer for one job: raises :class:`Cancelled` once the job's flag is set."""

    def __init__(self, job: Job, detok: Detokenizer, metrics: Metrics):
        self.job, self.detok, self.metrics = job, detok, metrics
        self.prompt_seen = False
        self.tokens = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        if self.job.cancel.is_set():
            raise Cancelled
        ids = value.reshape(-1).tolist()
        self.tokens += len(ids)
        logprobs = self.detok.logprobs(ids, self.job.seq.token_logprobs[-len(ids):]) \
            if self.job.logprobs is not None else None
        if self.job.first_token is None:
            self.job.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.job.first_token - self.job.arrival)
        delta = self.detok.add()
        self.job.emit("delta", (delta, self.tokens, logprobs))

    def end(self) -> None:
        pass


class Engine:
    """Owns the model; admits jobs into a bounded FIFO and decodes up to ``max_batch_size`` of them at once on one
    thread (continuous batching, :class:`medusa_lite.decode.SpeculativeBatch`): between two verify steps,
    cancelled rows leave and waiting jobs join (their prompts prefilled together, up to ``max_prefill_tokens`` padded
    prompt tokens a forward); every step verifies all
    rows' trees in one target forward of at most ``max_batched_tokens`` tree tokens. Each row stops, streams and
    fails on its own: its output is its solo output whatever the other rows do."""

    def __init__(self, model: MedusaModel, tokenizer, metrics: Metrics, max_queue: int, max_batch_size: int = 16,
                 max_batched_tokens: int = 128, max_prefill_tokens: int = PREFILL_TOKENS, arrival_window: float = 0.02,
                 torch_thread: TorchThread | None = None, *, max_model_len: int | None = None,
                 chat_template: str | None = None):
        self.model, self.tok, self.metrics, self.max_queue = model, tokenizer, metrics, max_queue
        self.max_batch_size, self.max_batched_tokens = max_batch_size, max_batched_tokens
        self.max_prefill_tokens, self.arrival_window = max_prefill_tokens, arrival_window
        self.batch = model.decoder(max_step_tokens=max_batched_tokens)
        self.tok_lock = threading.Lock()  # fast tokenizers must not be used from two threads at once
        self.decoder = LockedTokenizer(tokenizer, self.tok_lock)  # the stop rules' (on the worker)
        self.limit = context_length(model.base_model.config)  # prompt + completion, at most (None: unbounded)
        if max_model_len is not None:
            self.limit = max_model_len if self.limit is None else min(self.limit, max_model_len)
        self.chat_template = chat_template  # None: the tokenizer's
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.running: list[Job] = []  # the rows of the batch (changed by the worker, under the lock)
        self.torch_thread = torch_thread or TorchThread()  # the thread that built the model, where one did
        self._worker: concurrent.futures.Future | None = None  # the decoding loop on it, once started

    # ---------------------------------------------------------- tokenization (event-loop thread)
    def encode(self, text: str, *, special: bool) -> list[int]:
        with self.tok_lock:
            return self.tok(text, add_special_tokens=special)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self.tok_lock:
            return self.tok.decode(ids)

    def chat_prompt(self, messages: list[dict], *, template: str | None = None, special: bool = False,
                    **options) -> list[int]:
        """The messages through the chat template (the request's ``template``, else the server's, else the
        tokenizer's) as token ids; ``options``: the template's (``add_generation_prompt``, ``continue_final_message``,
        ``documents``, the request's ``chat_template_kwargs``); ``special``: add the tokenizer's special tokens too."""
        template = template or self.chat_template
        if template is None and getattr(self.tok, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template: use /v1/completions or send chat_template",
                           param="messages")
        try:
            with self.tok_lock:
                text = self.tok.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
        except Exception as e:  # jinja raise_exception(), e.g. roles out of order
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages")
        return self.encode(text, special=special)

    # ---------------------------------------------------------- admission
    def start(self) -> None:
        self._worker = self.torch_thread.submit(self._loop)
        self._worker.add_done_callback(_report_stop)

    @property
    def alive(self) -> bool:
        return self._worker is not None and not self._worker.done() and not self._closed

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if len(self._pending) >= self.max_queue + max(self.max_batch_size - len(self.running), 0):
                raise APIError(429, f"the server is busy: {len(self._pending)} requests are waiting (max_queue)",
                               type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            at = len(self._pending)  # behind every job of its priority or a lower one (vLLM's: lower first)
            while at and self._pending[at - 1].priority > job.priority:
                at -= 1
            self._pending.insert(at, job)
            self.metrics.waiting.set(len(self._pending))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: a waiting job leaves the queue now, a running one leaves the batch before the next step."""
        job.cancel.set()
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
                self.metrics.waiting.set(len(self._pending))
                self.metrics.finished.labels(finished_reason="cancelled").inc()

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new jobs, cancel waiting and running ones, join the worker."""
        with self._cond:
            self._closed = True
            for job in self._pending:
                job.cancel.set()
                job.emit("error", APIError(503, "the server is shutting down", type="server_error"))
            self._pending.clear()
            self.metrics.waiting.set(0)
            for job in self.running:
                job.cancel.set()
            self._cond.notify_all()
        if self._worker is not None:
            concurrent.futures.wait([self._worker], timeout)

    # ---------------------------------------------------------- the worker
    def _loop(self) -> None:
        with self.batch.held():  # the faster linears patched in once, for the worker's life
            self._steps()

    def _steps(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self.running and not self._closed:
                    self._cond.wait()
                if self._closed and not self.running:
                    return
                if not self.running:
                    self._await_arrivals()
                joining = []
                while self._pending and len(self.running) + len(joining) < self.max_batch_size:
                    joining.append(self._pending.popleft())
                self.metrics.waiting.set(len(self._pending))
            self._join(_by_request(joining))
            self._leave([job for job in self.running if job.cancel.is_set()], Cancelled())
            if self.batch.rows:
                self.metrics.batch_size.observe(len(self.batch.rows))
                try:
                    finished = self.batch.step()
                except Exception as e:  # noqa: BLE001 - the step failed for every row: fail them, keep serving
                    log.exception("decoding step failed")
                    self._leave(list(self.running), e)
                    finished = []
                for seq in finished:
                    self._finish(seq.tag)
            self.metrics.running.set(len(self.running))

    def _await_arrivals(self) -> None:
        """An idle worker woken by a request waits up to ``arrival_window`` seconds (under the lock) for the requests
        that arrive with it, so that concurrent clients' prompts share one prefill forward instead of queueing behind
        the first one's."""
        deadline = time.perf_counter() + self.arrival_window
        while len(self._pending) < self.max_batch_size and not self._closed:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cond.wait(left)

    def _join(self, requests: list[list[Job]]) -> None:
        """Prefill the joining requests, several prompts in each forward (:func:`~medusa_lite.decode.prefill_chunks`;
        a request's ``n`` completions share its prompt's row) and add them to the batch, or finish those whose first
        token was their last, or fail those that are bad or cancelled."""
        groups = []
        for jobs in requests:
            seqs = []
            for job in jobs:
                try:
                    if job.cancel.is_set():
                        raise Cancelled
                    job.seq = self._sequence(job)
                    seqs.append(job.seq)
                except Exception as e:  # noqa: BLE001 - reported to this request only
                    self._fail(job, e)
            if seqs:
                groups.append(seqs)
        for chunk in prefill_chunks(groups, self.max_prefill_tokens):
            try:
                joined = self.batch.add_prompts(chunk)
            except Exception as e:  # noqa: BLE001 - reported to these requests only
                for seqs in chunk:
                    for seq in seqs:
                        self._fail(seq.tag, e)
                continue
            for seqs, oks in zip(chunk, joined):
                for seq, ok in zip(seqs, oks):
                    if ok:
                        with self._cond:
                            self.running.append(seq.tag)
                    else:
                        self._finish(seq.tag)

    def _sequence(self, job: Job):
        """The job's row (:meth:`MedusaModel.sequence`), streaming into its detokenizer."""
        detok = Detokenizer(self.tok, self.tok_lock, job.ids_as_tokens)
        streamer = _JobStreamer(job, detok, self.metrics)
        streamer.prompt_seen = True  # the prompt is not streamed back
        job.detok = detok
        ids = torch.tensor(job.prompt_ids, dtype=torch.long, device=self.model.device)
        seq = self.model.sequence(ids, max_new_tokens=job.max_tokens, streamer=streamer, tag=job,
                                  logprobs=job.logprobs, tokenizer=self.decoder, **job.gen_kwargs)
        detok.stopper = seq.stopper  # the row's text and where it ends: its stop rule's
        return seq

    def _leave(self, jobs: list[Job], error: BaseException) -> None:
        """Take ``jobs`` out of the batch now (cancelled, or their step failed) and report ``error`` to each."""
        if not jobs:
            return
        self.batch.remove([job.seq for job in jobs])
        for job in jobs:
            job.seq.error = error
            self._finish(job)

    def _fail(self, job: Job, e: BaseException) -> None:
        if isinstance(e, Cancelled):
            self.metrics.finished.labels(finished_reason="cancelled").inc()
            job.emit("error", APIError(499, "request cancelled", code="cancelled"))
            return
        self.metrics.finished.labels(finished_reason="error").inc()
        if isinstance(e, ValueError):
            job.emit("error", APIError(400, str(e)))
            return
        log.error("generation failed: %s: %s", type(e).__name__, e)
        job.emit("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))

    def _finish(self, job: Job) -> None:
        with self._cond:
            if job in self.running:
                self.running.remove(job)
        seq = job.seq
        if seq.error is not None:
            self._fail(job, seq.error)
            return
        stats, detok = seq.stats, job.detok
        new = seq.stopper.generated
        delta = detok.finish()
        reason = stats.finish_reason or "length"  # why the stop rule stopped it
        now = time.perf_counter()
        m = self.metrics
        m.e2e.observe(now - job.arrival)
        m.finished.labels(finished_reason=reason).inc()
        m.prompt_tokens.inc(len(job.prompt_ids))
        m.generation_tokens.inc(len(new))
        m.record_spec(stats)
        m.record_fitted(stats, "sample" if job.gen_kwargs.get("do_sample") else "greedy")
        logprobs = detok.logprobs(new, seq.token_logprobs) if job.logprobs is not None else None
        job.emit("done", {"delta": delta, "finish_reason": reason, "stop_reason": stats.stop_reason,
                          "text": detok.sent, "logprobs": logprobs,
                          "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(new),
                                    "total_tokens": len(job.prompt_ids) + len(new)},
                          "medusa_lite": speculative_stats(stats)})


def _by_request(jobs: list[Job]) -> list[list[Job]]:
    """Consecutive jobs of one request (its ``n`` completions share one events queue) grouped together."""
    groups: list[list[Job]] = []
    for job in jobs:
        if groups and groups[-1][0].events is job.events:
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups
