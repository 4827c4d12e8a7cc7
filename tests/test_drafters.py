"""The drafter contract, run over every registered drafter (as PEFT's tests run over its configs)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model

from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.drafters import DRAFTERS, Drafter, drafter_class, drafter_features, register_drafter
from medusa_lite.drafters.base import PathDrafter
from medusa_lite.tree import DynamicTree, build_buffers

NAMES = sorted(DRAFTERS)


def _model(name: str, **config) -> MedusaModel:
    target = tiny_model("llama", layers=4)
    return random_heads(MedusaModel(target, MedusaConfig(num_heads=3, head_type=name, **config)), std=0.1, seed=3)


def _features(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.base_model(input_ids=ids, output_hidden_states=True)
    return drafter_features(out.hidden_states, model.drafter.hidden_layers)  # [B, T, F]


def test_registry_names_and_errors():
    assert {"medusa", "hydra", "eagle3"} <= set(NAMES)
    assert all(issubclass(DRAFTERS[n], Drafter) and DRAFTERS[n].name == n for n in NAMES)
    with pytest.raises(ValueError, match="registered"):
        drafter_class("eagle9")
    with pytest.raises(ValueError, match="registered already"):
        register_drafter(type("Other", (Drafter,), {"name": "medusa"}))


@pytest.mark.parametrize("name", NAMES)
def test_propose_commit_batch_rows(name):
    """propose gives one Draft per batch row (per-row lengths), commit moves each row to its accepted node."""
    model = _model(name)
    drafter = model.drafter
    ids = [torch.tensor([5, 9, 17]), torch.tensor([3, 4, 8, 21, 30])]
    hidden = _features(model, torch.tensor([[5, 9, 3, 3, 3, 3], [3, 4, 8, 21, 3, 3]]))  # [2, 6, F]
    state = drafter.start(ids, hidden)
    assert torch.equal(state.hidden[1], hidden[1, 3])  # the last prompt position of row 1
    buffers = build_buffers([[0], [1], [0, 0]])
    drafts = drafter.propose(state, buffers, max_depth=8)
    assert len(drafts) == 2
    for draft, row in zip(drafts, ids):
        assert draft.tokens.shape == (4,) and int(draft.tokens[0]) == int(row[-1])  # the root first
    alone = drafter.start([ids[1]], hidden[1:])
    assert torch.equal(drafts[1].tokens, drafter.propose(alone, buffers, 8)[0].tokens)  # rows do not mix
    verify_hidden = torch.randn(2, 4, hidden.shape[-1])
    drafter.commit(state, [torch.tensor([0, 1]), torch.tensor([0])], verify_hidden,
                   [torch.tensor([5, 9, 17, 40, 41]), torch.tensor([3, 4, 8, 21, 30, 50])])
    assert torch.equal(state.hidden[0], verify_hidden[0, 1]) and torch.equal(state.hidden[1], verify_hidden[1, 0])
    if drafter.dynamic_trees:
        grown = drafter.propose(state, DynamicTree(nodes=5, depth=3), 8)
        assert [g.buffers.num_nodes for g in grown] == [6, 6]
    else:
        with pytest.raises(ValueError, match="dynamic"):
            drafter.propose(state, DynamicTree(nodes=5, depth=3), 8)


@pytest.mark.parametrize("name", [n for n in NAMES if issubclass(DRAFTERS[n], PathDrafter)])
@pytest.mark.parametrize("shape", [build_buffers([[0], [1], [0, 0], [0, 1], [0, 0, 0]]), DynamicTree(nodes=6, depth=3)])
def test_rows_drafted_together_equal_rows_drafted_alone(name, shape, monkeypatch):
    """propose drafts all rows in lockstep, each level of every row in one advance_rows call (one pass over the
    weights); each row's draft is the one it gets alone, whatever the other rows' prompt lengths, pending positions
    and depth caps."""
    model = _model(name)
    drafter = model.drafter
    ids = [torch.tensor([5, 9, 17, 2]), torch.tensor([3, 4, 8, 21, 30, 6, 7]), torch.tensor([11, 12])]
    hidden = _features(model, torch.tensor([[5, 9, 17, 3, 3, 3, 3], [3, 4, 8, 21, 30, 6, 7], [11, 3, 3, 3, 3, 3, 3]]))
    verify = torch.randn(3, 3, hidden.shape[-1], generator=torch.Generator().manual_seed(0))
    accepted = [torch.tensor([0, 1, 2]), torch.tensor([0]), torch.tensor([0, 2])]
    after = [torch.cat([row, torch.tensor(extra)]) for row, extra in zip(ids, ([40, 41, 42], [50], [60, 61]))]
    depths = [8, 2, 0] if isinstance(shape, DynamicTree) else 8

    def state(rows):
        s = drafter.start([ids[b] for b in rows], hidden[rows])
        drafter.commit(s, [accepted[b] for b in rows], verify[rows], [after[b] for b in rows])
        return s

    calls = []
    real = type(drafter).advance_rows
    monkeypatch.setattr(type(drafter), "advance_rows", lambda self, ctxs, requests: calls.append(len(requests))
                        or real(self, ctxs, requests))
    together = drafter.propose(state([0, 1, 2]), shape, depths)
    assert calls == ([2, 2, 1] if isinstance(shape, DynamicTree) else [3, 3, 3])  # a level of every drafting row a call
    for b in range(3):
        alone = drafter.propose(state([b]), shape, depths[b] if isinstance(depths, list) else depths)[0]
        assert torch.equal(together[b].tokens, alone.tokens), f"row {b}"
        assert together[b].buffers.parents == alone.buffers.parents


@pytest.mark.parametrize("name", NAMES)
def test_training_forward_loss_and_ranked(name):
    """forward + loss train only the drafter's own weights; ranked matches forward's ranking."""
    model = _model(name)
    drafter = model.drafter
    ids = torch.randint(0, 128, (2, 12))
    features = _features(model, ids)
    with torch.no_grad():
        teacher = model.base_model(input_ids=ids).logits
    logits = drafter(features, ids)  # [K, B, T, V]
    assert logits.shape == (3, 2, 12, 128)
    loss, stats = drafter.loss(logits, teacher, torch.ones(3, 2, 12), ids)
    loss.backward()
    assert torch.isfinite(loss) and stats["count"].shape == (3,)
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.base_model.parameters())
    ranked = drafter.ranked(features[0], ids[0], topk=2)  # [K, T, 2]
    assert torch.equal(ranked, logits[:, 0].topk(2, dim=-1).indices)


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip_and_export(name, tmp_path, prompt):
    model = _model(name)
    model.save_pretrained(tmp_path)
    loaded = MedusaModel.from_pretrained(model.base_model, tmp_path)
    assert type(loaded.drafter) is DRAFTERS[name]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=12, do_sample=False),
                       model.base_model.generate(prompt, max_new_tokens=12, do_sample=False))
    state = loaded.drafter.state_dict()
    lm_head = model.base_model.get_output_embeddings().weight
    cls = DRAFTERS[name]
    if cls.vllm_refusal:
        with pytest.raises(ValueError, match=name):
            cls.export_vllm(loaded.config, state, lm_head, torch.float32)
    else:
        config, tensors = cls.export_vllm(loaded.config, state, lm_head, torch.float32)
        assert config["architectures"] and tensors


@pytest.mark.parametrize("name", [n for n in NAMES if issubclass(DRAFTERS[n], PathDrafter)])
def test_decoding_computes_what_training_scores_on_the_true_path(name):
    """Training's teacher-forced logits (step k at t) = decoding's logits at depth k along the true path from the
    state after position t: the training unroll and the decoding cache see the same inputs, positions, attention."""
    model = _model(name)
    drafter = model.drafter
    ids = model.base_model.generate(torch.tensor([[1, 7, 30, 12, 4]]), max_new_tokens=14, do_sample=False)[0]
    features = _features(model, ids[None])[0]  # [T, F]
    with torch.no_grad():
        trained = drafter(features[None], ids[None])[:, 0]  # [K, T, V']
    for t in range(2, ids.numel() - 4):
        state = drafter.start([ids[: t + 2]], features[None, : t + 1])  # accepted up to t, root = ids[t + 1]
        ctx = drafter.begin(state.hidden[0], state.ids[0], None if state.cache is None else state.cache[0])
        parents = [-1]
        with torch.no_grad():
            for k in range(drafter.config.num_heads):
                nodes = [k]  # the chain node of depth k holds the true token ids[t + 1 + k]
                logits = drafter.advance(ctx, k, torch.zeros(1, dtype=torch.long), ids[t + 1 + k: t + 2 + k], nodes,
                                         parents)
                parents.append(k)
                torch.testing.assert_close(logits[0], trained[k, t], atol=1e-4, rtol=1e-4)


def test_eagle3_positions_committed_by_root_alone_steps_are_read_in_when_it_next_drafts():
    """Commits of steps that drafted nothing stay pending and are read in together by the next draft (or every
    SETTLE_EVERY positions): the cache and the draft equal those of reading each step in at once."""
    from medusa_lite.drafters.eagle3 import SETTLE_EVERY

    model = _model("eagle3")
    drafter = model.drafter
    ids = model.base_model.generate(torch.tensor([[1, 7, 30, 12, 4]]), max_new_tokens=40, do_sample=False)[0]
    features = _features(model, ids[None])  # [1, T, F]
    buffers = build_buffers([[0], [1], [0, 0]])
    for steps in (3, SETTLE_EVERY + 5):  # read in at the draft; once on the way (the bound) and at the draft
        lazy = drafter.start([ids[:5]], features[:, :4])
        eager = drafter.start([ids[:5]], features[:, :4])
        for t in range(4, 4 + steps):  # root-alone steps: position t accepted, ids[t + 1] the new root
            for state in (lazy, eager):
                drafter.commit(state, [torch.tensor([0])], features[:, t: t + 1], [ids[: t + 2]])
            drafter.settle(eager.cache[0])
        assert lazy.cache[0].length == eager.cache[0].length == 4 + steps
        assert len(lazy.cache[0].pending) == steps % SETTLE_EVERY
        torch.testing.assert_close(drafter.settle(lazy.cache[0]).keys, eager.cache[0].keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lazy.cache[0].last, eager.cache[0].last, atol=1e-5, rtol=1e-5)
        assert torch.equal(drafter.propose(lazy, buffers, 8)[0].tokens, drafter.propose(eager, buffers, 8)[0].tokens)


def test_eagle3_export_has_exactly_the_names_shapes_and_dtypes_vllm_loads():
    """vLLM's llama_eagle3.py: midlayer.* (q/k/v read 2H), fc [H, 3H], norm, lm_head [V', H], d2t (long offsets:
    target id = i + d2t[i]), t2d (bool over the target vocabulary); config Eagle3LlamaForCausalLM."""
    model = _model("eagle3", draft_vocab_size=40)
    model.drafter.draft_ids.copy_(torch.arange(40) * 3)
    h, heads, kv, d, inter = 64, 4, 2, 16, 128
    config, tensors = DRAFTERS["eagle3"].export_vllm(model.config, model.drafter.state_dict(), None, torch.bfloat16)
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * d), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (40, h),
              "d2t": (40,), "t2d": (128,)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    assert torch.equal(tensors["d2t"] + torch.arange(40), torch.arange(40) * 3) and int(tensors["t2d"].sum()) == 40
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["target_hidden_size"] == h and config["vocab_size"] == 128
    assert config["eagle_aux_hidden_state_layer_ids"] == model.config.aux_layers
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == model.config.aux_layers


def test_eagle3_default_trees_grow_when_greedy_and_draw_a_static_tree_when_sampling():
    from medusa_lite.config import DEFAULT_TREE
    from medusa_lite.tree import parse_tree, truncate

    config = MedusaConfig.from_dict({"head_type": "eagle3", "num_heads": 5})
    grown = parse_tree(config.choices_for(), config.num_heads)
    assert grown == DynamicTree(nodes=16, depth=4, topk=4, expand=4, min_prob=0.1)
    assert config.choices_for(sample=True) == truncate(DEFAULT_TREE, 4)  # drafted tokens are sampled
    own = MedusaConfig.from_dict({"head_type": "eagle3", "num_heads": 3, "tree": [[0], [1]]})
    assert own.choices_for() == own.choices_for(sample=True) == [[0], [1]]


@pytest.mark.parametrize("layout", ["vllm", "specforge"])
@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_published_eagle3_checkpoints_load_and_decode_token_for_token(tmp_path, layout, draft_vocab):
    """A drafter in the layout vLLM / speculators (Eagle3LlamaForCausalLM) or SpecForge (LlamaForCausalLMEagle3, with a
    copy of the target's embeddings) publish loads with from_pretrained and decodes exactly as the drafter it was
    exported from; a config.json of something else is refused, naming what is read."""
    import json

    from safetensors.torch import save_file

    model = _model("eagle3", **({"draft_vocab_size": draft_vocab} if draft_vocab else {}))
    if draft_vocab:
        model.drafter.draft_ids.copy_(torch.arange(draft_vocab) * 3)
    config, tensors = DRAFTERS["eagle3"].export_vllm(model.config, model.drafter.state_dict(), None, torch.float32)
    if layout == "specforge":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        tensors["embed_tokens.weight"] = model.base_model.get_input_embeddings().weight.detach().clone()
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = MedusaModel.from_pretrained(model.base_model, tmp_path)
    assert loaded.config.head_type == "eagle3" and loaded.config.draft_vocab_size == draft_vocab
    theirs = loaded.drafter.state_dict()
    assert set(theirs) == set(model.drafter.state_dict())
    assert all(torch.equal(theirs[k], v) for k, v in model.drafter.state_dict().items())
    prompt = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    for tree in ([[0], [1], [0, 0], [0, 0, 0]], {"dynamic": {"nodes": 8, "depth": 3, "topk": 3, "expand": 2}}):
        ours = model.generate(prompt, max_new_tokens=20, do_sample=False, tree=tree)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=20, do_sample=False, tree=tree), ours)
        assert loaded.last_stats.acceptance_rate_per_depth() == model.last_stats.acceptance_rate_per_depth()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ValueError, match="not a drafter medusa_lite reads"):
        MedusaModel.from_pretrained(model.base_model, tmp_path)


@pytest.mark.parametrize("layout, config", [("vllm", {}), ("vllm", {"draft_vocab_size": 40}),
                                            ("vllm", {"share_lm_head": False}),
                                            ("fasterdecoding", {"share_lm_head": False})])
def test_published_medusa_heads_load_and_decode_token_for_token(tmp_path, layout, config):
    """Medusa heads in vLLM's layout (what export-vllm writes) or FasterDecoding's (``{h}.{l}.linear``, ``{h}.{L}``,
    ``medusa_num_heads``) load with from_pretrained: same weights, same decoding; pickled weights are refused."""
    import json

    from safetensors.torch import save_file

    model = _model("medusa", **config)
    if config.get("draft_vocab_size"):
        model.drafter.draft_ids.copy_(torch.arange(40) * 3)
    lm_head = model.base_model.get_output_embeddings().weight.detach()
    public, tensors = DRAFTERS["medusa"].export_vllm(model.config, model.drafter.state_dict(), lm_head, torch.float32)
    name = "model.safetensors"
    if layout == "fasterdecoding":
        public = {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}
        tensors = {k.replace("blocks.", "").replace(".layers.0.", ".0.linear."): v for k, v in tensors.items()}
        tensors = {(f"{k.split('.')[1]}.1.weight" if k.startswith("lm_heads.") else k): v for k, v in tensors.items()}
        name = "medusa_lm_head.safetensors"
    (tmp_path / "config.json").write_text(json.dumps(public))
    save_file(tensors, str(tmp_path / name))
    loaded = MedusaModel.from_pretrained(model.base_model, tmp_path)
    assert loaded.config.share_lm_head == model.config.share_lm_head
    assert all(torch.equal(loaded.drafter.state_dict()[k], v) for k, v in model.drafter.state_dict().items())
    prompt = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    tree = [[0], [1], [0, 0], [0, 0, 0]]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=20, do_sample=False, tree=tree),
                       model.generate(prompt, max_new_tokens=20, do_sample=False, tree=tree))
    (tmp_path / name).rename(tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="pickle"):
        MedusaModel.from_pretrained(model.base_model, tmp_path)
