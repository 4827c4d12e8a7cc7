"""``medusa-lite serve`` with no model flags: the bundled default target (+ bundled or fresh heads)."""

from __future__ import annotations

import httpx
import pytest
import torch

from _serve_utils import ServerProcess, metric

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_default_model_serves_greedy_generate_exactly():
    import medusa_lite
    from medusa_lite.targets import DEFAULT_TARGET

    # in-process reference first: this also converts the GGUF once (the server then loads the cache)
    model, tok = medusa_lite.load_model(dtype="fp32")
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server (--threads 1): same float reduction order, same argmax
    try:
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    del model

    server = ServerProcess("--dtype", "fp32", "--max-queue", "2", "--threads", "1")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [DEFAULT_TARGET]
        plain = client.chat.completions.create(model=DEFAULT_TARGET, messages=MESSAGES, max_tokens=16,
                                               temperature=0)
        assert plain.choices[0].message.content == want
        chunks = list(client.chat.completions.create(model=DEFAULT_TARGET, messages=MESSAGES, max_tokens=16,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        metrics = httpx.get(server.url + "/metrics").text
        assert metric(metrics, "medusa_lite:spec_decode_num_drafts_total") > 0
        assert metric(metrics, "medusa_lite:generation_tokens_total") == 2 * plain.usage.completion_tokens
    finally:
        assert server.stop() == 0
