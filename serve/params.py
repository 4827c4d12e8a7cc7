"""What each request field does. Every field of the schemas (:mod:`.schemas`) is in one of three sets:

- honoured (:data:`HONOURED`): it does what OpenAI or vLLM documents, through ``generate``'s arguments (one stop rule,
  token masks and penalties applied at every tree node from that node's own prefix), the prompt or the response;
- accepted (:data:`ACCEPTED`): it cannot change anything the client sees from this server, for the reason given;
- refused (:data:`REFUSED`): a 400 that names it and says why, whenever it is set to anything but a neutral value.

tests/test_serve.py sends every field with the ``openai`` client and finds each one honoured or refused by name.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import GenerationConfig

from . import structured
from .schemas import APIError, ChatRequest, Common, CompletionRequest, parse_request

MAX_N = 16  # completions per request (each a row of the batch)

HONOURED = (
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "n",
    "best_of", "stream", "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "logprobs", "top_logprobs", "prompt", "messages", "echo", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "add_special_tokens", "priority", "request_id",
    "return_tokens_as_token_ids", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs",
)
_NO_CACHE = "a prompt-cache hint: this server keeps no prompt cache between requests, so it changes nothing"
ACCEPTED = {
    "user": "an end-user id for the provider's abuse monitoring: it never changes the output",
    "safety_identifier": "an end-user id for the provider's abuse monitoring: it never changes the output",
    "cache_salt": "salts a prefix cache shared between requests: this server shares none",
    "prompt_cache_key": _NO_CACHE, "prompt_cache_retention": _NO_CACHE, "prompt_cache_options": _NO_CACHE,
}
_TOOLS = "tool calls need the model's tool-call format in its chat template and a parser for its output; " \
         "medusa_lite serves text"
REFUSED: dict[str, tuple[tuple, str]] = {  # name -> (neutral values, accepted; why any other value is refused)
    "suffix": ((None, ""), "inserting between a prompt and a suffix needs a fill-in-the-middle format the served "
                           "model's tokenizer does not declare"),
    "tools": ((None, []), _TOOLS),
    "tool_choice": ((None, "none"), _TOOLS),
    "parallel_tool_calls": ((None,), _TOOLS),
    "functions": ((None, []), _TOOLS),
    "function_call": ((None, "none"), _TOOLS),
    "audio": ((None,), "this server reads and writes text only"),
    "modalities": ((None, ["text"]), "this server writes text only"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "mm_processor_kwargs": ((None, {}), "text-only models: there is no multimodal processor"),
    "metadata": ((None, {}), "completions are not stored, so there is nothing to attach it to"),
    "store": ((None, False), "completions are not stored"),
    "prediction": ((None,), "predicted outputs are not supported (the drafter predicts)"),
    "moderation": ((None,), "this server runs no moderation model"),
    "reasoning_effort": ((None,), "this server does not steer a model's reasoning"),
    "include_reasoning": ((None, True), "no reasoning parser separates reasoning from the answer"),
    "verbosity": ((None,), "this server does not steer a model's verbosity"),
    "web_search_options": ((None,), "this server has no web search"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier"),
    "prompt_logprobs": ((None,), "the prompt's log-probabilities are not computed (the prefill keeps only its last "
                                 "position's logits)"),
    "use_beam_search": ((None, False), "beam search is not supported: decoding is greedy or sampled"),
    "length_penalty": ((None, 1.0), "only beam search uses it, which is not supported"),
    "logits_processors": ((None, []), "the server runs no code named by a request"),
    "kv_transfer_params": ((None, {}), "there is no disaggregated prefill"),
    "vllm_xargs": ((None, {}), "this server has no custom extensions"),
}
# structured output (:mod:`.structured`): the grammar fields honoured, the backend's name accepted
HONOURED += structured.HONOURED
ACCEPTED.update(structured.ACCEPTED)
REFUSED["structural_tag"] = ((None,), "structural tags (grammars switched on by trigger strings in free text) are not "
                                      "supported: send one grammar (response_format or structured_outputs)")
_TEMPLATE_OWN = {"messages", "conversation", "tokenize", "chat_template", "add_generation_prompt",
                 "continue_final_message", "documents", "tools", "return_dict"}


def parse(schema: type[Common], body: Any) -> Common:
    """The request, validated (:func:`.schemas.parse_request`) and checked: 400 for a refused field or a bad value."""
    req = parse_request(schema, body)
    for name, (neutral, why) in REFUSED.items():
        value = getattr(req, name, None)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise APIError(400, f"{name} is not supported: {why}", param=name, code="unsupported_parameter")
    requested_logprobs(req)  # 400 for a bad logprobs / top_logprobs
    structured.grammar_spec(req)  # 400 for a malformed grammar field, or two
    token_bias(req)  # 400 for a bad logit_bias
    if (req.n or 1) > MAX_N:
        raise APIError(400, f"n={req.n}: at most {MAX_N} completions per request", param="n", code="invalid_value")
    _check_best_of(req)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise APIError(400, "stream_options.continuous_usage_stats is not supported: usage comes in the last chunk",
                       param="stream_options", code="unsupported_parameter")
    stops = stop_strings(req)
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop: up to 4 non-empty strings", param="stop")
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise APIError(400, "allowed_token_ids: at least one token id", param="allowed_token_ids")
    if isinstance(req, ChatRequest):
        _check_chat(req)
    elif req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (it would need the prompt's log-probabilities)",
                       param="echo", code="unsupported_parameter")
    return req


def _check_best_of(req: Common) -> None:
    """400 for a bad ``best_of``: at least ``n``, at most :data:`MAX_N`, not streamed when it ranks."""
    if req.best_of is None:
        return
    if not (req.n or 1) <= req.best_of <= MAX_N:
        raise APIError(400, f"best_of={req.best_of}: from n ({req.n or 1}) to {MAX_N}", param="best_of",
                       code="invalid_value")
    if req.stream and req.best_of > (req.n or 1):
        raise APIError(400, "best_of > n cannot be streamed (the best are known only when all have finished)",
                       param="best_of", code="invalid_value")


def _check_chat(req: ChatRequest) -> None:
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "continue_final_message continues the last message: set add_generation_prompt to false",
                       param="continue_final_message", code="invalid_value")
    taken = sorted(_TEMPLATE_OWN & set(req.chat_template_kwargs or {}))
    if taken:
        raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is set by the request's own fields",
                       param="chat_template_kwargs", code="invalid_value")


def stop_strings(req: Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def candidates(req: Common) -> int:
    """How many completions to generate: ``best_of`` when sampling (the ``n`` best of them are returned), else ``n``
    (greedy candidates are all the same answer)."""
    n = req.n or 1
    return (req.best_of or n) if req.temperature != 0 else n


def best_completions(outs: list[dict], n: int) -> list[dict]:
    """The ``n`` of ``outs`` with the highest mean log-probability per token (OpenAI's ``best_of`` rule; the target's
    raw log-probabilities, as ``logprobs`` reports them), best first."""
    def score(out: dict) -> float:
        logprobs = [e["logprob"] for e in out["logprobs"]]
        return sum(logprobs) / len(logprobs) if logprobs else 0.0
    return sorted(outs, key=score, reverse=True)[:n]


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


def bad_words_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's ``bad_words`` as token id sequences (transformers' ``bad_words_ids``): each word's tokens, and those of
    the word after a space where that spelling starts with another token and has as many (a word at the start of
    the text and one in its middle)."""
    out = []
    for word in words:
        plain, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if any(not ids for ids in out):
        raise APIError(400, "bad_words: non-empty words", param="bad_words", code="invalid_value")
    return out


NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(source: str, target_config: GenerationConfig) -> dict[str, Any]:
    """The defaults of the sampling fields a request leaves out (vLLM's ``--generation-config``): ``vllm``, the
    neutral values (OpenAI's temperature 1); ``auto``, the target's generation config where it differs from
    transformers' defaults (as vLLM reads it), else neutral; a folder, its ``generation_config.json`` so. Its
    ``max_new_tokens`` becomes the default ``max_tokens``."""
    if source == "vllm":
        return dict(NEUTRAL)
    config = target_config if source == "auto" else GenerationConfig.from_pretrained(source)
    diff = config.to_diff_dict()
    out = {**NEUTRAL, **{name: diff[name] for name in NEUTRAL if diff.get(name) is not None}}
    if diff.get("max_new_tokens"):
        out["max_tokens"] = diff["max_new_tokens"]
    return out


def sampling_kwargs(req: Common, device: torch.device, index: int = 0,
                    defaults: dict[str, Any] = NEUTRAL) -> dict[str, Any]:
    """OpenAI and vLLM sampling parameters -> generate() kwargs, ``defaults`` (:func:`generation_defaults`) where the
    request leaves them out. temperature 0 -> greedy. Penalties (``presence_penalty``, ``frequency_penalty``,
    vLLM's ``repetition_penalty``) and ``logit_bias`` in either mode. ``index``: which of the request's ``n``
    completions (with a ``seed``, completion i draws from seed + i)."""
    def value(name: str):
        return defaults[name] if getattr(req, name) is None else getattr(req, name)

    penalties = {name: v for name in ("presence_penalty", "frequency_penalty") if (v := getattr(req, name)) is not None}
    penalties["repetition_penalty"] = value("repetition_penalty")
    if (bias := token_bias(req)) is not None:
        penalties["sequence_bias"] = bias
    if value("temperature") == 0:
        return {"do_sample": False, **penalties}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": value("temperature"), **penalties,
                              "top_p": value("top_p"), "top_k": max(value("top_k"), 0)}
    if value("min_p"):
        kwargs["min_p"] = value("min_p")
    if req.seed is not None:
        kwargs["generator"] = torch.Generator(device=device).manual_seed(req.seed + index)
    return kwargs


def stop_kwargs(req: Common, encode: Callable[[str], list[int]]) -> dict[str, Any]:
    """The request's stop conditions and token masks as generate() kwargs (one stop rule:
    :mod:`medusa_lite.decode.stopping`; masks at every tree node: :class:`medusa_lite.sampling.TokenMasks`)."""
    kwargs: dict[str, Any] = {"ignore_eos": req.ignore_eos, "min_new_tokens": req.min_tokens,
                              "include_stop_str_in_output": req.include_stop_str_in_output,
                              "skip_special_tokens": req.skip_special_tokens,
                              "spaces_between_special_tokens": req.spaces_between_special_tokens}
    if stops := stop_strings(req):
        kwargs["stop_strings"] = stops
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = list(req.stop_token_ids)
    if req.allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        kwargs["bad_words_ids"] = bad_words_ids(req.bad_words, encode)
    return kwargs
