"""One tiny target named the three ways a command takes it: a Hub id in a fake Hugging Face cache (offline), a model
folder and a GGUF file. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

HUB_ID = "tiny-org/tiny-qwen2"
COMMITS = {"main": "0" * 39 + "1", "v2": "0" * 39 + "2"}  # refs/<name> -> the snapshot of that revision


def tiny_target(seed: int = 0):
    """(model, tokenizer): a tiny Qwen2 (GGUF keeps its weights as they are: no q/k permutation) and the byte-level
    tokenizer of the tests."""
    from conftest import tiny_model, tiny_tokenizer

    return tiny_model("qwen2", seed=seed), tiny_tokenizer()


def save_gguf(path: Path, model) -> Path:
    """``model`` (a Qwen2) as an fp32 GGUF file with a byte-level (gpt2) tokenizer, as llama.cpp lays it out."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg, chars = model.config, bytes_to_unicode()
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chars[b] for b in range(cfg.vocab_size)])
    writer.add_token_types([1] * cfg.vocab_size)
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight" or not cfg.tie_word_embeddings:  # a tied lm_head is the embedding
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def named_targets(root: Path, monkeypatch) -> dict:
    """{'hub': HUB_ID, 'folder': ..., 'gguf': ..., 'models': {revision: model}}: the folder and the GGUF file hold the
    seed-0 model, the fake Hub cache (huggingface_hub's layout, offline) holds it as ``main`` and a seed-1 model as
    ``v2``."""
    from huggingface_hub import constants

    models = {}
    repo = root / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    for seed, (revision, commit) in enumerate(COMMITS.items()):
        model, tokenizer = tiny_target(seed)
        model.save_pretrained(repo / "snapshots" / commit)
        tokenizer.save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        models[revision] = model
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(root / "cache"))  # where a GGUF target is de-quantised to
    model, tokenizer = tiny_target(0)
    model.save_pretrained(root / "folder")
    tokenizer.save_pretrained(root / "folder")
    return {"hub": HUB_ID, "folder": root / "folder", "gguf": save_gguf(root / "tiny.gguf", model), "models": models}
