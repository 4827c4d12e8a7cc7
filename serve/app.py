"""The FastAPI app: routes, server-sent events, error handlers and the status-counting middleware around an
:class:`~medusa_lite.serve.engine.Engine`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Job
from .metrics import Metrics
from .params import NEUTRAL, best_completions, candidates, parse, requested_logprobs, sampling_kwargs, stop_kwargs
from .schemas import APIError, ChatRequest, Common, CompletionRequest, read_json
from .structured import compile_request_grammar
from .utility import ApiKeyCheck, add_utility_routes

log = logging.getLogger("medusa_lite.serve")


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


async def _events(jobs: list[Job], engine: Engine, request: Request) -> AsyncIterator[tuple[int, str, Any]]:
    """The events of a request's jobs (which share one queue) as (index, kind, payload), until every job is done
    or one fails; cancels the unfinished jobs when the client goes away (checked every 0.25 s) or one fails."""
    unfinished = {job.index for job in jobs}
    checked = time.monotonic()
    try:
        while unfinished:
            try:
                index, kind, payload = await asyncio.wait_for(jobs[0].events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                kind = None
            if time.monotonic() - checked >= 0.25:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if kind is None:
                continue
            if kind != "delta":
                unfinished.discard(index)
            yield index, kind, payload
            if kind == "error":
                return
    finally:
        for job in jobs:
            if job.index in unfinished:
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
    """An SSE response that cancels its jobs however the response ends (a no-op for a finished job)."""

    def __init__(self, content, jobs: list[Job], engine: Engine):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.jobs, self.engine = jobs, engine

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                self.engine.cancel(job)


def create_app(engine: Engine, metrics: Metrics, settings, model_name: str,
               defaults: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app around a started-or-not engine (started in the lifespan). ``settings``: the server's
    (:class:`medusa_lite.serve.server.Settings`); ``defaults``: of the sampling fields a request leaves out
    (:func:`~medusa_lite.serve.params.generation_defaults`; None: neutral)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.close(timeout=settings.shutdown_timeout)

    app = FastAPI(title="medusa_lite", lifespan=lifespan)
    if getattr(settings, "api_key", None):
        app.add_middleware(ApiKeyCheck, key=settings.api_key)
    app.add_middleware(_CountStatus, counter=metrics.requests)  # outermost: it counts the 401s too
    _add_error_handlers(app)
    api = Api(engine, settings, model_name, defaults or dict(NEUTRAL))

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        api.check_model(name)
        return api.card

    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    add_utility_routes(app, api)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error JSON: ours, Starlette's (404, 405, ...) and unhandled ones (500)."""

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


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Api:
    """The completion endpoints: admit a request as a job of the engine, then answer with its result or stream it."""

    def __init__(self, engine: Engine, settings, model_name: str, defaults: dict[str, Any]):
        self.engine, self.settings, self.model_name, self.defaults = engine, settings, model_name, defaults
        self.card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "medusa_lite",
                     "max_model_len": engine.limit}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def admit(self, req: Common, prompt_ids: list[int], requested: int | None, param: str) -> list[Job]:
        """The request's completions (:func:`candidates`: ``n``, or ``best_of`` to rank), each a job of the engine
        (a row of the batch) reporting to one queue; the prompt cut to its last ``truncate_prompt_tokens`` first."""
        if req.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-req.truncate_prompt_tokens:]
        default = self.defaults.get("max_tokens", self.settings.default_max_tokens)
        max_tokens = _budget(self.engine, len(prompt_ids), requested, default, param)
        stops = stop_kwargs(req, lambda text: self.engine.encode(text, special=False))
        if (grammar := compile_request_grammar(req, self.engine)) is not None:  # a 400 here if it does not compile
            stops["grammar"] = grammar
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        count = candidates(req)
        logprobs = requested_logprobs(req)
        if count > (req.n or 1) and logprobs is None:
            logprobs = 0  # ranking needs each token's log-probability (not reported)
        ids = {"id": req.request_id} if req.request_id is not None else {}
        device = self.engine.model.device
        jobs = [Job(prompt_ids, max_tokens, {**sampling_kwargs(req, device, i, self.defaults), **stops}, loop,
                    events=events, index=i, logprobs=logprobs, ids_as_tokens=bool(req.return_tokens_as_token_ids),
                    priority=req.priority, **ids) for i in range(count)]
        try:
            for job in jobs:
                self.engine.submit(job)
        except APIError:
            for job in jobs:
                self.engine.cancel(job)
            raise
        return jobs

    async def collect(self, jobs: list[Job], request: Request) -> list[dict]:
        """Every job's result, in index order (the first error raised)."""
        results: dict[int, dict] = {}
        async for index, kind, payload in _events(jobs, self.engine, request):
            if kind == "error":
                raise payload
            if kind == "done":
                results[index] = payload
        if len(results) < len(jobs):
            raise APIError(499, "client disconnected", code="cancelled")
        return [results[i] for i in range(len(jobs))]

    async def stream(self, jobs: list[Job], request: Request, chat: bool, include_usage: bool,
                     echo: str = "") -> AsyncIterator[str]:
        """SSE chunks of the jobs' completions (``echo``: the prompt's text, or the chat's last message, each choice's
        first text)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + jobs[0].id
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False, logprobs=None,
                  stop_reason=None, **fields) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": index, "delta": delta, "logprobs": openai_logprobs(logprobs, chat),
                          "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": openai_logprobs(logprobs, chat),
                          "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason  # vLLM's: the stop token id or stop string
            return sse({**base, "choices": [choice], **extra, **fields})

        for job in jobs:
            if chat:
                yield chunk(job.index, None, None, role=True)
            if echo:
                yield chunk(job.index, echo, None)
        done = []
        async for index, kind, payload in _events(jobs, self.engine, request):
            if kind == "delta":
                if payload[0] or payload[2]:
                    yield chunk(index, payload[0], None, logprobs=payload[2])
            elif kind == "error":
                yield sse(payload.body())
                break
            else:
                if payload["delta"]:
                    yield chunk(index, payload["delta"], None)
                yield chunk(index, None if chat else "", payload["finish_reason"], stop_reason=payload["stop_reason"],
                            medusa_lite=payload["medusa_lite"])
                done.append(payload)
        if include_usage and len(done) == len(jobs):
            yield sse({**base, "choices": [], "usage": _usage(done)})
        yield "data: [DONE]\n\n"

    def respond(self, jobs: list[Job], req: Common, request: Request, chat: bool, echo: str = ""):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _JobStream(self.stream(jobs, request, chat, include_usage, echo), jobs, self.engine)

    async def completions(self, request: Request):
        req = parse(CompletionRequest, await read_json(request, self.settings.max_body_bytes))
        self.check_model(req.model)
        prompt_ids = self._prompt_ids(req.prompt, req.add_special_tokens is not False)
        jobs = self.admit(req, prompt_ids, req.max_tokens, "prompt")
        echo = self._prompt_text(req.prompt, prompt_ids) if req.echo else ""
        if req.stream:
            return self.respond(jobs, req, request, chat=False, echo=echo)
        outs = await self.collect(jobs, request)
        usage = _usage(outs)  # every candidate's tokens, as OpenAI counts best_of
        chosen = best_completions(outs, req.n or 1) if len(outs) > (req.n or 1) else outs
        reported = requested_logprobs(req) is not None
        return {"id": "cmpl-" + jobs[0].id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": i, "text": echo + out["text"],
                             "logprobs": openai_logprobs(out["logprobs"], False) if reported else None,
                             "finish_reason": out["finish_reason"], "stop_reason": out["stop_reason"]}
                            for i, out in enumerate(chosen)],
                "usage": usage, "medusa_lite": chosen[0]["medusa_lite"]}

    def _prompt_text(self, prompt, prompt_ids: list[int]) -> str:
        """What ``echo`` returns before the completion: the prompt as sent (token ids: their text)."""
        prompt = _one_prompt(prompt)
        return prompt if isinstance(prompt, str) else self.engine.decode(prompt_ids)

    def _prompt_ids(self, prompt, special: bool = True) -> list[int]:
        """A completion request's prompt (a string, a list of one string, or token ids) as token ids (``special``:
        with the tokenizer's special tokens, e.g. BOS)."""
        prompt = _one_prompt(prompt)
        if isinstance(prompt, str):
            return self.engine.encode(prompt, special=special)
        vocab = self.engine.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    def chat_prompt(self, req) -> list[int]:
        """A chat request's (or a chat ``/tokenize`` request's) messages through the chat template, as token ids."""
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        options = {"add_generation_prompt": req.add_generation_prompt,
                   "continue_final_message": req.continue_final_message, **(req.chat_template_kwargs or {})}
        if getattr(req, "documents", None):
            options["documents"] = req.documents
        return self.engine.chat_prompt(chat_messages(req.messages), template=req.chat_template,
                                       special=bool(req.add_special_tokens), **options)

    async def chat_completions(self, request: Request):
        req = parse(ChatRequest, await read_json(request, self.settings.max_body_bytes))
        self.check_model(req.model)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        jobs = self.admit(req, self.chat_prompt(req), requested, "messages")
        last = chat_messages(req.messages)[-1]
        echo = last["content"] if req.echo and last["role"] == "assistant" else ""  # vLLM's chat echo
        if req.stream:
            return self.respond(jobs, req, request, chat=True, echo=echo)
        outs = await self.collect(jobs, request)
        chosen = best_completions(outs, req.n or 1) if len(outs) > (req.n or 1) else outs
        reported = requested_logprobs(req) is not None
        return {"id": "chatcmpl-" + jobs[0].id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": echo + out["text"]},
                             "logprobs": openai_logprobs(out["logprobs"], True) if reported else None,
                             "finish_reason": out["finish_reason"], "stop_reason": out["stop_reason"]}
                            for i, out in enumerate(chosen)],
                "usage": _usage(outs), "medusa_lite": chosen[0]["medusa_lite"]}


def chat_messages(messages) -> list[dict]:
    """Request messages as the chat template takes them (text parts joined; ``developer`` is ``system``)."""
    out = []
    for m in messages:
        message = {"role": "system" if m.role == "developer" else m.role,
                   "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _one_prompt(prompt):
    """A completion request's prompt as a string or token ids (a list of one string unwrapped; of more, a 400)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (send several requests: they are batched)", param="prompt")
        return prompt[0]
    return prompt


def openai_logprobs(entries: list[dict] | None, chat: bool) -> dict | None:
    """Engine log-prob entries (:meth:`Detokenizer.logprobs`) in OpenAI's shape: chat ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs"}]}``; completions ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}`` (offsets within this choice's text as its tokens spell it)."""
    if entries is None:
        return None
    if chat:
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                             "top_logprobs": e["top"]} for e in entries], "refusal": None}
    offsets = [0]
    for e in entries[:-1]:
        offsets.append(offsets[-1] + len(e["token"]))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries], "text_offset": offsets}


def _usage(outs: list[dict]) -> dict:
    """OpenAI usage of a request's completions: the prompt counted once, every completion's tokens."""
    prompt = outs[0]["usage"]["prompt_tokens"]
    completion = sum(out["usage"]["completion_tokens"] for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
