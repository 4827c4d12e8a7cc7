"""The hardware half of calibration, measured where the model runs: :func:`probe` measures, within a time budget
(a few seconds, with a progress bar), the target's verify-forward latency against tree tokens at two cache lengths,
each candidate tree's drafting time, and the loop's per-step bookkeeping. :func:`verify_seconds` is the one routine
that times a verify forward (``medusa-lite calibrate`` times with it too). :mod:`.store` keeps the results."""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from .._hf import cache_kwarg, output_weight
from ..kv import attention_layout, extend_cache, new_cache
from ..decode import draft_rows, make_plan, speculative_generate, verify_forward
from ..drafters import drafter_features
from ..kernels import Kernels
from ..tree import build_buffers, chain, parse_tree, tree_key, tree_nodes
from .pricing import DRAFT_BATCH

PROBE_CACHE_LENGTHS = (128, 1024)
# Sizes 3, 6 and 12 too: a GEMM's cost is a staircase in its rows on some CPUs (Intel MKL's AVX-512 fp32 GEMM takes
# rows three at a time below 16: 3 tree tokens cost about what 1 does, 4 about twice), which 2-4-8 interpolation hides.
PROBE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 48, 64)
DEFAULT_BUDGET_S = 5.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_seconds(target, cache, ids: torch.Tensor, buffers, cache_len: int, kernel=None, layout=None) -> float:
    """Seconds of one verify forward of ``ids`` ([N] tree tokens) over ``cache`` (``cache_len`` tokens), exactly as
    decoding runs it, inside ``kernel`` (e.g. :class:`medusa_lite.kernels.PackedLinears`) when given; the cache is
    cropped back afterwards. The one routine that times a verify forward."""
    device = ids.device
    _sync(device)
    with kernel if kernel is not None else contextlib.nullcontext():
        _, seconds = verify_forward(target, {cache_kwarg(target): cache}, ids, buffers, cache_len, layout=layout)
    _sync(device)
    cache.crop(-ids.numel())  # drop the tokens just appended
    return seconds


def overhead_per_step(stats: list) -> float:
    """Seconds per verify step spent outside target forwards (drafting, verification, bookkeeping), over the
    :class:`~medusa_lite.decode.GenerationStats` of some generations. The one routine for the per-step overhead."""
    outside = sum(s.wall_time - s.target_time for s in stats)
    return max(outside / max(sum(s.verify_steps for s in stats), 1), 0.0)


def step_overhead(model, prompt: torch.Tensor, kernels: Kernels | None = None) -> float:
    """The loop's own per-step bookkeeping (seconds outside target forwards): a few steps of plain decoding."""
    _, stats = speculative_generate(model.base_model, model.drafter, make_plan(model.drafter, [], output_weight(model.base_model).device), prompt, _greedy_config(),
                                    max_new_tokens=9, kernels=kernels)
    return overhead_per_step([stats])


class _Latency:
    """The verify latency tables a probe fills: the stock kernels' and, where measured, the packed path's."""

    def __init__(self, target, packed, gen: torch.Generator):
        self.target, self.packed, self.gen = target, packed, gen
        self.layout = attention_layout(target)  # read once, not per timed forward
        self.table: dict[int, dict[int, float]] = {}
        self.fast: dict[int, dict[int, float]] = {}  # the packed path's latency, where measured
        self.packed_wins: dict[int, bool] = {}  # tree tokens -> packed faster at every cache length so far

    def timed(self, cache, ids, buffers, cache_len, kernel, repeats) -> float:
        times = [verify_seconds(self.target, cache, ids, buffers, cache_len, kernel, self.layout)
                 for _ in range(repeats)]
        return min(times[-2:])

    def measure(self, cache, cache_len: int, n: int, first: bool) -> float:
        """Time ``n`` tree tokens at ``cache_len`` (and through the packed path where it may win); the stock time."""
        device = self.target.get_output_embeddings().weight.device
        vocab = self.target.get_output_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (n,), generator=self.gen).to(device)
        buffers = build_buffers(chain(n - 1), device)
        seconds = self.timed(cache, ids, buffers, cache_len, None, 3 if first else 2)  # first: + a warm-up
        if self.packed is not None and self.packed.min_rows <= n <= self.packed.rows and self.packed_wins.get(n, True):
            fast = self.fast.setdefault(cache_len, {})[n] = self.timed(cache, ids, buffers, cache_len, self.packed,
                                                                       3 if n == 2 else 2)
            self.packed_wins[n] = fast < seconds
        return seconds

    def packed_range(self) -> tuple[int, int]:
        """(first, last): the longest run of measured sizes at each of which the packed path won (the smaller run
        of two as long); (0, 0): it never won."""
        best, run = (0, 0, 0), []  # (first, last, sizes in the run)
        for n in sorted(self.packed_wins):
            run = run + [n] if self.packed_wins[n] else []
            if len(run) > best[2]:  # strictly longer: of two runs as long, the smaller stays
                best = (run[0], run[-1], len(run))
        return best[:2]

    def result(self) -> tuple[dict[int, dict[int, float]], int, int, dict[int, float]]:
        """(latency of the path each size will take, packed_from, packed_to, the stock one-token latency per
        cache length: what :func:`medusa_lite.fit.store.stale` compares a fresh stock forward with)."""
        stock_one = {cache_len: table[1] for cache_len, table in self.table.items() if 1 in table}
        first, last = self.packed_range()
        for cache_len, table in self.table.items():
            for n, seconds in self.fast.get(cache_len, {}).items():
                if first and first <= n <= last:
                    table[n] = seconds
        return self.table, first, last, stock_one


def filled_cache(target, prompt: torch.Tensor, cache_len: int, gen: torch.Generator):
    """(the prompt's forward output, a cache of ``cache_len`` tokens: the prompt's, then random filler)."""
    cache = new_cache(target)
    out = target(input_ids=prompt[None], use_cache=True, return_dict=True, output_hidden_states=True,
                 **{cache_kwarg(target): cache})
    extend_cache(cache, cache_len - prompt.numel(), gen)
    return out, cache


def _measure_latency(model, prompt, sizes, lat: _Latency, bar, deadline: float, max_tokens_per_step):
    """Fill ``lat`` for every cache length of :data:`PROBE_CACHE_LENGTHS` until ``deadline``; returns the prompt's
    forward output (its features seed the drafting measurement)."""
    target = model.base_model
    for i, cache_len in enumerate(PROBE_CACHE_LENGTHS):
        out, cache = filled_cache(target, prompt, cache_len, lat.gen)
        # the first cache length at every size; longer ones at a few (attention's growth is smooth in tokens)
        first = lat.table.get(PROBE_CACHE_LENGTHS[0], {})
        todo = sizes if i == 0 else [n for n in first if n in (1, 4, 16) or n == max(first)]
        table: dict[int, float] = {}
        for n in todo:
            table[n] = lat.measure(cache, cache_len, n, first=not table)
            bar.update(1)
            if max_tokens_per_step is not None and table[n] > max_tokens_per_step * table[todo[0]]:
                break
            if time.perf_counter() > deadline:
                break
        if 1 in table:  # every tree is priced against one token: timed again last, the faster kept (a burst of load
            table[1] = min(table[1], lat.measure(cache, cache_len, 1, first=False))  # while it ran skews every ratio)
        if i == 0 or len(table) >= 2:  # a longer cache length cut to one point says nothing of its growth
            lat.table[cache_len] = table
        if time.perf_counter() > deadline:
            break
    return out


def draft_seconds(model, candidates: list, state, sampler=None, kernels: Kernels | None = None) -> dict[str, float]:
    """Per candidate tree (by :func:`~medusa_lite.tree.tree_key`), the faster of two drafting calls from ``state``
    (its rows drafted as a batched step drafts them, :func:`~medusa_lite.decode.draft_rows`)."""
    draft: dict[str, float] = {}
    device = output_weight(model.base_model).device
    rows = len(state.ids)
    for tree in candidates:
        plan = make_plan(model.drafter, parse_tree(tree, model.config.num_heads), device, sampler)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            with (kernels or Kernels()).drafting():
                draft_rows([plan] * rows, state, [8] * rows)
            _sync(device)
            times.append(time.perf_counter() - t0)
        draft[tree_key(tree)] = min(times)
    return draft


@torch.no_grad()
def probe(model, candidates: list, *, budget_s: float = DEFAULT_BUDGET_S, progress: bool = True,
          max_tokens_per_step: float | None = None, packed=None, sampler=None, kernels: Kernels | None = None) -> dict:
    """Measure this machine for :func:`medusa_lite.fit.fit_trees`.

    model: a :class:`~.machine.Subject` (its ``base_model``, ``drafter`` and ``config``); candidates: the trees (JSON form) whose drafting is timed.
    Verify latency is measured for 1, 2, 3, 4, 6, ... tree tokens (:data:`PROBE_TOKENS`) at each of :data:`PROBE_CACHE_LENGTHS`, two
    timed repeats each (the faster kept), up to the largest candidate; it stops growing where a forward
    already costs more than ``max_tokens_per_step`` single-token forwards (no tree can pay beyond), and
    when ``budget_s`` is spent. With ``packed`` (:class:`medusa_lite.kernels.PackedLinears`) the sizes it
    covers are timed through it too; ``"packed_from"`` .. ``"packed_to"`` is then the longest run of sizes at
    each of which it was faster (0: never), and the latency table holds the path each size will take.
    Returns ``{"latency": {cache_len: {tokens: s}}, "draft": {tree_key: s}, "draft_batch": {tree_key: s}, "overhead": s,
    "seconds": s,
    "packed_from": n, "packed_to": n, "stock_one": {cache_len: s}, "phases": {name: s}}``. ``sampler``: drafting
    is timed with it (sampled drafts), as decoding with sampling drafts. ``kernels``: what decoding will run with
    (:class:`medusa_lite.kernels.Kernels`, the verify linears aside; None: ``Kernels.defaults``), set up once for
    the whole probe as a decoding loop sets them up.
    """
    kernels = kernels or Kernels.defaults(model.base_model)
    with kernels.held(model.base_model):
        return _probe(model, candidates, budget_s, progress, max_tokens_per_step, packed, sampler, kernels)


def _probe(model, candidates: list, budget_s: float, progress: bool, max_tokens_per_step: float | None, packed,
           sampler, kernels: Kernels) -> dict:
    from tqdm.auto import tqdm

    start = time.perf_counter()
    vocab = model.base_model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    largest = max([tree_nodes(parse_tree(t)) + 1 for t in candidates] + [2])
    sizes = [n for n in PROBE_TOKENS if n < largest] + [next((n for n in PROBE_TOKENS if n >= largest), largest)]
    bar = tqdm(total=len(sizes) + 4 + 2, desc="medusa_lite: fitting speculation to this machine",
               disable=not progress, leave=False, file=sys.stderr)
    prompt = torch.randint(0, vocab, (16,), generator=gen).to(output_weight(model.base_model).device)
    overhead = step_overhead(model, prompt, kernels)
    bar.update(1)
    phases = {"overhead": time.perf_counter() - start}
    lat = _Latency(model.base_model, packed, gen)
    out = _measure_latency(model, prompt, sizes, lat, bar, start + budget_s, max_tokens_per_step)
    bar.update(bar.total - 1 - bar.n)
    phases["latency"] = time.perf_counter() - start - phases["overhead"]
    # a real state to draft from: the prompt's features, its last token as the root
    ids = torch.cat([prompt, prompt[-1:]])
    features = drafter_features(out.hidden_states, model.drafter.hidden_layers)[:, : prompt.numel()]
    draft = draft_seconds(model, candidates, model.drafter.start([ids], features), sampler, kernels)
    rows = model.drafter.start([ids] * DRAFT_BATCH, features.expand(DRAFT_BATCH, -1, -1))
    draft_batch = draft_seconds(model, candidates, rows, sampler, kernels)  # rows of a batched step share the drafter's passes
    bar.update(1)
    bar.close()
    phases["drafting"] = time.perf_counter() - start - phases["overhead"] - phases["latency"]
    latency, packed_from, packed_to, stock_one = lat.result()
    return {"latency": latency, "draft": draft, "draft_batch": draft_batch, "overhead": overhead,
            "seconds": time.perf_counter() - start,
            "packed_from": packed_from, "packed_to": packed_to, "stock_one": stock_one, "phases": phases}


@torch.no_grad()
def one_token_seconds(model, cache_len: int = PROBE_CACHE_LENGTHS[0], repeats: int = 3) -> float:
    """A one-token verify forward at ``cache_len`` now, the fastest of ``repeats`` (after a warm-up): what a cached
    probe's ``latency[cache_len][1]`` said, measured again in well under a second."""
    target = model.base_model
    gen = torch.Generator().manual_seed(0)
    vocab = target.get_output_embeddings().weight.shape[0]
    device = output_weight(target).device
    _, cache = filled_cache(target, torch.randint(0, vocab, (16,), generator=gen).to(device), cache_len, gen)
    ids = torch.randint(0, vocab, (1,), generator=gen).to(device)
    buffers, layout = build_buffers(chain(0), device), attention_layout(target)
    with Kernels().held(target):  # as the probe timed it: the attention routed once, not per timed forward
        return min(verify_seconds(target, cache, ids, buffers, cache_len, layout=layout) for _ in range(repeats + 1))


def _greedy_config():
    from transformers import GenerationConfig
    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=None)
