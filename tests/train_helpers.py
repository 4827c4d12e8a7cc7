"""Tiny offline material for the training tests: a random Llama target with a role-aware word-level
tokenizer saved as an HF directory, chat JSONL data, and a tiny training YAML."""

from __future__ import annotations

import json
import random
from pathlib import Path



SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|eot|>"]
NUM_WORDS = 58
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|eot|> ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")


def role_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """Word-level tokenizer over SPECIAL + w0..w57 (vocab 64) with a role-aware chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + [f"w{i}" for i in range(NUM_WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def tiny_target(seed: int = 0):
    from conftest import tiny_model

    return tiny_model("llama", vocab=len(SPECIAL) + NUM_WORDS, seed=seed, context=512, bos=0, eos=1, pad=1)


def write_target(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tiny_target().save_pretrained(directory)
    role_tokenizer(chat_template).save_pretrained(directory)
    return directory


def conversation(rng: random.Random) -> list[dict]:
    """A system prompt, then user/assistant turns; assistant turns count upwards (learnable)."""
    msgs = [{"role": "system", "content": " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(3))}]
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(rng.randint(2, 6)))})
        start = rng.randrange(NUM_WORDS)
        msgs.append({"role": "assistant",
                     "content": " ".join(f"w{(start + i) % NUM_WORDS}" for i in range(rng.randint(8, 20)))})
    return msgs


def write_chat_jsonl(path: Path, n: int = 60, seed: int = 0, malformed: bool = False) -> Path:
    rng = random.Random(seed)
    lines = [json.dumps({"messages": conversation(rng)}) for _ in range(n)]
    if malformed:
        lines += ['{"messages": [{"role": "user"', json.dumps({"messages": []}), json.dumps([1, 2]),
                  json.dumps({"messages": [{"role": "user", "content": "w1"}]})]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_config(path: Path, target: Path, data: Path, out: Path, **overrides) -> Path:
    cfg = {"target": str(target), "data": str(data), "max_samples": None, "eval_samples": 8, "max_doc_len": 128,
           "seq_len": 32, "micro_batch_size": 4, "max_steps": 4, "warmup_steps": 1, "lr": 1e-2,
           "precision": "fp32", "save_every": 2, "log_every": 1, "output_dir": str(out), "progress": False,
           "threads": 1, "accept_prompts": 2, "accept_tokens": 16}
    cfg.update(overrides)
    import yaml

    path.write_text("# test config\n" + yaml.safe_dump(cfg))
    return path
