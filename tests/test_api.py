"""generate's interface: streamers, stop strings, stopping criteria, clear errors for the unsupported."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import random_heads, tiny_model, tiny_tokenizer
from transformers import MistralConfig, MistralForCausalLM, StoppingCriteria, TextIteratorStreamer, TextStreamer

from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.kv import UnsupportedCacheError


@pytest.fixture
def model():
    m = MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=4))
    random_heads(m, std=0.5, seed=0)
    return m


class Recorder:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_every_chunk(model, prompt):
    rec = Recorder()
    out = model.generate(prompt, max_new_tokens=20, streamer=rec)
    assert rec.chunks[0] == prompt[0].tolist() and rec.ended
    assert sum(rec.chunks[1:], []) == out[0, prompt.shape[1]:].tolist()
    assert len(rec.chunks) - 1 == 1 + model.last_stats.verify_steps  # one push per target forward


def test_text_streamers(model, prompt, capsys):
    tok = tiny_tokenizer()
    out = model.generate(prompt, max_new_tokens=12, streamer=TextStreamer(tok, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.split() == tok.decode(out[0, prompt.shape[1]:]).split()
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    thread = threading.Thread(target=model.generate, args=(prompt,), kwargs={"max_new_tokens": 12, "streamer": streamer})
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text.split() == tok.decode(out[0, prompt.shape[1]:]).split()


def test_stop_strings_match_plain(model, prompt):
    tok = tiny_tokenizer()
    free = model.base_model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:]
    pos = next(i for i in range(5, 30) if 33 <= int(free[i]) <= 126 and 33 <= int(free[i + 1]) <= 126)
    stop = tok.decode(free[pos:pos + 2])  # a two-character stop string the model produces
    ref = model.base_model.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out, ref) and out.shape[1] < prompt.shape[1] + 30
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(prompt, max_new_tokens=5, stop_strings=["x"])


def test_custom_stopping_criteria(model, prompt):
    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= prompt.shape[1] + 6, dtype=torch.bool)

    out = model.generate(prompt, max_new_tokens=30, stopping_criteria=[StopAfter()])
    assert out.shape[1] == prompt.shape[1] + 6


def test_seeded_sampling_is_reproducible(model, prompt):
    a = model.generate(prompt, max_new_tokens=20, do_sample=True, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, max_new_tokens=20, do_sample=True, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_beams": 2}, "num_beams"),
    ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
    ({"num_return_sequences": 2, "do_sample": False}, "num_return_sequences"),  # sampling is fine (test_batch.py)
    ({"output_scores_typo": True}, "unsupported arguments"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_unsupported_options_raise(model, prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model.generate(prompt, **{"max_new_tokens": 5, **kwargs})


def test_bad_inputs(model, prompt):
    with pytest.raises(ValueError, match="batch size 1"):  # batches are fine (tests/test_batch.py), streamers not
        model.generate(prompt.repeat(2, 1), max_new_tokens=5, streamer=object())
    with pytest.raises(ValueError, match="empty"):
        model.generate(prompt[:, :0], max_new_tokens=5)
    with pytest.raises(ValueError, match="context length"):
        model.generate(torch.ones(1, 1020, dtype=torch.long), max_new_tokens=10)
    with pytest.raises(ValueError, match="left padding"):
        model.generate(prompt, attention_mask=torch.cat([torch.ones(1, 11), torch.zeros(1, 1)], 1).long())
    with pytest.raises(ValueError, match="tree"):
        model.generate(prompt, max_new_tokens=5, tree=[[0, 0]])


def test_sliding_window_model_is_exact(prompt):
    """Sliding-window models were refused before issue #12; now they decode exactly (tests/test_architectures.py)."""
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, initializer_range=0.2)
    target = MistralForCausalLM(cfg).eval()
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=2)), std=0.5)
    ref = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=20, do_sample=False), ref)


def test_recurrent_model_is_refused_at_construction():
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    target = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    with pytest.raises(UnsupportedCacheError, match="linear_attention"):
        MedusaModel(target, MedusaConfig(num_heads=2))


def test_tree_override_with_higher_ranks(model, prompt):
    """generate(tree=...) drafts as many ranks as the given tree needs, not the configured tree's."""
    ref = model.base_model.generate(prompt, max_new_tokens=12, do_sample=False)
    narrow = MedusaModel(model.base_model, MedusaConfig(num_heads=2, tree=[[0], [1]]))
    assert torch.equal(narrow.generate(prompt, max_new_tokens=12, tree=[[0], [3], [3, 5]]), ref)
