"""Helpers for the server tests: a tiny random Llama + tokenizer on disk, and the server as a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in memory (~400 tokens) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(directory: str | Path, *, seed: int = 0, context: int = 256) -> Path:
    """Save a tiny random Llama (2 layers, hidden 64, ``context`` positions) + tokenizer to ``directory``."""
    from conftest import tiny_model

    directory = Path(directory)
    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok), seed=seed, context=context, tie=False,
                       bos=tok.bos_token_id, eos=tok.eos_token_id)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``medusa-lite serve ARGS`` on a free loopback port; ``stop()`` sends SIGINT, then kills."""

    def __init__(self, *args: str, ready_timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "medusa_lite.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *args]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.log = open(os.devnull if os.environ.get("SERVE_TEST_QUIET") else _log_path(self.port), "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not ready after {ready_timeout} s; log: {self.log.name}")

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        if self.proc.returncode == 0 and self.log.name != os.devnull:
            Path(self.log.name).unlink(missing_ok=True)  # keep the log of a server that failed
        return self.proc.returncode


def _log_path(port: int) -> str:
    return str(Path(os.environ.get("TMPDIR", "/tmp")) / f"medusa_lite_serve_{port}.log")


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (0.0 when absent); its ``model_name`` label (every sample's, as
    vLLM's) left out of the comparison."""
    import re

    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        line = re.sub(r'(,?)model_name="[^"]*"(,?)', lambda m: "," if m[1] and m[2] else "", line).replace("{}", "")
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
