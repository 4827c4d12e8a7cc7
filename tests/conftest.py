"""Tiny random models built in-process under a fixed seed (never Hub ids)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)


def tiny_model(arch: str = "llama", vocab: int = 128, seed: int = 0, dtype: torch.dtype = torch.float32,
               init: float = 0.2, layers: int = 2, hidden: int = 64, eos: int | None = None,
               context: int = 1024, tie: bool = True, bos: int = 0, pad: int | None = None):
    """A tiny random decoder. ``init`` (initializer_range) large enough that logits are peaky, so greedy
    near-ties (which make any two float computations disagree) are rare. The one factory of all tests."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, initializer_range=init, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                  tie_word_embeddings=tie)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, **common)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=context, **common)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if pad is None else pad
    return model.to(dtype).eval()


def random_heads(model, std: float = 0.3, seed: int = 0):
    """Give ``model``'s heads random weights (arbitrary proposals: acceptance is partial); returns the model."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.drafter.parameters():
            p.normal_(0, std)
    return model


def oracle_draft(reference: torch.Tensor, num_heads: int, topk: int, vocab: int):
    """A draft function that always proposes the reference continuation at rank 0.

    reference: [L] the plain-decoding output (prompt + new). The root is the last token of ``ids``,
    so head k proposes reference[len(ids) + k].
    """
    ref = reference.tolist()

    def draft(hidden: torch.Tensor, ids: torch.Tensor, topk: int = topk) -> torch.Tensor:
        n = ids.numel()
        rows = []
        for k in range(num_heads):
            true = ref[n + k] if n + k < len(ref) else 0
            rows.append([true] + [(true + 1 + r) % vocab for r in range(topk - 1)])
        return torch.tensor(rows, device=ids.device)

    return draft


# under pytest-xdist (make test: two workers on two cores) one thread each: more oversubscribes the cores and a
# 2-thread forward next to a busy worker runs ~10x slower
DEFAULT_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else torch.get_num_threads()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and 10x slower with oversubscribed OpenMP threads on a
    busy machine); tests of the real default model opt back in to ``DEFAULT_THREADS``."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(DEFAULT_THREADS)


@pytest.fixture
def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 128, (1, 12), generator=g)


def tiny_tokenizer(vocab: int = 128):
    """A byte-level tokenizer over the ASCII bytes 0..vocab-1 (one token per byte) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE({byte_chars[b]: b for b in range(vocab)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="\x00", eos_token="\x02", pad_token="\x02")
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    return fast


def pytest_collection_modifyitems(config, items):
    """The slow tests (Monte Carlo runs, the default model) first: two workers that steal work end on short tests
    instead of one of them starting a five-minute case last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
