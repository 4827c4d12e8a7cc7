"""Calibration: the pure math (accuracy counting, latency interpolation) and the CLI end to end: the acceptance table,
the fit on this machine and the fallback tree it stores."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_heads
from tiny_chat import save_tiny_target

from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.calibrate import topk_hits
from medusa_lite.fit import AcceptanceTable, interpolate_latency, monotone_latency
from medusa_lite.targets import load_target
from medusa_lite.tree import load_tree, tree_json


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


def _calibrate_setup(tmp_path, config: MedusaConfig, questions: dict[int, str], std: float | None = 0.3,
                     monkeypatch=None):
    """A saved tiny target, heads (random when ``std``) and Spec-Bench-style questions; returns
    (target_dir, heads_dir, run) where ``run(*args)`` calls ``medusa-lite calibrate`` on them (the fit's probe
    cached under ``tmp_path``)."""
    if monkeypatch is not None:
        monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path / "cache"))
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
                     "1", "--threads", "1", "--probe-budget", "2", *args])
    return target_dir, heads, run


def test_calibrate_writes_the_table_and_the_fits_own_tree_as_the_fallback(tmp_path, monkeypatch):
    """One path chooses trees: calibrate writes the acceptance table, fits this machine from it and stores the fit's
    tree as the heads' no-fit fallback; loading the heads on this machine fits the same tree from the table."""
    target_dir, heads, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=3), {160: "write a story",
                                                                                   400: "what is it"},
                                              monkeypatch=monkeypatch)
    report = run("--max-new-tokens", "16", "--topk", "3", "--sample-prompts", "1",
                 "--continuations", str(tmp_path / "cont.json"))
    saved = json.loads((heads / "calibration.json").read_text())
    assert saved["data"]["question_ids"] == [160, 400] and saved["fallback_tree"] == report["fallback_tree"]
    acc = saved["accuracy"]["accuracies"]
    assert len(acc) == 3 and all(len(row) == 3 and 0 <= sum(row) <= 1 + 1e-9 for row in acc)
    table = AcceptanceTable.load(heads)
    steps = [sum(c.steps[b] for c in table.greedy) for b in range(len(table.buckets))]
    busiest = saved["fit"]["buckets"][steps.index(max(steps))]
    assert report["fallback_tree"] == busiest["tree"]  # the fit's tree where the table measured most
    config = json.loads((heads / "medusa_config.json").read_text())
    assert config["tree"] == report["fallback_tree"] and "dtype_trees" not in config
    assert not (heads / "tree.json").exists()
    model = MedusaModel.from_pretrained(load_target(target_dir)[0], heads)
    assert tree_json(model.choices) == report["fallback_tree"]  # decoding without a fit
    fit = model.fit_hardware(progress=False)
    assert fit.cache_hit and fit.fallback_tree() == report["fallback_tree"]  # the same probe, the same choice
    # a second run reuses the cached continuations (they depend on the target only): same accuracies
    again = run("--max-new-tokens", "16", "--topk", "3", "--sample-temperature", "0", "--dry-run",
                "--continuations", str(tmp_path / "cont.json"))
    assert [row[:3] for row in again["accuracy"]["accuracies"]] == [row[:3] for row in acc]
    # --fallback-only: the table stays as it is, only the fit runs again
    before = (heads / "acceptance.json").read_bytes()
    only = run("--fallback-only")
    assert (heads / "acceptance.json").read_bytes() == before and "accuracy" not in only
    assert json.loads((heads / "medusa_config.json").read_text())["tree"] == only["fallback_tree"]


def test_calibrate_dry_run_leaves_heads_unchanged(tmp_path, monkeypatch):
    _, heads, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=2), {320: "summarize"}, std=None,
                                     monkeypatch=monkeypatch)
    before = {p.name: p.read_bytes() for p in heads.iterdir()}
    report = run("--max-new-tokens", "8", "--topk", "2", "--sample-prompts", "1", "--dry-run",
                 "--save-tree", str(tmp_path / "tree.json"))
    assert report["written"] is False
    assert tree_json(load_tree(tmp_path / "tree.json")) == report["fallback_tree"]
    assert {p.name: p.read_bytes() for p in heads.iterdir()} == before
    with pytest.raises(SystemExit, match="no acceptance table"):
        run("--fallback-only")


def test_the_shipped_calibration_prompts_are_not_the_benchmarks_questions():
    """calibrate's default prompts are the campaign's held-out ShareGPT prompts, seven kinds named by their rows, and
    share no text with Spec-Bench (the table must not be tuned to the benchmark); Spec-Bench rows still group by id."""
    from medusa_lite.specbench import CALIBRATION_PROMPTS, DEFAULT_QUESTIONS, TASKS, load_questions
    prompts = load_questions(CALIBRATION_PROMPTS)
    assert len(prompts) == 48
    assert {q.task for q in prompts} == {"chat", "multi", "summarize", "translate", "passage", "arithmetic", "code"}
    assert not {q.prompt for q in prompts} & {q.prompt for q in load_questions(DEFAULT_QUESTIONS)}
    assert [q.task for q in load_questions(CALIBRATION_PROMPTS, limit=1)] == [
        "code", "multi", "translate", "summarize", "chat", "arithmetic", "passage"]  # in order of first appearance
    assert [q.task for q in load_questions(DEFAULT_QUESTIONS, limit=1)] == list(TASKS)
    with pytest.raises(ValueError, match="unknown tasks"):
        load_questions(CALIBRATION_PROMPTS, tasks=["poetry"])


def test_configs_of_0_1_read_their_fp32_tree_as_the_fallback(tmp_path):
    """Heads saved by 0.1 carry per-dtype trees (``dtype_trees``) and ``tree.json``: their fp32 greedy tree (what the
    CPU decoded with) becomes the fallback, with no warning about the retired key."""
    import warnings

    legacy = {"num_heads": 2, "head_type": "hydra", "tree": None,
              "dtype_trees": {"float32": [[0], [1]], "bfloat16": [[0]], "float32:sample": []}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = MedusaConfig.from_dict(legacy, strict=False)
    assert config.tree == [[0], [1]] and not hasattr(config, "dtype_trees")
    assert MedusaConfig.from_dict({**legacy, "tree": [[0]]}).tree == [[0]]  # a stored tree wins


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


@pytest.mark.parametrize("head_type", ["hydra", "eagle3"])
def test_calibrate_acceptance_table_feeds_the_hardware_fit(tmp_path, monkeypatch, head_type):
    """Every candidate replayed (greedy; Hydra heads' dynamic trees among them) and run (sampling) per context
    bucket, written as the heads' acceptance table; loading the heads then fits the tree to this machine (probe
    cached). The replay moves the drafter's state (an eagle3 drafter's own cache) along the truth as decoding does."""
    target_dir, heads, run = _calibrate_setup(tmp_path, MedusaConfig(num_heads=2, head_type=head_type),
                                              {160: "write a story", 400: "what is it"}, monkeypatch=monkeypatch)
    run("--max-new-tokens", "12", "--topk", "3", "--sample-prompts", "1")
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


def test_replay_steps_where_greedy_decoding_steps():
    """The replay verifies where decoding would: each step where the last one's accepted tokens end, so its tokens
    per step are greedy decoding's own (a mean over every position counts a long accepted run once per position in
    it: a repetition the lookup branch copies scored about twice its decoding rate)."""
    from conftest import tiny_model

    from medusa_lite.calibrate import replay_acceptance
    from medusa_lite.tree import parse_tree

    model = random_heads(MedusaModel(tiny_model(vocab=16), MedusaConfig(num_heads=2)), std=0.3)
    tree = {"tree": [[0], [1]], "prompt_lookup": 6, "ngram": 2}
    prompt = torch.tensor([[1, 5, 3, 4, 1, 5, 3, 4]])
    out = model.generate(prompt, max_new_tokens=60, do_sample=False, tree=tree, fit=False)
    stats = model.last_stats
    decoded = sum(stats.tokens_per_step) / stats.verify_steps
    assert decoded > 1.5  # the tiny model repeats itself: long accepted runs, where the two rules differ
    replayed = replay_acceptance(model, [(out[0], prompt.shape[1])], parse_tree(tree, 2))
    assert abs(replayed["steps"] - stats.verify_steps) <= 1  # the last step may be cut by the continuation's end
    assert replayed["mean_tokens"] == pytest.approx(decoded, rel=0.1)


@pytest.mark.parametrize("head_type", ["medusa", "hydra", "eagle3"])
def test_replaying_many_trees_in_one_pass_scores_each_as_alone(head_type):
    """The calibration replays every candidate in one pass over the continuations, cutting static trees from one
    draft of their union: each tree's steps and accepted tokens are what replaying it alone gives (a node's token
    depends on its own path only), whatever else shares the pass: static trees, lookup branches, grown trees."""
    from conftest import tiny_model

    from medusa_lite.calibrate import replay_trees
    from medusa_lite.tree import parse_tree

    model = random_heads(MedusaModel(tiny_model(vocab=16), MedusaConfig(num_heads=3, head_type=head_type)), std=0.3)
    trees = [[[0], [1], [0, 0], [0, 0, 0]], [[1], [1, 0], [1, 1]], [[0], [0, 0]],
             {"tree": [[0], [1]], "prompt_lookup": 4, "ngram": 2}, {"tree": [], "prompt_lookup": 6}]
    if head_type != "medusa":
        trees.append({"tree": {"dynamic": {"nodes": 4, "depth": 2, "topk": 2, "expand": 2}}, "prompt_lookup": 3})
    trees = [parse_tree(t, 3) for t in trees]
    prompts = [torch.tensor([[1, 5, 3, 4, 1, 5, 3]]), torch.tensor([[7, 9, 3]])]
    sequences = [(model.generate(p, max_new_tokens=40, do_sample=False, fit=False)[0], p.shape[1]) for p in prompts]
    together = replay_trees(model, sequences, trees)
    for tree, shared in zip(trees, together):
        (alone,) = replay_trees(model, sequences, [tree])
        assert shared == alone, tree
    assert len({r["mean_tokens"] for r in together}) > 2  # the trees differ: a test that can fail
