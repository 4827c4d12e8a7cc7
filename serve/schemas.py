"""The API's request schemas (pydantic, strict, unknown fields refused) and errors (OpenAI's ``{"error": {...}}``
JSON), and the request body reader. What each field does: :mod:`.params`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

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
    # strict: "10" is not an int, true is not a number; a field no schema declares is a 400 naming it, and every
    # declared field is honoured or refused by name (:mod:`.params`): nothing a client sends is dropped silently
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM's


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # handed to the chat template with the message


class Common(_Strict):
    """The fields of both endpoints: OpenAI's, then vLLM's sampling and extra parameters."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> -100..100
    logprobs: bool | int | None = None
    best_of: int | None = None
    user: str | None = None
    # vLLM's sampling parameters
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no top-k
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    # vLLM's extra parameters
    add_special_tokens: bool | None = None  # None: the endpoint's default (completions: true; chat: false)
    priority: int = 0
    request_id: str | None = Field(None, min_length=1, max_length=128)
    logits_processors: list | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    # structured output (OpenAI's response_format, vLLM's structured_outputs and guided_*): :mod:`.structured`
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: Any = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    suffix: str | None = None
    prompt_embeds: Any = None  # vLLM's


class ChatRequest(Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    metadata: dict | None = None
    store: bool | None = None
    prediction: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    reasoning_effort: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    moderation: Any = None
    # vLLM's chat parameters
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict | None = None
    include_reasoning: bool | None = None


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a completion prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # None: completions true, chat false (as the endpoints)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


_UNION_HINTS = {"prompt": "a string, a list with one string or a list of token ids",
                "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def parse_request(schema: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # loc names fields, list indices and union members ("prompt.str"): keep fields and indices
        fields = {f for m in (schema, Message, TextPart, StreamOptions) for f in m.model_fields}
        path = [str(x) for x in err["loc"] if isinstance(x, int) or x in fields]
        if err["type"] == "extra_forbidden":  # a field no schema declares: named, never dropped
            path.append(str(err["loc"][-1]))
            raise APIError(400, f"{'.'.join(path)}: unknown parameter (neither OpenAI's nor vLLM's for this "
                                "endpoint)", param=path[0], code="unknown_parameter")
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
