"""One stop rule (medusa_lite.decode.stopping) for generate and its batches, and the token masks (allowed_token_ids,
bad_words_ids, min_new_tokens) applied at every tree node from that node's own prefix: greedy output equals plain
decoding with the same rule token for token, and a rule that masks only the root fails. The server's side of the
rule: tests/test_serve.py (test_one_stop_rule_through_generate_a_batch_and_the_server)."""

from __future__ import annotations

import pytest
import torch
from conftest import oracle_draft, random_heads, tiny_model, tiny_tokenizer
from transformers import GenerationConfig

import medusa_lite.decode.sequence as seq_mod
from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.decode import Finish, StopRule, Stopper
from medusa_lite.sampling import TokenMasks, masked_logits
from medusa_lite.tree import build_buffers

TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]


def _stopper(tok, **options) -> Stopper:
    config = GenerationConfig(**{k: v for k, v in options.items() if hasattr(GenerationConfig(), k)})
    for name, value in options.items():
        setattr(config, name, value)
    return Stopper(torch.tensor([5, 6]), StopRule.from_config(config, 50, tokenizer=tok))


def test_stop_strings_are_found_in_the_text_and_cut_it():
    tok = tiny_tokenizer()
    ids = tok("say xyz then", add_special_tokens=False)["input_ids"]
    stopper = _stopper(tok, stop_strings=["yz", "then"])
    kept, done = stopper.extend(ids)
    assert done and tok.decode(kept) == "say xyz" and stopper.finish == Finish("stop", "yz", len("say x"))
    stopper = _stopper(tok, stop_strings=["yz"], include_stop_str_in_output=True)
    stopper.extend(ids)
    assert stopper.finish.text_end == len("say xyz")
    stopper = _stopper(tok, stop_strings=["xy"], min_new_tokens=6)  # "xy" ends at the 6th token: not counted
    kept, done = stopper.extend(ids)
    assert not done and len(kept) == len(ids) and stopper.finish is None


def test_stop_tokens_eos_and_length():
    tok = tiny_tokenizer()
    ids = tok("abcdef", add_special_tokens=False)["input_ids"]
    stopper = _stopper(tok, eos_token_id=ids[2], stop_token_ids=[ids[4]])
    assert stopper.extend(ids) == (ids[:3], True) and stopper.finish == Finish("stop", None, 2)
    stopper = _stopper(tok, eos_token_id=ids[2], stop_token_ids=[ids[4]], ignore_eos=True)
    assert stopper.extend(ids) == (ids[:5], True) and stopper.finish == Finish("stop", ids[4], 4)
    stopper = _stopper(tok, eos_token_id=ids[2], min_new_tokens=3)
    assert stopper.extend(ids[:3]) == (ids[:3], False)  # the 3rd token may not stop the row (it is masked)
    stopper = _stopper(None, stop_token_ids=[ids[4]], include_stop_str_in_output=True)
    stopper.extend(ids)
    assert stopper.finish == Finish("stop", ids[4], None)
    stopper = Stopper(torch.tensor([5]), StopRule(max_new=3))
    assert stopper.extend(ids) == (ids[:3], True) and stopper.finish == Finish("length")


def test_masks_use_each_nodes_path():
    """Each node's forbidden tokens from the history and its own path: a bad word's last token where its other tokens
    end that prefix, the stop tokens while that prefix holds fewer than min_new new tokens, all but the allowed."""
    vocab = 12
    buffers = build_buffers([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    tokens = torch.tensor([3, 4, 5, 6, 7, 8])  # root 3 (the newest output token); node 2's path is 3 -> 5
    history, new = [1, 2, 9, 3], 2  # prompt [1, 2], output [9, 3]
    masks = TokenMasks(bad_words=((3, 4, 10), (5, 11), (9,)), min_new=4, stop_ids=(0,))
    got = masked_logits(torch.zeros(len(tokens), vocab), masks, history, new, tokens, buffers.ancestor_mask)
    inf = float("-inf")
    assert (got[:, 9] == inf).all()
    assert got[1, 10] == inf and (got[[0, 2, 3, 4, 5], 10] == 0).all()  # only node 1's prefix ends in 3, 4
    assert got[2, 11] == inf and (got[[0, 1, 3, 4, 5], 11] == 0).all()  # only node 2 is token 5
    depth = buffers.ancestor_mask.sum(1) - 1
    assert torch.equal(got[:, 0] == inf, new + depth < 4)
    allowed = masked_logits(torch.zeros(2, vocab), TokenMasks(allowed=(1, 7)), history, new, tokens[:2],
                            buffers.ancestor_mask[:2, :2])
    assert torch.equal(allowed[0] == 0, torch.isin(torch.arange(vocab), torch.tensor([1, 7])))


def _eos_at(target, prompt, k: int) -> int:
    """A token plain greedy decoding emits as its k-th new token (made the EOS id by the caller)."""
    out = target.generate(prompt, max_new_tokens=k + 1, do_sample=False, eos_token_id=None)
    return int(out[0, prompt.shape[1] + k])


@pytest.mark.parametrize("heads", ["random", "oracle"])
def test_greedy_min_new_tokens_equals_transformers(heads, prompt):
    target = tiny_model("llama")
    eos = _eos_at(target, prompt, 3)
    target.generation_config.eos_token_id = eos
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=12)
    assert ref.shape[1] > prompt.shape[1] + 4  # the mask matters
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE))
    if heads == "oracle":
        model.drafter.draft = oracle_draft(ref[0], 4, model._topk, 128)
    else:
        random_heads(model, std=0.5)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=12)
    assert torch.equal(out, ref)
    if heads == "oracle":
        assert model.last_stats.mean_accepted_tokens > 2.5  # deep nodes were masked by their own prefixes


def test_greedy_bad_words_equal_transformers(prompt):
    target = tiny_model("llama")
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    bad = [[plain[2]], plain[8:10], [plain[15], plain[16], plain[17]]]
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False, bad_words_ids=bad)
    assert ref[0, prompt.shape[1]:].tolist() != plain
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE))
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, 128)
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, bad_words_ids=bad), ref)
    assert model.last_stats.mean_accepted_tokens > 2.5


def test_greedy_allowed_token_ids_equal_plain(prompt):
    """vLLM's allowed_token_ids: plain decoding restricted by transformers' prefix_allowed_tokens_fn."""
    target = tiny_model("llama")
    allowed = list(range(0, 128, 3))
    ref = target.generate(prompt, max_new_tokens=24, do_sample=False, prefix_allowed_tokens_fn=lambda b, ids: allowed)
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE))
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, 128)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, allowed_token_ids=allowed)
    assert torch.equal(out, ref) and model.last_stats.mean_accepted_tokens > 2.5


def _root_only(scores, masks, history, new_tokens, tokens, ancestors):
    """A wrong rule: every node masked as the root is (its own path forgotten)."""
    return masked_logits(scores, masks, history, new_tokens, tokens[:1].repeat(len(tokens)),
                         torch.eye(len(tokens), dtype=torch.bool))


def test_a_rule_that_forgets_the_path_fails(prompt, monkeypatch):
    target = tiny_model("llama")
    target.generation_config.eos_token_id = _eos_at(target, prompt, 3)
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=12)
    model = MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE))
    model.drafter.draft = oracle_draft(ref[0], 4, model._topk, 128)
    monkeypatch.setattr(seq_mod, "masked_logits", _root_only)
    assert not torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=12), ref)


def test_batch_rows_stop_as_they_do_alone(prompt):
    """Rows of one batch, each stopped by the one rule (stop token, stop string, length): each row's tokens, finish
    reason and stop reason are its batch-1 ones."""
    tok = tiny_tokenizer()
    target = tiny_model("llama")
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=4, tree=TREE)), std=0.5)
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:]
    stop = tok.decode(plain[10:12])
    later = next(int(t) for t in plain[13:] if int(t) not in plain[:13].tolist())  # stops the other rows, not this
    rules = dict(max_new_tokens=30, do_sample=False, stop_token_ids=[later], stop_strings=[stop],
                 tokenizer=tok, eos_token_id=None)
    prompts = [prompt[0], torch.tensor([7, 3, 99, 12, 5]), prompt[0, :5]]
    solo = []
    for p in prompts:
        out = model.generate(p[None], **rules)[0, p.numel():]
        solo.append((out.tolist(), model.last_stats.finish_reason, model.last_stats.stop_reason))
    assert [r[1:] for r in solo] == [("stop", stop), ("length", None), ("stop", later)]  # each way of stopping
    width = max(p.numel() for p in prompts)
    ids = torch.stack([torch.nn.functional.pad(p, (width - p.numel(), 0)) for p in prompts])
    mask = torch.stack([torch.nn.functional.pad(torch.ones_like(p), (width - p.numel(), 0)) for p in prompts])
    out = model.generate(ids, attention_mask=mask, **rules)
    for row, stats, (want, reason, stop_reason) in zip(out, model.last_batch_stats, solo):
        assert row[width:width + len(want)].tolist() == want
        assert (stats.finish_reason, stats.stop_reason) == (reason, stop_reason)
