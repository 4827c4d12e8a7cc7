"""The package as a user installs it: the sdist, a wheel built from that sdist, installed into a fresh venv, and
every command run from a folder outside the checkout. Offline: the venv takes its dependencies from this
environment's site-packages (a .pth line), so nothing is downloaded."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import venv
from pathlib import Path

import pytest
from train_helpers import write_chat_jsonl, write_target

from medusa_lite.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list, cwd: Path, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(venv bin directory, an empty working folder): medusa_lite installed from sdist -> wheel."""
    tmp = tmp_path_factory.mktemp("install")
    dist = tmp / "dist"
    build = ("import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))")
    # the sdist build writes medusa_lite.egg-info into the checkout: one xdist worker at a time
    with open(tmp_path_factory.getbasetemp().parent / "medusa_lite-sdist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sdist = dist / _run([sys.executable, "-c", build, dist], cwd=ROOT).strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "src", filter="data")
    (source,) = (tmp / "src").iterdir()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", dist, source], cwd=tmp)
    (wheel,) = dist.glob("medusa_lite-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # dependencies, not medusa_lite
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    return env_dir / "bin", work


@pytest.mark.slow
def test_the_installed_copy_is_imported_with_its_data(installed):
    bin_dir, work = installed
    code = ("import json, medusa_lite, medusa_lite.train.train as t, medusa_lite.serve.server as s;"
            "from medusa_lite.specbench import DEFAULT_QUESTIONS;"
            "from medusa_lite.paths import CONFIGS_DIR, PRETRAINED_ROOT, bundled_heads;"
            "from medusa_lite.kernels import _SOURCE;"
            "print(json.dumps([medusa_lite.__file__, t.__file__, s.__file__, str(DEFAULT_QUESTIONS),"
            " sorted(p.name for p in CONFIGS_DIR.rglob('*.*')),"
            " [str(PRETRAINED_ROOT / n / 'heads.safetensors') for n in bundled_heads()], str(_SOURCE)]))")
    files = json.loads(_run([bin_dir / "python", "-c", code], cwd=work))
    venv_root = str(bin_dir.parent)
    assert all(f.startswith(venv_root) for f in files[:4]), files  # not the checkout
    assert Path(files[3]).is_file()  # the Spec-Bench questions ship inside the package
    assert {"smollm2-135m.yaml", "default.yaml", "zero2.json", "zero3.json", "medusa-16.json"} <= set(files[4])
    bundles = files[5]  # every bundled drafter ships in the wheel, the default first
    assert [Path(b).parent.name for b in bundles] == ["smollm2-135m-instruct", "smollm2-135m-instruct-hydra"]
    assert all(b.startswith(venv_root) and Path(b).is_file() for b in bundles), bundles
    assert files[6].startswith(venv_root) and Path(files[6]).is_file()  # the skinny kernel's source, compiled on use


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_help_from_anywhere(installed, command):
    bin_dir, work = installed
    assert f"medusa-lite {command}" in _run([bin_dir / "medusa-lite", command, "--help"], cwd=work)


@pytest.mark.slow
def test_installed_train_bench_calibrate_export_run(installed):
    """One real tiny run of the main commands from the wheel: train heads (DeepSpeed, the shipped zero2
    config), benchmark them on the shipped Spec-Bench questions, calibrate and export them."""
    bin_dir, work = installed
    target = write_target(work / "target")
    data = write_chat_jsonl(work / "chat.jsonl")
    cli = bin_dir / "medusa-lite"
    _run([cli, "train", f"target={target}", f"data={data}", "--precision", "fp32", "--seq_len", "32",
          "--max_steps", "2", "--eval_samples", "4", "--progress", "false", "--threads", "1",
          "--output_dir", "out"], cwd=work)
    heads = work / "out" / "heads"
    assert json.loads((heads / "medusa_config.json").read_text())["training"]["engine"] == "deepspeed ZeRO-2"
    _run([cli, "bench", "--target", target, "--heads", heads, "--limit", "1", "--tasks", "translation,qa",
          "--max-new-tokens", "6", "--threads", "1", "--out", "bench"], cwd=work)
    report = json.loads((work / "bench" / "results.json").read_text())
    assert report["summary"]["overall"]["medusa"]["exact_match"] == 1.0
    questions = work / "q.jsonl"  # Spec-Bench's last questions outgrow the tiny target's 512-token context
    questions.write_text(json.dumps({"question_id": 161, "turns": ["w1 w2 w3"]}) + "\n")
    _run([cli, "calibrate", "--heads", heads, "--target", target, "--questions", questions, "--per-task", "1",
          "--max-new-tokens", "8", "--sample-prompts", "1", "--probe-budget", "2",
          "--threads", "1", "--dry-run", "--out", "calibration.json"], cwd=work)
    assert (work / "calibration.json").is_file()
    _run([cli, "export-vllm", heads, "vllm", "--target", target, "--dtype", "fp32"], cwd=work)
    assert (work / "vllm" / "model.safetensors").is_file()
    _run([bin_dir / "python", "-m", "medusa_lite.train.train", "--help"], cwd=work)  # python -m works too
