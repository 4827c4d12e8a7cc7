"""A target larger than one device (``shard_target``): its decoder layers partitioned across ranks by DeepSpeed ZeRO-3,
each gathered only for its own forward. Two CPU ranks (gloo) on a tiny target: each holds about half of it, and the
training loss is the one-rank run's. Tiny random targets only, offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train_helpers import write_chat_jsonl, write_config, write_target

from medusa_lite.train import data as D
from medusa_lite.train.config import TrainConfig
from medusa_lite.train.features import compute_features
from medusa_lite.train.runtime import init_runtime
from medusa_lite.train.shard import ShardedTarget, held_parameters
from medusa_lite.train.train import build_model, main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    base = tmp_path_factory.mktemp("shard")
    return {"target": write_target(base / "target"), "data": write_chat_jsonl(base / "chat.jsonl")}


def test_shard_target_takes_no_adapter():
    with pytest.raises(ValueError, match="adapter"):
        TrainConfig(shard_target=True, adapter="lora")


def test_a_sharded_target_computes_the_whole_targets_features_and_keeps_no_layer_gathered(material, tmp_path):
    """One rank (its partition is the whole layer): the loading, the hooks and the lockstep pass, against the
    target loaded whole."""
    from medusa_lite.targets import load_target

    cfg = TrainConfig(target=str(material["target"]), data=str(material["data"]), precision="fp32", dtype="fp32",
                      shard_target=True, output_dir=str(tmp_path))
    rt = init_runtime(cfg)
    model, tok = build_model(cfg, rt)
    shard = ShardedTarget.of(model.base_model)
    assert shard is not None and len(shard.layers) == model.base_model.config.num_hidden_layers
    assert all(p.data.numel() == 0 for p in shard.layers.parameters())  # partitioned: only ds_tensor holds them
    embed, lm_head = model.base_model.get_input_embeddings().weight, model.base_model.get_output_embeddings().weight
    assert embed is lm_head and not hasattr(lm_head, "ds_tensor") and lm_head.numel() > 0  # whole, still tied
    whole, _ = load_target(material["target"])
    assert held_parameters(model.base_model)[1] == sum(p.numel() for p in whole.parameters())
    records, _ = D.read_records(material["data"])
    data = D.build_token_data(tok, records[:12], max_len=64)
    ours = compute_features(model.base_model, data, rt, (1, -1), tokens_per_batch=256, progress=False, lockstep=True)
    theirs = compute_features(whole, data, rt, (1, -1), tokens_per_batch=256, progress=False)
    assert torch.equal(ours, theirs)
    assert all(p.data.numel() == 0 for p in shard.layers.parameters())  # released after each forward
    assert shard.lead(lambda: 7) == 7


@pytest.mark.slow
@pytest.mark.parametrize("variant", [(), ("cache_features=false", "head_type=eagle3", "draft_vocab=40")],
                         ids=["feature-cache", "target-forward-each-step"])
def test_two_cpu_ranks_each_hold_about_half_of_the_target_and_train_to_the_one_rank_loss(material, tmp_path, variant):
    """Cached features (the target runs once, in lockstep), or the target's forward at every step and evaluation."""
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    cfg = write_config(tmp_path / "tiny.yaml", material["target"], material["data"], tmp_path / "two",
                       max_samples=None, eval_samples=8)
    command = [launcher, "--num_gpus", "2", "--master_port", str(29741 + len(variant)), "--module",
               "medusa_lite.train.train", "--config", str(cfg), "shard_target=true", *variant]
    proc = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    # one rank, the whole target, the same global batch (two micro steps of the same windows)
    one = main(["--config", str(cfg), "grad_accum=2", *variant, f"output_dir={tmp_path / 'one'}"])
    conf = json.loads((tmp_path / "two" / "heads" / "medusa_config.json").read_text())["training"]
    shard = conf["target_shard"]
    assert conf["world_size"] == 2 and shard["world"] == 2 and len(shard["fraction_per_rank"]) == 2
    assert all(0.45 <= f <= 0.55 for f in shard["fraction_per_rank"]), shard
    assert sum(shard["held_per_rank"]) < 1.1 * shard["parameters"]
    two_log = [json.loads(x) for x in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    one_log = [json.loads(x) for x in (tmp_path / "one" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in two_log] == [r["step"] for r in one_log] == [1, 2, 3, 4]
    assert [x for r in two_log for x in r["loss"]] == pytest.approx([x for r in one_log for x in r["loss"]], abs=1e-3)
    assert conf["eval"]["accept_length"] == pytest.approx(one["eval"]["accept_length"], abs=0.2)
