"""The API's request schemas (pydantic, strict) and errors (OpenAI's ``{"error": {...}}`` JSON), the request body
reader, and OpenAI sampling parameters turned into ``generate`` arguments."""

from __future__ import annotations

import json
from typing import Any, Literal

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect


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


class Common(_Strict):
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
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # extension (vLLM's)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> -100..100
    logprobs: bool | int | None = None


class CompletionRequest(Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list | None = None


MAX_N = 16  # completions per request (each a row of the batch)
UNSUPPORTED = {  # OpenAI parameters refused whenever set, and why
    "suffix": "inserting between a prompt and a suffix needs a fill-in-the-middle format the served model's "
              "tokenizer does not declare",
    "tools": "tool calls need the model's tool-call format in its chat template and a parser for its output; "
             "medusa_lite serves text",
}


def _check_unsupported(req: Common) -> None:
    """400 for OpenAI parameters this server accepts only at their neutral value."""
    for name, why in UNSUPPORTED.items():
        if getattr(req, name, None):
            raise APIError(400, f"{name} is not supported: {why}", param=name, code="unsupported_parameter")
    requested_logprobs(req)  # 400 for a bad logprobs / top_logprobs
    token_bias(req)  # 400 for a bad logit_bias
    if (req.n or 1) > MAX_N:
        raise APIError(400, f"n={req.n}: at most {MAX_N} completions per request", param="n", code="invalid_value")
    if isinstance(req, CompletionRequest):
        _check_completion_only(req)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop: up to 4 non-empty strings", param="stop")


def _check_completion_only(req: "CompletionRequest") -> None:
    """400 for a bad ``best_of`` (at least ``n``, at most :data:`MAX_N`, not streamed when it ranks) or ``echo`` with
    ``logprobs`` (the prompt's own log-probabilities are not computed)."""
    if req.best_of is not None:
        if not (req.n or 1) <= req.best_of <= MAX_N:
            raise APIError(400, f"best_of={req.best_of}: from n ({req.n or 1}) to {MAX_N}", param="best_of",
                           code="invalid_value")
        if req.stream and req.best_of > (req.n or 1):
            raise APIError(400, "best_of > n cannot be streamed (the best are known only when all have finished)",
                           param="best_of", code="invalid_value")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (it would need the prompt's log-probabilities)",
                       param="echo", code="unsupported_parameter")


def candidates(req: Common) -> int:
    """How many completions to generate: ``best_of`` when sampling (the ``n`` best of them are returned), else ``n``
    (greedy candidates are all the same answer)."""
    n = req.n or 1
    best_of = getattr(req, "best_of", None) or n
    return best_of if req.temperature != 0 else n


def best_completions(outs: list[dict], n: int) -> list[dict]:
    """The ``n`` of ``outs`` with the highest mean log-probability per token (OpenAI's ``best_of`` rule; the target's
    raw log-probabilities, as ``logprobs`` reports them), best first."""
    def score(out: dict) -> float:
        logprobs = [e["logprob"] for e in out["logprobs"]]
        return sum(logprobs) / len(logprobs) if logprobs else 0.0
    return sorted(outs, key=score, reverse=True)[:n]


_UNION_HINTS = {"prompt": "a string, a list with one string or a list of token ids",
                "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def parse_request(schema: type[Common], body: Any) -> Common:
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


def requested_logprobs(req: Common) -> int | None:
    """How many likeliest alternatives to report with each token's log-probability, or None for no log-probs:
    chat ``logprobs: true`` (+ ``top_logprobs`` 0..20), completions ``logprobs`` 0..5 (OpenAI's ranges)."""
    top = getattr(req, "top_logprobs", None)
    if isinstance(req, CompletionRequest):
        if req.logprobs is None:
            return None
        if isinstance(req.logprobs, bool) or not 0 <= req.logprobs <= 5:
            raise APIError(400, "logprobs: an integer from 0 to 5", param="logprobs", code="invalid_value")
        return req.logprobs
    if top is not None and not 0 <= top <= 20:
        raise APIError(400, "top_logprobs: an integer from 0 to 20", param="top_logprobs", code="invalid_value")
    if req.logprobs is not None and not isinstance(req.logprobs, bool):
        raise APIError(400, "logprobs: true or false (top_logprobs says how many alternatives)", param="logprobs",
                       code="invalid_type")
    if not req.logprobs:
        if top:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return None
    return top or 0


def token_bias(req: Common) -> dict[tuple[int], float] | None:
    """OpenAI's ``logit_bias`` ({"token id": -100..100}) as transformers' ``sequence_bias`` of one-token sequences
    (added to the target's logits before the penalties and the warpers, at every tree node); 400 if malformed."""
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        if not key.isdigit() or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias: token ids (as strings) mapped to -100..100, got {key!r}: {value!r}",
                           param="logit_bias", code="invalid_value")
        bias[(int(key),)] = float(value)
    return bias


def sampling_kwargs(req: Common, device: torch.device, index: int = 0) -> dict[str, Any]:
    """OpenAI sampling parameters -> generate() kwargs. temperature 0 -> greedy; default 1 (OpenAI's). Penalties
    (``presence_penalty``, ``frequency_penalty``, vLLM's ``repetition_penalty``) and ``logit_bias`` in either mode.
    ``index``: which of the request's ``n`` completions (with a ``seed``, completion i draws from seed + i)."""
    penalties = {name: value for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                 if (value := getattr(req, name)) is not None}
    if (bias := token_bias(req)) is not None:
        penalties["sequence_bias"] = bias
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature == 0:
        return {"do_sample": False, **penalties}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": temperature, **penalties,
                              "top_p": 1.0 if req.top_p is None else req.top_p,
                              "top_k": 0 if req.top_k in (None, -1) else req.top_k}
    if req.seed is not None:
        kwargs["generator"] = torch.Generator(device=device).manual_seed(req.seed + index)
    return kwargs
