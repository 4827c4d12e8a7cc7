"""vLLM's utility endpoints (``POST /tokenize``, ``POST /detokenize``, ``GET /version``) and its API key check
(``--api-key``)."""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request

from medusa_lite import __version__

from .schemas import APIError, DetokenizeRequest, TokenizeRequest, parse_request, read_json

PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # /health, /metrics and /version answer without the key


class ApiKeyCheck:
    """ASGI middleware: a request to the API without ``Authorization: Bearer <key>`` gets 401 (vLLM's ``--api-key``;
    the key compared in constant time)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                                 type="authentication_error", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def add_utility_routes(app: FastAPI, api) -> None:
    """The routes, answered by ``api`` (:class:`medusa_lite.serve.app.Api`): the same prompt building as the
    completion endpoints, so ``/tokenize`` counts exactly the tokens a completion request would be given."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_request(TokenizeRequest, await read_json(request, api.settings.max_body_bytes))
        api.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        ids = api.chat_prompt(req) if req.messages is not None else \
            api._prompt_ids(req.prompt, req.add_special_tokens is not False)
        strs = None
        if req.return_token_strs:
            with api.engine.tok_lock:
                strs = api.engine.tok.convert_ids_to_tokens(ids)
        return {"count": len(ids), "max_model_len": api.engine.limit, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await read_json(request, api.settings.max_body_bytes))
        api.check_model(req.model)
        vocab = api.engine.model.config.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", param="tokens", code="invalid_value")
        return {"prompt": api.engine.decode(req.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}
