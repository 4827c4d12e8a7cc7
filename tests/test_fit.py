"""Fitting speculation to the hardware: the pure choice on made-up latency tables, the online guard, the
probe's cache, and exactness of the adaptive path (greedy equality while the guard moves every step)."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os

import pytest
import torch
from conftest import random_heads, tiny_model

from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.fit import store as probe_mod
from medusa_lite.fit import (PLAIN, AcceptanceTable, Candidate, CyclingGuard, HardwareFit, Rung, SpeedGuard,
                             bucket_of, fit_trees, latency_at)

SMALL = [[0]]
MEDIUM = [[0], [1], [0, 0]]
LARGE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 1]]
LOOKUP = {"tree": [[0]], "prompt_lookup": 8, "ngram": 3}


def _candidates():
    """Tokens per step grow with the tree, less than its size; the lookup branch pays at long contexts only."""
    return [Candidate(SMALL, [1.3, 1.3, 1.3], [2, 2, 2], [100, 100, 100]),
            Candidate(MEDIUM, [1.6, 1.6, 1.6], [4, 4, 4], [100, 100, 100]),
            Candidate(LARGE, [2.0, 2.0, 2.0], [9, 9, 9], [100, 100, 100]),
            Candidate(LOOKUP, [1.4, 2.2, 3.5], [6, 8, 9], [100, 100, 100])]


def _table(cost, cache_lengths=(128, 1024), tokens=(1, 2, 4, 8, 16)) -> dict:
    return {c: {n: cost(n, c) for n in tokens} for c in cache_lengths}


def test_linear_cost_never_speculates():
    """bf16 on an AVX2-only CPU: N tokens cost N times one, so no tree can pay (tokens per step < nodes)."""
    ladders = fit_trees(_candidates(), _table(lambda n, c: 0.05 * n), {}, overhead=0.002)
    assert [[r.tree for r in ladder] for ladder in ladders] == [[PLAIN]] * 3


def test_flat_cost_takes_the_most_tokens():
    """A GPU-like flat cost: the candidate with the most tokens per step wins, in every bucket."""
    ladders = fit_trees(_candidates(), _table(lambda n, c: 0.01), {}, overhead=0.0)
    assert [ladder[0].tree for ladder in ladders] == [LARGE, LOOKUP, LOOKUP]
    assert all(ladder[-1].tree == PLAIN for ladder in ladders)
    speeds = [r.tokens_per_second for r in ladders[0]]
    assert speeds == sorted(speeds, reverse=True)


def test_two_token_jump_picks_a_tree_that_clears_it():
    """fp32 with small-M GEMM packing: 2 tokens cost 1.6x one, then little more; small trees do not pay."""
    ladders = fit_trees(_candidates(), _table(lambda n, c: 0.086 if n == 1 else 0.138 + 0.002 * n), {}, overhead=0.0)
    assert ladders[0][0].tree == LARGE
    assert SMALL not in [r.tree for r in ladders[0]]  # 1.3 tokens for 1.6x the cost


def test_drafting_cost_and_context_are_priced():
    cost = _table(lambda n, c: 0.02 + 0.001 * n + 0.00005 * c)
    free = fit_trees(_candidates(), cost, {}, overhead=0.0)
    slow_draft = fit_trees(_candidates(), cost, {json.dumps(LARGE, separators=(",", ":")): 1.0}, overhead=0.0)
    assert free[0][0].tree == LARGE and slow_draft[0][0].tree != LARGE
    assert latency_at(cost, 4, 2048) > latency_at(cost, 4, 1024) > latency_at(cost, 4, 128)
    assert latency_at(cost, 3, 128) == pytest.approx((cost[128][2] + cost[128][4]) / 2)


def test_latency_never_decreases_with_context():
    noisy = {128: {1: 1.0, 4: 1.0}, 512: {1: 0.8, 4: 0.8}, 1024: {1: 1.2, 4: 1.2}}
    values = [latency_at(noisy, 1, c) for c in range(0, 3000, 7)]
    assert values == sorted(values) and min(values) == 1.0


def test_a_long_cache_cut_short_prices_by_the_short_one():
    """A probe whose budget ran out at the long cache length still prices every measured size."""
    cut = {128: {1: 0.05, 2: 0.05, 4: 0.05, 8: 0.06}, 1024: {1: 0.06, 4: 0.07}}
    ladders = fit_trees(_candidates(), cut, {}, overhead=0.0)
    assert all(len(ladder) > 1 for ladder in ladders)  # not collapsed to the root alone
    assert ladders[0][0].tree == MEDIUM and ladders[1][0].tree == LOOKUP


def test_unmeasured_sizes_are_left_out():
    ladders = fit_trees(_candidates(), _table(lambda n, c: 0.01, tokens=(1, 2, 4)), {}, overhead=0.0)
    assert all(LARGE not in [r.tree for r in ladder] for ladder in ladders)


def test_buckets_and_pooled_figures():
    assert [bucket_of(n) for n in (0, 255, 256, 1023, 1024, 10**6)] == [0, 0, 1, 1, 2, 2]
    sparse = Candidate(SMALL, [2.0, 3.0, 1.0], [2, 2, 2], [100, 100, 0])
    assert sparse.in_bucket(0) == (2.0, 2)
    assert sparse.in_bucket(2) == (2.5, 2)  # no steps there: the pooled figures


def test_acceptance_table_round_trip(tmp_path):
    table = AcceptanceTable([0, 256, 1024], _candidates(), _candidates()[:2], 1.0, {"prompts": "test"})
    table.save(tmp_path)
    again = AcceptanceTable.load(tmp_path)
    assert again.to_dict() == table.to_dict()
    assert AcceptanceTable.load(tmp_path / "missing") is None
    (tmp_path / "acceptance.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a medusa_lite.acceptance"):
        AcceptanceTable.load(tmp_path)
    with pytest.raises(ValueError, match="tokens_per_step"):
        Candidate(SMALL, [0.5, 1, 1], [2, 2, 2], [1, 1, 1])


# ------------------------------------------------------------------------------------- the guard
def _ladder():
    return [Rung(LARGE, 2.0, 0.010), Rung(SMALL, 1.3, 0.008), Rung(PLAIN, 1.0, 0.007)]


def test_guard_stays_when_the_prediction_holds():
    guard = SpeedGuard(_ladder(), window=4, retry=16)
    for _ in range(50):
        guard.record(2, 0.010)
    assert guard.rung() == 0


def test_guard_steps_down_to_no_tree_and_retries():
    guard = SpeedGuard(_ladder(), window=4, retry=16)
    levels = []
    for _ in range(40):
        level = guard.rung()
        levels.append(level)
        guard.record(1, 0.010 if level < 2 else 0.007)  # the trees accept nothing: slower than plain decoding
    assert levels[:4] == [0] * 4 and 2 in levels  # stepped down after one window, reached the root alone
    assert levels.index(2) <= 8
    assert 1 in levels[levels.index(2):]  # and tried a tree again after `retry` steps


def test_guard_corrects_predictions_by_what_it_saw():
    """Acceptance far below the table on this text: the guard jumps past the other trees to the root alone."""
    ladder = [Rung(LARGE, 3.0, 0.010), Rung(MEDIUM, 2.0, 0.009), Rung(SMALL, 1.5, 0.008), Rung(PLAIN, 1.0, 0.007)]
    guard = SpeedGuard(ladder, window=4, retry=100)
    for _ in range(4):
        guard.record(1, 0.010)  # nothing accepted, at the predicted cost
    assert guard.rung() == 3
    busy = SpeedGuard(ladder, window=4, retry=100)
    for _ in range(10):
        busy.record(3, 0.020)  # acceptance as predicted, every step twice as slow: all rungs slow alike
    assert busy.rung() == 0


def test_ladder_keeps_the_drafter_alone_below_lookup_branches():
    """Where the fastest rungs all carry a prompt-lookup branch (which pays only on text that repeats itself), the
    ladder's last tree rung is the fastest tree without one, the guard's fallback before the root alone."""
    lookups = [Candidate({"tree": t, "prompt_lookup": n}, [3.0, 3.0, 3.0], [len(t) + n + 1] * 3, [100] * 3)
               for t in (SMALL, MEDIUM) for n in (4, 8)]
    ladders = fit_trees(lookups + _candidates()[:2], _table(lambda n, c: 0.01 + 0.001 * n), {}, overhead=0.0)
    trees = [r.tree for r in ladders[0]]
    assert len(trees) == 5 and trees[-1] == PLAIN and trees[-2] in (SMALL, MEDIUM)
    assert all("prompt_lookup" in t for t in trees[:3])
    assert fit_trees(lookups, _table(lambda n, c: 0.01 + 0.001 * n), {}, overhead=0.0)[0][-2].tree != PLAIN


def test_guard_keeps_a_paying_tree_through_a_short_run_of_misses():
    """A drafter rung that pays on average (1.4 tokens a step for 1.09x the root's time) but, as any drafter right a
    third of the time, now and then misses 8 steps in a row: judged on its last ``memory`` steps, not the last
    ``window``, it keeps the tree (on the last window alone it fell to the root alone for ``retry`` steps each time)."""
    ladder = [Rung(SMALL, 1.4, 0.0062), Rung(PLAIN, 1.0, 0.0057)]
    guard = SpeedGuard(ladder, window=8, retry=64)
    pattern = [2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1] * 2 + [1] * 8  # 1.4 tokens a step, 8 misses
    levels = []
    for step in range(400):
        level = guard.rung()
        levels.append(level)
        guard.record(pattern[step % len(pattern)] if level == 0 else 1, 0.0062 if level == 0 else 0.0057)
    assert levels.count(0) > 0.95 * len(levels)


def test_guard_decides_from_past_steps_only():
    guard = SpeedGuard(_ladder(), window=1, retry=2)
    before = guard.rung()
    assert [guard.rung() for _ in range(5)] == [before] * 5  # asking does not move it; only record() does


# ------------------------------------------------------------------------- the probe and its cache
def _hydra_model(seed: int = 0):
    target = tiny_model("llama", seed=seed)
    model = MedusaModel(target, MedusaConfig(num_heads=3, head_type="hydra"))
    random_heads(model, std=0.5, seed=seed)
    model.acceptance = AcceptanceTable([0, 256, 1024], _candidates())
    return model


def test_probe_is_cached_and_bad_caches_are_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    model = _hydra_model()
    fit = model.fit_hardware(progress=False)
    assert not fit.cache_hit and len(fit.ladders) == 3 and fit.fingerprint["isa"]
    files = list((tmp_path / "fit").glob("*.json"))
    assert len(files) == 1 and not list((tmp_path / "fit").glob(".probe-*"))
    assert model.fit_hardware(progress=False).cache_hit is False  # in-memory fit reused as it is
    assert model.fit_hardware(progress=False, force=True).cache_hit is False
    other = _hydra_model()
    assert other.fit_hardware(progress=False).cache_hit  # a new model on the same machine: read back

    saved = json.loads(files[0].read_text())
    for corrupt in ("not json", json.dumps({**saved, "sha256": "0" * 64}),
                    json.dumps({**saved, "key": "someone else's"})):
        files[0].write_text(corrupt)
        assert not _hydra_model().fit_hardware(progress=False).cache_hit
        rewritten = json.loads(files[0].read_text())  # measured again and written whole
        assert rewritten["sha256"] == probe_mod._digest(rewritten["measured"])
    bad = json.loads(files[0].read_text())
    bad["measured"]["latency"]["128"]["1"] = -1.0
    bad["sha256"] = probe_mod._digest(bad["measured"])
    files[0].write_text(json.dumps(bad))
    assert not _hydra_model().fit_hardware(progress=False).cache_hit  # impossible numbers are not trusted


def test_interrupted_probe_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _hydra_model().fit_hardware(progress=False)
    assert not list((tmp_path / "fit").glob("*"))


def test_trees_the_heads_cannot_draft_are_left_out(tmp_path, monkeypatch, prompt):
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    model = MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=2))  # Medusa heads, depth 2
    dynamic = {"dynamic": {"nodes": 4, "depth": 2, "topk": 2, "expand": 2}}
    model.acceptance = AcceptanceTable([0, 256, 1024], [Candidate(dynamic, [3.0] * 3, [5] * 3, [100] * 3),
                                                        Candidate(LARGE, [3.0] * 3, [9] * 3, [100] * 3),
                                                        Candidate(SMALL, [1.5] * 3, [2] * 3, [100] * 3)])
    fit = model.fit_hardware(progress=False)
    assert {json.dumps(r.tree) for ladder in fit.ladders for r in ladder} <= {json.dumps(SMALL), "[]"}
    model.generate(prompt, max_new_tokens=6)
    model.acceptance = AcceptanceTable([0, 256, 1024], [Candidate(dynamic, [3.0] * 3, [5] * 3, [100] * 3)])
    model.fits.clear()
    with pytest.warns(UserWarning, match="no tree these heads can draft"):
        assert model.fit_hardware(progress=False) is None
    with pytest.warns(UserWarning, match="no tree these heads can draft"):
        model.generate(prompt, max_new_tokens=6)  # the stored tree, as heads without a table


def test_an_unwritable_cache_costs_a_probe_not_the_decoding(tmp_path, monkeypatch, prompt):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path / "file"))
    model = _hydra_model()
    with pytest.warns(UserWarning, match="cannot keep the hardware fit"):
        model.generate(prompt, max_new_tokens=6)
    assert model.last_stats.fitted is not None


def test_fit_can_be_switched_off(tmp_path, monkeypatch, prompt):
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    model = _hydra_model()
    model.generate(prompt, max_new_tokens=8, fit=False)
    assert model.last_stats.fitted is None and not (tmp_path / "fit").exists()
    model.generate(prompt, max_new_tokens=8)
    assert model.last_stats.fitted is not None
    model.fit_enabled = False  # as MEDUSA_LITE_FIT=0
    model.generate(prompt, max_new_tokens=8)
    assert model.last_stats.fitted is None
    model.generate(prompt, max_new_tokens=8, fit=True)  # an explicit argument wins
    assert model.last_stats.fitted is not None


def test_the_first_use_fit_says_what_it_does(tmp_path, monkeypatch, prompt, caplog):
    """generate's lazy fit is one visible call: it logs that it fits, and the probe logs whether it measured or read
    back its cache file, naming the file."""
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="medusa_lite"):
        _hydra_model().generate(prompt, max_new_tokens=4)
        _hydra_model().generate(prompt, max_new_tokens=4)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("on first use" in line for line in lines) == 2
    assert any("probed in" in line and str(tmp_path / "fit") in line for line in lines)
    assert any("read back from" in line and str(tmp_path / "fit") in line for line in lines)


# ------------------------------------------------------------------ exactness of the adaptive path
def restless_fit(trees) -> HardwareFit:
    """A fit whose every bucket has the ladder ``trees`` (decode it with :class:`CyclingGuard`: a new tree every
    step, or with a one-step :class:`SpeedGuard`)."""
    ladder = [Rung(t, 1.0 + 0.5 * (len(trees) - i), 0.01) for i, t in enumerate(trees)]
    return HardwareFit({}, [ladder, ladder, ladder])


ADAPTIVE_TREES = [LARGE, {"dynamic": {"nodes": 6, "depth": 3, "topk": 2, "expand": 2}}, LOOKUP, SMALL, PLAIN]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("guard", ["cycling", "speed"])
@pytest.mark.parametrize("heads", ["hydra", "eagle3"])  # eagle3: root-alone steps leave its cache pending
def test_greedy_equals_plain_while_the_guard_moves(arch, guard, heads):
    target = tiny_model(arch)
    model = MedusaModel(target, MedusaConfig(num_heads=3, head_type=heads))
    random_heads(model, std=0.5)
    if guard == "cycling":
        model.use_fit(restless_fit(ADAPTIVE_TREES), guard=CyclingGuard)
    else:  # the real guard, one-step windows, the lower rungs predicted far faster: it moves every step
        ladder = [Rung(t, 2.0, 1.0 if i == 0 else 1e-6) for i, t in enumerate(ADAPTIVE_TREES)]
        model.use_fit(HardwareFit({}, [ladder] * 3), guard=functools.partial(SpeedGuard, window=1, retry=1))
    gen = torch.Generator().manual_seed(2)
    used = set()
    for _ in range(3):
        ids = torch.randint(1, 128, (1, 10), generator=gen)
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        out = model.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(out, ref)
        used |= set(model.last_stats.fitted["steps_by_tree"])
    assert len(used) >= (len(ADAPTIVE_TREES) if guard == "cycling" else 3)  # the trees changed


# ------------------------------------------------------------------------------ packed verification
def test_packed_linears_match_linear():
    from medusa_lite.kernels import PackedLinears

    target = tiny_model("llama")
    packed = PackedLinears(target, counts=(2, 4))  # 3 rows are padded to the 4-row pack
    layer = target.model.layers[0].mlp.up_proj
    for m in (1, 2, 3, 4, 6):
        x = torch.randn(1, m, layer.in_features)
        with packed:
            y = layer(x)
        ref = torch.nn.functional.linear(x, layer.weight)
        assert y.shape == ref.shape
        assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
        if m == 1 or m > 4:
            assert torch.equal(y, ref)  # outside 2..rows the stock kernel runs
    with torch.no_grad():
        layer.weight.mul_(2.0)  # changed in place after packing: the stale packed copy is not used
    x = torch.randn(1, 3, layer.in_features)
    with packed:
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


def test_the_packed_path_covers_the_longest_run_of_sizes_where_it_won():
    from medusa_lite.fit.probe import _Latency

    lat = _Latency.__new__(_Latency)
    for wins, expected in (({2: True, 3: True, 4: True, 8: True, 16: True, 32: False}, (2, 16)),  # loses at the top
                           ({2: False, 3: True, 4: True, 8: True}, (3, 8)),
                           ({2: True, 3: False, 4: True, 8: False}, (2, 2)),  # two runs as long: the smaller
                           ({2: False, 4: False}, (0, 0))):
        lat.packed_wins = wins
        assert lat.packed_range() == expected


def test_packed_row_counts_fit_in_a_share_of_the_available_memory():
    from medusa_lite.kernels import MEMORY_SHARE, PACKED_ROWS, linear_bytes, packed_rows

    target = tiny_model("llama")
    each = linear_bytes(target)
    assert packed_rows(target, available=int(100 * each / MEMORY_SHARE)) == PACKED_ROWS
    assert packed_rows(target, available=int(2.5 * each / MEMORY_SHARE)) == PACKED_ROWS[:2]  # the smallest first
    assert packed_rows(target, available=int(0.5 * each / MEMORY_SHARE)) == ()  # not even one copy: no packing


def _skinny():
    from medusa_lite.kernels import skinny_kernel
    kernel = skinny_kernel()
    if kernel is None:
        pytest.skip("the skinny kernel does not build here (no C++ compiler, or no AVX2 kernels)")
    return kernel


def test_skinny_kernel_matches_linear_for_any_row_count_width_and_thread_count():
    kernel = _skinny()
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for n, k in ((1537, 24), (3, 5), (64, 200), (17, 12)):  # widths that are not a multiple of the 16-wide panel
                w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
                packed = kernel.pack_weight(w)
                for m in (1, 2, 3, 5, 6, 7, 8, 13, 33):  # passes of up to 6 rows, split evenly
                    x = torch.randn(2 * m, k, generator=gen)[::2]  # not contiguous
                    for bias in (None, b):
                        ref = torch.nn.functional.linear(x, w, bias)
                        assert torch.allclose(kernel.skinny_linear(x, packed, n, bias), ref, atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)
    w, b = torch.randn(1537, 64, generator=gen).bfloat16(), torch.randn(1537, generator=gen).bfloat16()
    packed = kernel.pack_weight(w)  # bf16 weights stay bf16 (half the bytes), sums in fp32, output rounded to bf16
    for m in (1, 4, 33):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        y = kernel.skinny_linear(x, packed, 1537, b)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16()
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref.float(), atol=0.05, rtol=0.01)


def test_the_cpu_kernels_give_the_same_bits_on_one_thread_and_two():
    """Shapes large enough that the kernels share them between threads (a batched step's GEMM and attention): each
    output is one thread's sum in order, so the thread count changes no bit (a kernel that split the sums across
    threads would fail here). Skipped on a one-core machine, where no second thread runs."""
    from medusa_lite.kernels import attention_kernel

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing runs in parallel")
    skinny, attention = _skinny(), attention_kernel()
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(4096, 576, generator=gen), torch.randn(16, 576, generator=gen)  # 16 rows: compute-bound
    packed = skinny.pack_weight(w)
    q = torch.randn(8, 9, 2, 64, generator=gen)  # 8 rows x 9 heads x 2 queries over 3 key/value heads of 600 keys
    k, v = torch.randn(8, 3, 600, 64, generator=gen), torch.randn(8, 3, 600, 64, generator=gen)
    mask = torch.where(torch.rand(8, 1, 2, 600, generator=gen) < 0.2, torch.finfo(torch.float32).min, 0.0)
    outputs = []
    for n_threads in (1, 2):  # (the autouse one_thread fixture restores the thread count)
        torch.set_num_threads(n_threads)
        outputs.append([skinny.skinny_linear(x, packed, 4096, None)]
                       + ([attention.small_attention(q, k, v, mask, 0.125)] if attention is not None else []))
    for one, two in zip(*outputs):
        assert torch.equal(one, two)


def test_skinny_linears_match_linear_and_skip_what_they_cannot_take():
    from medusa_lite.kernels import SKINNY_ROWS, SkinnyLinears

    _skinny()
    target = tiny_model("qwen2")  # q/k/v projections with a bias
    skinny = SkinnyLinears(target)
    layer = target.model.layers[0].self_attn.q_proj
    assert layer.bias is not None and layer in skinny._packed
    calls, kernel_linear = [], skinny._linear
    skinny._linear = lambda *args: calls.append(args[0].shape[0]) or kernel_linear(*args)  # which calls take it
    for m in (1, 2, 3, 7, SKINNY_ROWS, SKINNY_ROWS + 1):
        x = torch.randn(1, m, layer.in_features)
        calls.clear()
        with skinny:
            y = layer(x)
        ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
        assert calls == ([] if m > SKINNY_ROWS else [m])  # beyond its rows the stock kernel runs
        assert torch.equal(y, ref) or m <= SKINNY_ROWS
    with SkinnyLinears(target, min_rows=2):  # a one-token forward kept on the stock kernel
        assert torch.equal(layer(x[:, :1]), torch.nn.functional.linear(x[:, :1], layer.weight, layer.bias))
    x = torch.randn(1, 3, layer.in_features, requires_grad=True)
    with skinny, torch.enable_grad():  # a forward that needs gradients (training) takes the stock kernel
        y = layer(x)
    assert y.requires_grad and torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    x = x.detach()
    with torch.no_grad():
        layer.weight.mul_(2.0)  # changed in place after packing: the stale packed copy is not used
    with skinny:
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_held_linears_stay_patched_and_take_the_kernel_only_inside_with():
    from medusa_lite.kernels import SkinnyLinears

    _skinny()
    target = tiny_model("llama")
    skinny = SkinnyLinears(target)
    layer = target.model.layers[0].mlp.up_proj
    calls, kernel_linear = [], skinny._linear
    skinny._linear = lambda *args: calls.append(args[0].shape[0]) or kernel_linear(*args)
    x = torch.randn(1, 2, layer.in_features)
    with skinny.held():  # a decoding loop: patched once, switched on per forward
        assert "forward" in layer.__dict__
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight)) and calls == []  # held, not active
        with skinny:
            layer(x)
        assert calls == [2] and "forward" in layer.__dict__  # still patched after the forward's own ``with``
    assert "forward" not in layer.__dict__  # the module's own forward is back
    with skinny:  # without a hold: patched for the ``with`` alone, as before
        layer(x)
    assert calls == [2, 2] and "forward" not in layer.__dict__


def test_the_drafters_own_linears_take_the_skinny_kernel_for_one_row_too():
    from medusa_lite.kernels import drafting_linears

    _skinny()
    target = tiny_model("llama")
    model = MedusaModel(target, MedusaConfig(num_heads=3, head_type="eagle3"))
    linears = drafting_linears(model.drafter)
    assert linears.min_rows == 1 and model.drafter.fc in linears._packed
    assert not any(m in linears._packed for m in target.modules())  # the target's layers are not the drafter's
    x = torch.randn(1, model.drafter.fc.in_features)
    with torch.no_grad():
        ref = model.drafter.fc(x)
        with linears:
            y = model.drafter.fc(x)
    assert not torch.equal(y, ref) and torch.allclose(y, ref, atol=1e-5)  # one row through the kernel
    from medusa_lite.kernels import Kernels

    assert Kernels(draft_linears=linears).drafting() is linears
    assert drafting_linears(model.drafter.to(torch.bfloat16)) is not None  # bf16 weights are packed as bf16
    assert drafting_linears(model.drafter.to(torch.float16)) is None  # fp16 drafters keep the stock kernels


def test_the_skinny_kernel_is_preferred_and_mkl_packing_is_the_fallback(monkeypatch):
    from medusa_lite.kernels import PackedLinears, SkinnyLinears, skinny_kernel, verify_linears

    _skinny()
    target = tiny_model("llama")
    assert verify_linears(target)[0] is SkinnyLinears
    monkeypatch.setenv("MEDUSA_LITE_SKINNY", "0")
    skinny_kernel.cache_clear()
    try:
        assert skinny_kernel() is None and verify_linears(target)[0] is PackedLinears
    finally:
        skinny_kernel.cache_clear()


@pytest.mark.parametrize("kind", ["mkl", "skinny"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # nn.Linear layers (GPT-2's Conv1D is never packed)
def test_greedy_equals_plain_with_packed_verify(arch, kind):
    from medusa_lite.kernels import Kernels, PackedLinears, SkinnyLinears, VerifyKernels, drafting_linears

    if kind == "skinny":
        _skinny()
    target = tiny_model(arch)
    model = MedusaModel(target, MedusaConfig(num_heads=3, head_type="hydra"))
    random_heads(model, std=0.5)
    linears = VerifyKernels(target, first=1 if kind == "skinny" else 2, counts=(4, 8),  # skinny: one-token steps too
                            kind=SkinnyLinears if kind == "skinny" else PackedLinears)
    # skinny: drafting through the kernel too, as a fitted model on an AVX2 CPU drafts
    kernels = Kernels.defaults(target, linears=linears,
                               draft_linears=drafting_linears(model.drafter) if kind == "skinny" else None)
    model.use_fit(restless_fit(ADAPTIVE_TREES), guard=CyclingGuard, kernels=kernels)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(1, 128, (1, 10), generator=gen)
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=30, do_sample=False), ref)


def test_a_cached_probe_is_measured_again_when_the_machine_now_runs_at_another_speed(monkeypatch, tmp_path):
    """A probe cached while other work loaded the CPU (or before that load went) prices every tree wrong: when a
    one-token forward now differs from its cached time by more than STALE_RATIO either way, the fit probes again."""
    from medusa_lite.fit import store

    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    cached = {"latency": {1024: {1: 0.9}, 128: {1: 0.05, 4: 0.07}}}  # the shortest cache length is compared
    for now, is_stale in ((0.05, False), (0.07, False), (0.1, True), (0.02, True)):
        monkeypatch.setattr(store, "one_token_seconds", lambda model, cache_len, now=now: now)
        assert store.stale(None, cached) is is_stale
    assert not store.stale(None, {"latency": {128: {1: 0.001}}})  # too short to time reliably: kept
    model = _hydra_model()
    model.fit_hardware(progress=False)  # probed and cached
    monkeypatch.setattr(store, "STALE_MIN_SECONDS", 0.0)
    monkeypatch.setattr(store, "one_token_seconds", lambda model, cache_len: 1e3)  # the machine is now far slower
    assert not _hydra_model().fit_hardware(progress=False).cache_hit


def test_a_burst_of_load_during_the_first_one_token_timing_does_not_price_every_tree(monkeypatch):
    """Every tree is priced against the one-token forward, so it is timed again at the end of its cache length and
    the faster kept: a burst of other work during its first timing no longer makes every tree look nearly free."""
    calls = []

    def timed(target, cache, ids, buffers, cache_len, kernel=None, layout=None):
        calls.append(ids.numel())
        first_ones = sum(1 for n in calls if n == 1)
        burst = ids.numel() == 1 and first_ones <= 3  # the first timing's repeats, all slowed 3x
        return (0.03 if burst else 0.01) + 0.002 * ids.numel()

    probe_module = importlib.import_module("medusa_lite.fit.probe")
    monkeypatch.setattr(probe_module, "verify_seconds", timed)
    measured = probe_module.probe(_hydra_model(), [t.tree for t in _candidates() if t.tree != []], progress=False)
    for table in measured["latency"].values():
        assert table[1] == pytest.approx(0.012)


def test_heads_directory_carries_the_acceptance_table(tmp_path):
    model = _hydra_model()
    model.save_pretrained(tmp_path / "heads")
    again = MedusaModel.from_pretrained(model.base_model, tmp_path / "heads")
    assert again.acceptance.to_dict() == model.acceptance.to_dict()


def test_guard_reaches_a_lookup_rung_past_a_drafter_alone_rung_that_never_pays():
    """The rungs above the root take turns being tried: when the text starts repeating itself (a loop, where the
    lookup rung accepts 6 tokens a step), the guard finds the lookup rung even though the rung just above the root
    (the drafter alone) never pays; trying only the rung just above would never leave it."""
    ladder = [Rung(LARGE, 2.0, 0.010), Rung(SMALL, 1.3, 0.008), Rung(PLAIN, 1.0, 0.007)]
    guard = SpeedGuard(ladder, window=4, retry=16, max_retry=64)
    levels = []
    for step in range(600):
        level = guard.rung()
        levels.append(level)
        looping = step >= 200
        tokens = {0: 7 if looping else 1, 1: 1, 2: 1}[level]
        guard.record(tokens, {0: 0.010, 1: 0.008, 2: 0.007}[level])
    assert levels[150:200].count(2) > 40  # before the loop: the root alone, nothing pays
    assert levels[400:].count(0) > 190    # in the loop: the lookup rung, found and kept


def test_guard_backs_off_when_tries_keep_failing():
    guard = SpeedGuard(_ladder(), window=4, retry=16, max_retry=128)
    levels = []
    for _ in range(700):
        level = guard.rung()
        levels.append(level)
        guard.record(1, 0.010 if level < 2 else 0.007)  # no tree ever pays
    tries = [i for i in range(1, len(levels)) if levels[i] < levels[i - 1]]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[0] < gaps[1] < gaps[2] and gaps[-1] == gaps[-2]  # waits double, up to max_retry
    assert sum(level < 2 for level in levels[200:]) / 500 < 0.05  # little time spent on trees that do not pay


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    import os
    import time

    from medusa_lite.kernels import STALE_LOCK_SECONDS, _clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    _clear_stale_lock(lock)
    assert lock.exists()  # a build may be running now
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="did not finish"):
        _clear_stale_lock(lock)
    assert not lock.exists()
