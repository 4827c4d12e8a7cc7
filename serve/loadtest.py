"""Load test for ``medusa-lite serve``: time to first token and tokens/s at several client concurrencies.

    python serve/loadtest.py --url http://127.0.0.1:8000 --concurrency 1,4,8 --max-tokens 64
    python serve/loadtest.py --spawn "--dtype bf16"      # start a server on a free port, test, stop it

Each of N concurrent clients sends ``--requests`` streamed chat requests one after another (greedy by
default, ``stream_options.include_usage`` for exact token counts). Per concurrency level it reports
  TTFT        arrival -> first content chunk, seen by the client (queue wait included)
  client tok/s  completion tokens / request wall time, averaged over requests
  total tok/s   all completion tokens / wall time of the level
  tokens/step   1 + accepted / drafts from the server's spec-decode counters over the level
The server batches concurrent requests (continuous batching, ``max_batch_size``): total tok/s grows with N
while the batch has room; beyond it requests wait and TTFT grows.
A tool that reports: nothing here asserts timings.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from medusa_lite.settings import Ints, SettingsParser, option

PROMPTS = [
    "What are three tips for staying healthy?",
    "Write a short Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "Give me a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "How do I boil an egg?",
    "Name five countries in South America and their capitals.",
]


@dataclass
class LoadtestSettings:
    """``medusa-lite loadtest`` settings: these defaults < ``--config FILE`` < flags."""

    url: str = option("http://127.0.0.1:8000", "server to load")
    spawn: str | None = option(None, "start `medusa-lite serve SPAWN` on a free port instead of using --url")
    concurrency: Ints = option(Ints((1, 4, 8, 16)), "client counts, one level each")
    requests: int = option(1, "requests per client per level")
    max_tokens: int = option(64, "max_tokens per request")
    temperature: float = option(0.0, "sampling temperature (0: greedy)")
    timeout: float = option(600.0, "per request, seconds")
    json: str | None = option(None, "also write the results here")


def parse_args(argv: list[str] | None = None) -> LoadtestSettings:
    return SettingsParser(LoadtestSettings, prog="medusa-lite loadtest", description=__doc__,
                          kind="loadtest").parse(argv)[0]


def spawn_server(serve_args: str, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "medusa_lite.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(serve_args)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become ready")


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, args) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else e2e, "e2e": e2e, "tokens": tokens}


async def warm_up(url: str, model: str, args) -> None:
    async with httpx.AsyncClient(timeout=args.timeout) as http:
        await one_request(http, url, model, "Hi", args)


def spec_counters(url: str) -> tuple[float, float]:
    drafts = accepted = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():  # medusa_lite's counters, or vLLM's of the same name
        name = line.split("{")[0].split(" ")[0].partition(":")[2]
        if name == "spec_decode_num_drafts_total":
            drafts += float(line.split()[-1])
        elif name == "spec_decode_num_accepted_tokens_total":
            accepted += float(line.split()[-1])
    return drafts, accepted


async def run_level(url: str, model: str, clients: int, args) -> dict:
    async def client(i: int) -> list[dict]:
        out = []
        for j in range(args.requests):
            out.append(await one_request(http, url, model, PROMPTS[(i + j) % len(PROMPTS)], args))
        return out

    d0, a0 = spec_counters(url)
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(i) for i in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    d1, a1 = spec_counters(url)
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "completion_tokens": tokens, "wall_s": wall,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
            "client_tok_s": statistics.mean(r["tokens"] / r["e2e"] for r in results),
            "total_tok_s": tokens / wall, "tokens_per_step": 1 + (a1 - a0) / max(d1 - d0, 1)}


def main(argv: list[str] | None = None) -> None:
    # 1. parse
    args = parse_args(argv)
    levels = list(args.concurrency)
    # 2. server: given or spawned
    proc, url = spawn_server(args.spawn) if args.spawn is not None else (None, args.url.rstrip("/"))
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        # 3. run: a warm-up request, then each level
        asyncio.run(warm_up(url, model, args))
        rows = []
        for n in levels:
            rows.append(asyncio.run(run_level(url, model, n, args)))
            r = rows[-1]
            print(f"clients={n}: ttft mean {r['ttft_mean_s']:.2f}s, client {r['client_tok_s']:.1f} tok/s, "
                  f"total {r['total_tok_s']:.1f} tok/s", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    # 4. report
    print(f"\nmodel {model}, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"{args.requests} request(s) per client, streamed chat\n")
    print("| clients | requests | TTFT mean (s) | TTFT p50 (s) | TTFT max (s) | client tok/s | total tok/s "
          "| tokens/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['ttft_mean_s']:.2f} | {r['ttft_p50_s']:.2f} | "
              f"{r['ttft_max_s']:.2f} | {r['client_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
              f"{r['tokens_per_step']:.2f} |")
    if args.json is not None:
        Path(args.json).write_text(json.dumps({"model": model, "max_tokens": args.max_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
