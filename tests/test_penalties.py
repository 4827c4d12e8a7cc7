"""Penalties on the prefix (transformers' repetition_penalty, OpenAI's presence / frequency penalties) applied at every
tree node from that node's own prefix: greedy output equals plain decoding with the same penalties token for token,
sampled output has the penalized target's distribution (Monte Carlo), and a rule that forgets the path fails."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from conftest import oracle_draft, random_heads, tiny_model
from test_sampling import NEW, PROMPT, VOCAB, make_model, sample_counts, tv_bound, tv_distance

import medusa_lite.decode.sequence as seq_mod
from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.sampling import Penalties, build_warpers, penalized_logits, target_probs, token_bias
from medusa_lite.tree import build_buffers

TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]
OPENAI = {"presence_penalty": 1.0, "frequency_penalty": 1.5}


def penalize_by_hand(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float = 1.0,
                     presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """One position's logits [V] after the penalties of its prefix, token by token (the reference)."""
    scores = logits.float().clone()
    for tok in set(prompt) | set(output):
        s = float(scores[tok])
        scores[tok] = s * repetition if s < 0 else s / repetition
    for tok, count in Counter(output).items():
        scores[tok] -= frequency * count
        scores[tok] -= presence
    return scores


def plain_penalized(target, prompt: torch.Tensor, new: int, **penalties) -> list[int]:
    """Plain greedy decoding with the penalties applied by hand, one full forward per token."""
    ids = prompt[0].tolist()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new):
            logits = target(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(penalize_by_hand(logits, ids, out, **penalties).argmax()))
    return out


def test_penalized_logits_use_each_nodes_path():
    """A tree's nodes: each penalized from the prompt, the output so far and its own path (not its siblings')."""
    vocab, gen = 11, torch.Generator().manual_seed(0)
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    buffers = build_buffers(choices)
    tokens = torch.tensor([3, 4, 5, 4, 3, 4])  # root 3 (already output), children repeat tokens of their paths
    logits = torch.randn(len(tokens), vocab, generator=gen) * 3
    prompt, output = [1, 2, 4], [7, 3]  # the root is the output's last token
    pen = Penalties(1.3, 0.7, 0.4)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt] = True
    counts = torch.bincount(torch.tensor(output), minlength=vocab).float()
    got = penalized_logits(logits, pen, seen, counts, tokens, buffers.ancestor_mask)
    for node in range(len(tokens)):
        path = [int(tokens[j]) for j in range(1, len(tokens)) if buffers.ancestor_mask[node, j]]
        want = penalize_by_hand(logits[node], prompt, output + path, 1.3, 0.7, 0.4)
        torch.testing.assert_close(got[node], want)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("heads", ["random", "oracle"])
def test_greedy_repetition_penalty_equals_transformers(arch, heads, prompt):
    target = tiny_model(arch)
    ref = target.generate(prompt, max_new_tokens=40, do_sample=False, repetition_penalty=1.4)
    assert not torch.equal(ref, target.generate(prompt, max_new_tokens=40, do_sample=False))  # the penalty matters
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE))
    if heads == "random":
        random_heads(model, std=0.5)
    else:
        model.drafter.draft = oracle_draft(ref[0], 4, model._topk, 128)
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, repetition_penalty=1.4)
    assert torch.equal(out, ref)
    if heads == "oracle":
        assert model.last_stats.mean_accepted_tokens > 3.0  # deep nodes were judged by their own prefixes


@pytest.mark.parametrize("tree", [TREE, {"tree": TREE, "prompt_lookup": 6, "ngram": 1}], ids=["tree", "lookup"])
def test_greedy_openai_penalties_equal_plain(tree, prompt):
    target = tiny_model("llama")
    ref = plain_penalized(target, prompt, 30, presence=1.0, frequency=1.5)
    assert ref != plain_penalized(target, prompt, 30)
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=tree))
    model.drafter.draft = oracle_draft(torch.cat([prompt[0], torch.tensor(ref)]), 4, model._topk, 128)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, **OPENAI)
    assert out[0, prompt.shape[1]:].tolist() == ref
    assert model.last_stats.mean_accepted_tokens > 2.5


def test_batched_rows_keep_their_own_penalties():
    """Rows of one batch, each penalized by its own prompt and output: each equals its batch-1 output."""
    target = tiny_model("llama")
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE)), std=0.5)
    prompts = [torch.tensor([[5, 9, 9, 17, 3]]), torch.tensor([[0, 44, 2, 2, 81, 7, 7]])]
    kw = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.2, **OPENAI)
    solo = [model.generate(p, **kw)[0, p.shape[1]:] for p in prompts]
    width = max(p.shape[1] for p in prompts)
    ids = torch.stack([torch.nn.functional.pad(p[0], (width - p.shape[1], 0)) for p in prompts])
    mask = torch.stack([torch.nn.functional.pad(torch.ones_like(p[0]), (width - p.shape[1], 0)) for p in prompts])
    out = model.generate(ids, attention_mask=mask, **kw)
    for row, want in zip(out, solo):
        assert torch.equal(row[width:width + want.numel()], want)


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
])
def test_penalties_out_of_range_are_refused(kwargs, message, prompt):
    model = MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=2, tree=[[0]]))
    with pytest.raises(ValueError, match=message):
        model.generate(prompt, max_new_tokens=4, **kwargs)


def test_token_bias_then_penalties_as_transformers_processors():
    """Each node's logits = transformers' SequenceBias then RepetitionPenalty processors over that node's prefix (a
    bias added after the penalty, or forgotten, fails)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor
    vocab, gen = 11, torch.Generator().manual_seed(1)
    buffers = build_buffers([[0], [1], [0, 0]])
    tokens = torch.tensor([3, 4, 5, 6])
    logits = torch.randn(len(tokens), vocab, generator=gen) * 3
    prompt, output, bias = [1, 2, 4], [7, 3], {(4,): 2.5, (9,): -1.5, (2,): 4.0}
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt] = True
    counts = torch.bincount(torch.tensor(output), minlength=vocab).float()
    got = penalized_logits(logits, Penalties(1.3, bias=token_bias(bias)), seen, counts, tokens, buffers.ancestor_mask)
    for node in range(len(tokens)):
        path = [int(tokens[j]) for j in range(1, len(tokens)) if buffers.ancestor_mask[node, j]]
        ids = torch.tensor([prompt + output + path])
        want = SequenceBiasLogitsProcessor(bias)(ids, logits[node][None].clone())
        want = RepetitionPenaltyLogitsProcessor(1.3)(ids, want)[0]
        torch.testing.assert_close(got[node], want)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_token_bias_equals_transformers(arch, prompt):
    target = tiny_model(arch)
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    banned, favoured = int(plain[0, prompt.shape[1] + 2]), int(plain[0, prompt.shape[1] + 5])
    bias = {(banned,): -100.0, (favoured,): 3.0}
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False, sequence_bias=bias, repetition_penalty=1.2)
    assert not torch.equal(ref, plain) and banned not in ref[0, prompt.shape[1]:].tolist()
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE))
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, 128)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, sequence_bias=bias, repetition_penalty=1.2)
    assert torch.equal(out, ref)
    assert model.last_stats.mean_accepted_tokens > 2.5  # deep nodes were judged with the bias


@pytest.mark.parametrize("bias, message", [
    ({(3, 4): 1.0}, "only single tokens"),
    ({(10**6,): 1.0}, "outside the vocabulary"),
])
def test_unsupported_token_bias_is_refused(bias, message, prompt):
    model = MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=2, tree=[[0]]))
    with pytest.raises(ValueError, match=message):
        model.generate(prompt, max_new_tokens=4, sequence_bias=bias)


# ---------------------------------------------------------------- sampling: Monte Carlo
PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "frequency_penalty": 0.8,
             "sequence_bias": {(1,): 1.2, (2,): -0.7}}  # the bias first, then the penalties


def exact_penalized_distribution(model: MedusaModel, **gen) -> dict[tuple[int, ...], float]:
    """P(x1..x3) = prod_i p(x_i | prompt, x_<i), each p after the penalties of its own prefix, then the warpers."""
    config, _ = model.base_model._prepare_generation_config(None, do_sample=True, **gen)
    warpers = build_warpers(config)
    seqs = list(itertools.product(range(VOCAB), repeat=NEW))
    ids = torch.cat([PROMPT.expand(len(seqs), -1), torch.tensor(seqs)], dim=1)  # [S, L+3]
    with torch.no_grad():
        logits = model.base_model(ids).logits[:, PROMPT.shape[1] - 1:-1]  # [S, 3, V]
    prompt = PROMPT[0].tolist()
    dist = {}
    for s, seq in enumerate(seqs):
        biased = logits[s].clone()  # [3, V]
        for (token,), value in PENALTIES["sequence_bias"].items():
            biased[:, token] += value
        rows = torch.stack([penalize_by_hand(biased[i], prompt, list(seq[:i]), PENALTIES["repetition_penalty"],
                                             PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"])
                            for i in range(NEW)])
        probs = target_probs(rows, warpers)  # [3, V]
        dist[seq] = float(probs.gather(-1, torch.tensor(seq)[:, None]).double().prod())
    return dist


def _path_blind(logits, penalties, prompt_seen, output_counts, tokens, ancestors):
    """A wrong rule: every node penalized by the output before the step, its own path forgotten."""
    return penalized_logits(logits, penalties, prompt_seen, output_counts, tokens[:1].repeat(len(tokens)),
                            torch.zeros_like(ancestors))


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["exact", "path_blind"])
def test_sampling_with_penalties_matches_target_distribution(rule, monkeypatch):
    model = make_model("hydra")
    gen = {"temperature": 1.0, "top_k": 0}
    if rule == "path_blind":
        monkeypatch.setattr(seq_mod, "penalized_logits", _path_blind)
    n = 20_000 if rule == "exact" else 6000
    exact = exact_penalized_distribution(model, **gen)
    counts = sample_counts(model, n, rows=250, **gen, **PENALTIES)
    tv, bound = tv_distance(exact, counts, n), tv_bound(sum(p > 0 for p in exact.values()), n)
    print(f"\npenalties, {rule}: TV {tv:.4f}, bound {bound:.4f}, n {n}")
    assert (tv < bound) if rule == "exact" else (tv > bound), f"{rule}: TV {tv:.4f}, bound {bound:.4f}"
