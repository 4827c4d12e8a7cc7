"""Sampling exactness by Monte Carlo.

A tiny-vocabulary model; the exact joint distribution of the first three new tokens by enumeration
(through transformers' own warpers); total-variation distance of >= 20k medusa_lite samples under a
bound derived from the sample size. The same harness must reject deliberately wrong acceptance rules.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import Counter

import pytest
import torch
from conftest import random_heads, tiny_model
from test_fit import restless_fit

import medusa_lite.decode.sequence as gen_mod
from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.fit import CyclingGuard
from medusa_lite.sampling import build_warpers, target_probs

VOCAB, NEW, N_SAMPLES = 5, 3, 20_000
PROMPT = torch.tensor([[1, 2, 3, 4]])
TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1]]  # depth 2: acceptance, rejection, bonus all exercised


# from the support matrix (tests/test_architectures.py): a window shorter than prompt + new tokens
MATRIX = {"sliding": ("Gemma 2 (alternating)", {"sliding_window": 2}),
          "moe": ("Mixtral (sliding window, MoE)", {"sliding_window": 3})}


def _matrix_target(kind: str):
    from dataclasses import replace

    from test_architectures import BY_NAME

    name, extra = MATRIX[kind]
    arch = BY_NAME[name]
    arch = replace(arch, kwargs={**arch.kwargs, "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                                 "initializer_range": 0.12, **extra})
    return arch.build(seed=3)


def make_model(head_type: str = "medusa", tree=TREE, arch: str = "llama") -> MedusaModel:
    target = (tiny_model("llama", vocab=VOCAB, init=0.12, layers=1, hidden=32, seed=3) if arch == "llama"
              else _matrix_target(arch))
    model = MedusaModel(target, MedusaConfig(num_heads=2, tree=tree, head_type=head_type))
    random_heads(model, std=0.3, seed=1)
    return model


def exact_distribution(model: MedusaModel, **gen) -> dict[tuple[int, ...], float]:
    """P(x1..x3) = prod_i p(x_i | prompt, x_<i), each p after the same warpers plain sampling uses."""
    config, _ = model.base_model._prepare_generation_config(None, do_sample=True, **gen)
    warpers = build_warpers(config)
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)), device=model.device)  # [V^3, 3]
    ids = torch.cat([PROMPT.to(model.device).expand(len(seqs), -1), seqs], dim=1)  # [S, L+3]
    with torch.no_grad():
        logits = model.base_model(ids).logits[:, PROMPT.shape[1] - 1:-1]  # [S, 3, V]
    probs = target_probs(logits.reshape(-1, VOCAB), warpers).reshape(len(seqs), NEW, VOCAB)
    p = probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1)  # [S]
    return {tuple(s.tolist()): float(q) for s, q in zip(seqs.cpu(), p.cpu())}


def sample_counts(model: MedusaModel, n: int, seed: int = 0, rows: int = 1, solo: bool = False, **gen) -> Counter:
    """``n`` samples of the first NEW tokens, ``rows`` at a time (``num_return_sequences``: one batch sharing the
    prompt's prefill, each row verified on its own). ``solo``: the batch-1 path that ``generate`` of one sequence
    takes (sliding-window layers keeping only their window), the rows one after another, each on a copy of the
    prompt's prefill."""
    torch.manual_seed(seed)
    counts = Counter()
    # one token more than scored: after the prefill token the remaining budget of 3 lets the step use the tree's
    # depth 2 (a depth-2 path accepted, rejected at depth 2, bonus after it); the first NEW tokens of an exact
    # sampler are exactly distributed
    options = dict(max_new_tokens=NEW + 1, do_sample=True, eos_token_id=None, **gen)
    if solo:
        batch = model.decoder(sample=True, solo=True)
        out, cache, seconds = batch.prefill(PROMPT[0].to(model.device))
        for seq in model.sequences([PROMPT[0].to(model.device)], num_return_sequences=n, **options):
            batch.add_group([seq], prefilled=(out, copy.deepcopy(cache), seconds))
            while batch.rows:
                batch.step()
            counts[tuple(seq.new_tokens[:NEW].tolist())] += 1
        return counts
    while n > 0:
        k = min(rows, n)
        out = model.generate(PROMPT.to(model.device), num_return_sequences=k, **options)[:, :-1]
        for row in out[:, PROMPT.shape[1]:].tolist():
            counts[tuple(row)] += 1
        n -= k
    return counts


def tv_distance(exact: dict, counts: Counter, n: int) -> float:
    keys = set(exact) | set(counts)
    return 0.5 * sum(abs(exact.get(k, 0.0) - counts.get(k, 0) / n) for k in keys)


def tv_bound(num_outcomes: int, n: int, delta: float = 1e-4) -> float:
    """Bretagnolle-Huber-Carol: P(TV > eps) <= 2^K exp(-2 n eps^2); eps for failure probability delta."""
    return math.sqrt((num_outcomes * math.log(2) + math.log(1 / delta)) / (2 * n))


def _support(exact: dict) -> int:
    return sum(1 for p in exact.values() if p > 0)


# samples drawn per generate call (num_return_sequences): rows of one batch verified together, sharing the prompt's
# prefill; the Gemma 2 case decodes them one after another on the batch-1 path (sample_counts' solo)
BATCH_ROWS = 250


# EAGLE-3 (drafts drawn from its own layer, its own KV cache rows joining and leaving) is tests/test_batch.py's
# batched case: a superset of the num_return_sequences batch this file would draw
@pytest.mark.slow
@pytest.mark.parametrize("gen, heads", [
    ({"temperature": 1.0, "top_k": 0}, "medusa"),
    ({"temperature": 0.7, "top_k": 0}, "medusa"),
    ({"temperature": 1.0, "top_k": 3}, "medusa"),
    ({"temperature": 1.0, "top_k": 0, "top_p": 0.8}, "medusa"),
    ({"temperature": 1.0, "top_k": 0}, "hydra"),  # path-dependent drafts
    ({"temperature": 1.0, "top_k": 0}, "hydra-dynamic"),  # a tree chosen anew every step
    ({"temperature": 1.0, "top_k": 0}, "lookup"),  # + a prompt-lookup branch merged into the tree
    ({"temperature": 1.0, "top_k": 0, "sampled_drafts": False}, "hydra"),  # the heads' top ranks, one-hot proposals
    # batch-1 path, Gemma 2 (alternating full + sliding layers, window 2): a fitted ladder whose guard moves every step
    ({"temperature": 1.0, "top_k": 0}, "hydra-adaptive-sliding"),
    ({"temperature": 1.0, "top_k": 0}, "moe"),  # batched rows, Mixtral: experts, a sliding window of 3 cut by the mask
], ids=["T1", "T0.7", "topk3", "topp0.8", "T1-hydra", "T1-hydra-dynamic", "T1-lookup", "T1-hydra-top-ranks",
        "T1-hydra-adaptive-sliding-gemma2", "T1-moe-mixtral"])
def test_sampling_matches_target_distribution(gen, heads):
    dynamic = {"dynamic": {"nodes": 5, "depth": 2, "topk": 3, "expand": 2}}
    if heads == "hydra-adaptive-sliding":  # the tree changes between steps (never within one): still exact
        model = make_model("hydra", arch="sliding")
        trees = [TREE, dynamic, {"tree": TREE, "prompt_lookup": 3, "ngram": 1}, [[0]], []]
        model.use_fit(restless_fit(trees), sample=True, guard=CyclingGuard)
    elif heads == "hydra-dynamic":
        model = make_model("hydra", dynamic)
    elif heads == "lookup":
        model = make_model("medusa", {"tree": TREE, "prompt_lookup": 3, "ngram": 1})
    elif heads in MATRIX:
        model = make_model(arch=heads)
    else:
        model = make_model(heads)
    exact = exact_distribution(model, **gen)
    counts = sample_counts(model, N_SAMPLES, rows=BATCH_ROWS, solo=heads == "hydra-adaptive-sliding", **gen)
    tv = tv_distance(exact, counts, N_SAMPLES)
    bound = tv_bound(_support(exact), N_SAMPLES)
    print(f"\n{gen}: TV {tv:.4f}, bound {bound:.4f}, n {N_SAMPLES}, outcomes {_support(exact)}")
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f}"
    # the tree was really used: some steps accepted drafted tokens
    assert all(p == 0 or k in exact for k, p in counts.items())


# ---------------------------------------------------------------- deliberately wrong rules
def _wrong_walk(kind: str):
    """A sampling walk with a classic bug, on the same tree, probabilities and proposals the real one sees."""

    def walk(tokens, parents, target, proposals=None, generator=None):
        children = {}
        for node, parent in enumerate(parents[1:], start=1):
            children.setdefault(parent, []).append(node)
        node, nodes = 0, [0]
        while True:
            kids, r = children.get(node, []), target(node)
            if kind == "no_coin" and kids:  # accept the first child whenever it is possible at all
                if r[tokens[kids[0]]] > 0:
                    node = kids[0]; nodes.append(node); continue
                return torch.tensor(nodes), torch.multinomial(r, 1)[0]
            for c in kids:
                x = int(tokens[c])
                q = proposals.at(c, r.numel()) if proposals is not None else None
                # "residual": on rejection draw from p, not from p without the rejected token
                # "ratio": a drawn token accepted with probability min(1, p(x) / q(x)), but on rejection only
                #   x is removed from p (the residual must be max(p - q, 0))
                qx = 1.0 if q is None or kind != "ratio" else float(q[x])
                if torch.rand(()) * qx < r[x]:
                    node = c; nodes.append(c); break
                if kind == "ratio":
                    r = r.clone(); r[x] = 0; r = r / r.sum()
            else:
                return torch.tensor(nodes), torch.multinomial(r, 1)[0]

    return walk


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["no_coin", "residual", "ratio"])
def test_harness_rejects_wrong_rule(kind, monkeypatch):
    model = make_model()
    monkeypatch.setattr(gen_mod, "sample_walk", _wrong_walk(kind))
    n = 6000
    exact = exact_distribution(model, temperature=1.0, top_k=0)
    counts = sample_counts(model, n, rows=BATCH_ROWS, temperature=1.0, top_k=0)
    tv = tv_distance(exact, counts, n)
    print(f"\nwrong rule {kind}: TV {tv:.4f}, bound {tv_bound(_support(exact), n):.4f}, n {n}")
    assert tv > tv_bound(_support(exact), n), f"wrong rule {kind} not detected (TV {tv:.4f})"


def test_exact_distribution_sums_to_one():
    model = make_model()
    for gen in ({"temperature": 0.7, "top_k": 0}, {"top_p": 0.8, "top_k": 0}):
        assert abs(sum(exact_distribution(model, **gen).values()) - 1) < 1e-6


@pytest.mark.parametrize("arch, heads", [("llama", "medusa"), *((kind, "medusa") for kind in MATRIX),
                                         ("llama", "eagle3")])
def test_sampling_uses_the_tree(arch, heads):
    """The distribution test is only meaningful if drafted tokens are accepted and rejected."""
    model = make_model(heads, arch=arch)
    torch.manual_seed(0)
    steps = []
    for _ in range(200):
        model.generate(PROMPT, max_new_tokens=NEW + 1, do_sample=True, top_k=0)
        steps += model.last_stats.tokens_per_step
    assert 1 in steps and 2 in steps and max(steps) == 3  # rejections, and whole depth-2 paths accepted


def test_zero_probability_never_sampled():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    for _ in range(200):
        draws = gen_mod.sample_choice(probs)
        assert probs[torch.arange(3), draws].gt(0).all()


def test_sample_walk_mixed_proposals_give_the_target_distribution():
    """One node, three children: two drawn from q without replacement, one deterministic (a lookup token).
    The token that follows the root (accepted child or bonus) must have the target's distribution r."""
    from medusa_lite.verify import Proposals, sample_walk

    gen = torch.Generator().manual_seed(0)
    r = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.30], dtype=torch.float64)
    q = torch.tensor([[0.40, 0.05, 0.30, 0.05, 0.15, 0.05]])  # far from r: many rejections
    parents, n = [-1, 0, 0, 0], 30_000
    counts = torch.zeros(6)
    for _ in range(n):
        drawn = torch.multinomial(q, 2, replacement=False, generator=gen)  # [1, 2]
        tokens = torch.tensor([0, *drawn[0].tolist(), 3])  # the deterministic child may repeat a drawn one
        props = Proposals(q, drawn, row=torch.tensor([-1, 0, 0, -1]), rank=torch.tensor([0, 0, 1, 0]))
        nodes, bonus = sample_walk(tokens, parents, lambda node: r, props, gen)
        counts[int(tokens[nodes[1]]) if nodes.numel() > 1 else int(bonus)] += 1
    tv = 0.5 * float((counts / n - r.float()).abs().sum())
    assert tv < tv_bound(5, n), f"TV {tv:.4f}"
    assert counts[4] == 0  # a token the target never draws is never accepted, even when proposed
