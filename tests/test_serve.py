"""The OpenAI-compatible server, end to end: a real server subprocess on a tiny random Llama saved to disk.

One server for the whole module (startup is the expensive part); requests are small (<= 24 tokens) except
where a request must stay busy long enough to be cancelled.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import torch

from _serve_utils import ROOT, ServerProcess, metric, save_tiny_model

import medusa_lite.serve.loadtest as loadtest
import medusa_lite.serve.server as server_module

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

MAX_QUEUE = 7        # 4 decoding together + 7 waiting
MAX_BATCH = 4
MAX_BODY = 64 * 1024
CONTEXT = 1024
LONG_PROMPT = "The quick brown fox"  # greedy continuation has no EOS within 1000 tokens (fixed seed)




@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, heads dir, in-process MedusaModel, tokenizer) for references."""
    from medusa_lite import MedusaConfig, MedusaModel
    from medusa_lite.targets import load_target

    root = tmp_path_factory.mktemp("serve")
    target_dir = save_tiny_model(root / "target", context=CONTEXT)
    target, tok = load_target(target_dir)
    torch.manual_seed(0)
    model = MedusaModel(target, MedusaConfig(num_heads=3))
    with torch.no_grad():  # non-zero heads, so drafts differ from the base prediction
        for p in model.drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(root / "heads")
    return target_dir, root / "heads", model, tok


@pytest.fixture(scope="module")
def server(tiny):
    target_dir, heads_dir, _, _ = tiny
    srv = ServerProcess("--target", str(target_dir), "--heads", str(heads_dir), "--max-queue", str(MAX_QUEUE),
                        "--max-batch-size", str(MAX_BATCH),
                        "--max-body-bytes", str(MAX_BODY), "--threads", "1", "--shutdown-timeout", "5")
    yield srv
    assert srv.stop() == 0, "graceful shutdown (SIGINT) should exit 0"


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(tiny, ids: list[int], max_new: int, **kwargs) -> tuple[str, list[int], "object"]:
    """MedusaModel.generate greedy in this process (``kwargs``: more generate options): (text, new ids, stats)."""
    _, _, model, tok = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server (--threads 1): same float reduction order, same argmax
    try:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, **kwargs)
    finally:
        torch.set_num_threads(threads)
    new = out[0, len(ids):].tolist()
    return tok.decode(new, skip_special_tokens=True), new, model.last_stats


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body strictly: only `data: ...` lines and blank separators; [DONE] last."""
    events, lines = [], [line for line in response.iter_lines()]
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


# ---------------------------------------------------------------- unit: settings, metric definitions
def test_settings_precedence_and_unknown_keys(tmp_path):
    server = server_module
    assert server.parse_settings([]) == server.Settings()  # the shipped YAML states the defaults
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9000\nmax_queue: 3\n")
    s = server.parse_settings(["--config", str(cfg), "--port", "9100"])
    assert (s.port, s.max_queue, s.dtype) == (9100, 3, "auto")  # flag > YAML > default
    cfg.write_text("prot: 9000\n")
    with pytest.raises(ValueError, match="prot"):
        server.parse_settings(["--config", str(cfg)])
    with pytest.raises(ValueError, match="max_queue"):
        server.parse_settings(["--max-queue", "-1"])
    with pytest.raises(ValueError, match="'port'"):
        server.parse_settings(["--port", "eighty"])


# ---------------------------------------------------------------- the API
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["target"]
    assert client.models.retrieve("target").id == "target"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completion_streamed_equals_plain_equals_generate(tiny, client):
    _, _, _, tok = tiny
    prompt = "Hello world"
    want, new, _ = reference(tiny, tok(prompt)["input_ids"], 24)
    plain = client.completions.create(model="target", prompt=prompt, max_tokens=24, temperature=0)
    assert plain.choices[0].text == want
    assert plain.usage.completion_tokens == len(new) and plain.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    assert plain.choices[0].finish_reason == ("stop" if new[-1] == tok.eos_token_id else "length")
    chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    spec = plain.model_extra["medusa_lite"]  # the request's speculative stats (an extension field)
    assert spec == chunks[-1].model_extra["medusa_lite"]  # greedy: the same steps streamed or not
    assert spec["verify_steps"] >= 1 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["mean_accepted_tokens"] == pytest.approx(len(new) / (spec["verify_steps"] + 1), abs=1e-3)


def test_chat_streamed_equals_plain_equals_generate(tiny, client):
    _, _, _, tok = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    want, new, _ = reference(tiny, chat_ids(tok, messages), 20)
    plain = client.chat.completions.create(model="target", messages=messages, max_tokens=20, temperature=0)
    assert plain.choices[0].message.content == want and plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == len(new)
    stream = client.chat.completions.create(model="target", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(new)
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason


def test_n_completions_are_rows_with_their_own_seeds(tiny, client):
    """n > 1: n rows of the batch; greedy ones all equal generate's output, sampled ones with a seed are exactly the
    completions of n = 1 requests seeded seed, seed + 1, ...; streamed choices carry their index; usage sums."""
    _, _, _, tok = tiny
    messages = [{"role": "user", "content": "Count to five"}]
    want, new, _ = reference(tiny, chat_ids(tok, messages), 12)
    greedy = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert all(c.message.content == want for c in greedy.choices)
    assert greedy.usage.completion_tokens == 3 * len(new) and greedy.usage.prompt_tokens == len(chat_ids(tok, messages))
    sampled = client.completions.create(model="target", prompt="Once upon", max_tokens=10, seed=7, n=2)
    solo = [client.completions.create(model="target", prompt="Once upon", max_tokens=10, seed=7 + i).choices[0].text
            for i in range(2)]
    assert [c.text for c in sampled.choices] == solo
    chunks = list(client.completions.create(model="target", prompt="Once upon", max_tokens=10, seed=7, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    texts = ["", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == solo and chunks[-1].usage.completion_tokens == sampled.usage.completion_tokens
    assert sum(1 for c in chunks[:-1] if c.choices[0].finish_reason) == 2


def test_best_of_returns_the_best_seeded_candidates(client):
    """best_of: best_of seeded candidates (those of n = 1 requests seeded seed, seed + 1, ...), the n with the highest
    mean log-probability per token returned best first; usage counts every candidate; greedy runs n only."""
    kw = dict(model="target", prompt="Once upon", max_tokens=10, temperature=1.0)
    solo = [client.completions.create(**kw, seed=7 + i, logprobs=0).choices[0] for i in range(4)]
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in solo]
    want = [solo[i].text for i in sorted(range(4), key=lambda i: mean[i], reverse=True)[:2]]
    out = client.completions.create(**kw, seed=7, n=2, best_of=4)
    assert [c.text for c in out.choices] == want and [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is None for c in out.choices)  # ranked by log-probs, reported only when asked
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in solo)
    plain = client.completions.create(**{**kw, "temperature": 0})
    greedy = client.completions.create(**{**kw, "temperature": 0}, best_of=3)
    assert greedy.choices[0].text == plain.choices[0].text
    assert greedy.usage.completion_tokens == plain.usage.completion_tokens  # one candidate


def test_echo_prepends_the_prompt(tiny, client):
    _, _, _, tok = tiny
    plain = client.completions.create(model="target", prompt="Once upon", max_tokens=8, temperature=0)
    echoed = client.completions.create(model="target", prompt="Once upon", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    ids = tok("Once upon")["input_ids"]
    by_ids = client.completions.create(model="target", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == tok.decode(ids) + plain.choices[0].text
    chunks = list(client.completions.create(model="target", prompt="Once upon", max_tokens=8, temperature=0,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text == "Once upon"
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_logprobs_are_the_targets_own(tiny, client):
    """logprobs: each emitted token's log-probability under the target (raw logits, as vLLM reports them) and the
    likeliest alternatives; greedy tokens are their own top alternative; streamed entries spell the text."""
    _, _, model, tok = tiny
    messages = [{"role": "user", "content": "Say hello"}]
    ids = chat_ids(tok, messages)
    want, new, _ = reference(tiny, ids, 12)
    out = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == len(new) and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob for c in content)
    with torch.no_grad():
        full = torch.log_softmax(model.base_model(torch.tensor([ids + new])).logits[0].float(), -1)
    expected = full[len(ids) - 1:-1].gather(-1, torch.tensor(new)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([c.logprob for c in content]), expected, atol=1e-4)
    chunks = list(client.completions.create(model="target", prompt="Once upon", max_tokens=10, temperature=0,
                                            logprobs=1, stream=True))
    plain = client.completions.create(model="target", prompt="Once upon", max_tokens=10, temperature=0, logprobs=1)
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == plain.choices[0].logprobs.tokens and len(streamed) == plain.usage.completion_tokens
    assert "".join(plain.choices[0].logprobs.tokens).strip() == plain.choices[0].text.strip()


def test_penalties_are_generates(tiny, client):
    """presence / frequency (OpenAI's) and repetition (vLLM's) penalties: the greedy answer is generate's with the same
    penalties (each tree node penalized from its own prefix) and differs from the unpenalized one."""
    _, _, _, tok = tiny
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    ids = tok(LONG_PROMPT)["input_ids"]
    want, _, _ = reference(tiny, ids, 40, **penalties)
    assert want != reference(tiny, ids, 40)[0]
    out = client.completions.create(model="target", prompt=LONG_PROMPT, max_tokens=40, temperature=0,
                                    presence_penalty=1.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3})
    assert out.choices[0].text == want


def test_logit_bias_is_generates(tiny, client):
    """logit_bias: the greedy answer is generate's with the same bias (transformers' sequence_bias of single tokens),
    a token biased by -100 never appears, and the answer differs from the unbiased one."""
    _, _, _, tok = tiny
    ids = tok(LONG_PROMPT)["input_ids"]
    _, plain, _ = reference(tiny, ids, 30)
    banned, favoured = plain[3], plain[7]
    want, new, _ = reference(tiny, ids, 30, sequence_bias={(banned,): -100.0, (favoured,): 4.0})
    assert new != plain and banned not in new
    out = client.completions.create(model="target", prompt=LONG_PROMPT, max_tokens=30, temperature=0,
                                    logit_bias={str(banned): -100, str(favoured): 4})
    assert out.choices[0].text == want


def test_raw_sse_format(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    # without include_usage: no usage key at all, last chunk before [DONE] carries finish_reason
    body.pop("stream_options")
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = sse_events(r)
    assert "usage" not in events[0] and events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings(tiny, client):
    _, _, _, tok = tiny
    full, _, _ = reference(tiny, tok(LONG_PROMPT)["input_ids"], 24)
    # a printable two-character stop string that first occurs well inside the text
    pos = next(i for i in range(4, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].strip()
               and full[i:i + 2].isprintable())
    stop = full[pos:pos + 2]
    want = full[:full.find(stop)]
    for stream in (False, True):
        args = dict(model="target", prompt=LONG_PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**args)
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (want, "stop")


def test_seed_reproducible_and_max_completion_tokens(client):
    def sample(seed):
        out = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                             max_completion_tokens=12, temperature=1.0, top_p=0.9, seed=seed)
        return out.choices[0].message.content, out.usage.completion_tokens

    first = sample(1234)
    assert first == sample(1234)
    assert first[1] <= 12
    assert len({sample(s)[0] for s in (1, 2, 3)} | {first[0]}) > 1  # different seeds, different samples


def test_metrics_move_with_generate_stats(tiny, server, client):
    _, _, _, tok = tiny
    before = httpx.get(server.url + "/metrics").text
    ids = tok("Numbers: 0 1 2")["input_ids"]
    _, new, stats = reference(tiny, ids, 16)
    client.completions.create(model="target", prompt="Numbers: 0 1 2", max_tokens=16, temperature=0)
    after = httpx.get(server.url + "/metrics").text

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    p = "medusa_lite:"
    assert delta(p + "spec_decode_num_drafts_total") == stats.verify_steps
    depths = stats.step_depths
    assert delta(p + "spec_decode_num_draft_tokens_total") == sum(depths)
    accepted = delta(p + "spec_decode_num_accepted_tokens_total")
    assert accepted == sum(stats.accepted_per_depth) == sum(stats.tokens_per_step) - stats.verify_steps
    assert 0 <= accepted <= sum(depths)
    for k, n in enumerate(stats.accepted_per_depth):
        assert delta(p + "spec_decode_num_accepted_tokens_per_pos_total", f'position="{k}"') == n
    assert delta(p + "generation_tokens_total") == len(new)
    assert delta(p + "prompt_tokens_total") == len(ids)
    assert delta(p + "requests_total", 'status="200"') == 1
    reason = "stop" if new[-1] == tok.eos_token_id else "length"
    assert delta(p + "request_success_total", f'finished_reason="{reason}"') == 1
    assert delta(p + "time_to_first_token_seconds_count") == 1
    assert delta(p + "e2e_request_latency_seconds_count") == 1
    assert "# TYPE medusa_lite:spec_decode_num_drafts_total counter" in after


BAD = [  # (path, body (dict or raw bytes), status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[" * 20000 + b"]" * 20000, 400, None),  # nested 20,000 deep: 400, the server stays up
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * CONTEXT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "target"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5},
     400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "suffix": "bye"}, 400, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"hi": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}, 413, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_an_openai_error(server, path, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_unknown_route_and_method_and_chunked_oversize(server):
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()

    def body():  # chunked upload: no Content-Length, the size is checked while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=body(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="target", messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    # and the server still serves
    assert client.completions.create(model="target", prompt="hi", max_tokens=2, temperature=0).usage


def test_eight_concurrent_streaming_clients(tiny, server, client):
    """Eight streams with their own budgets decoded in batches (continuous batching), next to a client that
    disconnects mid-stream and a malformed request: every answer equals its solo greedy answer."""
    _, _, _, tok = tiny
    prompts = [f"Hello {i} world" for i in range(8)]
    budgets = [6 + 2 * i for i in range(8)]
    want = [reference(tiny, chat_ids(tok, [{"role": "user", "content": p}]), n)[0] for p, n in zip(prompts, budgets)]
    before = httpx.get(server.url + "/metrics").text
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i):
        try:
            stream = client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompts[i]}],
                                                    max_tokens=budgets[i], temperature=0, stream=True)
            got[i] = "".join(c.choices[0].delta.content or "" for c in stream)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def leave_early():
        body = {"prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert len([line for line, _ in zip(r.iter_lines(), range(4)) if line.startswith("data: ")]) >= 1

    def malformed():
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": -3}).status_code == 400

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=leave_early), threading.Thread(target=malformed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and [got.get(i) for i in range(8)] == want
    after = _wait_idle(server)
    steps = metric(after, "medusa_lite:batch_size_count") - metric(before, "medusa_lite:batch_size_count")
    rows = metric(after, "medusa_lite:batch_size_sum") - metric(before, "medusa_lite:batch_size_sum")
    assert rows / steps > 1.5  # rows were verified together


def _wait_idle(server, timeout=20.0) -> str:
    """Poll /metrics until nothing runs or waits; returns the metrics text."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        if metric(text, "medusa_lite:num_requests_running") == 0 and \
                metric(text, "medusa_lite:num_requests_waiting") == 0:
            return text
        time.sleep(0.1)
    raise AssertionError(f"server still busy after {timeout} s")


def test_disconnect_mid_stream_frees_the_slot(server, client):
    before = httpx.get(server.url + "/metrics").text
    body = {"prompt": LONG_PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert len(got) >= 2
        t0 = time.monotonic()  # the connection is closed here
    after = _wait_idle(server)
    assert time.monotonic() - t0 < 20
    key = ("medusa_lite:request_success_total", 'finished_reason="cancelled"')
    assert metric(after, *key) - metric(before, *key) == 1
    assert metric(after, "medusa_lite:generation_tokens_total") == metric(before, "medusa_lite:generation_tokens_total")
    assert client.completions.create(model="target", prompt="hi", max_tokens=3, temperature=0).usage.completion_tokens


def test_full_queue_answers_429_and_cancelled_waiters_leave(server, client):
    body = {"prompt": LONG_PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=16)) as http:
        streams, readers = [], []
        try:
            for i in range(MAX_BATCH + MAX_QUEUE):
                r = http.send(http.build_request("POST", server.url + "/v1/completions", json=body), stream=True)
                assert r.status_code == 200
                streams.append(r)
                if i < MAX_BATCH:  # the batch is full and generating before the others queue up
                    readers.append(r.iter_lines())  # keep it referenced: a collected iterator closes the stream
                    assert next(line for line in readers[i] if line.startswith("data: "))
            extra = http.post(server.url + "/v1/completions", json=body)
            assert extra.status_code == 429, extra.text
            assert extra.json()["error"]["code"] == "queue_full" and extra.headers["retry-after"] == "1"
            text = httpx.get(server.url + "/metrics").text
            assert metric(text, "medusa_lite:num_requests_waiting") == MAX_QUEUE
        finally:
            for r in streams:
                r.close()
    _wait_idle(server)
    out = client.completions.create(model="target", prompt="hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 or out.choices[0].finish_reason == "stop"


def test_graceful_shutdown_finishes_the_running_stream(tiny):
    """SIGINT: no new connections, the in-flight stream runs to its end, then the process exits 0."""
    target_dir, heads_dir, _, _ = tiny
    srv = ServerProcess("--target", str(target_dir), "--heads", str(heads_dir), "--threads", "1",
                        "--shutdown-timeout", "60")
    try:
        body = {"prompt": LONG_PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()


def test_disconnect_while_waiting_for_a_plain_answer(server):
    before = httpx.get(server.url + "/metrics").text
    body = {"prompt": LONG_PROMPT, "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.15))
    after = _wait_idle(server)
    key = ("medusa_lite:request_success_total", 'finished_reason="cancelled"')
    assert metric(after, *key) - metric(before, *key) == 1


def test_documented_metrics_exist_and_loadtest_runs(server, capsys):
    import re

    text = httpx.get(server.url + "/metrics").text
    documented = set(re.findall(r"`(medusa_lite:[a-z_]+)", (ROOT / "docs" / "serving.md").read_text()))
    assert len(documented) >= 12
    assert not [name for name in documented if name not in text]

    loadtest.main(["--url", server.url, "--concurrency", "1,2", "--max-tokens", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]


def test_an_idle_worker_waits_for_requests_arriving_together():
    """An idle worker woken by one request waits ``arrival_window`` for the requests arriving with it (so their prompts
    share a prefill forward), and stops waiting as soon as the batch is full; with no window it does not wait."""
    import collections
    import threading
    import time

    from medusa_lite.serve.engine import Engine

    engine = Engine.__new__(Engine)  # the admission state only: no model
    engine._pending, engine._cond, engine._closed = collections.deque(["first"]), threading.Condition(), False
    engine.max_batch_size, engine.arrival_window = 3, 0.5

    def arrive():
        time.sleep(0.05)
        with engine._cond:
            engine._pending.append("second")
            engine._cond.notify()

    threading.Thread(target=arrive).start()
    start = time.perf_counter()
    with engine._cond:
        engine._await_arrivals()
    assert list(engine._pending) == ["first", "second"] and time.perf_counter() - start >= 0.45
    engine._pending.append("third")  # the batch is full: no wait
    start = time.perf_counter()
    with engine._cond:
        engine._await_arrivals()
    assert time.perf_counter() - start < 0.1
    engine._pending.popleft()
    engine.arrival_window = 0.0
    start = time.perf_counter()
    with engine._cond:
        engine._await_arrivals()
    assert time.perf_counter() - start < 0.1
