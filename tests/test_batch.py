"""Batched verification (SpeculativeBatch, generate with B > 1): exact per row, rows joining and leaving."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_heads, tiny_model
from test_sampling import (N_SAMPLES, NEW, PROMPT, TREE, VOCAB, _support, _wrong_walk, exact_distribution, make_model,
                           tv_bound, tv_distance)

import medusa_lite.decode.sequence as gen_mod
from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.fit import HardwareFit, Rung
from medusa_lite.decode import SpeculativeBatch

BATCH_ROWS = 48  # rows of the Monte Carlo batches (plus one that leaves and one that joins)
WIDE = [[0], [1], [2], [3], [0, 0], [1, 0], [0, 1], [2, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0]]
DYNAMIC = {"dynamic": {"nodes": 12, "depth": 4, "topk": 3, "expand": 3}}


def batch_oracle(references: list[torch.Tensor], num_heads: int, vocab: int):
    """Drafts for whichever reference (prompt + plain continuation) the row's ids are a prefix of: the true token
    at a rank that changes with the position (so non-first branches are accepted, moving cache entries) and,
    at some positions, no true token at all (so rows accept different lengths: holes)."""
    refs = [r.tolist() for r in references]

    def draft(hidden: torch.Tensor, ids: torch.Tensor, topk: int) -> torch.Tensor:
        seen = ids.tolist()
        ref = next((r for r in refs if r[:len(seen)] == seen), seen)  # off every reference (a control): no true token
        n, rows = len(seen), []
        for k in range(num_heads):
            true = ref[n + k] if n + k < len(ref) else 0
            ranks = [(true + 1 + r) % vocab for r in range(topk)]
            if (3 * n + k) % 7:  # a miss at some depths
                ranks[(n + k) % topk] = true
            rows.append(ranks)
        return torch.tensor(rows, device=ids.device)

    return draft


def _prompts(lengths=(12, 5, 9, 3), seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g) for n in lengths]


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():], mask[b, width - p.numel():] = p, 1
    return ids, mask


def _plain(target, prompt: torch.Tensor, n: int, **gen) -> torch.Tensor:
    return target.generate(prompt[None], max_new_tokens=n, do_sample=False, **gen)[0, prompt.numel():]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("heads, tree", [("medusa-oracle", WIDE), ("hydra", DYNAMIC), ("hydra", WIDE),
                                         ("hydra", {"tree": WIDE, "prompt_lookup": 4, "ngram": 1}),
                                         ("eagle3", DYNAMIC)])
def test_batch_greedy_equals_solo_and_plain(arch, heads, tree):
    """Each row of a left-padded batch equals plain decoding of its prompt alone, and its own batch-1 output."""
    target = tiny_model(arch)
    prompts = _prompts()
    refs = [_plain(target, p, 40) for p in prompts]
    head_type = heads.split("-")[0]
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=4, head_type=head_type, tree=tree)), std=0.5)
    if heads.endswith("oracle"):
        model.drafter.draft = batch_oracle([torch.cat([p, r]) for p, r in zip(prompts, refs)], 4, 128)
    ids, mask = _left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    assert out.shape == (4, ids.shape[1] + 40)
    steps = [s.tokens_per_step for s in model.last_batch_stats]
    assert len({s.prefill_time for s in model.last_batch_stats}) == 1  # the four prompts were prefilled in one forward
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        assert torch.equal(out[b, :ids.shape[1]], ids[b])
        assert torch.equal(out[b, ids.shape[1]:], ref), f"row {b}"
        solo = model.generate(p[None], max_new_tokens=40, do_sample=False)
        assert torch.equal(solo[0, p.numel():], ref)
    if heads.endswith("oracle"):
        assert max(max(s) for s in steps) >= 3 and min(min(s) for s in steps) == 1  # long and short acceptances


def test_prefill_chunks_hold_the_budget_in_padded_tokens():
    """Prompts joining together are prefilled several at a time: rows x the longest prompt within the budget, in
    order, a prompt longer than the budget alone; sequences sharing a prompt are one row."""
    from types import SimpleNamespace

    from medusa_lite.decode import prefill_chunks, same_prompt_groups

    seqs = [SimpleNamespace(prompt=torch.arange(n) + first) for n, first in
            [(30, 0), (30, 0), (40, 0), (60, 0), (300, 0), (10, 0), (10, 1)]]
    groups = same_prompt_groups(seqs)
    assert [len(g) for g in groups] == [2, 1, 1, 1, 1, 1]  # the two 30-token prompts are one row; the 10s differ
    chunks = prefill_chunks(groups, budget=128)
    assert [[g[0].prompt.numel() for g in c] for c in chunks] == [[30, 40], [60], [300], [10, 10]]
    assert prefill_chunks(groups, budget=1) == [[g] for g in groups]


def test_rows_join_leave_and_stop_on_their_own():
    """Rows with their own budgets and EOS, one joining after a few steps, one removed mid-way (a cancelled
    request), one whose streamer raises: every other row's output is its solo output; memory stays bounded."""
    target = tiny_model("llama")
    prompts = _prompts((12, 5, 9, 3, 7, 10))
    budgets = [40, 6, 33, 40, 25, 40]
    refs = [_plain(target, p, n) for p, n in zip(prompts, budgets)]
    eos = int(refs[4][10])  # row 4 stops at its first EOS
    refs[4] = _plain(target, prompts[4], 25, eos_token_id=eos)
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=WIDE))
    model.drafter.draft = batch_oracle([torch.cat([p, r]) for p, r in zip(prompts, refs)], 4, 128)

    class Boom:
        def put(self, value):
            if value.numel() and len(seen) > 2:
                raise RuntimeError("client went away")
            seen.append(value)

    seen: list = []
    seqs = [model.sequence(p, max_new_tokens=n, do_sample=False, eos_token_id=eos if b == 4 else None)
            for b, (p, n) in enumerate(zip(prompts, budgets))]
    seqs[5].streamer = Boom()
    batch = SpeculativeBatch(model.base_model, model.drafter)
    for seq in seqs[:3] + seqs[4:]:
        assert batch.add(seq)
    finished, step = [], 0
    while batch.rows:
        finished += batch.step()
        step += 1
        if step == 3:
            assert batch.add(seqs[3])  # joins a running batch, its prompt shorter than the others' caches
        if step == 5:
            batch.remove([seqs[2]])  # cancelled: leaves at once
        if batch.rows:  # bounded: holes never exceed a quarter of the slots plus a little per row
            held = int(batch.valid.sum())
            assert batch.valid.numel() <= 1.25 * held + 32 * len(batch.rows) + 4 * 12
            for seq, row in zip(batch.rows, batch.valid):
                assert int(row.sum()) == seq.cache_len
    assert seqs[2].done and seqs[2].stats.new_tokens < budgets[2]
    assert isinstance(seqs[5].error, RuntimeError)
    for b in (0, 1, 3, 4):
        assert torch.equal(seqs[b].new_tokens, refs[b]), f"row {b}"
    assert seqs[1].stats.new_tokens == 6 and seqs[4].new_tokens[-1] == eos


SLIDING = ["Mistral (sliding window)", "Gemma 2 (alternating)", "GPT-OSS (alternating, MoE, sinks)",
           "Llama 4 text (chunked + full, MoE)"]


def _sliding_rows(name: str, window: int = 3):
    """A sliding-window target, prompts longer than its window and their plain continuations, and a batched model
    whose oracle drafts make rows accept different lengths and non-first branches (holes, moved slots)."""
    from dataclasses import replace

    from test_architectures import BY_NAME

    arch = BY_NAME[name]
    key = "attention_chunk_size" if "attention_chunk_size" in arch.kwargs else "sliding_window"
    target = replace(arch, kwargs={**arch.kwargs, key: window}).build(seed=0)
    vocab = target.config.vocab_size
    prompts = [p % vocab for p in _prompts((12, 5, 9))]
    refs = [_plain(target, p, 30) for p in prompts]
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=WIDE))
    model.drafter.draft = batch_oracle([torch.cat([p, r]) for p, r in zip(prompts, refs)], 4, vocab)
    return model, prompts, refs


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_rows_share_verify_steps(name):
    """Rows of a sliding-window model verified together (their layers keep every key, each row's window cut by the
    mask) equal plain decoding, past the window, with holes and moved slots; a row alone keeps only its window."""
    model, prompts, refs = _sliding_rows(name)
    ids, mask = _left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    steps = [s.tokens_per_step for s in model.last_batch_stats]
    assert max(max(s) for s in steps) >= 3 and min(min(s) for s in steps) == 1
    assert sum(s.target_forwards for s in model.last_batch_stats) > max(s.target_forwards for s in model.last_batch_stats)
    for b, ref in enumerate(refs):
        assert torch.equal(out[b, ids.shape[1]:], ref), f"row {b}"
    batch = model.decoder(solo=True)
    assert batch.window is None and any(batch.prefill(prompts[0])[1].is_sliding)


@pytest.mark.parametrize("name", SLIDING[:2])
def test_control_batched_rows_without_the_window_differ(name):
    """A deliberately wrong batched mask (sliding layers see every key: no window) must change some row."""
    model, prompts, refs = _sliding_rows(name)
    decoder = model.decoder

    def windowless(*args, **kwargs):
        from dataclasses import replace

        batch = decoder(*args, **kwargs)
        if batch.window is not None:
            batch.layout = replace(batch.layout, window=10**9)
        return batch

    model.decoder = windowless
    ids, mask = _left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert any(not torch.equal(out[b, ids.shape[1]:], ref) for b, ref in enumerate(refs))


def test_batch_trees_shrink_as_the_batch_grows():
    """B trees of N nodes are one forward of B x N tokens: on a linear-cost machine trees stop paying at B = 4."""
    from medusa_lite.fit import Candidate

    candidates = [Candidate([], [1.0] * 3, [1.0] * 3, [100] * 3),
                  Candidate([[0], [0, 0]], [2.0] * 3, [3.0] * 3, [100] * 3),
                  Candidate([[0]], [1.6] * 3, [2.0] * 3, [100] * 3)]
    flat_then_linear = {256: {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.024, 16: 0.048, 32: 0.096, 64: 0.192}}
    measured = {"latency": flat_then_linear, "draft": {}, "overhead": 0.0}
    fit = HardwareFit({}, [[Rung([[0], [0, 0]], 2.0, 0.012), Rung([], 1.0, 0.01)]] * 3, measured=measured,
                      candidates=candidates)
    assert fit.batch_trees(1)[0] == [[0], [0, 0]]   # 2 tokens / 3-token forward: 174 tok/s (plain 100)
    assert fit.batch_trees(2)[0] == [[0]]           # 2 x 1.6 tokens / 4-token forward: 267 (chain 222, plain 182)
    assert fit.batch_trees(4)[0] == []              # plain 4 / 4-token forward: 333 beats 267 and 222
    assert fit.batch_trees(16)[0] == []


def test_batch_trees_price_drafting_shared_by_the_rows():
    """Rows drafted together share the drafter's passes: a step of B rows pays one row's drafting plus B - 1 times
    the probe's extra per row, so a tree whose drafting one row cannot afford pays once it is shared."""
    from medusa_lite.fit import Candidate
    from medusa_lite.fit.pricing import DRAFT_BATCH, draft_per_row

    assert draft_per_row(0.008, None, 8) == 0.008  # a probe that did not time rows together: each row pays its own
    assert draft_per_row(0.008, 0.015, 1) == 0.008
    assert draft_per_row(0.008, 0.015, DRAFT_BATCH) == pytest.approx(0.015 / DRAFT_BATCH)
    assert draft_per_row(0.008, 0.015, 16) == pytest.approx((0.008 + 15 * 0.001) / 16)
    candidates = [Candidate([], [1.0] * 3, [1.0] * 3, [100] * 3), Candidate([[0]], [1.8] * 3, [2.0] * 3, [100] * 3)]
    flat = {256: {n: 0.010 + 0.0001 * n for n in (1, 2, 4, 8, 16, 32, 64)}}
    measured = {"latency": flat, "draft": {"[[0]]": 0.003}, "overhead": 0.0}
    alone = HardwareFit({}, [[Rung([], 1.0, 0.0101)]] * 3, measured=measured, candidates=candidates)
    shared = HardwareFit({}, [[Rung([], 1.0, 0.0101)]] * 3, measured=measured | {"draft_batch": {"[[0]]": 0.004}},
                         candidates=candidates)
    assert alone.batch_trees(8)[0] == []  # 1.8 tokens in 1.45 ms (its share of the forward) + 3 ms: 404 tok/s < 740
    assert shared.batch_trees(8)[0] == [[0]]  # + 0.5 ms of drafting per row: 923 tok/s


def test_batch_guards_share_what_they_learned_across_batch_sizes():
    """A guard for a new batch size starts where the acceptance realized at other sizes predicts fastest."""
    from medusa_lite.fit import Candidate, batch_guards

    candidates = [Candidate([], [1.0] * 3, [1.0] * 3, [100] * 3), Candidate([[0]], [1.9] * 3, [2.0] * 3, [100] * 3)]
    flat = {256: {n: 0.010 + 0.0001 * n for n in (1, 2, 4, 8, 16, 32, 64)}}
    fit = HardwareFit({}, [[Rung([[0]], 1.9, 0.0102), Rung([], 1.0, 0.0101)]] * 3,
                      measured={"latency": flat, "draft": {}, "overhead": 0.0}, candidates=candidates)
    guards = batch_guards(fit)
    assert guards.tree(4, 10) == [[0]]  # nearly flat latency: the 1-node tree is priced best at 4 rows
    for _ in range(3):
        assert guards.tree(4, 10) == [[0]]
        guards.record(4, 4, 0.0102)  # nothing drafted was accepted: 1 token per row and step
    assert guards.tree(2, 10) == []  # a fresh guard for 2 rows starts on the root alone
    assert batch_guards(fit).tree(2, 10) == [[0]]  # without that history it starts on the priced best


def _batch_samples(model, n: int, seed: int = 0, rows: int = BATCH_ROWS, **gen) -> list[tuple[int, ...]]:
    """``n`` samples of the first NEW tokens after PROMPT from batches of ``rows`` PROMPT rows (sharing one prefill),
    a row with another prompt that stops after one step, then a PROMPT row that joins after that step; a budget of
    3.4 tree tokens per row and step cuts the 7-node trees to 3 nodes while all rows are present, less as rows
    finish."""
    torch.manual_seed(seed)
    other = torch.tensor([3, 1, 4])
    samples = []
    while len(samples) < n:
        seqs = model.sequences([PROMPT[0]] * (rows + 1), max_new_tokens=NEW + 1, do_sample=True, eos_token_id=None,
                               **gen)
        early = model.sequence(other, max_new_tokens=2, do_sample=True, eos_token_id=None, **gen)
        batch = model.decoder(sample=True, max_step_tokens=int(3.4 * (rows + 1)))
        batch.add_group(seqs[:rows])
        batch.add(early)
        batch.step()
        assert early.done
        batch.add(seqs[rows])
        while batch.rows:
            batch.step()
        samples += [tuple(seq.new_tokens[:NEW].tolist()) for seq in seqs]
    return samples[:n]


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["medusa", "eagle3", "hydra-adaptive"])
def test_batched_sampling_matches_target_distribution(heads):
    """Static trees; a stateful drafter (its cache rows join and leave); batch guards that change the tree every step."""
    from collections import Counter

    from medusa_lite.fit import CyclingGuard
    from test_fit import restless_fit

    model = make_model(heads.split("-")[0])
    if heads == "hydra-adaptive":
        trees = [TREE, {"dynamic": {"nodes": 5, "depth": 2, "topk": 3, "expand": 2}},
                 {"tree": TREE, "prompt_lookup": 3, "ngram": 1}, [[0]], []]
        model.use_fit(restless_fit(trees), sample=True, guard=CyclingGuard)
    gen = {"temperature": 1.0, "top_k": 0}
    exact = exact_distribution(model, **gen)
    counts = Counter(_batch_samples(model, N_SAMPLES, **gen))
    tv, bound = tv_distance(exact, counts, N_SAMPLES), tv_bound(_support(exact), N_SAMPLES)
    print(f"\nbatched {heads}: TV {tv:.4f}, bound {bound:.4f}")
    assert tv < bound


@pytest.mark.slow
def test_batched_harness_rejects_a_wrong_rule(monkeypatch):
    model = make_model()
    monkeypatch.setattr(gen_mod, "sample_walk", _wrong_walk("residual"))
    n = 6000
    exact = exact_distribution(model, temperature=1.0, top_k=0)
    from collections import Counter
    counts = Counter(_batch_samples(model, n, temperature=1.0, top_k=0))
    assert tv_distance(exact, counts, n) > tv_bound(_support(exact), n)


def test_num_return_sequences_samples_share_the_prefill():
    model = random_heads(MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=3, head_type="hydra")), std=0.5)
    prompt = _prompts((6,))[0][None]
    out = model.generate(prompt, max_new_tokens=12, do_sample=True, num_return_sequences=5,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (5, 18) and all(torch.equal(row[:6], prompt[0]) for row in out)
    assert len({tuple(row.tolist()) for row in out}) > 1  # independent samples
    assert all(s.target_forwards == s.verify_steps + 1 for s in model.last_batch_stats)  # one prefill each (shared)
    again = model.generate(prompt, max_new_tokens=12, do_sample=True, num_return_sequences=5,
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_generate_batch_errors():
    model = MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=2))
    ids, mask = _left_padded(_prompts((4, 6)))
    bad = mask.clone()
    bad[0, -1] = 0
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=bad, max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, streamer=object())
    assert VOCAB == 5


def test_token_logprobs_are_the_targets_own_in_every_row():
    """``logprobs``: each emitted token's log-softmax under the target, whatever row and step verified it (sampled
    rows sharing a prefill, a greedy row), with the likeliest alternatives."""
    from medusa_lite.decode import run_batch

    model = random_heads(MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=3, head_type="hydra")), std=0.5)
    prompt = _prompts((7,))[0]
    seqs = model.sequences([prompt], max_new_tokens=14, do_sample=True, num_return_sequences=3, eos_token_id=None,
                           logprobs=2, generator=torch.Generator().manual_seed(0))
    run_batch(model.decoder(sample=True), seqs)
    greedy = model.sequences([prompt], max_new_tokens=14, do_sample=False, eos_token_id=None, logprobs=2)
    run_batch(model.decoder(), greedy)
    for seq in seqs + greedy:
        new = seq.new_tokens
        with torch.no_grad():
            full = torch.log_softmax(model.base_model(seq.ids()[None]).logits[0].float(), -1)  # [L + n, V]
        expected = full[prompt.numel() - 1: prompt.numel() - 1 + new.numel()]
        assert len(seq.token_logprobs) == new.numel() == 14
        got = torch.tensor([lp for lp, _ in seq.token_logprobs])
        assert torch.allclose(got, expected.gather(-1, new[:, None])[:, 0], atol=1e-4)
        assert all(top[0][1] == pytest.approx(float(expected[i].max()), abs=1e-4) and len(top) == 2
                   for i, (_, top) in enumerate(seq.token_logprobs))
    assert all(top[0][0] == int(t) for (_, top), t in zip(greedy[0].token_logprobs, greedy[0].new_tokens))


def test_slack_layer_appends_in_place_and_keeps_its_room_when_narrowed():
    """The cache's full-attention layers append into spare room (no copy of the layer per step); narrowing to a prefix
    (keep the accepted nodes) keeps the room; any other tensor assigned becomes the layer."""
    from medusa_lite.kv import new_cache
    from medusa_lite.kv.cache import SlackLayer

    layer = new_cache(tiny_model()).layers[0]
    assert isinstance(layer, SlackLayer)
    first = torch.randn(2, 2, 5, 4)
    keys, _ = layer.update(first, first.clone())
    assert torch.equal(keys, first) and layer.get_seq_length() == 5
    room = layer.keys.data_ptr()
    step = torch.randn(2, 2, 3, 4)
    keys, values = layer.update(step, step.clone())
    assert keys.data_ptr() == room and torch.equal(keys, torch.cat([first, step], dim=2))  # written in place
    layer.keys, layer.values = layer.keys[:, :, :6], layer.values[:, :, :6]  # keep the first tree node only
    layer.update(step, step.clone())
    assert layer.keys.data_ptr() == room and layer.get_seq_length() == 9
    assert torch.equal(layer.keys, torch.cat([first, step[:, :, :1], step], dim=2))
    other = torch.randn(1, 2, 4, 4)
    layer.keys, layer.values = other, other.clone()  # e.g. rows selected: a new tensor
    assert layer.keys.data_ptr() == other.data_ptr() and layer.get_seq_length() == 4
    layer.update(torch.ones(1, 2, 300, 4), torch.ones(1, 2, 300, 4))  # grows past its room
    assert layer.get_seq_length() == 304 and torch.equal(layer.keys[:, :, :4], other)


def test_grouped_attention_is_bit_identical_to_repeated_heads():
    """Inside medusa_lite's forwards, masked SDPA takes the grouped key/value heads as they are (no repeat copy): the
    logits are the same bits as transformers' own path, for a tree mask over several rows with holes."""
    from medusa_lite.attention import attending as grouped_attention, takes_grouped_heads

    target = tiny_model()  # 4 query heads, 2 key/value heads
    ids = torch.randint(1, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :7] = mask[2, :3] = 0
    with torch.no_grad():
        plain = target(input_ids=ids, attention_mask=mask).logits
        with grouped_attention(target):
            grouped = target(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(plain, grouped)
    from transformers.integrations import sdpa_attention

    k = torch.zeros(1, 2, 3, 4)
    assert takes_grouped_heads(torch.ones(1, 1, 1, 3, dtype=torch.bool), k)  # the copy-free path
    assert not sdpa_attention.use_gqa_in_sdpa(torch.ones(1, 1, 1, 3, dtype=torch.bool), k, k)  # only inside
    half, one_query, two_queries = k.bfloat16(), torch.ones(1, 1, 1, 3, dtype=torch.bool), torch.ones(1, 1, 2, 3, dtype=torch.bool)
    # one query in half precision: transformers packs its heads
    assert not takes_grouped_heads(None, half, single_query=True)
    assert takes_grouped_heads(None, k, single_query=True)  # fp32 keeps torch's GQA kernel (its bits unchanged)
    assert not takes_grouped_heads(one_query, half)
    assert takes_grouped_heads(two_queries, half) and takes_grouped_heads(None, half)


def test_packed_single_query_attention_matches_in_half_precision():
    """One query token per row in bf16 (rows of a batched root step, and the root alone without a mask): the packed
    heads give the target's own logits (bf16 rounding aside) and the same greedy token."""
    from medusa_lite.attention import attending as grouped_attention

    target = tiny_model().to(torch.bfloat16)  # 4 query heads, 2 key/value heads
    ids = torch.randint(1, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[1, :7] = 0
    with torch.no_grad():
        cache = target(input_ids=ids, attention_mask=mask[:, :20], use_cache=True).past_key_values
        step = dict(input_ids=ids[:, -1:], attention_mask=mask, use_cache=False)
        plain = target(past_key_values=copy.deepcopy(cache), **step).logits
        with grouped_attention(target):
            packed = target(past_key_values=copy.deepcopy(cache), **step).logits
        alone = target(input_ids=ids[:1], use_cache=True).past_key_values
        plain1 = target(input_ids=ids[:1, -1:], past_key_values=copy.deepcopy(alone)).logits
        with grouped_attention(target, single_query=True):
            packed1 = target(input_ids=ids[:1, -1:], past_key_values=copy.deepcopy(alone)).logits
    for a, b in ((plain, packed), (plain1, packed1)):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_rows_with_the_same_plan_draft_together(monkeypatch):
    """A batched step drafts the rows whose plans share a batch_key in one propose call (one pass over the drafter's
    weights per level); a row sampling from a static tree draws with its own generator and is drafted alone."""
    from medusa_lite.drafters.eagle3 import Eagle3Drafter

    calls = []
    real = Eagle3Drafter.propose
    monkeypatch.setattr(Eagle3Drafter, "propose", lambda self, state, *a: calls.append(len(state.ids))
                        or real(self, state, *a))
    model = random_heads(MedusaModel(tiny_model(), MedusaConfig(num_heads=4, head_type="eagle3")), std=0.5)
    batch = model.decoder(fit=False)
    for p in _prompts():
        batch.add(model.sequence(p, max_new_tokens=8, do_sample=False, tree=DYNAMIC))
    batch.add(model.sequence(_prompts()[0], max_new_tokens=8, do_sample=True, tree=[[0], [1], [0, 0]]))
    batch.step()
    assert sorted(calls) == [1, 4]


def test_compaction_ignores_the_left_padding_it_cannot_free(monkeypatch):
    """Rows of unequal prompts: compacting cannot drop the shorter rows' left padding, so it is not counted as
    freeable (it was, and every step copied the whole cache for nothing)."""
    import medusa_lite.decode.batch as batch_mod

    calls = []
    real = batch_mod.compact_rows
    monkeypatch.setattr(batch_mod, "compact_rows", lambda cache, valid: calls.append(1) or real(cache, valid))
    model = MedusaModel(tiny_model(), MedusaConfig(num_heads=2))
    batch = model.decoder(fit=False)
    for p in _prompts(lengths=(200, 5, 9, 3)):
        batch.add(model.sequence(p, max_new_tokens=6, do_sample=False, tree=[]))
    while batch.rows:
        batch.step()
    assert not calls


def _attention_kernel():
    from medusa_lite.kernels import attention_kernel

    kernel = attention_kernel()
    if kernel is None:
        pytest.skip("the few-query attention kernel does not build here (no C++ compiler, or no AVX2 kernels)")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_attention_kernel_matches_sdpa(dtype):
    """The few-query kernel against float64 SDPA: grouped heads, 1-5 queries, masks with holes and other branches
    (the dtype's minimum), a mask shared by the rows or one per row, none for one query, the cache a view with room."""
    import torch.nn.functional as F

    kernel = _attention_kernel()
    g = torch.Generator().manual_seed(0)
    tol = 5e-6 if dtype == torch.float32 else 2e-2  # float rounding: SDPA itself is off by 1e-6 at these sizes
    for batch, heads, kv_heads, queries, keys, dim in [(1, 9, 3, 1, 300, 64), (3, 4, 2, 2, 7, 16), (2, 6, 6, 5, 33, 8),
                                                       (3, 8, 2, 1, 1, 72), (1, 4, 1, 3, 129, 64)]:
        q = torch.randn(batch, queries, heads, dim, generator=g).to(dtype).transpose(1, 2)  # as transformers has it
        room = torch.randn(2, batch, kv_heads, keys + 5, dim, generator=g).to(dtype)
        k, v = room[0, :, :, :keys], room[1, :, :, :keys]
        for rows in (1, batch):
            masks = [torch.where(torch.rand(rows, 1, queries, keys, generator=g) < 0.3, torch.finfo(dtype).min, 0.0)]
            masks[0][..., -1] = 0.0  # every query sees a key
            masks = [m.to(dtype) for m in masks] + ([None] if queries == 1 else [])
            for mask in masks:
                ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                     attn_mask=None if mask is None else mask.double(), enable_gqa=True,
                                                     scale=0.3)
                out = kernel.small_attention(q, k, v, mask, 0.3)
                assert out.dtype == dtype and out.shape == q.shape
                assert (out.double() - ref).abs().max() < tol, (batch, heads, kv_heads, queries, keys, dim, rows)


def test_small_attention_gives_masked_keys_no_weight():
    """A key the mask hides contributes exactly nothing, however large its value (holes and padding hold stale or
    zero entries): the same output as with those values zeroed. A rule that only down-weights them fails."""
    kernel = _attention_kernel()
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 2, 16, generator=g), torch.randn(2, 2, 50, 16, generator=g), torch.randn(2, 2, 50, 16, generator=g)
    hidden = torch.rand(2, 1, 2, 50, generator=g) < 0.4
    hidden[..., 0] = False
    mask = torch.zeros(2, 1, 2, 50).masked_fill_(hidden, torch.finfo(torch.float32).min)
    both = hidden[:, 0].all(dim=1)  # [2, 50] keys hidden from both queries of a row
    loud = v.clone()
    loud.masked_fill_(both[:, None, :, None], 1e30)
    quiet = v.masked_fill(both[:, None, :, None], 0.0)
    assert torch.equal(kernel.small_attention(q, k, loud, mask, 0.25), kernel.small_attention(q, k, quiet, mask, 0.25))
    assert torch.isfinite(kernel.small_attention(q, k, loud, mask, 0.25)).all()


def test_few_query_forwards_take_the_attention_kernel_and_keep_the_target_logits():
    """Inside medusa_lite's forwards a CPU step of at most SMALL_ATTENTION_QUERIES queries per row attends through the
    kernel (batched roots and trees with a mask, the root alone without one), longer ones through SDPA; the logits are
    the target's own (float rounding)."""
    from medusa_lite.attention import attending as grouped_attention

    kernel = _attention_kernel()
    target = tiny_model()  # 4 query heads, 2 key/value heads
    ids = torch.randint(1, 128, (3, 27), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(3, 27, dtype=torch.bool)
    valid[1, :7] = False  # a row's left padding
    calls = []
    with torch.no_grad():
        cache = target(input_ids=ids[:, :20], attention_mask=valid[:, :20].long(), use_cache=True).past_key_values
        for n in (1, 3, 7):  # n new tokens a row, causal among themselves, as a verify step's additive mask
            allowed = valid[:, None, None, :20 + n] & torch.ones(n, 20 + n, dtype=torch.bool).tril(20)
            step = dict(input_ids=ids[:, 20:20 + n], position_ids=(valid[:, :20].sum(1, keepdim=True) + torch.arange(n)),
                        attention_mask=torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min),
                        use_cache=True)
            plain = target(past_key_values=copy.deepcopy(cache), **step).logits
            with grouped_attention(target, small=_Spy(kernel, calls)):
                fast = target(past_key_values=copy.deepcopy(cache), **step).logits
            torch.testing.assert_close(plain, fast, atol=1e-5, rtol=1e-5)
        alone = target(input_ids=ids[:1, :20], use_cache=True).past_key_values
        plain = target(input_ids=ids[:1, 20:21], past_key_values=copy.deepcopy(alone)).logits
        with grouped_attention(target, single_query=True, small=_Spy(kernel, calls)):
            fast = target(input_ids=ids[:1, 20:21], past_key_values=copy.deepcopy(alone)).logits
        torch.testing.assert_close(plain, fast, atol=1e-5, rtol=1e-5)
    layers = target.config.num_hidden_layers
    assert calls == [1] * layers + [3] * layers + [1] * layers  # 7 queries a row: SDPA


class _Spy:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def small_attention(self, q, *args):
        self.calls.append(q.shape[2])
        return self.kernel.small_attention(q, *args)
