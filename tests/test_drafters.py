"""The drafter contract, run over every registered drafter (as PEFT's tests run over its configs)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model

from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.drafters import DRAFTERS, Drafter, DraftState, drafter_class, register_drafter
from medusa_lite.tree import DynamicTree, build_buffers

NAMES = sorted(DRAFTERS)


def _model(name: str, **config) -> MedusaModel:
    return random_heads(MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=3, head_type=name, **config)), seed=3)


def test_registry_names_and_errors():
    assert {"medusa", "hydra"} <= set(NAMES)
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
    hidden = torch.randn(2, 6, 64)
    state = drafter.start(ids, hidden)
    assert torch.equal(state.hidden[1], hidden[1, 3])  # the last prompt position of row 1
    buffers = build_buffers([[0], [1], [0, 0]])
    drafts = drafter.propose(state, buffers, max_depth=8)
    assert len(drafts) == 2
    for draft, row in zip(drafts, ids):
        assert draft.tokens.shape == (4,) and int(draft.tokens[0]) == int(row[-1])  # the root first
    assert torch.equal(drafts[1].tokens, drafter.propose(DraftState.single(ids[1], hidden[1, 3]), buffers, 8)[0].tokens)
    verify_hidden = torch.randn(2, 4, 64)
    drafter.commit(state, [torch.tensor([0, 1]), torch.tensor([0])], verify_hidden,
                   [torch.tensor([5, 9, 17, 40, 41]), torch.tensor([3, 4, 8, 21, 30, 50])])
    assert torch.equal(state.hidden[0], verify_hidden[0, 1]) and torch.equal(state.hidden[1], verify_hidden[1, 0])
    if drafter.dynamic_trees:
        (grown,) = drafter.propose(DraftState.single(ids[0], hidden[0, 1]), DynamicTree(nodes=5, depth=3), 8)
        assert grown.buffers.num_nodes == 6
    else:
        with pytest.raises(ValueError, match="dynamic"):
            drafter.propose(DraftState.single(ids[0], hidden[0, 1]), DynamicTree(nodes=5, depth=3), 8)


@pytest.mark.parametrize("name", NAMES)
def test_training_forward_loss_and_ranked(name):
    """forward + loss train only the drafter's own weights; ranked matches forward's ranking."""
    model = _model(name)
    drafter = model.drafter
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        out = model.base_model(input_ids=ids, output_hidden_states=True)
    logits = drafter(out.hidden_states[-1], ids)  # [K, B, T, V]
    assert logits.shape == (3, 2, 12, 128)
    loss, stats = drafter.loss(logits, out.logits, torch.ones(3, 2, 12), ids)
    loss.backward()
    assert torch.isfinite(loss) and stats["count"].shape == (3,)
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.base_model.parameters())
    ranked = drafter.ranked(out.hidden_states[-1][0], ids[0], topk=2)  # [K, T, 2]
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
