"""Every request field of OpenAI's chat and completions APIs and of vLLM's extra parameters, sent with the real
``openai`` client: each is honoured (its effect tested here or in tests/test_serve.py) or refused with a 400 that names
it; none is dropped silently. Also vLLM's surface: /tokenize, /detokenize, /version, --api-key, its flag names, and
Prometheus metrics with its model_name label. One server for the module (tiny random Llama)."""

from __future__ import annotations

import httpx
import pytest
import torch
from _serve_utils import CHAT_TEMPLATE, ServerProcess, metric
from test_serve import chat_ids, reference, tiny  # noqa: F401 - tiny: the module's fixture

import medusa_lite.serve.params as params
import medusa_lite.serve.server as server_module
from medusa_lite.serve.schemas import ChatRequest, CompletionRequest

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
NAME = "tiny"
SERVER_TEMPLATE = "SERVER\n" + CHAT_TEMPLATE  # --chat-template: requests that send none get this one
VLLM_FIELDS = {  # vLLM's sampling and extra parameters (vllm/entrypoints/openai/protocol.py)
    "both": ["best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
             "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
             "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
             "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
             "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority", "request_id",
             "logits_processors", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs"],
    "chat": ["bad_words", "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
             "chat_template_kwargs", "mm_processor_kwargs", "structural_tag", "include_reasoning"],
    "completions": ["prompt_embeds"],
}
SAMPLES = {  # field -> the request fields that set it to something other than its default
    "model": {"model": NAME}, "max_tokens": {"max_tokens": 3}, "max_completion_tokens": {"max_completion_tokens": 3},
    "temperature": {"temperature": 0.7, "seed": 1}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1}, "stop": {"stop": ["zz"]}, "seed": {"seed": 3}, "n": {"n": 2},
    "best_of": {"best_of": 2, "temperature": 1.0}, "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "presence_penalty": {"presence_penalty": 0.5}, "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2}, "logit_bias": {"logit_bias": {"5": 1}},
    "logprobs": {"logprobs": True}, "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "echo": {"echo": True}, "user": {"user": "u1"}, "safety_identifier": {"safety_identifier": "u1"},
    "stop_token_ids": {"stop_token_ids": [5]}, "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True}, "min_tokens": {"min_tokens": 2}, "skip_special_tokens":
    {"skip_special_tokens": False}, "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 3}, "allowed_token_ids": {"allowed_token_ids": [5, 6, 7]},
    "bad_words": {"bad_words": ["hello"]}, "add_special_tokens": {"add_special_tokens": True},
    "priority": {"priority": 1}, "request_id": {"request_id": "req-1"},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True, "logprobs": True},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"continue_final_message": True, "add_generation_prompt": False},
    "documents": {"documents": [{"title": "a", "text": "b"}]}, "chat_template": {"chat_template": CHAT_TEMPLATE},
    "chat_template_kwargs": {"chat_template_kwargs": {"flavour": 1}}, "cache_salt": {"cache_salt": "salt"},
    "prompt_cache_key": {"prompt_cache_key": "k"}, "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prompt_cache_options": {"prompt_cache_options": {}},
    # refused
    "suffix": {"suffix": "x"}, "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "tool_choice": {"tool_choice": "required"}, "parallel_tool_calls": {"parallel_tool_calls": False},
    "functions": {"functions": [{"name": "f"}]}, "function_call": {"function_call": "auto"},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}}, "modalities": {"modalities": ["text", "audio"]},
    "prompt_embeds": {"prompt_embeds": "AAAA"}, "mm_processor_kwargs": {"mm_processor_kwargs": {"a": 1}},
    "metadata": {"metadata": {"k": "v"}}, "store": {"store": True},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}}, "reasoning_effort": {"reasoning_effort": "low"},
    "include_reasoning": {"include_reasoning": False}, "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {}}, "service_tier": {"service_tier": "flex"},
    "prompt_logprobs": {"prompt_logprobs": 1}, "use_beam_search": {"use_beam_search": True},
    "length_penalty": {"length_penalty": 0.5}, "logits_processors": {"logits_processors": ["a.B"]},
    "kv_transfer_params": {"kv_transfer_params": {"a": 1}}, "vllm_xargs": {"vllm_xargs": {"a": 1}},
    "response_format": {"response_format": {"type": "json_object"}}, "structured_outputs":
    {"structured_outputs": {"regex": "a+"}}, "guided_json": {"guided_json": {"type": "object"}},
    "guided_regex": {"guided_regex": "a+"}, "guided_choice": {"guided_choice": ["a", "b"]},
    "guided_grammar": {"guided_grammar": 'root ::= "a"'}, "structural_tag": {"structural_tag": "{}"},
    "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
    "guided_whitespace_pattern": {"guided_whitespace_pattern": " "},
}
COMPLETION_SAMPLES = {"logprobs": {"logprobs": 1}, "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True,
                                                                                    "logprobs": 1}}
BEHAVIOUR = {  # the test of each honoured field's effect (this module or tests/test_serve.py)
    "test_health_and_models": ["model"],
    "test_raw_sse_format": ["max_tokens", "stream", "stream_options"],
    "test_seed_reproducible_and_max_completion_tokens": ["max_completion_tokens", "temperature", "top_p"],
    "test_n_completions_are_rows_with_their_own_seeds": ["seed", "n"],
    "test_best_of_returns_the_best_seeded_candidates": ["best_of"],
    "test_top_k_and_min_p_narrow_sampling": ["top_k", "min_p"],
    "test_stop_strings": ["stop"],
    "test_penalties_are_generates": ["presence_penalty", "frequency_penalty", "repetition_penalty"],
    "test_logit_bias_is_generates": ["logit_bias"],
    "test_logprobs_are_the_targets_own": ["logprobs", "top_logprobs"],
    "test_completion_streamed_equals_plain_equals_generate": ["prompt"],
    "test_chat_streamed_equals_plain_equals_generate": ["messages"],
    "test_one_stop_rule_through_generate_a_batch_and_the_server": ["stop_token_ids", "include_stop_str_in_output"],
    "test_ignore_eos_and_special_tokens": ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"],
    "test_min_tokens_and_masks_are_generates": ["min_tokens", "allowed_token_ids", "bad_words"],
    "test_prompt_options": ["truncate_prompt_tokens", "add_special_tokens", "request_id", "return_tokens_as_token_ids"],
    "test_priority_orders_the_queue": ["priority"],
    "test_chat_template_options": ["add_generation_prompt", "documents", "chat_template", "chat_template_kwargs"],
    "test_chat_echo_and_continue_final_message": ["echo", "continue_final_message"],
    "test_server_structured_output_is_plain_constrained_decoding": [  # tests/test_constraints.py
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_whitespace_pattern"],
}


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):  # noqa: F811 - the fixture imported above
    target_dir, heads_dir, _, _ = tiny
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(SERVER_TEMPLATE)
    srv = ServerProcess("--target", str(target_dir), "--heads", str(heads_dir), "--threads", "1",
                        "--api-key", KEY, "--served-model-name", NAME, "--max-num-seqs", "4", "--max-model-len", "512",
                        "--chat-template", str(template), "--metrics-prefix", "vllm", "--generation-config", "vllm")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _send(client, endpoint: str, fields: dict):
    """One request through the openai client: OpenAI's own fields as arguments, the others in extra_body."""
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "Hello world"})
    kwargs = {"model": NAME, "max_tokens": 4, "temperature": 0, **base}
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    known = set(_openai_fields(endpoint))
    if fields.get("continue_final_message"):
        kwargs["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    kwargs.update(fields)
    extra = {k: v for k, v in kwargs.items() if k not in known}
    out = create(**{k: v for k, v in kwargs.items() if k in known}, extra_body=extra or None)
    return list(out) if fields.get("stream") else out


def _openai_fields(endpoint: str) -> list[str]:
    if endpoint == "chat":
        from openai.types.chat.completion_create_params import CompletionCreateParamsBase
    else:
        from openai.types.completion_create_params import CompletionCreateParamsBase
    return sorted(CompletionCreateParamsBase.__annotations__) + ["stream"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_field_is_honoured_or_refused_by_name(client, endpoint):
    schema = ChatRequest if endpoint == "chat" else CompletionRequest
    declared = set(schema.model_fields)
    sent = set(_openai_fields(endpoint)) | set(VLLM_FIELDS["both"]) | set(VLLM_FIELDS[endpoint])
    assert sent <= declared, f"fields of OpenAI or vLLM this server does not declare: {sorted(sent - declared)}"
    honoured, accepted, refused = set(params.HONOURED), set(params.ACCEPTED), set(params.REFUSED)
    assert not (honoured & accepted or honoured & refused or accepted & refused)
    assert declared <= honoured | accepted | refused, sorted(declared - honoured - accepted - refused)
    assert {field for fields in BEHAVIOUR.values() for field in fields} == honoured
    outcome = {}
    for field in sorted(declared - {"messages", "prompt"}):
        try:
            sample = COMPLETION_SAMPLES.get(field) if endpoint == "completions" else None
            _send(client, endpoint, sample or SAMPLES[field])
            outcome[field] = "ok"
        except openai.BadRequestError as e:
            outcome[field] = "refused" if e.body and e.body.get("param") == field else f"400: {e.body}"
    wrong = {f: o for f, o in outcome.items() if o != ("refused" if f in refused else "ok")}
    assert not wrong, wrong  # 0 silently ignored: every 200 is honoured or accepted, every refusal names its field


def test_unknown_fields_are_refused_by_name(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "temprature": 0.5},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temprature"
    assert r.json()["error"]["code"] == "unknown_parameter"
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": "hi", "tool_calls": []}]})
    assert r.status_code == 400 and "messages.0.tool_calls" in r.json()["error"]["message"]


def test_behaviour_tests_exist():
    import test_constraints
    import test_serve

    missing = [name for name in BEHAVIOUR if name not in globals() and not any(
        hasattr(module, name) for module in (test_serve, test_constraints))]
    assert not missing, missing


# ---------------------------------------------------------------- the fields' effects
LONG_PROMPT = "The quick brown fox"


def _template_ids(tok, messages, template=SERVER_TEMPLATE, **options) -> list[int]:
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
    return tok(text, add_special_tokens=False)["input_ids"]


def _stop_reason(choice):
    return choice.model_extra["stop_reason"]


def test_one_stop_rule_through_generate_a_batch_and_the_server(tiny, client):
    """The same stop conditions through generate, a batch row and the server: the same tokens, the same finish
    and stop reasons, and the server's text the tokens' text cut where the rule says (before the stop string or
    stop token, after it with include_stop_str_in_output)."""
    _, _, model, tok = tiny
    ids = tok(LONG_PROMPT)["input_ids"]
    _, plain, _ = reference(tiny, ids, 40)
    text = tok.decode(plain, skip_special_tokens=True)
    pos = next(i for i in range(6, len(text) - 2) if text[i:i + 2].isascii() and text[i:i + 2].isprintable()
               and text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    stop, stop_id = text[pos:pos + 2], next(t for k, t in enumerate(plain) if k > 4 and t not in plain[:k])
    other = torch.tensor(tok("Hello world")["input_ids"])
    for case in ({"stop": [stop]}, {"stop": [stop], "include_stop_str_in_output": True}, {"stop_token_ids": [stop_id]},
                 {"stop_token_ids": [stop_id], "include_stop_str_in_output": True}, {}):
        rule = {"stop_strings": case.get("stop"), "stop_token_ids": case.get("stop_token_ids"),
                "include_stop_str_in_output": case.get("include_stop_str_in_output", False),
                "skip_special_tokens": True, "tokenizer": tok}
        _, new, stats = reference(tiny, ids, 40, **rule)
        width = max(len(ids), other.numel())
        rows = torch.stack([torch.nn.functional.pad(torch.tensor(ids), (width - len(ids), 0)),
                            torch.nn.functional.pad(other, (width - other.numel(), 0))])
        mask = (torch.arange(width)[None] >= torch.tensor([[width - len(ids)], [width - other.numel()]])).long()
        batch = model.generate(rows, attention_mask=mask, max_new_tokens=40, do_sample=False, **rule)
        assert batch[0, width:width + len(new)].tolist() == new
        assert (model.last_batch_stats[0].finish_reason, model.last_batch_stats[0].stop_reason) == \
            (stats.finish_reason, stats.stop_reason)
        extra = {k: v for k, v in case.items() if k != "stop"}
        out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=40, temperature=0,
                                        stop=case.get("stop"), extra_body=extra)
        choice = out.choices[0]
        assert out.usage.completion_tokens == len(new)
        assert (choice.finish_reason, _stop_reason(choice)) == (stats.finish_reason, stats.stop_reason)
        full = tok.decode(new, skip_special_tokens=True)
        include = case.get("include_stop_str_in_output", False)
        if "stop" in case:
            want = full[:full.find(stop) + (len(stop) if include else 0)]
        elif "stop_token_ids" in case and not include:
            want = tok.decode(new[:-1], skip_special_tokens=True)
        else:
            want = full
        assert choice.text == want, case
    assert stats.finish_reason == "length"  # the last case: no condition but the length


def test_ignore_eos_and_special_tokens(tiny, client):
    """EOS made the likeliest token (logit_bias): it stops the row at once, or with ignore_eos the row runs to
    max_tokens; its text is skipped, or kept with skip_special_tokens: false."""
    _, _, _, tok = tiny
    eos = tok.eos_token_id
    args = dict(model=NAME, prompt="Hello", max_tokens=5, temperature=0, logit_bias={str(eos): 100})
    out = client.completions.create(**args)
    assert (out.choices[0].finish_reason, out.usage.completion_tokens, out.choices[0].text) == ("stop", 1, "")
    out = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert (out.choices[0].finish_reason, out.usage.completion_tokens, out.choices[0].text) == ("length", 5, "")
    out = client.completions.create(**args, extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                        "spaces_between_special_tokens": False})
    assert out.choices[0].text == tok.decode([eos] * 5, skip_special_tokens=False,
                                             spaces_between_special_tokens=False) == tok.eos_token * 5


def test_min_tokens_and_masks_are_generates(tiny, client):
    """min_tokens (a stop token masked until then), allowed_token_ids and bad_words: the greedy answer is generate's
    with the same rule (applied at every tree node from its own prefix) and differs from the plain one."""
    _, _, _, tok = tiny
    ids = tok(LONG_PROMPT)["input_ids"]
    plain_text, plain, _ = reference(tiny, ids, 24)
    stop_id = plain[2]
    want, new, _ = reference(tiny, ids, 24, stop_token_ids=[stop_id], min_new_tokens=8)
    assert len(new) > 3 and stop_id not in new[:8]
    out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "min_tokens": 8})
    assert out.usage.completion_tokens == len(new)
    allowed = [t for t in range(3, len(tok)) if t not in (plain[1], plain[4])]
    want, new, _ = reference(tiny, ids, 24, allowed_token_ids=allowed)
    out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"allowed_token_ids": allowed})
    assert out.choices[0].text == want != plain_text
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    at = next(i for i in range(3, 20) if encode(tok.decode(plain[i:i + 2])) == plain[i:i + 2])
    word = tok.decode(plain[at:at + 2])
    want, _, _ = reference(tiny, ids, 24, bad_words_ids=params.bad_words_ids([word], encode))
    out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"bad_words": [word]})
    assert out.choices[0].text == want != plain_text


def test_top_k_and_min_p_narrow_sampling(tiny, client):
    """top_k 1, or min_p 1 (only the likeliest token is kept), make sampling at T = 1 the greedy answer."""
    _, _, _, tok = tiny
    want, _, _ = reference(tiny, tok(LONG_PROMPT)["input_ids"], 12)
    for narrow in ({"top_k": 1}, {"min_p": 1.0}):
        out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=12, temperature=1.0, seed=5,
                                        extra_body=narrow)
        assert out.choices[0].text == want, narrow


def test_prompt_options(tiny, client):
    """truncate_prompt_tokens keeps the prompt's last tokens; add_special_tokens as the tokenizer takes it; request_id
    names the response; return_tokens_as_token_ids names log-prob tokens by id."""
    _, _, _, tok = tiny
    ids = tok(LONG_PROMPT)["input_ids"]
    want, new, _ = reference(tiny, ids[-3:], 6)
    out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3, "request_id": "abc-1"})
    assert (out.choices[0].text, out.usage.prompt_tokens, out.id) == (want, 3, "cmpl-abc-1")
    for special in (True, False):
        out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=1,
                                        extra_body={"add_special_tokens": special})
        assert out.usage.prompt_tokens == len(tok(LONG_PROMPT, add_special_tokens=special)["input_ids"])
    _, new, _ = reference(tiny, ids, 5)
    out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in new]


def test_priority_orders_the_queue():
    """Waiting jobs leave by priority (lower first, vLLM's), then by arrival."""
    import collections
    import threading
    from types import SimpleNamespace

    from medusa_lite.serve.engine import Engine

    engine = Engine.__new__(Engine)  # the admission state only: no model
    engine._pending, engine._cond, engine._closed = collections.deque(), threading.Condition(), False
    engine.running = []
    engine.max_queue, engine.max_batch_size = 10, 1
    engine.metrics = SimpleNamespace(waiting=SimpleNamespace(set=lambda n: None))
    for name, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5)):
        engine.submit(SimpleNamespace(name=name, priority=priority))
    assert [job.name for job in engine._pending] == ["c", "a", "d", "b", "e"]


def test_chat_template_options(tiny, client, server):
    """The server's --chat-template for requests without one; a request's chat_template, add_generation_prompt,
    chat_template_kwargs and documents, as transformers' apply_chat_template takes them; /tokenize builds the same
    prompt."""
    _, _, _, tok = tiny
    messages = [{"role": "user", "content": "Say hello"}]
    ids = _template_ids(tok, messages, add_generation_prompt=True)
    want, _, _ = reference(tiny, ids, 8)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert (out.choices[0].message.content, out.usage.prompt_tokens) == (want, len(ids))
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if flavour %}<{{ flavour }}>"
                "{% endif %}{% for d in documents or [] %}({{ d['text'] }}){% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    options = {"add_generation_prompt": False, "chat_template_kwargs": {"flavour": "x"},
               "documents": [{"title": "t", "text": "doc"}]}
    ids = _template_ids(tok, messages, template, add_generation_prompt=False, flavour="x",
                        documents=options["documents"])
    want, _, _ = reference(tiny, ids, 8)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"chat_template": template, **options})
    assert (out.choices[0].message.content, out.usage.prompt_tokens) == (want, len(ids))
    r = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": messages, "chat_template": template, "add_generation_prompt": False,
                         "chat_template_kwargs": {"flavour": "x", "documents": options["documents"]}})
    assert r.json()["tokens"] == ids


def test_chat_echo_and_continue_final_message(tiny, client):
    """continue_final_message: the model continues the last (assistant) message; echo puts that message first."""
    _, _, _, tok = tiny
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hel"}]
    ids = _template_ids(tok, messages, continue_final_message=True)
    want, _, _ = reference(tiny, ids, 8)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, extra_body=extra)
    assert out.choices[0].message.content == want and out.usage.prompt_tokens == len(ids)
    echoed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                            extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == "Hel" + want
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={**extra, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hel" + want


# ---------------------------------------------------------------- vLLM's surface
def test_tokenize_detokenize_version(tiny, server):
    from medusa_lite import __version__

    _, _, _, tok = tiny
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/tokenize", headers=auth, json={"prompt": LONG_PROMPT, "return_token_strs": True})
    ids = tok(LONG_PROMPT)["input_ids"]
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                        "token_strs": tok.convert_ids_to_tokens(ids)}
    r = httpx.post(server.url + "/detokenize", headers=auth, json={"tokens": ids})
    assert r.json() == {"prompt": tok.decode(ids)}
    assert httpx.post(server.url + "/detokenize", headers=auth, json={"tokens": [10 ** 6]}).status_code == 400
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_api_key(server):
    """--api-key: the API answers 401 without the key or with another; /health, /metrics and /version need none."""
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_vllm_flags_and_metrics_label(server, client):
    """vLLM's flag names (--max-num-seqs, --served-model-name, --max-model-len, --chat-template,
    --generation-config) and its metric names with their model_name label (--metrics-prefix vllm)."""
    assert server_module.parse_settings(["--max-num-seqs", "3"]).max_batch_size == 3
    assert server_module.parse_settings(["--max-num-seqs=5"]).max_batch_size == 5
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.model_extra["max_model_len"] == 512
    with pytest.raises(openai.BadRequestError, match="512"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=600)
    client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    assert f'vllm:generation_tokens_total{{model_name="{NAME}"}}' in text and "medusa_lite:" not in text
    assert metric(text, "vllm:num_requests_running") == 0


def test_generation_defaults(tmp_path):
    """--generation-config: auto, the target's sampling defaults where they differ from transformers' (vLLM's rule);
    vllm, neutral ones; a folder, its generation_config.json."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=0.6, top_k=20, max_new_tokens=77, eos_token_id=2)
    assert params.generation_defaults("auto", config) == {**params.NEUTRAL, "temperature": 0.6, "top_k": 20,
                                                          "max_tokens": 77}
    assert params.generation_defaults("vllm", config) == params.NEUTRAL
    config.save_pretrained(tmp_path)
    assert params.generation_defaults(str(tmp_path), GenerationConfig()) == params.generation_defaults("auto", config)
