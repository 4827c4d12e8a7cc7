"""Heads format: round trip, only heads files written, mismatched targets refused, no pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import random_heads, tiny_model
from safetensors.torch import load_file

from medusa_lite import HeadsMismatchError, MedusaConfig, MedusaModel
from medusa_lite.config import CONFIG_NAME, WEIGHTS_NAME


def _trained(model: MedusaModel) -> MedusaModel:
    random_heads(model, std=0.1, seed=0)
    return model


@pytest.mark.parametrize("share", [True, False])
def test_round_trip(tmp_path, share):
    target = tiny_model("llama")
    tree = [[0], [1], [0, 0]]
    model = _trained(MedusaModel(target, MedusaConfig(num_heads=3, num_layers=2, share_lm_head=share, tree=tree)))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    saved = load_file(str(tmp_path / WEIGHTS_NAME))
    assert not any("base_model" in k or "embed" in k for k in saved)
    assert any("lm_heads" in k for k in saved) == (not share)
    loaded = MedusaModel.from_pretrained(tiny_model("llama"), tmp_path)
    for (k, a), (k2, b) in zip(model.drafter.state_dict().items(), loaded.drafter.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert loaded.config.choices == tree
    assert loaded.config.num_layers == 2 and loaded.config.share_lm_head == share
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(ids, max_new_tokens=8), loaded.generate(ids, max_new_tokens=8))


def test_round_trip_hydra_with_draft_vocab(tmp_path):
    target = tiny_model("llama")
    model = _trained(MedusaModel(target, MedusaConfig(num_heads=3, head_type="hydra", draft_vocab_size=50)))
    model.drafter.draft_ids.copy_(torch.arange(50) * 2)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / WEIGHTS_NAME))
    assert torch.equal(saved["draft_ids"], torch.arange(50) * 2) and "fuse.2.weight" in saved
    loaded = MedusaModel.from_pretrained(tiny_model("llama"), tmp_path)
    assert loaded.config.head_type == "hydra" and torch.equal(loaded.drafter.draft_ids, model.drafter.draft_ids)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(ids, max_new_tokens=8), loaded.generate(ids, max_new_tokens=8))
    # proposals come from the draft vocabulary only
    from medusa_lite.tree import build_buffers

    tokens = loaded.drafter.draft_row(torch.randn(64), torch.tensor([3]), build_buffers(loaded.config.choices), 64).tokens
    assert all(t % 2 == 0 for t in tokens[1:].tolist())
    with pytest.raises(ValueError, match="head_type"):
        MedusaConfig(head_type="eagle")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        MedusaConfig(draft_vocab_size=10, share_lm_head=False)


def test_repeated_blocks_are_distinct_modules():
    model = MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=3, num_layers=2))
    blocks = [b for head in model.drafter.blocks for b in head]
    assert len({id(b) for b in blocks}) == 6


def test_fresh_heads_reproduce_base_prediction():
    target = tiny_model("llama")
    model = MedusaModel(target, MedusaConfig(num_heads=2))
    ids = torch.tensor([[5, 6, 7]])
    out, head_logits = model(ids)
    for k in range(2):
        assert torch.allclose(head_logits[k], out.logits, atol=1e-6)


def test_mismatched_target_shape(tmp_path):
    MedusaModel(tiny_model("llama", vocab=128), MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(HeadsMismatchError, match="trained for a target"):
        MedusaModel.from_pretrained(tiny_model("llama", vocab=96), tmp_path)
    with pytest.raises(HeadsMismatchError):
        MedusaModel.from_pretrained(tiny_model("qwen2"), tmp_path)


def test_mismatched_target_weights(tmp_path):
    MedusaModel(tiny_model("llama", seed=0), MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(HeadsMismatchError, match="lm_head"):
        MedusaModel.from_pretrained(tiny_model("llama", seed=1), tmp_path)


def test_same_target_other_dtype_loads(tmp_path):
    MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    model = MedusaModel.from_pretrained(tiny_model("llama", dtype=torch.bfloat16), tmp_path)
    assert next(model.drafter.parameters()).dtype == torch.bfloat16


def test_malformed_configs(tmp_path):
    with pytest.raises(FileNotFoundError, match="medusa_config.json"):
        MedusaModel.from_pretrained(tiny_model("llama"), tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        MedusaConfig.load(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"num_heads": 0}))
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig.load(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"num_heads": 2, "tree": [[0], [0, 0, 0]]}))
    with pytest.raises(ValueError, match="no parent"):
        MedusaConfig.load(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"num_heads": 2, "future_key": 1}))
    with pytest.warns(UserWarning, match="future_key"):
        MedusaConfig.load(tmp_path)
    with pytest.raises(ValueError, match="unknown MedusaConfig keys"):
        MedusaConfig.from_dict({"num_heads": 2, "nmu_layers": 1})


def test_no_pickle_is_loaded(tmp_path, monkeypatch):
    MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=2)).save_pretrained(tmp_path)

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load (pickle) must never be used")

    monkeypatch.setattr(torch, "load", forbidden)
    MedusaModel.from_pretrained(tiny_model("llama"), tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    (tmp_path / "heads.pt").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match="heads.safetensors"):
        MedusaModel.from_pretrained(tiny_model("llama"), tmp_path)


def test_from_pretrained_takes_a_hub_repo_id_from_the_offline_cache(tmp_path, monkeypatch):
    """A Hub repo id resolves through huggingface_hub's cache (HF_HUB_OFFLINE: the cache only), as PEFT's does;
    push_to_hub uploads exactly what save_pretrained writes."""
    import huggingface_hub
    from huggingface_hub import constants

    target = tiny_model("llama")
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=2)), std=0.2)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-heads"
    model.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = MedusaModel.from_pretrained(target, "someone/tiny-heads")
    assert loaded.heads_dir == repo / "snapshots" / commit
    assert all(torch.equal(loaded.drafter.state_dict()[k], v) for k, v in model.drafter.state_dict().items())
    with pytest.raises(FileNotFoundError, match="Hub repo someone/not-cached at revision main could not be read"):
        MedusaModel.from_pretrained(target, "someone/not-cached")
    with pytest.raises(FileNotFoundError, match="no such heads directory"):
        MedusaModel.from_pretrained(target, str(tmp_path / "missing" / "deeper" / "dir"))
    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            uploaded["repo"] = repo_id

        def upload_folder(self, repo_id, folder_path, commit_message):
            uploaded["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            return f"https://huggingface.co/{repo_id}/commit/x"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert model.push_to_hub("someone/tiny-heads").endswith("/commit/x")
    assert uploaded == {"repo": "someone/tiny-heads", "files": sorted(p.name for p in (repo / "snapshots" / commit).iterdir())}


def test_a_bundled_drafter_is_named_by_its_folder(tmp_path, monkeypatch):
    """``--heads NAME`` loads a drafter shipped with the package (the default first in the list); a local directory of
    that name wins; an unknown bare name is refused with the bundled names."""
    from medusa_lite import heads_io, paths

    target = tiny_model("llama")
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=2)), std=0.2)
    root = tmp_path / "pretrained"
    for name in ("smollm2-135m-instruct", "smollm2-135m-instruct-hydra"):
        model.save_pretrained(root / name)
    monkeypatch.setattr(paths, "PRETRAINED_ROOT", root)
    monkeypatch.setattr(paths, "PRETRAINED_DIR", root / "smollm2-135m-instruct")
    monkeypatch.setattr(heads_io, "PRETRAINED_ROOT", root)
    assert paths.bundled_heads() == ["smollm2-135m-instruct", "smollm2-135m-instruct-hydra"]
    loaded = MedusaModel.from_pretrained(target, "smollm2-135m-instruct-hydra")
    assert loaded.heads_dir == root / "smollm2-135m-instruct-hydra"
    monkeypatch.chdir(tmp_path)
    model.save_pretrained(tmp_path / "smollm2-135m-instruct-hydra")
    assert heads_io.resolve_heads_dir("smollm2-135m-instruct-hydra") == Path("smollm2-135m-instruct-hydra")
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct-hydra"):
        heads_io.resolve_heads_dir("no-such-drafter")
