"""OpenAI-compatible server for a MedusaModel: ``medusa-lite serve [--target DIR] [--heads DIR] ...``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
-> server-sent events in OpenAI's chunk format), vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``,
``GET /health``, ``GET /metrics`` (Prometheus text). Every request field is honoured or refused by name
(:mod:`medusa_lite.serve.params`); ``--api-key`` guards the API.

Scheduling: continuous batching. One worker thread decodes up to ``max_batch_size`` requests at once
(:class:`medusa_lite.decode.SpeculativeBatch`): every step verifies all their trees in one target forward;
between steps finished and cancelled requests leave and waiting ones join, their prompts prefilled together
(up to ``max_prefill_tokens`` a forward). Trees shrink as the batch grows
(priced by the latency model fitted to this machine, capped at ``max_batched_tokens`` per step). Up to
``max_queue`` more requests wait in a FIFO queue and further requests get 429 with ``Retry-After``. A request
whose client disconnects is cancelled: a waiting one leaves the queue at once, a running one leaves the batch
before the next step.

Settings (``medusa_lite.settings``): defaults < the shipped ``configs/serve/default.yaml`` (or ``--config FILE``)
< command-line flags.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from prometheus_client import disable_created_metrics

from medusa_lite import MedusaModel
from medusa_lite.settings import SettingsParser, TargetOptions, option
from medusa_lite.targets import DEFAULT_TARGET, load_model
from medusa_lite.tree import parse_tree, tree_nodes

from .app import create_app
from .engine import Engine, TorchThread
from .metrics import Metrics
from .params import generation_defaults

log = logging.getLogger("medusa_lite.serve")


# ====================================================================== settings
@dataclass
class Settings(TargetOptions):
    """Server settings. Precedence: these defaults < the YAML file (``--config``; the shipped ``default``) < flags."""

    host: str = option("127.0.0.1", "listen address (0.0.0.0: all interfaces)")
    port: int = option(8000, "listen port")
    heads: str | None = option(None, "heads directory, bundled drafter name or Hub repo id"
                               "; none: the bundled default (default target), else fresh heads")
    served_model_name: str | None = option(None, "the model id clients send; none: the target's name")
    max_queue: int = option(16, "requests waiting while the batch is full; more get 429")
    max_batch_size: int = option(16, "requests decoded at once (continuous batching); 1: one at a time")
    max_batched_tokens: int = option(128, "tree tokens one verify step may hold, all rows together (trees are "
                                          "cut to fit)")
    arrival_window_ms: float = option(20.0, "an idle server waits this long after a request for others arriving with "
                                            "it (their prompts then share one prefill forward); 0: no wait")
    max_prefill_tokens: int = option(256, "prompt tokens one prefill forward may hold when requests join together "
                                          "(prompts x the longest; a longer prompt is prefilled alone)")
    default_max_tokens: int = option(256, "max_tokens when a request gives none (capped by the context window)")
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    threads: int | None = option(None, "torch intra-op threads; none: torch's default")
    shutdown_timeout: float = option(10.0, "seconds in-flight requests get to finish on SIGINT / SIGTERM")
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log level")
    # vLLM's flags of the same names (--max-num-seqs is --max-batch-size)
    api_key: str | None = option(None, "requests to /v1/*, /tokenize and /detokenize need the header Authorization: "
                                       "Bearer <key> (else 401); none: $VLLM_API_KEY, if set, else no key")
    max_model_len: int | None = option(None, "prompt + completion tokens at most, within the target's context "
                                             "window; none: the target's")
    chat_template: str | None = option(None, "a Jinja chat template (a file or the template itself) for requests "
                                             "that send none; none: the tokenizer's")
    generation_config: str = option("auto", "defaults of the sampling fields a request leaves out: auto, the "
                                            "target's generation config; vllm, none (neutral); or a folder's "
                                            "generation_config.json")
    metrics_prefix: Literal["medusa_lite", "vllm"] = option("medusa_lite", "the Prometheus names' prefix; vllm: "
                                                            "vLLM's, read by its Grafana dashboard")

    def __post_init__(self) -> None:
        checks = {"port": 0 <= self.port < 65536, "max_queue": self.max_queue >= 0,
                  "max_batch_size": self.max_batch_size >= 1, "max_batched_tokens": self.max_batched_tokens >= 1,
                  "max_prefill_tokens": self.max_prefill_tokens >= 1, "arrival_window_ms": self.arrival_window_ms >= 0,
                  "default_max_tokens": self.default_max_tokens >= 1, "max_body_bytes": self.max_body_bytes >= 1024,
                  "shutdown_timeout": self.shutdown_timeout >= 0,
                  "max_model_len": self.max_model_len is None or self.max_model_len >= 1}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid serve settings: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


VLLM_FLAGS = {"--max-num-seqs": "--max-batch-size", "--max_num_seqs": "--max-batch-size"}  # vLLM's other names


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = SettingsParser(Settings, prog="medusa-lite serve", description=__doc__, kind="serve",
                            default_config="default")
    settings = parser.parse([_vllm_flag(arg) for arg in (sys.argv[1:] if argv is None else argv)])[0]
    settings.api_key = settings.api_key or os.environ.get("VLLM_API_KEY") or None
    return settings


def _vllm_flag(arg: str) -> str:
    flag, eq, value = arg.partition("=")
    return VLLM_FLAGS.get(flag, flag) + eq + value


def chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself (vLLM's rule: a value with Jinja syntax)."""
    if value is None or "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    return path.read_text()


def build_model(settings: Settings) -> tuple[MedusaModel, Any, str]:
    """(model, tokenizer, served name) from the settings."""
    model, tok = load_model(heads=settings.heads, **settings.load_kwargs())
    name = Path(settings.target).name if settings.target else DEFAULT_TARGET
    return model, tok, settings.served_model_name or name


# ====================================================================== main
def main(argv: list[str] | None = None) -> None:
    import uvicorn

    # 1. settings: defaults < YAML < flags
    settings = parse_settings(argv).resolve()  # the log names the device and dtype that run
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    disable_created_metrics()  # no *_created samples: this process owns its registry
    # 2. build: model, engine, app
    t0 = time.perf_counter()
    torch_thread = TorchThread()  # builds, fits and decodes: one thread for every torch call that parallelizes
    model, tokenizer, name = torch_thread.run(lambda: build_model(settings))
    log.info("loaded %s (%s, %s) in %.1f s", name, settings.dtype, settings.device, time.perf_counter() - t0)
    metrics = Metrics(name, settings.metrics_prefix)
    for decoding in ("greedy", "sample") if model.fit_enabled else ():  # fit now, not on the first request
        fit = torch_thread.run(lambda: model.fit_hardware(sample=decoding == "sample"))
        if fit is None:
            log.info("tree: the heads' stored tree, %d nodes (no acceptance table: no hardware fit)",
                     tree_nodes(model.choices) + 1)
            break
        log.info("tree fitted for %s decoding:\n%s", decoding, fit.report())
        metrics.record_fit(fit, decoding)
    engine = torch_thread.run(lambda: Engine(model, tokenizer, metrics, settings.max_queue, settings.max_batch_size,
                                             settings.max_batched_tokens, settings.max_prefill_tokens,
                                             settings.arrival_window_ms / 1000, torch_thread,
                                             max_model_len=settings.max_model_len,
                                             chat_template=chat_template(settings.chat_template)))
    log.info("continuous batching: up to %d requests at once, %d tree tokens per step", engine.max_batch_size,
             settings.max_batched_tokens)
    for decoding in ("greedy", "sample"):
        fit = model.fitted(sample=decoding == "sample")
        sizes = [b for b in (2, 4, 8, 16, 32) if b <= engine.max_batch_size]
        if fit is not None and sizes:  # the tree per batch size, per context bucket (tree tokens, root included)
            log.info("%s decoding, tree tokens per row by batch size and context bucket: %s", decoding,
                     "; ".join(f"B={b}: " + "/".join(str(tree_nodes(parse_tree(t)) + 1) for t in fit.batch_trees(b))
                               for b in sizes))
    app = create_app(engine, metrics, settings, name,
                     generation_defaults(settings.generation_config, model.generation_config))
    # 3. run until SIGINT / SIGTERM; in-flight requests get shutdown_timeout seconds to finish
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=settings.shutdown_timeout)


if __name__ == "__main__":
    main()
