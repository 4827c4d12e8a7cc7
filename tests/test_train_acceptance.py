"""The acceptance length while training: every evaluation decodes held-out prompts in the real verify loop (greedy,
fixed tree, no lookup, no fit), logs tokens per step beside top-1, and the run writes the best-by-acceptance heads.
Tiny random targets only, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import role_tokenizer, write_chat_jsonl, write_target

from medusa_lite.train.acceptance import BestHeads, held_out_prompts
from medusa_lite.train.config import TrainConfig
from medusa_lite.train.runtime import Runtime
from medusa_lite.train.train import main


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    base = tmp_path_factory.mktemp("accept")
    return {"target": write_target(base / "target"), "data": write_chat_jsonl(base / "chat.jsonl")}


def test_held_out_prompts_are_what_precedes_the_first_trained_token():
    tok = role_tokenizer()
    chat = {"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"},
                         {"role": "assistant", "content": "w4 w5"}, {"role": "user", "content": "w6"},
                         {"role": "assistant", "content": "w7"}], "text": "", "prompt_chars": 0}
    text = {"messages": [], "text": "w10 w11 w12 w13 w14", "prompt_chars": 8}     # a continuation of "w10 w11"
    plain = {"messages": [], "text": "w20 w21 w22 w23 w24 w25", "prompt_chars": 0}  # learnt in full
    prompts = held_out_prompts(tok, [chat, text, plain], count=3, max_len=64)
    expected = tok.apply_chat_template(chat["messages"][:2], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    assert prompts[0].tolist() == list(expected)
    assert tok.decode(prompts[1]).split()[-2:] == ["w10", "w11"]
    assert len(prompts[2]) == len(tok("w20 w21 w22 w23 w24 w25")["input_ids"]) // 2
    assert len(held_out_prompts(tok, [chat, text, plain], count=1, max_len=64)) == 1


class _Engine:
    """Engine stand-in: one process, nothing partitioned."""

    def gathered(self, modify: bool = False):
        import contextlib

        return contextlib.nullcontext()


def test_the_best_evaluation_by_acceptance_length_is_what_is_loaded_back(tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path))
    rt = Runtime(0, 1, torch.device("cpu"))
    model = torch.nn.Module()
    model.drafter = torch.nn.Linear(3, 2)
    best = BestHeads(cfg, rt)
    weights = {}
    for step, length in ((2, 1.5), (4, 1.7), (6, 1.6), (8, 1.7)):  # the later of equals wins
        with torch.no_grad():
            model.drafter.weight.fill_(step)
        weights[step] = model.drafter.weight.clone()
        best.offer(step, {"accept_length": length, "top1": [0.1 * step]}, model, _Engine())
    assert best.record["step"] == 8 and [p.name for p in (tmp_path / "best").iterdir()] == ["step8.safetensors"]
    resumed = BestHeads(cfg, rt)
    resumed.restore(best.state())  # what a checkpoint's client state carries
    assert resumed.load_into(model, _Engine())["step"] == 8
    assert torch.equal(model.drafter.weight, weights[8])
    assert [h["step"] for h in resumed.history] == [2, 4, 6, 8]
    unknown = BestHeads(cfg, rt)
    unknown.restore({"best": {"step": 4, "accept_length": 1.7, "metrics": {}}, "eval_history": []})
    assert unknown.load_into(model, _Engine()) is None  # step 4's file was replaced: the final heads stay


def test_every_evaluation_measures_acceptance_in_the_verify_loop_and_the_best_heads_are_written(
        material, tmp_path, capsys, monkeypatch):
    from medusa_lite import MedusaModel
    from medusa_lite import model as model_module
    from medusa_lite.targets import load_target
    from medusa_lite.train import data as D

    def no_fit(*args, **kwargs):
        raise AssertionError("training evaluation must not fit the tree to the machine")

    monkeypatch.setattr(model_module, "fit_machine", no_fit)
    out = main([f"target={material['target']}", f"data={material['data']}", "precision=fp32", "seq_len=32",
                "max_steps=4", "save_every=2", "log_every=1", "lr=1e-2", "warmup_steps=1", "eval_samples=6",
                "accept_prompts=3", "accept_tokens=12", "progress=false", f"output_dir={tmp_path}"])
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    measured = {r["step"]: r["eval"]["accept_length"] for r in log if "eval" in r}
    assert sorted(measured) == [2, 4] and all(1.0 <= v <= 5.0 for v in measured.values())
    ev = out["eval"]
    best_step = max(sorted(measured), key=lambda s: (measured[s], s))
    assert ev["heads_step"] == best_step and ev["accept_length"] == measured[best_step]
    assert ev["accept_prompts"] == 3 and ev["accept_dtype"] == "torch.float32"
    assert json.loads((tmp_path / "accept_tree.json").read_text()) == ev["accept_tree"]  # for bench --tree
    stdout = capsys.readouterr().out
    assert "eval at step 2: accept_length" in stdout and "the heads written are" in stdout
    card = (Path(out["heads_dir"]) / "README.md").read_text()
    assert "tokens per verify step" in card and f"step {best_step}'s" in card
    # the saved heads, loaded as a user loads them, decode the same prompts at the same tokens per step
    target, tok = load_target(material["target"])
    model = MedusaModel.from_pretrained(target, out["heads_dir"])
    records, _ = D.read_records(material["data"])
    tokens = steps = 0
    for prompt in held_out_prompts(tok, records[:6], 3, 1024):
        model.generate(prompt[None], max_new_tokens=12, do_sample=False, tree=ev["accept_tree"], fit=False)
        tokens, steps = tokens + sum(model.last_stats.tokens_per_step), steps + model.last_stats.verify_steps
    assert tokens / steps == pytest.approx(ev["accept_length"], abs=1e-3)
    best = load_file(str(tmp_path / "best" / f"step{best_step}.safetensors"))
    saved = load_file(str(Path(out["heads_dir"]) / "heads.safetensors"))
    assert all(torch.equal(saved[k], best[k]) for k in saved)
