"""OpenAI-compatible server for a MedusaModel: ``medusa-lite serve [--target DIR] [--heads DIR] ...``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
-> server-sent events in OpenAI's chunk format), ``GET /health``, ``GET /metrics`` (Prometheus text).

Scheduling: continuous batching. One worker thread decodes up to ``max_batch_size`` requests at once
(:class:`medusa_lite.decode.SpeculativeBatch`): every step verifies all their trees in one target forward;
between steps finished and cancelled requests leave and waiting ones join. Trees shrink as the batch grows
(priced by the latency model fitted to this machine, capped at ``max_batched_tokens`` per step). Up to
``max_queue`` more requests wait in a FIFO queue and further requests get 429 with ``Retry-After``. A request
whose client disconnects is cancelled: a waiting one leaves the queue at once, a running one leaves the batch
before the next step.

Settings (``medusa_lite.settings``): defaults < the shipped ``configs/serve/default.yaml`` (or ``--config FILE``)
< command-line flags.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from medusa_lite import MedusaModel
from medusa_lite._hf import context_length
from medusa_lite.decode import GenerationStats
from medusa_lite.settings import SettingsParser, option
from medusa_lite.targets import DEFAULT_TARGET, load_model
from medusa_lite.tree import parse_tree, tree_nodes

log = logging.getLogger("medusa_lite.serve")


# ====================================================================== settings
@dataclass
class Settings:
    """Server settings. Precedence: these defaults < the YAML file (``--config``; the shipped ``default``) < flags."""

    host: str = option("127.0.0.1", "listen address (0.0.0.0: all interfaces)")
    port: int = option(8000, "listen port")
    target: str | None = option(None, "HF directory or .gguf file; none: the bundled default target")
    heads: str | None = option(None, "heads directory; none: the bundled heads (default target), else fresh heads")
    dtype: Literal["fp32", "bf16", "fp16"] = option("fp32", "target dtype")
    device: str = option("cpu", "cpu or cuda")
    served_model_name: str | None = option(None, "the model id clients send; none: the target's name")
    max_queue: int = option(16, "requests waiting while the batch is full; more get 429")
    max_batch_size: int = option(8, "requests decoded at once (continuous batching); 1: one at a time")
    max_batched_tokens: int = option(128, "tree tokens one verify step may hold, all rows together (trees are "
                                          "cut to fit)")
    default_max_tokens: int = option(256, "max_tokens when a request gives none (capped by the context window)")
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    threads: int | None = option(None, "torch intra-op threads; none: torch's default")
    shutdown_timeout: float = option(10.0, "seconds in-flight requests get to finish on SIGINT / SIGTERM")
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log level")

    def __post_init__(self) -> None:
        checks = {"port": 0 <= self.port < 65536, "max_queue": self.max_queue >= 0,
                  "max_batch_size": self.max_batch_size >= 1, "max_batched_tokens": self.max_batched_tokens >= 1,
                  "default_max_tokens": self.default_max_tokens >= 1, "max_body_bytes": self.max_body_bytes >= 1024,
                  "dtype": self.dtype in ("fp32", "bf16", "fp16"), "shutdown_timeout": self.shutdown_timeout >= 0}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid serve settings: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = SettingsParser(Settings, prog="medusa-lite serve", description=__doc__, kind="serve",
                            default_config="default")
    return parser.parse(argv)[0]


def build_model(settings: Settings) -> tuple[MedusaModel, Any, str]:
    """(model, tokenizer, served name) from the settings."""
    model, tok = load_model(settings.target, settings.heads, dtype=settings.dtype, device=settings.device)
    name = Path(settings.target).name if settings.target else DEFAULT_TARGET
    return model, tok, settings.served_model_name or name


# ====================================================================== errors
class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ====================================================================== request schemas
class _Strict(BaseModel):
    # strict: "10" is not an int, true is not a number; unknown fields (user, metadata, ...) are ignored
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)          # extension (vLLM's); -1 or 0: no top-k
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted at their neutral values only (see _check_unsupported)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    logprobs: bool | int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list | None = None


def _check_unsupported(req: _Common) -> None:
    """400 for OpenAI parameters this server accepts only at their neutral value."""
    for name in ("n", "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "echo",
                 "suffix", "top_logprobs", "tools"):
        value = getattr(req, name, None)
        neutral = value is None or (value == 1 if name in ("n", "best_of") else not value)
        if not neutral:
            what = "n must be 1: one completion per request" if name == "n" else f"{name}={value!r} is not supported"
            raise APIError(400, f"{what} (medusa_lite serves one completion per request, greedy or sampling)",
                           param=name, code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop: up to 4 non-empty strings", param="stop")


_UNION_HINTS = {"prompt": "a string, a list with one string or a list of token ids",
                "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def parse_request(schema: type[_Common], body: Any) -> _Common:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # loc names fields, list indices and union members ("prompt.str"): keep fields and indices
        fields = {f for m in (schema, Message, TextPart, StreamOptions) for f in m.model_fields}
        path = [str(x) for x in err["loc"] if isinstance(x, int) or x in fields]
        if err["type"] == "missing":
            code = "missing_required_parameter"
        elif err["type"].startswith(("greater_than", "less_than")):
            code = "invalid_value"
        else:
            code = "invalid_type"
        msg = err["msg"]
        if len(path) < len(err["loc"]) and path and path[-1] in _UNION_HINTS:  # a union member failed
            msg = f"expected {_UNION_HINTS[path[-1]]}"
        raise APIError(400, f"{'.'.join(path) or 'body'}: {msg}", param=path[0] if path else None, code=code)
    _check_unsupported(req)
    return req


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 beyond ``limit`` bytes (checked before reading where a length is given)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body", code="client_disconnected")
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json")
    except RecursionError:  # json nests by recursion: a body nested thousands of levels deep
        raise APIError(400, "invalid JSON body: nested too deeply", code="invalid_json")


# ====================================================================== metrics
class Metrics:
    """Prometheus metrics in their own registry (vLLM's names, ``medusa_lite:`` prefix).

    Spec-decode counters, per verify step (one target forward over the tree):
      num_drafts            += 1
      num_draft_tokens      += the tree's depth at that step (positions drafted ahead; trees are cut
                               shallower in the last steps before max_tokens / the context end)
      num_accepted_tokens   += accepted depth (draft tokens the target agreed with; the bonus token
                               is not counted)
      accepted_per_pos{k}   += 1 if the accepted depth > k (k = 0: the first drafted position)
    so ``accepted / draft_tokens`` is the per-position acceptance rate and
    ``1 + accepted / drafts`` the mean tokens per verify step, as in vLLM.
    """

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "medusa_lite:"
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verify steps (target forwards over a tree).",
                              registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft positions proposed.", registry=r)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position.", ["position"], registry=r)
        self.requests = Counter(p + "requests", "API requests by HTTP status.", ["status"], registry=r)
        self.finished = Counter(p + "request_success", "Finished requests by finish reason "
                                "(stop / length / cancelled / error).", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token (queue wait included).",
                              buckets=buckets, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token.", buckets=buckets,
                             registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests generating (rows of the running batch).",
                             registry=r)
        self.batch_size = Histogram(p + "batch_size", "Rows verified together, per decoding step.",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued.", registry=r)
        # the tree fitted to this machine (medusa_lite.fit): what was chosen, predicted vs realized speed
        fit_labels = ["decoding", "context"]
        self.fit_info = Gauge(p + "fit_info", "The tree fitted to this machine per decoding mode and context bucket "
                              "(value 1; the machine and tree are labels).", fit_labels + ["machine", "tree"], registry=r)
        self.fit_predicted = Gauge(p + "fit_predicted_tokens_per_second", "Predicted tokens/s of the fitted tree.",
                                   fit_labels, registry=r)
        self.fit_plain = Gauge(p + "fit_predicted_plain_tokens_per_second",
                               "Predicted tokens/s of plain decoding on this machine.", fit_labels, registry=r)
        self.fit_tokens = Counter(p + "fit_realized_tokens", "Tokens emitted by speculative steps.", fit_labels,
                                  registry=r)
        self.fit_seconds = Counter(p + "fit_realized_seconds", "Wall seconds of speculative steps (realized tokens/s "
                                   "= rate of fit_realized_tokens / rate of this).", fit_labels, registry=r)
        self._contexts: dict[str, list[str]] = {}

    def record_fit(self, fit, decoding: str) -> None:
        """Publish a :class:`medusa_lite.fit.HardwareFit` (``decoding``: greedy or sample)."""
        from medusa_lite.machine import describe

        rows = fit.summary()["buckets"]
        self._contexts[decoding] = [row["context"] for row in rows]
        for row in rows:
            labels = {"decoding": decoding, "context": row["context"]}
            self.fit_info.labels(**labels, machine=describe(fit.fingerprint), tree=json.dumps(row["tree"])).set(1)
            self.fit_predicted.labels(**labels).set(row["predicted_tokens_per_second"])
            self.fit_plain.labels(**labels).set(row["predicted_plain_tokens_per_second"])

    def record_spec(self, stats: GenerationStats) -> None:
        self.drafts.inc(stats.verify_steps)
        self.draft_tokens.inc(sum(stats.step_depths))  # tree depth verified per step (vLLM's draft length)
        self.accepted.inc(sum(stats.accepted_per_depth))
        for k, n in enumerate(stats.accepted_per_depth):
            self.accepted_per_pos.labels(position=str(k)).inc(n)

    def record_fitted(self, stats: GenerationStats, decoding: str) -> None:
        """Realized speed of the fitted trees' speculative steps, per context bucket."""
        contexts = self._contexts.get(decoding)
        if stats.fitted is None or contexts is None:
            return
        for context, (tokens, seconds) in zip(contexts, stats.fitted["realized"]):
            if tokens:
                self.fit_tokens.labels(decoding=decoding, context=context).inc(tokens)
                self.fit_seconds.labels(decoding=decoding, context=context).inc(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ====================================================================== engine: one worker thread
class Cancelled(Exception):
    """Raised inside ``generate`` (from the streamer) when a request is cancelled."""


@dataclass(eq=False)  # identity semantics: jobs are found in the queue by identity
class Job:
    """One admitted request; the worker reports to ``events`` (an asyncio queue) via ``emit``."""

    prompt_ids: list[int]
    max_tokens: int
    gen_kwargs: dict[str, Any]
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token: float | None = None
    seq: Any = None          # its row in the running batch (medusa_lite.decode.Sequence), once admitted
    detok: Any = None

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: the server is gone, nobody listens
            pass


class Detokenizer:
    """Token ids -> text deltas whose concatenation is the final text, cut at the first stop string.

    Text that might still become (the start of) a stop string, or an incomplete UTF-8 sequence, is
    held back until more tokens arrive or generation ends.
    """

    def __init__(self, tokenizer, lock: threading.Lock, stop: list[str]):
        self.tok, self.lock, self.stop = tokenizer, lock, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def _text(self) -> tuple[str, bool]:
        with self.lock:
            text = self.tok.decode(self.ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return (text[:min(cuts)], True) if cuts else (text, False)

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text, stopped = self._text()
        if not stopped:
            text = text[:len(text) - self.hold] if self.hold else text
            text = text.rstrip("\ufffd")
        return self._advance(text)

    def finish(self) -> tuple[str, bool]:
        """(last delta, whether a stop string cut the text)."""
        text, stopped = self._text()
        return self._advance(text), stopped

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (or a tokenizer that re-spells earlier text: keep what was sent)
        delta, self.sent = text[len(self.sent):], text
        return delta


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
        if self.job.first_token is None:
            self.job.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.job.first_token - self.job.arrival)
        delta = self.detok.add(ids)
        self.job.emit("delta", (delta, self.tokens))

    def end(self) -> None:
        pass


class Engine:
    """Owns the model; admits jobs into a bounded FIFO and decodes up to ``max_batch_size`` of them at once on one
    thread (continuous batching, :class:`medusa_lite.decode.SpeculativeBatch`): between two verify steps,
    cancelled rows leave and waiting jobs join (each prefilled by a forward of its own); every step verifies all
    rows' trees in one target forward of at most ``max_batched_tokens`` tree tokens. Each row stops, streams and
    fails on its own: its output is its solo output whatever the other rows do."""

    def __init__(self, model: MedusaModel, tokenizer, metrics: Metrics, max_queue: int, max_batch_size: int = 8,
                 max_batched_tokens: int = 128):
        self.model, self.tok, self.metrics, self.max_queue = model, tokenizer, metrics, max_queue
        self.max_batch_size, self.max_batched_tokens = max_batch_size, max_batched_tokens
        self.batch = model.decoder(max_step_tokens=max_batched_tokens)
        if not self.batch.batchable:
            log.info("one request at a time: this model has sliding-window layers, which cannot share a batch")
            self.max_batch_size = 1
        self.tok_lock = threading.Lock()  # fast tokenizers must not be used from two threads at once
        self.limit = context_length(model.base_model.config)
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
        if not self.eos and tokenizer.eos_token_id is not None:
            self.eos = {tokenizer.eos_token_id}
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.running: list[Job] = []  # the rows of the batch (changed by the worker, under the lock)
        self._thread = threading.Thread(target=self._loop, name="medusa-worker", daemon=True)

    # ---------------------------------------------------------- tokenization (event-loop thread)
    def encode(self, text: str, *, special: bool) -> list[int]:
        with self.tok_lock:
            return self.tok(text, add_special_tokens=special)["input_ids"]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if getattr(self.tok, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        try:
            with self.tok_lock:
                text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja raise_exception(), e.g. roles out of order
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages")
        return self.encode(text, special=False)

    # ---------------------------------------------------------- admission
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if len(self._pending) >= self.max_queue + max(self.max_batch_size - len(self.running), 0):
                raise APIError(429, f"the server is busy: {len(self._pending)} requests are waiting (max_queue)",
                               type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            self._pending.append(job)
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
        self._thread.join(timeout)

    # ---------------------------------------------------------- the worker
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self.running and not self._closed:
                    self._cond.wait()
                if self._closed and not self.running:
                    return
                joining = []
                while self._pending and len(self.running) + len(joining) < self.max_batch_size:
                    joining.append(self._pending.popleft())
                self.metrics.waiting.set(len(self._pending))
            for job in joining:
                self._join(job)
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

    def _join(self, job: Job) -> None:
        """Prefill ``job`` and add it to the batch (or finish it: its first token was its last, or it is bad)."""
        detok = Detokenizer(self.tok, self.tok_lock, job.stop)
        streamer = _JobStreamer(job, detok, self.metrics)
        streamer.prompt_seen = True  # the prompt is not streamed back
        kwargs = dict(job.gen_kwargs)
        if job.stop:  # built here, under the lock: the event loop thread tokenizes concurrently
            with self.tok_lock:
                kwargs["stopping_criteria"] = StoppingCriteriaList([StopStringCriteria(self.tok, job.stop)])
        job.detok = detok
        try:
            if job.cancel.is_set():
                raise Cancelled
            ids = torch.tensor(job.prompt_ids, dtype=torch.long, device=self.model.device)
            job.seq = self.model.sequence(ids, max_new_tokens=job.max_tokens, streamer=streamer, tag=job, **kwargs)
            joined = self.batch.add(job.seq)
        except Exception as e:  # noqa: BLE001 - reported to this request only
            self._fail(job, e)
            return
        if joined:
            with self._cond:
                self.running.append(job)
        else:
            self._finish(job)

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
        delta, stopped = detok.finish()
        if stopped or (new and new[-1] in self.eos) or len(new) < job.max_tokens:
            reason = "stop"
        else:
            reason = "length"
        now = time.perf_counter()
        m = self.metrics
        m.e2e.observe(now - job.arrival)
        m.finished.labels(finished_reason=reason).inc()
        m.prompt_tokens.inc(len(job.prompt_ids))
        m.generation_tokens.inc(len(new))
        m.record_spec(stats)
        m.record_fitted(stats, "sample" if job.gen_kwargs.get("do_sample") else "greedy")
        job.emit("done", {"delta": delta, "finish_reason": reason, "text": detok.sent,
                          "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(new),
                                    "total_tokens": len(job.prompt_ids) + len(new)},
                          "medusa_lite": speculative_stats(stats)})


def speculative_stats(stats: GenerationStats) -> dict[str, Any]:
    """The request's speculative decoding, as the response's ``medusa_lite`` extension field (the Prometheus
    counters' names; llama.cpp's ``draft_n`` / ``draft_n_accepted``)."""
    return {"verify_steps": stats.verify_steps, "draft_tokens": sum(stats.step_depths),
            "accepted_tokens": sum(stats.accepted_per_depth),
            "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4)}


# ====================================================================== the API
def _sampling(req: _Common, device: torch.device) -> dict[str, Any]:
    """OpenAI sampling parameters -> generate() kwargs. temperature 0 -> greedy; default 1 (OpenAI's)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature == 0:
        return {"do_sample": False}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": temperature,
                              "top_p": 1.0 if req.top_p is None else req.top_p,
                              "top_k": 0 if req.top_k in (None, -1) else req.top_k}
    if req.seed is not None:
        kwargs["generator"] = torch.Generator(device=device).manual_seed(req.seed)
    return kwargs


def _budget(engine: Engine, prompt_len: int, requested: int | None, default: int, param: str) -> int:
    """max_tokens after the context-window check (400 when prompt + max_tokens does not fit)."""
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param=param)
    limit = engine.limit
    if requested is None:
        requested = default if limit is None else min(default, limit - prompt_len)
        if requested < 1:
            raise APIError(400, f"the prompt ({prompt_len} tokens) fills this model's context length ({limit})",
                           param=param, code="context_length_exceeded")
    elif limit is not None and prompt_len + requested > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but {prompt_len + requested} "
                            f"were requested ({prompt_len} in the prompt, {requested} for the completion); "
                            "reduce the prompt or max_tokens", param="max_tokens", code="context_length_exceeded")
    return requested


async def _events(job: Job, engine: Engine, request: Request) -> AsyncIterator[tuple[str, Any]]:
    """The job's events; cancels the job when the client goes away (checked every 0.25 s)."""
    finished = False
    checked = time.monotonic()
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                kind = None
            if time.monotonic() - checked >= 0.25:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if kind is None:
                continue
            if kind != "delta":
                finished = True
            yield kind, payload
            if finished:
                return
    finally:
        if not finished:
            engine.cancel(job)


class _CountStatus:
    """ASGI middleware: count /v1/ responses by HTTP status (pure ASGI, so streams pass through untouched)."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class _JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends (a no-op for a finished job)."""

    def __init__(self, content, job: Job, engine: Engine):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job, self.engine = job, engine

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.cancel(self.job)


def create_app(engine: Engine, metrics: Metrics, settings: Settings, model_name: str) -> FastAPI:
    """The FastAPI app around a started-or-not engine (started in the lifespan)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.close(timeout=settings.shutdown_timeout)

    app = FastAPI(title="medusa_lite", lifespan=lifespan)
    created = int(time.time())

    app.add_middleware(_CountStatus, counter=metrics.requests)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def admit(req: _Common, prompt_ids: list[int], requested: int | None, param: str) -> Job:
        max_tokens = _budget(engine, len(prompt_ids), requested, settings.default_max_tokens, param)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        job = Job(prompt_ids, max_tokens, _sampling(req, engine.model.device), stop, asyncio.get_running_loop())
        engine.submit(job)
        return job

    async def collect(job: Job, request: Request) -> dict:
        async for kind, payload in _events(job, engine, request):
            if kind == "error":
                raise payload
            if kind == "done":
                return payload
        raise APIError(499, "client disconnected", code="cancelled")

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(job: Job, request: Request, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        rid = ("chatcmpl-" if chat else "cmpl-") + job.id
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name}
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish: str | None, role: bool = False, **fields) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return sse({**base, "choices": [choice], **extra, **fields})

        if chat:
            yield chunk(None, None, role=True)
        async for kind, payload in _events(job, engine, request):
            if kind == "delta":
                if payload[0]:
                    yield chunk(payload[0], None)
            elif kind == "error":
                yield sse(payload.body())
                break
            else:
                if payload["delta"]:
                    yield chunk(payload["delta"], None)
                yield chunk(None if chat else "", payload["finish_reason"], medusa_lite=payload["medusa_lite"])
                if include_usage:
                    yield sse({**base, "choices": [], "usage": payload["usage"]})
        yield "data: [DONE]\n\n"

    def respond(job: Job, req: _Common, request: Request, chat: bool):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _JobStream(stream(job, request, chat, include_usage), job, engine)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "medusa_lite",
            "max_model_len": engine.limit}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return card

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await read_json(request, settings.max_body_bytes))
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (send several requests: they are batched)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = engine.encode(prompt, special=True)
        else:
            vocab = engine.model.config.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        job = admit(req, ids, req.max_tokens, "prompt")
        if req.stream:
            return respond(job, req, request, chat=False)
        out = await collect(job, request)
        return {"id": "cmpl-" + job.id, "object": "text_completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "text": out["text"], "logprobs": None,
                             "finish_reason": out["finish_reason"]}],
                "usage": out["usage"], "medusa_lite": out["medusa_lite"]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatRequest, await read_json(request, settings.max_body_bytes))
        check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                    for m in req.messages]
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = admit(req, engine.chat_prompt(messages), requested, "messages")
        if req.stream:
            return respond(job, req, request, chat=True)
        out = await collect(job, request)
        return {"id": "chatcmpl-" + job.id, "object": "chat.completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                             "logprobs": None, "finish_reason": out["finish_reason"]}],
                "usage": out["usage"], "medusa_lite": out["medusa_lite"]}

    return app


# ====================================================================== main
def main(argv: list[str] | None = None) -> None:
    import uvicorn

    # 1. settings: defaults < YAML < flags
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    disable_created_metrics()  # no *_created samples: this process owns its registry
    # 2. build: model, engine, app
    t0 = time.perf_counter()
    model, tokenizer, name = build_model(settings)
    log.info("loaded %s (%s, %s) in %.1f s", name, settings.dtype, settings.device, time.perf_counter() - t0)
    metrics = Metrics()
    for decoding in ("greedy", "sample") if model.fit_enabled else ():  # fit now, not on the first request
        fit = model.fit_hardware(sample=decoding == "sample")
        if fit is None:
            log.info("tree: the heads' stored tree, %d nodes (no acceptance table: no hardware fit)",
                     tree_nodes(model.choices) + 1)
            break
        log.info("tree fitted for %s decoding:\n%s", decoding, fit.report())
        metrics.record_fit(fit, decoding)
    engine = Engine(model, tokenizer, metrics, settings.max_queue, settings.max_batch_size, settings.max_batched_tokens)
    log.info("continuous batching: up to %d requests at once, %d tree tokens per step", engine.max_batch_size,
             settings.max_batched_tokens)
    for decoding in ("greedy", "sample"):
        fit = model.fitted(sample=decoding == "sample")
        sizes = [b for b in (2, 4, 8, 16, 32) if b <= engine.max_batch_size]
        if fit is not None and sizes:  # the tree per batch size, per context bucket (tree tokens, root included)
            log.info("%s decoding, tree tokens per row by batch size and context bucket: %s", decoding,
                     "; ".join(f"B={b}: " + "/".join(str(tree_nodes(parse_tree(t)) + 1) for t in fit.batch_trees(b))
                               for b in sizes))
    app = create_app(engine, metrics, settings, name)
    # 3. run until SIGINT / SIGTERM; in-flight requests get shutdown_timeout seconds to finish
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=settings.shutdown_timeout)


if __name__ == "__main__":
    main()
