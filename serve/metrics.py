"""The server's Prometheus metrics (vLLM's names and ``model_name`` label; prefix ``medusa_lite:``, or ``vllm:`` for
vLLM's Grafana dashboard) and a request's speculative statistics."""

from __future__ import annotations

import functools
import json
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from medusa_lite.decode import GenerationStats
from medusa_lite.machine import describe


class Metrics:
    """Prometheus metrics in their own registry (vLLM's names, ``medusa_lite:`` prefix).

    Spec-decode counters, per verify step (one target forward over the tree):
      num_drafts            += 1
      num_draft_tokens      += the tree's depth at that step (positions drafted ahead; trees are cut
                               shallower in the last steps before max_tokens / the context end)
      num_accepted_tokens   += accepted depth (draft tokens the target agreed with; the bonus token
                               is not counted)
      accepted_per_pos{k}   += 1 if the accepted depth > k (k = 0: the first drafted position)
    so ``accepted / draft_tokens`` is the per-position acceptance rate and
    ``1 + accepted / drafts`` the mean tokens per verify step, as in vLLM.
    """

    def __init__(self, model_name: str = "model", prefix: str = "medusa_lite") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name  # every sample's model_name label, as vLLM labels its metrics
        p = prefix + ":"
        counter, gauge, histogram = (functools.partial(self._metric, kind) for kind in (Counter, Gauge, Histogram))
        self.drafts = counter(p + "spec_decode_num_drafts", "Verify steps (target forwards over a tree).")
        self.draft_tokens = counter(p + "spec_decode_num_draft_tokens", "Draft positions proposed.")
        self.accepted = counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position.", ["position"])
        self.requests = counter(p + "requests", "API requests by HTTP status.", ["status"])
        self.finished = counter(p + "request_success", "Finished requests by finish reason "
                                "(stop / length / cancelled / error).", ["finished_reason"])
        self.prompt_tokens = counter(p + "prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter(p + "generation_tokens", "Generated tokens.")
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
        self.ttft = histogram(p + "time_to_first_token_seconds", "Arrival to first token (queue wait included).",
                              buckets=buckets)
        self.e2e = histogram(p + "e2e_request_latency_seconds", "Arrival to last token.", buckets=buckets)
        self.running = gauge(p + "num_requests_running", "Requests generating (rows of the running batch).")
        self.batch_size = histogram(p + "batch_size", "Rows verified together, per decoding step.",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
        self.waiting = gauge(p + "num_requests_waiting", "Requests queued.")
        # the tree fitted to this machine (medusa_lite.fit): what was chosen, predicted vs realized speed
        fit_labels = ["decoding", "context"]
        self.fit_info = gauge(p + "fit_info", "The tree fitted to this machine per decoding mode and context bucket "
                              "(value 1; the machine and tree are labels).", fit_labels + ["machine", "tree"])
        self.fit_predicted = gauge(p + "fit_predicted_tokens_per_second", "Predicted tokens/s of the fitted tree.",
                                   fit_labels)
        self.fit_plain = gauge(p + "fit_predicted_plain_tokens_per_second",
                               "Predicted tokens/s of plain decoding on this machine.", fit_labels)
        self.fit_tokens = counter(p + "fit_realized_tokens", "Tokens emitted by speculative steps.", fit_labels)
        self.fit_seconds = counter(p + "fit_realized_seconds", "Wall seconds of speculative steps (realized tokens/s "
                                   "= rate of fit_realized_tokens / rate of this).", fit_labels)
        self._contexts: dict[str, list[str]] = {}

    def _metric(self, kind, name: str, doc: str, labels: list[str] = (), **kwargs):
        """A metric of this registry labelled ``model_name``, the label bound: ``.inc()`` etc. where it has no other
        label, ``.labels(**others)`` where it has."""
        metric = kind(name, doc, ["model_name", *labels], registry=self.registry, **kwargs)
        return _ModelLabel(metric, self.model_name) if labels else metric.labels(model_name=self.model_name)

    def record_fit(self, fit, decoding: str) -> None:
        """Publish a :class:`medusa_lite.fit.HardwareFit` (``decoding``: greedy or sample)."""
        rows = fit.summary()["buckets"]
        self._contexts[decoding] = [row["context"] for row in rows]
        for row in rows:
            labels = {"decoding": decoding, "context": row["context"]}
            self.fit_info.labels(**labels, machine=describe(fit.fingerprint), tree=json.dumps(row["tree"])).set(1)
            self.fit_predicted.labels(**labels).set(row["predicted_tokens_per_second"])
            self.fit_plain.labels(**labels).set(row["predicted_plain_tokens_per_second"])

    def record_spec(self, stats: GenerationStats) -> None:
        self.drafts.inc(stats.verify_steps)
        self.draft_tokens.inc(sum(stats.step_depths))  # tree depth verified per step (vLLM's draft length)
        self.accepted.inc(sum(stats.accepted_per_depth))
        for k, n in enumerate(stats.accepted_per_depth):
            self.accepted_per_pos.labels(position=str(k)).inc(n)

    def record_fitted(self, stats: GenerationStats, decoding: str) -> None:
        """Realized speed of the fitted trees' speculative steps, per context bucket."""
        contexts = self._contexts.get(decoding)
        if stats.fitted is None or contexts is None:
            return
        for context, (tokens, seconds) in zip(contexts, stats.fitted["realized"]):
            if tokens:
                self.fit_tokens.labels(decoding=decoding, context=context).inc(tokens)
                self.fit_seconds.labels(decoding=decoding, context=context).inc(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def speculative_stats(stats: GenerationStats) -> dict[str, Any]:
    """The request's speculative decoding, as the response's ``medusa_lite`` extension field (the Prometheus
    counters' names; llama.cpp's ``draft_n`` / ``draft_n_accepted``)."""
    return {"verify_steps": stats.verify_steps, "draft_tokens": sum(stats.step_depths),
            "accepted_tokens": sum(stats.accepted_per_depth),
            "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4)}


class _ModelLabel:
    """A labelled metric whose ``labels(...)`` adds the ``model_name`` label."""

    def __init__(self, metric, model_name: str):
        self.metric, self.model_name = metric, model_name

    def labels(self, **labels):
        return self.metric.labels(model_name=self.model_name, **labels)
