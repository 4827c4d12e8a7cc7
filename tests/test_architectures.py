"""The support matrix: tiny random models of the decoder architectures transformers ships.

Each is built in-process from a config (never a Hub download) with a tiny sliding window where the
architecture has one (WINDOW, shorter than the prompt), and must either decode greedily token for token
like ``target.generate(do_sample=False)`` -- with perturbed random heads and with an oracle drafter whose
whole paths are accepted, so trees cross the window edge -- or be refused when wrapped
(``MedusaModel(...)``) with an error naming the layer type.

``python tests/test_architectures.py`` prints docs/architectures.md's table from ARCHITECTURES.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import oracle_draft, random_heads  # noqa: E402

WINDOW = 6
VOCAB = 128
PROMPT = 20  # longer than WINDOW
NEW = 40

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=0,
            eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)  # tied + scaled embeddings (Gemma) copy the last token
ALTERNATING = ["sliding_attention", "full_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass
class Arch:
    name: str            # as in docs/architectures.md's table
    model_type: str      # transformers' model_type (AutoConfig.for_model)
    kwargs: dict = field(default_factory=dict)  # on top of BASE (a None value removes a BASE key)
    attention: str = "full"  # full, sliding, alternating (full + sliding) or chunked (+ full), as configured here
    refused: str | None = None  # the layer type named in the refusal, when refused

    def config(self):
        from transformers import AutoConfig

        kw = {**BASE, **self.kwargs}
        kw = {k: v for k, v in kw.items() if v is not None or k in ("eos_token_id", "pad_token_id")}
        return AutoConfig.for_model(self.model_type, **kw)

    def build(self, seed: int = 0, attn_implementation: str | None = None):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_config(self.config(), **extra).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model


ARCHITECTURES = [
    Arch("Llama", "llama"),
    Arch("Mistral (sliding window)", "mistral", dict(sliding_window=WINDOW), "sliding"),
    Arch("Mixtral (sliding window, MoE)", "mixtral", dict(sliding_window=WINDOW, num_local_experts=4,
                                                           num_experts_per_tok=2), "sliding"),
    Arch("Qwen2 (use_sliding_window)", "qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                     max_window_layers=1), "alternating"),
    Arch("Qwen2-MoE (use_sliding_window)", "qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                             max_window_layers=2, shared_expert_intermediate_size=64,
                                                             **MOE), "alternating"),
    Arch("Qwen3 (use_sliding_window)", "qwen3", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                     max_window_layers=1, head_dim=16), "alternating"),
    Arch("Qwen3-MoE", "qwen3_moe", dict(head_dim=16, **MOE)),
    Arch("Gemma", "gemma", dict(head_dim=16)),
    Arch("Gemma 2 (alternating)", "gemma2", dict(head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING,
                                                 query_pre_attn_scalar=16), "alternating"),
    Arch("Gemma 3 text (alternating)", "gemma3_text", dict(head_dim=16, sliding_window=WINDOW,
                                                           layer_types=ALTERNATING, query_pre_attn_scalar=16),
         "alternating"),
    Arch("Phi", "phi"),
    Arch("Phi-3 (sliding window)", "phi3", dict(sliding_window=WINDOW, pad_token_id=None), "sliding"),
    Arch("GPT-2", "gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, hidden_size=None,
                               intermediate_size=None, num_hidden_layers=None, num_attention_heads=None,
                               num_key_value_heads=None, max_position_embeddings=None)),
    Arch("GPT-NeoX", "gpt_neox", dict(num_key_value_heads=None)),
    Arch("GPT-J", "gptj", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8, hidden_size=None,
                               intermediate_size=None, num_hidden_layers=None, num_attention_heads=None,
                               num_key_value_heads=None, max_position_embeddings=None)),
    Arch("OPT", "opt", dict(ffn_dim=128, intermediate_size=None, num_key_value_heads=None, initializer_range=None,
                            init_std=0.2, word_embed_proj_dim=64, pad_token_id=1)),
    Arch("Falcon", "falcon", dict(intermediate_size=None, num_key_value_heads=None, new_decoder_architecture=True,
                                  num_kv_heads=2)),
    Arch("StableLM", "stablelm"),
    Arch("OLMo 2", "olmo2", dict(pad_token_id=1)),
    Arch("Granite", "granite"),
    Arch("Cohere 2 (alternating)", "cohere2", dict(sliding_window=WINDOW, layer_types=ALTERNATING), "alternating"),
    Arch("Starcoder2 (sliding window)", "starcoder2", dict(sliding_window=WINDOW), "sliding"),
    Arch("GPT-OSS (alternating, MoE, sinks)", "gpt_oss", dict(head_dim=16, sliding_window=WINDOW,
                                                              layer_types=ALTERNATING, num_local_experts=4,
                                                              num_experts_per_tok=2), "alternating"),
    # three chunked layers (a token sees the earlier tokens of its chunk of WINDOW) and a full NoPE layer
    Arch("Llama 4 text (chunked + full, MoE)", "llama4_text", dict(head_dim=16, attention_chunk_size=WINDOW,
                                                                   num_hidden_layers=4, intermediate_size_mlp=128,
                                                                   num_local_experts=2), "chunked"),
    Arch("Mamba", "mamba", dict(intermediate_size=None, num_attention_heads=None, num_key_value_heads=None,
                                max_position_embeddings=None, state_size=8), refused="linear_attention"),
    Arch("Jamba", "jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                expert_layer_offset=1, num_experts=2, use_mamba_kernels=False),
         refused="linear_attention"),
    Arch("Qwen3-Next", "qwen3_next", dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                          linear_num_key_heads=2, linear_num_value_heads=4,
                                          shared_expert_intermediate_size=32, **MOE), refused="linear_attention"),
    Arch("LFM2", "lfm2", dict(layer_types=["conv", "full_attention"]), refused="conv"),
    Arch("Falcon-H1", "falcon_h1", dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                                        mamba_chunk_size=16), refused="hybrid"),
    Arch("Bloom (ALiBi)", "bloom", dict(num_key_value_heads=None), refused="ALiBi"),
    Arch("MPT (ALiBi)", "mpt", dict(d_model=64, n_layers=2, n_heads=4, hidden_size=None, num_hidden_layers=None,
                                    num_attention_heads=None, num_key_value_heads=None), refused="ALiBi"),
]
BY_NAME = {a.name: a for a in ARCHITECTURES}
SUPPORTED = [a.name for a in ARCHITECTURES if a.refused is None]
REFUSED = [a.name for a in ARCHITECTURES if a.refused is not None]


def _prompt(length: int = PROMPT) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))


def _check_layers(arch: Arch, target) -> None:
    """The configured attention pattern is what the cache holds (else the matrix would test nothing)."""
    from medusa_lite.kv import layer_types

    types = set(layer_types(target))
    expected = {"full": {"full_attention"}, "sliding": {"sliding_attention"},
                "alternating": {"full_attention", "sliding_attention"},
                "chunked": {"full_attention", "chunked_attention"}}[arch.attention]
    assert types == expected, types


@pytest.mark.parametrize("name", SUPPORTED)
def test_greedy_identical(name):
    """Greedy output == plain greedy decoding, random (perturbed) heads and oracle drafts (whole paths
    accepted, non-contiguous nodes of a wide tree), prompt longer than the window, decoding past it."""
    from medusa_lite import MedusaConfig, MedusaModel

    arch = BY_NAME[name]
    target = arch.build()
    _check_layers(arch, target)
    prompt = _prompt()
    ref = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    assert len(set(ref[0, PROMPT:].tolist())) >= 5  # not a degenerate repeat any mask would reproduce
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=4)), std=0.5)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), ref)
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, VOCAB)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), ref)
    assert model.last_stats.mean_accepted_tokens > 3.0  # trees accepted whole: they cross the window edge


@pytest.mark.parametrize("name", REFUSED)
def test_refused_at_construction(name):
    from medusa_lite import MedusaConfig, MedusaModel
    from medusa_lite.kv import UnsupportedCacheError

    arch = BY_NAME[name]
    target = arch.build()
    with pytest.raises(UnsupportedCacheError, match=arch.refused):
        MedusaModel(target, MedusaConfig(num_heads=2))


SLIDING_CONTROLS = ["Mistral (sliding window)", "Gemma 2 (alternating)", "GPT-OSS (alternating, MoE, sinks)",
                    "Llama 4 text (chunked + full, MoE)"]


@pytest.mark.parametrize("name", SLIDING_CONTROLS)
@pytest.mark.parametrize("window", [2, 3, 5])
def test_trees_straddle_the_window(name, window):
    """Windows shorter than the tree (depth 4: the deepest nodes no longer see the root), a wide tree whose
    accepted nodes are not contiguous; sliding layers never hold more than window - 1 keys between steps."""
    from dataclasses import replace

    import medusa_lite.decode.batch as gen
    from medusa_lite import MedusaConfig, MedusaModel
    from medusa_lite.config import DEFAULT_TREE

    arch = BY_NAME[name]
    key = "attention_chunk_size" if "attention_chunk_size" in arch.kwargs else "sliding_window"
    arch = replace(arch, kwargs={**arch.kwargs, key: window})
    target = arch.build()
    prompt = _prompt(2 * PROMPT)
    ref = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    held = []
    keep = gen.keep_accepted

    def recording_keep(cache, prefix_len, accepted):
        keep(cache, prefix_len, accepted)
        held.append(max(layer.keys.shape[-2] for layer in cache.layers if layer.is_sliding))

    gen.keep_accepted = recording_keep
    try:
        for tree in (DEFAULT_TREE, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]):
            model = MedusaModel(target, MedusaConfig(num_heads=4, tree=tree))
            model.drafter.draft = oracle_draft(ref[0], 4, model._topk, VOCAB)
            assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), ref)
            assert model.last_stats.mean_accepted_tokens > 3.0
    finally:
        gen.keep_accepted = keep
    assert held and max(held) == window - 1


@pytest.mark.parametrize("name", SLIDING_CONTROLS)
def test_control_full_attention_on_sliding_layers_differs(name, monkeypatch):
    """A deliberately wrong mask (sliding layers see every key they hold: no window) must change the output,
    so the matrix above would catch a wrong window."""
    import medusa_lite.kv.masks as cache
    from medusa_lite import MedusaConfig, MedusaModel

    target = BY_NAME[name].build()
    prompt = _prompt()
    ref = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    real = cache.sliding_attention_bias
    monkeypatch.setattr(cache, "sliding_attention_bias",
                        lambda buffers, cache_len, dtype, window, kv_start=0, **kw: real(buffers, cache_len, dtype,
                                                                                         10**9, kv_start, **kw))
    model = MedusaModel(target, MedusaConfig(num_heads=4))
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, VOCAB)
    assert not torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), ref)


@pytest.mark.parametrize("name", ["Mistral (sliding window)", "Qwen2 (use_sliding_window)", "Cohere 2 (alternating)"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_implementations(name, attn):
    """The per-type masks are consumed the same way by the eager and the SDPA attention."""
    from medusa_lite import MedusaConfig, MedusaModel

    target = BY_NAME[name].build(attn_implementation=attn)
    assert target.config._attn_implementation == attn
    prompt = _prompt()
    ref = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    model = MedusaModel(target, MedusaConfig(num_heads=4))
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, VOCAB)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), ref)


@pytest.mark.parametrize("name", ["Mistral (sliding window)", "Gemma 2 (alternating)"])
@pytest.mark.parametrize("tree", [{"dynamic": {"nodes": 12, "depth": 4, "topk": 3, "expand": 3}},
                                  {"tree": [[0], [1], [0, 0]], "prompt_lookup": 6}], ids=["dynamic", "lookup"])
def test_hydra_trees_on_sliding_layers(name, tree):
    """Trees built per step from parent pointers (dynamic, prompt lookup) get the same sliding masks."""
    from medusa_lite import MedusaConfig, MedusaModel

    target = BY_NAME[name].build()
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 3])  # repetitive: the lookup branch gets accepted
    ref = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=4, head_type="hydra", tree=tree)), std=0.5)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), ref)


def test_full_attention_models_build_no_sliding_mask(monkeypatch):
    """No extra work without sliding layers: the verify mask is the plain full one (a tensor, not a dict),
    and the sliding mask is never built."""
    import medusa_lite.kv.masks as cache
    from medusa_lite import MedusaConfig, MedusaModel

    def boom(*args, **kwargs):
        raise AssertionError("sliding mask built for a full-attention model")

    monkeypatch.setattr(cache, "sliding_attention_bias", boom)
    target = BY_NAME["Llama"].build()
    prompt = _prompt()
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=4)), std=0.5)
    ref = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), ref)


def refusal_reason(arch: Arch) -> str:
    from medusa_lite import MedusaConfig, MedusaModel
    from medusa_lite.kv import UnsupportedCacheError

    try:
        MedusaModel(arch.build(), MedusaConfig(num_heads=2))
    except UnsupportedCacheError as e:
        return str(e).split(". Tree verification")[0]
    return "not refused"


def markdown_table() -> str:
    rows = ["| Architecture (tiny random, transformers 5.24) | Attention | medusa_lite greedy |", "|---|---|---|"]
    for arch in ARCHITECTURES:
        if arch.refused is None:
            result = "identical"
        else:
            result = "refused at `MedusaModel(...)`: " + refusal_reason(arch).replace("|", "\\|")
        attention = {"full": "full", "sliding": f"sliding window ({WINDOW})",
                     "alternating": f"full + sliding ({WINDOW})",
                     "chunked": f"full + chunked ({WINDOW})"}[arch.attention] if arch.refused is None \
            else "full, ALiBi" if arch.refused == "ALiBi" else "hybrid"
        rows.append(f"| {arch.name} | {attention} | {result} |")
    return "\n".join(rows)


def test_control_chunked_layers_given_a_sliding_window_differ(monkeypatch):
    """Llama 4's chunked layers see the earlier tokens of their own chunk, not the last ``w`` tokens: a deliberately
    wrong mask that counts their window as sliding must change the output (so the chunked mask is what is tested)."""
    import medusa_lite.kv.masks as masks
    import medusa_lite.tree.buffers as buffers
    from medusa_lite import MedusaConfig, MedusaModel

    target = BY_NAME["Llama 4 text (chunked + full, MoE)"].build()
    prompt = _prompt()
    ref = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    sliding = lambda query, key, window, chunked=False: query - key < window  # noqa: E731
    monkeypatch.setattr(buffers, "within_window", sliding)
    monkeypatch.setattr(masks, "within_window", sliding)
    model = MedusaModel(target, MedusaConfig(num_heads=4))
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, VOCAB)
    assert not torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), ref)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(markdown_table())
