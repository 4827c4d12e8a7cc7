"""CUDA checks (``make gpu-check``; skipped without a GPU): greedy equality (one row and a batch) and a Monte Carlo run on the device,
the hardware fit's probe on CUDA, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model
from test_fit import ADAPTIVE_TREES, restless_fit
from test_sampling import N_SAMPLES, _support, exact_distribution, make_model, sample_counts, tv_bound, tv_distance

from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.fit import CyclingGuard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [None, "adaptive"])
def test_greedy_equals_plain_on_cuda(dtype, tree):
    target = tiny_model("llama", dtype=dtype).cuda()
    model = MedusaModel(target, MedusaConfig(num_heads=3, head_type="hydra"))
    random_heads(model, std=0.5)
    if tree == "adaptive":
        model.use_fit(restless_fit(ADAPTIVE_TREES), guard=CyclingGuard)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(1, 128, (1, 10), generator=gen).cuda()
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        out = model.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_greedy_equals_plain_on_cuda(dtype):
    """A left-padded batch of 4 rows on CUDA: each row equals plain decoding of its prompt alone."""
    target = tiny_model("llama", dtype=dtype).cuda()
    model = random_heads(MedusaModel(target, MedusaConfig(num_heads=3, head_type="hydra")), std=0.5)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=gen).cuda() for n in (10, 4, 7, 12)]
    ids = torch.zeros(4, 12, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 12 - p.numel():], mask[b, 12 - p.numel():] = p, 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    for b, p in enumerate(prompts):
        ref = target.generate(p[None], max_new_tokens=30, do_sample=False)[0, p.numel():]
        assert torch.equal(out[b, 12:], ref), f"row {b}"


def test_sampling_matches_target_distribution_on_cuda():
    model = make_model("hydra")
    model.cuda()
    gen = {"temperature": 1.0, "top_k": 0}
    exact = exact_distribution(model, **gen)
    counts = sample_counts(model, N_SAMPLES, **gen)
    tv, bound = tv_distance(exact, counts, N_SAMPLES), tv_bound(_support(exact), N_SAMPLES)
    print(f"\nCUDA T=1 hydra: TV {tv:.4f}, bound {bound:.4f}")
    assert tv < bound


def test_probe_on_cuda(tmp_path, monkeypatch):
    from test_fit import _hydra_model
    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    model = _hydra_model()
    model.cuda()
    fit = model.fit_hardware(progress=False)
    assert fit.fingerprint["device"] == "cuda" and fit.fingerprint["gpu"]
    assert all(ladder[-1].tree == [] for ladder in fit.ladders)
