"""Calibration: the pure math (accuracy counting, latency interpolation, tree choice) and the CLI end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_heads
from tiny_chat import save_tiny_target

from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.calibrate import choose_tree, measure_forward_latency, score_trees, topk_hits
from medusa_lite.fit import interpolate_latency, monotone_latency
from medusa_lite.targets import load_target
from medusa_lite.tree import expected_length, grow_tree, load_tree, tree_json

ACC = [[0.6, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1], [0.2, 0.05]]


def test_topk_hits_counts_head_k_against_target_choice_k_plus_1_ahead():
    vocab, length = 8, 6
    choice = torch.tensor([3, 1, 4, 1, 5, 2])  # target's token at positions 0..5 (for 1..6)
    logits = torch.zeros(2, length, vocab)
    for t in range(length):
        if t + 1 < length:
            logits[0, t, choice[t + 1]] = 2.0  # head 0 always right at rank 0
        logits[1, t, (t % vocab)] = 2.0        # head 1 rank 0: token t
        if t + 2 < length:
            logits[1, t, choice[t + 2]] = 1.0  # ... and the right answer at rank 1 (unless it is token t)
    hits, totals = topk_hits(logits.topk(2, dim=-1).indices, choice)
    assert totals.tolist() == [5, 4]
    assert hits[0].tolist() == [5, 0]
    # head 1, t = 0..3 answers choice[2..5] = 4, 1, 5, 2; rank-0 tokens 0, 1, 2, 3 -> rank 0 right at t=1 only
    assert hits[1].tolist() == [1, 3]


def test_interpolate_latency():
    table = {1: 1.0, 4: 1.0, 8: 3.0}
    assert interpolate_latency(table, 1) == 1.0
    assert interpolate_latency(table, 2) == 1.0
    assert interpolate_latency(table, 6) == pytest.approx(2.0)
    assert interpolate_latency(table, 12) == pytest.approx(5.0)  # slope of the last segment
    assert interpolate_latency({1: 2.0}, 9) == 2.0


def test_monotone_latency_removes_noise_dips():
    assert monotone_latency({1: 70.0, 2: 118.0, 4: 110.0, 8: 135.0}) == {1: 70.0, 2: 110.0, 4: 110.0, 8: 135.0}


def test_choose_tree_flat_then_steep_latency_picks_largest_cheap_tree():
    latency = {1: 1.0, 16: 1.0, 32: 4.0, 64: 12.0}
    best, cands = choose_tree(ACC, latency, sizes=[1, 2, 4, 8, 15, 31, 63])
    assert best.size == 15  # 16 tokens cost one forward: the biggest tree in the flat region wins
    assert best.choices == grow_tree(ACC, 15)
    assert best.expected_length == pytest.approx(expected_length(best.choices, ACC))
    assert best.tokens_per_second == max(c.tokens_per_second for c in cands)


def test_choose_tree_linear_latency_picks_small_tree_and_overhead_favours_bigger():
    latency = {1: 1.0, 64: 64.0}  # every token costs a full forward: speculation barely pays
    best, _ = choose_tree(ACC, latency, sizes=[1, 2, 4, 8])
    assert best.size == 1
    best_oh, cands = choose_tree(ACC, latency, sizes=[1, 2, 4, 8], overhead=20.0)
    assert best_oh.size > 1  # a large fixed per-step cost makes extra nodes relatively cheap
    brute = max(cands, key=lambda c: c.expected_length / (interpolate_latency(latency, c.size + 1) + 20.0))
    assert best_oh.size == brute.size


def test_score_trees_drops_sizes_beyond_the_accuracies():
    cands = score_trees([[0.5, 0.2]], {1: 1.0, 8: 1.0}, sizes=[1, 2, 5])
    assert [c.size for c in cands] == [1, 2]


def test_measure_forward_latency_restores_cache(tmp_path):
    target, _ = load_target(save_tiny_target(tmp_path / "t"))
    table = measure_forward_latency(target, tokens=[1, 4], cache_len=16, repeats=1)
    assert set(table) == {1, 4} and all(v["median"] > 0 for v in table.values())


def _calibrate_setup(tmp_path, config: MedusaConfig, questions: dict[int, str], std: float | None = 0.3):
    """A saved tiny target, heads (random when ``std``) and Spec-Bench-style questions; returns
    (target_dir, heads_dir, run) where ``run(*args)`` calls ``medusa-lite calibrate`` on them."""
    target_dir = save_tiny_target(tmp_path / "target")
    model = MedusaModel(load_target(target_dir)[0], config)
    if std is not None:
        random_heads(model, std=std, seed=0)
    heads = tmp_path / "heads"
    model.save_pretrained(heads)
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "turns": [text]}) + "\n" for i, text in questions.items()))
    from medusa_lite.serve.calibrate import main

    def run(*args):
        return main(["--heads", str(heads), "--target", str(target_dir), "--questions", str(path), "--per-task",
                            "1", "--cache-len", "16", "--repeats", "1", "--threads", "1", *args])
    return target_dir, heads, run


def test_calibrate_cli_writes_tree_that_loads(tmp_path):
    target_dir, heads, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=3),
                                              {160: "write a story", 400: "what is it"})
    report = run("--max-new-tokens", "16", "--topk", "3", "--sizes", "1,2,4,8", "--latency-tokens", "1,2,4,8",
                 "--cache-len", "32", "--lookup", "", "--continuations", str(tmp_path / "cont.json"))
    saved = json.loads((heads / "calibration.json").read_text())
    assert saved["data"]["question_ids"] == [160, 400]
    acc = saved["accuracy"]["accuracies"]
    assert len(acc) == 3 and all(len(row) == 3 and 0 <= sum(row) <= 1 + 1e-9 for row in acc)
    assert all(c["kind"] == "static" and c["tokens_per_step"] >= 1 for c in saved["candidates"])  # replayed
    assert set(saved["latency"]) >= {"1", "2", "4", "8", "9"}  # 8 nodes + root measured too
    assert saved["best"]["choices"] == report["best"]["choices"]
    best = saved["best"]["choices"]
    assert best == grow_tree(acc, saved["best"]["size"])
    assert json.loads((heads / "tree.json").read_text())["choices"] == best
    reloaded = MedusaModel.from_pretrained(load_target(target_dir)[0], heads)
    assert reloaded.config.choices == best  # used by default from now on
    # a second run reuses the cached continuations (they depend on the target only): same accuracies
    again = run("--max-new-tokens", "16", "--topk", "3", "--sizes", "1,2", "--latency-tokens", "1,3", "--dry-run",
                "--continuations", str(tmp_path / "cont.json"))
    assert [row[:3] for row in again["accuracy"]["accuracies"]] == [row[:3] for row in acc]
    # a bf16 calibration adds the bf16 tree; fp32 keeps its own (sizes 1,2 cannot give the 8-node fp32 tree)
    run("--dtype", "bf16", "--max-new-tokens", "16", "--topk", "3", "--sizes", "1,2", "--latency-tokens", "1,3",
        "--lookup", "")  # (a lookup branch could win on timing: not what this checks)
    config = json.loads((heads / "medusa_config.json").read_text())
    assert set(config["dtype_trees"]) == {"float32", "bfloat16"} and config["dtype_trees"]["float32"] == best
    assert len(config["dtype_trees"]["bfloat16"]) <= 2 and (heads / "calibration-bf16.json").is_file()
    assert MedusaModel.from_pretrained(load_target(target_dir, dtype="bf16")[0], heads).choices == \
        config["dtype_trees"]["bfloat16"]
    assert MedusaModel.from_pretrained(load_target(target_dir)[0], heads).choices == best
    assert set(json.loads((heads / "tree.json").read_text())["calibration"]) == {"float32", "bfloat16"}


def test_calibrate_dry_run_leaves_heads_unchanged(tmp_path):
    _, heads, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=2), {320: "summarize"}, std=None)
    before = {p.name: p.read_bytes() for p in heads.iterdir()}
    report = run("--max-new-tokens", "8", "--topk", "2", "--sizes", "1,2", "--latency-tokens", "1,3", "--dry-run",
                 "--save-tree", str(tmp_path / "tree.json"))
    assert report["written"] is False
    assert tree_json(load_tree(tmp_path / "tree.json")) == report["best"]["choices"]  # static, or with a lookup branch
    assert {p.name: p.read_bytes() for p in heads.iterdir()} == before


def test_measure_head_accuracy_matches_batched_heads(tmp_path):
    from medusa_lite.calibrate import accuracies_from_counts, measure_head_accuracy

    target, _ = load_target(save_tiny_target(tmp_path / "t"))
    model = MedusaModel(target, MedusaConfig(num_heads=3))
    random_heads(model, std=0.3, seed=1)
    prompt = torch.tensor([1, 3, 10, 12, 4])
    ids = target.generate(prompt[None], max_new_tokens=12, do_sample=False)[0]
    got = measure_head_accuracy(model, [(ids, prompt.numel())], topk=3)
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True)
        hidden = out.hidden_states[-1][:, prompt.numel() - 1:]
        ranked = model.drafter(hidden, ids[None, prompt.numel() - 1:])[:, 0].topk(3, dim=-1).indices
        hits, totals = topk_hits(ranked, out.logits[0, prompt.numel() - 1:].argmax(-1))
    assert got["accuracies"] == accuracies_from_counts(hits, totals)
    assert got["totals"] == [12, 11, 10]  # T = 13 scored positions; head k needs k + 1 more


def test_hydra_ranked_proposals_match_what_decoding_drafts_on_the_true_path(tmp_path):
    """Calibration's teacher-forced Hydra accuracy reads the same proposals decoding drafts when the path is right."""
    from medusa_lite.tree import build_buffers

    target, _ = load_target(save_tiny_target(tmp_path / "t"))
    model = MedusaModel(target, MedusaConfig(num_heads=2, head_type="hydra"))
    random_heads(model, std=0.3, seed=2)
    ids = target.generate(torch.tensor([[1, 3, 10, 12, 4]]), max_new_tokens=10, do_sample=False)[0]
    with torch.no_grad():
        hidden = target(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]
    ranked = model.drafter.ranked(hidden, ids, topk=3)  # [2, T, 3]
    wide = build_buffers([[0], [1], [2]])
    for t in range(4, ids.numel() - 2):
        drafted = model.drafter.draft_row(hidden[t], ids[: t + 2], wide, 64).tokens  # root = the true token at t + 1
        assert drafted[1:].tolist() == ranked[0, t].tolist()
        path = build_buffers([[0], [0, 0]])  # depth 2 after the rank-0 token
        second = model.drafter.draft_row(hidden[t], ids[: t + 2], path, 64).tokens
        if second[1] == ids[t + 2]:  # head 0 was right: head 1 read the true token
            assert second[2] == ranked[1, t, 0]


def test_calibrate_hydra_replays_dynamic_trees(tmp_path):
    """Hydra heads: dynamic trees are candidates, scored by replaying them on the target's continuations."""
    from medusa_lite.tree import DynamicTree, load_tree

    _, _, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=2, head_type="hydra"), {160: "write a story"})
    report = run("--max-new-tokens", "16", "--topk", "3", "--sizes", "1,4", "--latency-tokens", "1,5", "--stride", "1",
                 "--dry-run", "--save-tree", str(tmp_path / "best.json"))
    kinds = [(c["kind"], c["size"]) for c in report["candidates"]]
    assert ("dynamic", 4) in kinds and ("static", 1) in kinds
    assert {"static+lookup", "dynamic+lookup"} <= {kind for kind, _ in kinds}
    assert all(1 <= c["tokens_per_step"] <= 3 and c["draft_ms"] > 0 for c in report["candidates"])
    tree = load_tree(tmp_path / "best.json")
    assert (isinstance(tree, DynamicTree)) == (report["best"]["kind"] == "dynamic")


def test_calibrate_sampling_tree_is_stored_next_to_the_greedy_one(tmp_path):
    """``--temperature``: candidate trees are run with sampling; the winner becomes the dtype's sampling tree,
    which sampled ``generate`` uses while greedy keeps its own."""
    target_dir, heads, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=2, head_type="hydra", tree=[[0]]),
                                              {160: "write a story", 400: "what is it"})
    report = run("--temperature", "1.0", "--max-new-tokens", "12", "--topk", "3", "--latency-tokens", "1,3",
                 "--sample-sizes", "2,4", "--sample-lookup", "0,3")
    assert report["decoding"] == "sampling T=1.0" and (heads / "calibration-sampling.json").is_file()
    kinds = [(c["kind"], c["size"]) for c in report["candidates"]]
    assert kinds == [("current", 1), ("none", 0), ("static", 2), ("static+lookup", 5), ("static", 4),
                     ("static+lookup", 7)]
    assert all(1 <= c["tokens_per_step"] <= 4 and c["tokens_per_second"] > 0 for c in report["candidates"])  # depth <= 3
    config = json.loads((heads / "medusa_config.json").read_text())
    assert config["tree"] == [[0]] and config["dtype_trees"] == {"float32:sample": report["best"]["choices"]}
    model = MedusaModel.from_pretrained(load_target(target_dir)[0], heads)
    assert model.choices == [[0]] and tree_json(model.tree_for(sample=True)) == report["best"]["choices"]
    assert tree_json(MedusaModel.from_pretrained(load_target(target_dir, dtype="bf16")[0], heads).tree_for(True)) == [[0]]


@pytest.mark.parametrize("head_type", ["hydra", "eagle3"])
def test_calibrate_acceptance_table_feeds_the_hardware_fit(tmp_path, monkeypatch, head_type):
    """``--acceptance``: every candidate replayed (greedy) and run (sampling) per context bucket, written as the
    heads' acceptance table; loading the heads then fits the tree to this machine (probe cached). The replay
    moves the drafter's state (an eagle3 drafter's own cache) along the truth as decoding does."""
    from medusa_lite.fit import AcceptanceTable

    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path / "cache"))
    target_dir, heads, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=2, head_type=head_type),
                                              {160: "write a story", 400: "what is it"})
    run("--acceptance", "--max-new-tokens", "12", "--topk", "3", "--sample-prompts", "1")
    table = AcceptanceTable.load(heads)
    assert table.buckets == [0, 256, 1024] and table.sample_temperature == 1.0
    trees = [c.tree for c in table.greedy]
    assert {"dynamic": {"nodes": 4, "depth": 2, "topk": 4, "expand": 4}} in trees
    assert {"tree": [], "prompt_lookup": 8, "ngram": 3} in trees
    assert all(c.steps[0] > 0 and c.steps[1:] == [0, 0] for c in table.greedy)  # short prompts: bucket 0 only
    assert all(1 <= c.tokens_per_step[0] <= 3 for c in table.greedy + table.sample)  # depth <= 2
    assert table.data["sampled_prompts"] == 1 and len(table.data["question_ids"]) == 2
    model = MedusaModel.from_pretrained(load_target(target_dir)[0], heads)
    fit = model.fit_hardware(progress=False)
    assert len(fit.ladders) == 3 and all(ladder[-1].tree == [] for ladder in fit.ladders)
    prompt = torch.tensor([[1, 5, 3, 4]])  # no pad token (2): plain generate would mask it out
    out = model.generate(prompt, max_new_tokens=8)
    assert out.shape[1] == 12 and model.last_stats.fitted is not None
    assert torch.equal(out, model.base_model.generate(prompt, max_new_tokens=8, do_sample=False))
