"""serve/bench.py end to end on a tiny random Llama + word-level chat tokenizer (no Hub ids, no timings asserted)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_chat import save_tiny_target


QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["write a short story about the sea", "now shorter"]},
    {"question_id": 161, "category": "translation", "turns": ["translate german to english : hallo welt"]},
    {"question_id": 321, "category": "qa", "turns": ["what is the answer"]},  # dropped by --limit/--tasks below
]


@pytest.fixture(scope="module")
def bench():
    import medusa_lite.serve.bench as bench

    return vars(bench)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    questions = tmp / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return save_tiny_target(tmp / "target"), questions, tmp


def test_bench_end_to_end_greedy(bench, setup):
    target, questions, tmp = setup
    out = tmp / "greedy"
    report = bench["main"](["--target", str(target), "--questions", str(questions), "--max-new-tokens", "20",
                            "--limit", "1", "--tasks", "mt_bench,translation", "--out", str(out), "--seed", "0", "--threads", "1"])
    for name in ("results.json", "results.md", "speedup.png", "acceptance.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    saved = json.loads((out / "results.json").read_text())
    assert set(saved["summary"]) == {"mt_bench", "translation", "overall"}
    assert saved["config"]["methods"] == ["plain", "pld", "medusa"]
    assert saved["config"]["turns"] == "first turn only"
    overall = saved["summary"]["overall"]
    assert overall["questions"] == 2
    for m in ("plain", "pld", "medusa"):
        s = overall[m]
        assert s["new_tokens"] == 40  # no EOS in the tiny model: every method generates 20 tokens per question
        assert s["tokens_per_second"] > 0 and s["wall_time"] > 0 and s["speedup"] > 0
    assert overall["plain"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert overall["medusa"]["mean_accepted_tokens"] >= 1.0
    acc = overall["medusa"]["acceptance_per_depth"]
    assert len(acc) == 4 and all(0 <= a <= 1 for a in acc) and acc == sorted(acc, reverse=True)
    # exactness: greedy medusa_lite and prompt lookup reproduce plain decoding
    assert overall["medusa"]["exact_match"] == 1.0 and overall["pld"]["exact_match"] == 1.0
    assert saved["mismatches"] == []
    assert [q["question_id"] for q in saved["questions"]] == [81, 161]
    md = (out / "results.md").read_text()
    assert "| overall | 2 |" in md and "medusa_lite speedup" in md and "acceptance per depth" in md
    assert report["summary"]["overall"]["medusa"]["speedup"] == overall["medusa"]["speedup"]


def test_bench_sampling_subset_of_methods(bench, setup):
    target, questions, tmp = setup
    out = tmp / "sample"
    bench["main"](["--target", str(target), "--questions", str(questions), "--max-new-tokens", "12",
                   "--limit", "1", "--tasks", "qa", "--temperature", "1.0", "--methods", "medusa", "--out", str(out), "--threads", "1"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["methods"] == ["plain", "medusa"]  # plain is always run: it is the reference
    assert saved["config"]["decoding"] == "sampling T=1.0"
    assert saved["mismatches"] is None and "exact_match" not in saved["summary"]["overall"]["medusa"]
    assert (out / "speedup.png").is_file()


@pytest.mark.parametrize("method,methods,label", [("loop", "medusa,loop", "no-tree loop"),
                                                   ("kernel", "kernel", "plain, skinny kernel")])
def test_bench_one_token_references(bench, setup, method, methods, label):
    """``loop`` (medusa_lite with no tree) and ``kernel`` (plain decoding with the target's linears through the
    skinny kernel: what the kernel alone gives) decode one token per forward, exactly as plain greedy does."""
    from medusa_lite.kernels import skinny_kernel

    if method == "kernel" and skinny_kernel() is None:
        pytest.skip("the skinny kernel does not build here")
    target, questions, tmp = setup
    out = tmp / method
    report = bench["main"](["--target", str(target), "--questions", str(questions), "--max-new-tokens", "10",
                            "--limit", "1", "--tasks", "qa", "--methods", methods, "--out", str(out),
                            "--threads", "1"])
    overall = report["summary"]["overall"]
    assert overall[method]["exact_match"] == 1.0 and overall[method]["mean_accepted_tokens"] == 1.0
    assert f"{label} speedup" in (out / "results.md").read_text()


def test_bench_tree_file_with_more_ranks_than_the_heads_tree(bench, setup):
    target, questions, tmp = setup
    tree = tmp / "tree.json"
    tree.write_text(json.dumps({"choices": [[0], [7], [0, 0], [0, 6]]}))  # ranks beyond the default tree's 0..3
    out = tmp / "tree"
    bench["main"](["--target", str(target), "--questions", str(questions), "--max-new-tokens", "10",
                   "--limit", "1", "--tasks", "translation", "--methods", "medusa", "--tree", str(tree),
                   "--out", str(out), "--threads", "1"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["tree"] == [[0], [7], [0, 0], [0, 6]] and saved["config"]["tree_nodes"] == 4
    assert saved["summary"]["overall"]["medusa"]["exact_match"] == 1.0


def test_bench_pairs_a_second_drafter_on_the_same_target(bench, setup):
    """--vs-heads: a second drafter on the same target, run beside medusa on every question, exact, and paired."""
    from medusa_lite import MedusaModel
    from medusa_lite.drafters import MedusaConfig
    from medusa_lite.targets import load_target

    target, questions, tmp = setup
    base, _ = load_target(str(target))
    torch.manual_seed(0)
    second = MedusaModel(base, MedusaConfig(num_heads=2, base_model=str(target)))
    for p in second.drafter.parameters():
        torch.nn.init.normal_(p, std=0.02)  # not zero heads: their proposals differ from the first drafter's
    second.save_pretrained(tmp / "second")
    out = tmp / "vs"
    report = bench["main"](["--target", str(target), "--questions", str(questions), "--max-new-tokens", "12",
                            "--limit", "1", "--tasks", "mt_bench,translation", "--methods", "medusa",
                            "--vs-heads", str(tmp / "second"), "--out", str(out), "--threads", "1"])
    assert list(report["config"]["methods"]) == ["plain", "medusa", "vs"]
    assert report["config"]["vs_heads"] == str(tmp / "second")
    overall = report["summary"]["overall"]
    assert overall["vs"]["exact_match"] == 1.0 and len(overall["vs"]["acceptance_per_depth"]) == 2
    paired = report["paired"]["all"]
    assert paired["questions"] == 2 and paired["diff"] == pytest.approx(paired["b"] - paired["a"])
    assert "B faster on" in (out / "results.md").read_text()
    with pytest.raises(ValueError, match="--vs-heads"):
        bench["main"](["--target", str(target), "--questions", str(questions), "--methods", "vs"])


def test_first_difference(bench):
    diff = bench["first_difference"]
    assert diff([1, 2, 3], [1, 2, 3]) is None
    assert diff([1, 2, 3], [1, 5, 3]) == 1
    assert diff([1, 2], [1, 2, 3]) == 2


def test_mismatch_reports_position_and_logit_gap(bench, setup):
    from medusa_lite.targets import load_target

    target, _ = load_target(setup[0])
    ids = torch.tensor([[1, 3, 10, 11, 4]])
    plain = target.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    wrong = plain[:3] + [(plain[3] + 1) % 10] + plain[4:]
    row = {"question_id": 7, "task": "qa", "methods": {"plain": {"tokens": plain}, "medusa": {"tokens": wrong},
                                                        "pld": {"tokens": list(plain)}}}
    found = bench["mismatches"](row, ["plain", "pld", "medusa"], target, ids)
    assert len(found) == 1 and found[0]["method"] == "medusa" and found[0]["first_difference"] == 3
    assert found[0]["logit_gap"] > 0  # plain's token is the target's argmax there


def test_cli_dispatches_every_command(capsys):
    from medusa_lite.cli import COMMANDS
    from medusa_lite.cli import main as cli

    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            cli([command, "--help"])
        assert exit_.value.code == 0
        assert f"medusa-lite {command}" in capsys.readouterr().out


def _report(speedups: dict[int, float], outputs: dict[int, list[int]]) -> dict:
    """A bench report whose question k has plain at 10 tok/s and medusa at 10 * speedups[k]."""
    return {"questions": [{"question_id": k, "task": "qa", "methods": {
        "plain": {"tokens_per_second": 10.0, "tokens": [1, 2, 3]},
        "medusa": {"tokens_per_second": 10.0 * s, "tokens": outputs.get(k, [1, 2, 3])}}} for k, s in speedups.items()]}


def test_compare_pairs_questions_and_splits_off_those_whose_outputs_differ():
    from medusa_lite.serve.compare import compare, markdown

    a = _report({1: 1.0, 2: 2.0, 3: 3.0, 4: 1.5}, {})
    b = _report({1: 1.5, 2: 2.5, 3: 3.5, 4: 0.5}, {4: [1, 2, 9]})  # question 4: B's text parted from A's
    result = compare(a, b, "medusa", resamples=2000, seed=0)
    every, same = result["all"], result["same_output"]
    assert every["questions"] == 4 and every["b_wins"] == 3
    assert every["diff"] == pytest.approx((0.5 + 0.5 + 0.5 - 1.0) / 4)
    assert every["ci95"][0] <= every["diff"] <= every["ci95"][1] and every["ci95"][0] < 0  # the loss on q4 shows
    assert same["questions"] == 3 and same["diff"] == pytest.approx(0.5) and same["ci95"] == [0.5, 0.5]
    assert "| same output in both | 3 |" in markdown(result, ("a", "b"))


def test_compare_main_reads_two_reports(tmp_path, capsys):
    from medusa_lite.serve.compare import main

    paths = []
    for name, s in (("a", 1.0), ("b", 1.25)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_report({1: s, 2: s}, {})))
        paths.append(str(path))
    result = main([*paths, "--resamples", "100"])
    assert result["all"]["diff"] == pytest.approx(0.25) and "B faster on" in capsys.readouterr().out
