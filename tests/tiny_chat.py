"""A tiny random Llama target with a word-level tokenizer and a chat template, saved as an HF directory.

Built in-process under a fixed seed (no Hub ids), for the benchmark and calibration tests.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<s>", "<end>", "<user>", "<assistant>"]
WORDS = ("the a of to and in is it you that for on with as are this be at or by from what how why "
         "translate german english summarize question answer hello please write short story about").split()
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<end>",
                                   pad_token="<end>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    """Peaky random logits (initializer_range 0.2) so greedy near-ties are rare; no EOS so lengths are fixed."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=2,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


def save_tiny_target(directory: Path, seed: int = 0) -> Path:
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
