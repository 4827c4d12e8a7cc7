"""The hardware fit's cache: a probe's result kept under ``<cache dir>/fit/`` per machine, target, heads and
candidates, so a later process on the same machine reads it back in milliseconds. A cache file that is corrupt,
was written for another machine, target, heads or library version, or holds impossible numbers is measured again,
never trusted; it is written atomically, so an interrupted probe leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

from .._hf import output_weight
from .._version import __version__
from ..kernels import ATTENTION_SOURCE_ID, VerifyKernels, attention_kernel, verify_linears
from .pricing import DRAFT_BATCH
from ..machine import machine_fingerprint
from ..paths import cache_dir
from ..tree import tree_key
from .probe import DEFAULT_BUDGET_S, one_token_seconds, probe

# Bump whenever what the probe measures or how its figures are used changes (sizes timed, kernels timed, fields
# kept): a cached probe of another format is measured again, never reinterpreted.
FIT_FORMAT = "medusa_lite.fit/11"

log = logging.getLogger("medusa_lite")


def cache_path(key: str) -> Path:
    return cache_dir() / "fit" / f"{key[:40]}.json"


def fit_key(fingerprint: dict, target_id: str, heads_id: str, candidates: list, sample: bool,
            kernel: str = "") -> str:
    """The cache key: machine, target, heads (their drafting is timed), the candidate trees, greedy or sampled
    drafting, the packed verify path and the few-query attention kernel timed (``kernel``: their sources' ids), the
    format and the library version."""
    blob = json.dumps({"format": FIT_FORMAT, "version": __version__, "machine": fingerprint, "target": target_id,
                       "heads": heads_id, "candidates": sorted(tree_key(t) for t in candidates), "sample": sample,
                       "kernel": kernel}, sort_keys=True)
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
    packed_from, packed_to = measured.get("packed_from", 0), measured.get("packed_to", 0)
    if (not isinstance(packed_from, int) or not isinstance(packed_to, int) or packed_from < 0
            or (packed_from and packed_to < packed_from)):
        raise ValueError(f"impossible packed range {packed_from!r}..{packed_to!r}")
    return {"latency": latency, "draft": {str(k): seconds(v) for k, v in measured["draft"].items()},
            "draft_batch": {str(k): seconds(v) for k, v in measured.get("draft_batch", {}).items()},
            "overhead": seconds(measured["overhead"]), "seconds": seconds(measured.get("seconds", 0.0)),
            "packed_from": packed_from, "packed_to": packed_to,
            "stock_one": {int(c): seconds(s) for c, s in measured.get("stock_one", {}).items()},
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


STALE_RATIO = 1.6  # a cached probe whose one-token forward is now this much slower or faster is measured again
STALE_MIN_SECONDS = 0.005  # below this a one-token forward is timer and dispatch jitter: not checked


def stale(model, measured: dict) -> bool:
    """Whether this machine's one-token forward now differs from the cached probe's by more than
    :data:`STALE_RATIO` either way (a probe taken while other work loaded the CPU, or the load gone since): its
    prices would be off for every tree, so it is measured again. Costs a prefill and four one-token forwards."""
    cache_len, table = min(measured["latency"].items())
    then = measured.get("stock_one", {}).get(cache_len, table.get(1, 0.0))  # the stock kernel's, as timed now
    if then < STALE_MIN_SECONDS:
        return False
    now = one_token_seconds(model, cache_len)
    return not 1 / STALE_RATIO <= now / then <= STALE_RATIO


def load_or_probe(model, candidates: list, *, force: bool = False, progress: bool = True,
                  budget_s: float = DEFAULT_BUDGET_S, max_tokens_per_step: float | None = None, sampler=None,
                  kernels=None):
    """(fingerprint, measured, cache hit, verify linears or None) for ``model`` (a :class:`~.machine.Subject`): the
    cached probe for this machine, target and candidates (logged, with its file), else a fresh probe (written to the cache) that decodes and drafts with ``kernels``
    (:class:`medusa_lite.kernels.Kernels`). The verify linears (:class:`medusa_lite.kernels.VerifyKernels`: the
    skinny kernel, else MKL's packed GEMM) cover the sizes where they were measured faster, packed once per
    process."""
    weight = output_weight(model.base_model)
    fingerprint = machine_fingerprint(weight.device, weight.dtype)
    heads = {k: v for k, v in model.config.to_dict().items() if k != "tree"}
    linears = verify_linears(model.base_model)  # (the packed path's class, its row counts); memory read once
    kind, counts = linears if linears is not None else (None, ())
    sources = f" attention {ATTENTION_SOURCE_ID}" if weight.device.type == "cpu" and attention_kernel() else ""
    sources += f" draft_batch {DRAFT_BATCH}"  # probes before rows drafted together did not time them
    key = fit_key(fingerprint, json.dumps(model.config.target_fingerprint, sort_keys=True),
                  json.dumps(heads, sort_keys=True, default=str), candidates, sampler is not None,
                  (f"{kind.__name__}{list(counts)}{kind.source_id}" if kind is not None else "") + sources)
    measured, hit, packed = None, False, None
    if not force:
        measured = read_cached(key)
        hit = measured is not None and not stale(model, measured)
        measured = measured if hit else None
    if measured is None:
        packed = kind(model.base_model, counts) if kind is not None else None
        measured = probe(model, candidates, budget_s=budget_s, progress=progress,
                         max_tokens_per_step=max_tokens_per_step, packed=packed, sampler=sampler, kernels=kernels)
        write_cached(key, fingerprint, measured)
        measured = check_measured(json.loads(json.dumps(measured)))
    log.info("medusa_lite: hardware fit (%s): %s %s", "sampling" if sampler is not None else "greedy",
             "probe read back from" if hit else f"probed in {measured['seconds']:.1f} s, cached in", cache_path(key))
    if not measured["packed_from"] or not counts:
        return fingerprint, measured, hit, None
    return fingerprint, measured, hit, VerifyKernels(model.base_model, measured["packed_from"], counts, packed=packed,
                                                     kind=kind, last=measured["packed_to"])
