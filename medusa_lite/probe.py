"""The hardware half of calibration, measured where the model runs, once per machine fingerprint.

:func:`machine_fingerprint` names what the timings depend on (CPU model and ISA class or GPU name,
threads, dtype, device, torch / transformers versions). :func:`probe` measures, within a time budget
(a few seconds, with a progress bar): the target's verify-forward latency against tree tokens at two
cache lengths, each candidate tree's drafting time, and the loop's per-step bookkeeping.
:func:`load_or_probe` keeps the result under ``<cache dir>/fit/``: a later process on the same
machine reads it back in milliseconds. A cache file that is corrupt, was written for another machine,
target, heads or library version, or holds impossible numbers is measured again, never trusted; it is
written atomically, so an interrupted probe leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from ._hf import cache_kwarg
from .drafters import drafter_features
from .fit import tree_key
from .machine import machine_fingerprint
from .paths import cache_dir
from ._version import __version__

FIT_FORMAT = "medusa_lite.fit/2"
PROBE_CACHE_LENGTHS = (128, 1024)
PROBE_TOKENS = (1, 2, 4, 8, 16, 32, 48, 64)
DEFAULT_BUDGET_S = 5.0


# ------------------------------------------------------------------------------------- measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def probe(model, candidates: list, *, budget_s: float = DEFAULT_BUDGET_S, progress: bool = True,
          max_tokens_per_step: float | None = None, packed=None, sampler=None) -> dict:
    """Measure this machine for :func:`medusa_lite.fit.fit_trees`.

    model: a :class:`medusa_lite.MedusaModel`; candidates: the trees (JSON form) whose drafting is timed.
    Verify latency is measured for 1, 2, 4, ... tree tokens at each of :data:`PROBE_CACHE_LENGTHS`, two
    timed repeats each (the faster kept), up to the largest candidate; it stops growing where a forward
    already costs more than ``max_tokens_per_step`` single-token forwards (no tree can pay beyond), and
    when ``budget_s`` is spent. With ``packed`` (:class:`medusa_lite.kernels.PackedLinears`) the sizes it
    covers are timed through it too; ``"packed_from"`` is then the smallest size from which it was faster
    at every larger size it covers (0: never), and the latency table holds the faster of the two.
    Returns ``{"latency": {cache_len: {tokens: s}}, "draft": {tree_key: s}, "overhead": s, "seconds": s,
    "packed_from": n, "phases": {name: s}}``. ``sampler``: drafting is timed with it (sampled drafts), as
    decoding with sampling drafts.
    """
    from tqdm.auto import tqdm

    from .cache import extend_cache, new_cache
    from .generate import GenerationStats, speculative_generate, verify_forward
    from .tree import build_buffers, chain, parse_tree, tree_nodes

    start = time.perf_counter()
    target = model.base_model
    device = model.device
    vocab = target.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    largest = max([tree_nodes(parse_tree(t)) + 1 for t in candidates] + [2])
    sizes = [n for n in PROBE_TOKENS if n < largest] + [next((n for n in PROBE_TOKENS if n >= largest), largest)]
    bar = tqdm(total=len(sizes) + 4 + 2, desc="medusa_lite: fitting speculation to this machine",
               disable=not progress, leave=False, file=sys.stderr)
    kw = cache_kwarg(target)
    prompt = torch.randint(0, vocab, (16,), generator=gen).to(device)

    # the loop's own per-step bookkeeping: a few steps of plain decoding inside the loop
    _, stats = speculative_generate(model.base_model, model.drafter, model.plan([]), prompt, _greedy_config(),
                                    max_new_tokens=9)
    overhead = max((stats.wall_time - stats.target_time) / max(stats.verify_steps, 1), 0.0)
    bar.update(1)

    latency: dict[int, dict[int, float]] = {}
    fast: dict[int, dict[int, float]] = {}  # the packed path's latency, where measured
    packed_wins: dict[int, bool] = {}  # tree tokens -> packed faster at every cache length so far

    def timed(cache, ids, buffers, cache_len, kernel, repeats) -> float:
        times = []
        for _ in range(repeats):
            stats = GenerationStats()
            _sync(device)
            with kernel if kernel is not None else contextlib.nullcontext():
                verify_forward(target, stats, {kw: cache}, ids, buffers, cache_len)
            _sync(device)
            cache.crop(-ids.numel())  # drop the tokens just appended
            times.append(stats.target_time)
        return min(times[-2:])

    phases = {"overhead": time.perf_counter() - start}
    for i, cache_len in enumerate(PROBE_CACHE_LENGTHS):
        cache = new_cache(target)
        out = target(input_ids=prompt[None], use_cache=True, return_dict=True, output_hidden_states=True, **{kw: cache})
        extend_cache(cache, cache_len - prompt.numel(), gen)
        # the first cache length at every size; longer ones at a few (attention's growth is smooth in tokens)
        todo = sizes if i == 0 else [n for n in latency[PROBE_CACHE_LENGTHS[0]] if n in (1, 4, 16) or
                                     n == max(latency[PROBE_CACHE_LENGTHS[0]])]
        table: dict[int, float] = {}
        for n in todo:
            ids = torch.randint(0, vocab, (n,), generator=gen).to(device)
            buffers = build_buffers(chain(n - 1), device)
            table[n] = timed(cache, ids, buffers, cache_len, None, 3 if not table else 2)  # first: + a warm-up
            if packed is not None and 1 < n <= packed.rows and packed_wins.get(n, True):
                fast.setdefault(cache_len, {})[n] = timed(cache, ids, buffers, cache_len, packed, 3 if n == 2 else 2)
                packed_wins[n] = fast[cache_len][n] < table[n]
            bar.update(1)
            if max_tokens_per_step is not None and table[n] > max_tokens_per_step * table[todo[0]]:
                break
            if time.perf_counter() - start > budget_s:
                break
        if i == 0 or len(table) >= 2:  # a longer cache length cut to one point says nothing of its growth
            latency[cache_len] = table
        if time.perf_counter() - start > budget_s:
            break
    bar.update(bar.total - 1 - bar.n)
    phases["latency"] = time.perf_counter() - start - phases["overhead"]

    # a real state to draft from: the prompt's features, its last token as the root
    state = model.drafter.start([torch.cat([prompt, prompt[-1:]])],
                                drafter_features(out.hidden_states, model.drafter.hidden_layers)[:, : prompt.numel()])
    draft: dict[str, float] = {}
    for tree in candidates:
        plan = model.plan(parse_tree(tree, model.config.num_heads), sampler)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            plan(state, 8)
            _sync(device)
            times.append(time.perf_counter() - t0)
        draft[tree_key(tree)] = min(times)
    bar.update(1)
    bar.close()
    phases["drafting"] = time.perf_counter() - start - phases["overhead"] - phases["latency"]
    packed_from = 0
    for n in sorted(packed_wins, reverse=True):  # the packed path from the smallest size that wins up to its rows
        if not packed_wins[n]:
            break
        packed_from = n
    for cache_len, table in latency.items():  # the latency of the path each size will take
        for n, seconds in fast.get(cache_len, {}).items():
            if packed_from and packed_from <= n:
                table[n] = seconds
    return {"latency": latency, "draft": draft, "overhead": overhead, "seconds": time.perf_counter() - start,
            "packed_from": packed_from, "phases": phases}


def _greedy_config():
    from transformers import GenerationConfig
    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=None)


# --------------------------------------------------------------------------------------- caching
def cache_path(key: str) -> Path:
    return cache_dir() / "fit" / f"{key[:40]}.json"


def fit_key(fingerprint: dict, target_id: str, heads_id: str, candidates: list, sample: bool) -> str:
    """The cache key: machine, target, heads (their drafting is timed), the candidate trees, greedy or sampled
    drafting, the format and the library version."""
    blob = json.dumps({"format": FIT_FORMAT, "version": __version__, "machine": fingerprint, "target": target_id,
                       "heads": heads_id, "candidates": sorted(tree_key(t) for t in candidates), "sample": sample},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _digest(measured: dict) -> str:
    return hashlib.sha256(json.dumps(measured, sort_keys=True).encode()).hexdigest()


def check_measured(measured: dict) -> dict:
    """Validate a probe result read back from JSON (string keys) and return it with int keys; ValueError if
    anything is missing or impossible (non-finite or non-positive times)."""
    def seconds(x) -> float:
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
            raise ValueError(f"impossible time {x!r}")
        return float(x)

    latency = {int(c): {int(n): seconds(s) for n, s in t.items()} for c, t in measured["latency"].items()}
    if not latency or any(not t or 1 not in t for t in latency.values()):
        raise ValueError("latency table without a single-token forward")
    if any(s <= 0 for t in latency.values() for s in t.values()):
        raise ValueError("a forward cannot take no time")
    packed_from = measured.get("packed_from", 0)
    if not isinstance(packed_from, int) or packed_from < 0:
        raise ValueError(f"impossible packed_from {packed_from!r}")
    return {"latency": latency, "draft": {str(k): seconds(v) for k, v in measured["draft"].items()},
            "overhead": seconds(measured["overhead"]), "seconds": seconds(measured.get("seconds", 0.0)),
            "packed_from": packed_from,
            "phases": {str(k): seconds(v) for k, v in measured.get("phases", {}).items()}}


def read_cached(key: str) -> dict | None:
    """The cached probe for ``key``, or None when absent, corrupt, foreign or impossible."""
    path = cache_path(key)
    try:
        saved = json.loads(path.read_text())
        if saved.get("format") != FIT_FORMAT or saved.get("key") != key or saved.get("sha256") != _digest(saved["measured"]):
            return None
        return check_measured(saved["measured"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_cached(key: str, fingerprint: dict, measured: dict) -> Path | None:
    """Write atomically (a temporary file renamed into place): readers see the old file or the whole new one.
    Best effort: a cache directory that cannot be written costs a probe per process, not the decoding (None)."""
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"medusa_lite: cannot keep the hardware fit in {path.parent} ({e}); it is measured again "
                      "in every process", stacklevel=2)
        return None
    measured = json.loads(json.dumps(measured))  # the JSON form (string keys) is what the digest covers
    blob = {"format": FIT_FORMAT, "key": key, "fingerprint": fingerprint, "measured": measured,
            "sha256": _digest(measured), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probe-", suffix=".tmp")
    except OSError as e:
        warnings.warn(f"medusa_lite: cannot write the hardware fit to {path.parent} ({e})", stacklevel=2)
        return None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(blob, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        warnings.warn(f"medusa_lite: cannot write the hardware fit to {path} ({e})", stacklevel=2)
        return None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_or_probe(model, candidates: list, *, force: bool = False, progress: bool = True,
                  budget_s: float = DEFAULT_BUDGET_S, max_tokens_per_step: float | None = None, sampler=None):
    """(fingerprint, measured, cache hit, verify kernels or None): the cached probe for this machine, target and
    candidates, else a fresh probe (written to the cache). The kernels are the packed linears
    (:mod:`medusa_lite.kernels`) where they were measured faster, packed once per process."""
    from .kernels import PackedLinears, VerifyKernels, packing_available

    fingerprint = machine_fingerprint(model.device, model.dtype)
    heads = {k: v for k, v in model.config.to_dict().items() if k not in ("tree", "dtype_trees")}
    key = fit_key(fingerprint, json.dumps(model.config.target_fingerprint, sort_keys=True),
                  json.dumps(heads, sort_keys=True, default=str), candidates, sampler is not None)
    measured, hit, packed = None, False, None
    if not force:
        measured = read_cached(key)
        hit = measured is not None
    if measured is None:
        packed = PackedLinears(model.base_model) if packing_available(model.base_model) else None
        measured = probe(model, candidates, budget_s=budget_s, progress=progress,
                         max_tokens_per_step=max_tokens_per_step, packed=packed, sampler=sampler)
        write_cached(key, fingerprint, measured)
        measured = check_measured(json.loads(json.dumps(measured)))
    if not measured["packed_from"]:
        return fingerprint, measured, hit, None
    return fingerprint, measured, hit, VerifyKernels(model.base_model, measured["packed_from"], packed=packed)

