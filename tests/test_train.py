"""Training: configs, data masking, loss, freeze, resume, the real entry point (with and without the
deepspeed launcher), PEFT targets and the vLLM export. Tiny random targets only, offline."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import role_tokenizer, write_chat_jsonl, write_config, write_target

from medusa_lite.paths import CONFIGS_DIR, resolve_config
from medusa_lite.train import data as D
from medusa_lite.drafters.heads import heads_loss
from medusa_lite.train.config import TrainConfig
from medusa_lite.train.engine import Engine
from medusa_lite.train.loop import train_step
from medusa_lite.train.runtime import init_runtime
from medusa_lite.train.train import build_config, build_model, main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    return {"target": write_target(base / "target"), "data": write_chat_jsonl(base / "chat.jsonl", malformed=True),
            "base": base}


def _greedy_equal(target_dir: Path, heads_dir: Path) -> None:
    """Trained heads load onto their target and generate exactly the target's greedy output."""
    from medusa_lite import MedusaModel
    from medusa_lite.targets import load_target

    target, tok = load_target(target_dir)
    model = MedusaModel.from_pretrained(target, heads_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    ours = model.generate(ids, max_new_tokens=16, do_sample=False)
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(ours, plain)
    training = json.loads((heads_dir / "medusa_config.json").read_text())["training"]
    assert training["tokens_seen"] > 0 and len(training["eval"]["top1"]) == model.config.num_heads
    assert (heads_dir / "README.md").is_file()


# ------------------------------------------------------------------------------------------- configs
def test_every_shipped_config_loads_and_opens_with_its_launch_line():
    configs = sorted((CONFIGS_DIR / "train").glob("*.yaml"))
    assert configs
    for path in configs:
        first = path.read_text().splitlines()[0]
        assert first.startswith("#") and "launch" in first.lower(), path
        assert "train" in path.read_text().splitlines()[1], path
        by_name = build_config(path.stem, [])  # a shipped config is named as well as given by path
        assert by_name == build_config(str(path), [])
        assert resolve_config("deepspeed", by_name.deepspeed).is_file(), by_name.deepspeed
    assert resolve_config("deepspeed", "configs/deepspeed/zero3.json") == CONFIGS_DIR / "deepspeed" / "zero3.json"
    with pytest.raises(FileNotFoundError, match="zero2"):
        resolve_config("deepspeed", "zero9")
    for path in sorted((CONFIGS_DIR / "deepspeed").glob("*.json")):
        ds = json.loads(path.read_text())
        assert "train_batch_size" not in ds and "bf16" not in ds  # injected from the training config


def test_config_precedence_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_heads: 3\nlr: 1e-3\nmax_samples: null\n")
    cfg = build_config(str(path), ["num_heads=5", "deepspeed=zero3", "--cache-features", "false", "--lr", "2e-3"])
    assert (cfg.num_heads, cfg.lr, cfg.max_samples, cfg.deepspeed, cfg.cache_features) == (5, 2e-3, None, "zero3", False)
    assert cfg.decay == TrainConfig().decay
    with pytest.raises(ValueError, match="num_hedas"):
        build_config(str(path), ["num_hedas=2"])
    with pytest.raises(ValueError, match="'max_steps'"):
        build_config(None, ["max_steps=lots"])
    with pytest.raises(ValueError, match="'precision'"):
        build_config(None, ["precision=fp16"])
    with pytest.raises(ValueError, match="'deepspeed' may not be null"):
        build_config(None, ["deepspeed=none"])
    for bad, key in (("lr: fast", "'lr'"), ("num_heads: 2.5", "'num_heads'"), ("resume: 3", "'resume'"),
                     ("num_hedas: 2", "num_hedas"), ("seq_len: [1, 2]", "'seq_len'")):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=key):
            build_config(str(path), [])


def test_deepspeed_dict_gets_batch_and_precision_from_training_config():
    from medusa_lite.train.engine import load_deepspeed_config
    from medusa_lite.train.runtime import Runtime

    cfg = TrainConfig(micro_batch_size=3, grad_accum=2, precision="bf16", deepspeed="zero3")
    ds = load_deepspeed_config(cfg, Runtime(0, 4, torch.device("cpu")))
    assert ds["train_batch_size"] == 24 and ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 2 and ds["zero_optimization"]["stage"] == 3
    assert ds["bf16"]["enabled"] is False  # CPU: fp32 master weights + bf16 autocast
    assert load_deepspeed_config(cfg, Runtime(0, 1, torch.device("cuda", 0)))["bf16"]["enabled"] is True


@pytest.mark.parametrize("native", [True, False])
def test_precision_auto_follows_the_hardware(native, monkeypatch):
    import medusa_lite.machine as machine
    from medusa_lite.train.config import resolve_precision

    monkeypatch.setattr(machine, "native_bf16", lambda device: (native, "made up"))
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if native else "fp32", "made up")
    assert resolve_precision("fp32", torch.device("cpu"))[0] == "fp32"  # an explicit choice is kept
    assert resolve_precision("bf16", torch.device("cpu"))[0] == "bf16"
    assert TrainConfig().precision == "auto"


def test_native_bf16_respects_the_isa_limit():
    import medusa_lite.machine as machine

    code = "from medusa_lite.machine import native_bf16; print(native_bf16('cpu')[0])"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    limited = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert limited.stdout.strip() == "False"  # AVX2 kernels: no bf16 matmul units, whatever the CPU has
    assert isinstance(machine.native_bf16("cpu")[0], bool)


# ------------------------------------------------------------------------------------------- data
def test_only_assistant_tokens_carry_loss_weight():
    tok = role_tokenizer()
    messages = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w12 w13 w14"},
                {"role": "assistant", "content": "w20 w21 w22"}, {"role": "user", "content": "w15"},
                {"role": "assistant", "content": "w23 w24"}]
    enc = D.encode_record(tok, {"messages": messages, "text": ""}, max_len=100)
    words = tok.convert_ids_to_tokens(enc["input_ids"])
    trained = [w for w, m in zip(words, enc["loss_mask"]) if m]
    assert trained == ["w20", "w21", "w22", "<|eot|>", "w23", "w24", "<|eot|>"]
    # head weights follow the mask of the *predicted* token: no position predicting a user/system token
    data = D.TokenData(torch.tensor(enc["input_ids"]), torch.tensor(enc["loss_mask"], dtype=torch.uint8),
                       torch.zeros(len(words), dtype=torch.long), 1)
    n, k_heads = len(words), 3
    w = D.window_weights(data.mask, data.segments, torch.tensor([0]), seq_len=n, num_heads=k_heads, total=n)
    for k in range(k_heads):
        for t in torch.nonzero(w[k, 0]).flatten().tolist():
            assert enc["loss_mask"][t + 2 + k] == 1
    # and the loss does not depend on the teacher at positions whose predicted token is not trained
    torch.manual_seed(0)
    v = 7
    heads = torch.randn(k_heads, 1, n, v, requires_grad=True)
    teacher = torch.randn(1, n, v)
    loss, _ = heads_loss(heads, teacher, w, loss="kl")
    loss.backward()
    untrained_user = [t for t in range(n - k_heads - 1) if enc["loss_mask"][t + 2] == 0]
    assert untrained_user and heads.grad[0, 0, untrained_user].abs().max() == 0


@pytest.mark.parametrize("whole_documents", [False, True])
def test_windows_train_every_position_and_head_once_within_its_document(whole_documents):
    """Stream windows (overlapping) and document windows (whole documents, packed) both train each (position, head)
    pair whose predicted token is trained and in the same document exactly once per epoch; document windows also
    start every trained document at a window start, so its whole prompt is in view."""
    lengths, k_heads, seq_len = [5, 7, 3, 9, 4, 12], 2, 12
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    mask = torch.ones(len(segments), dtype=torch.uint8)
    mask[torch.tensor([0, 5, 12])] = 0  # untrained first tokens of three documents
    data = D.TokenData(torch.arange(len(segments)), mask, segments, len(lengths))
    starts = D.make_windows(data, seq_len=seq_len, num_heads=k_heads, whole_documents=whole_documents)
    w = D.window_weights(mask, segments, starts, seq_len=seq_len, num_heads=k_heads, total=len(segments),
                         whole_documents=whole_documents)
    trained = [(k, int(s) + t) for k in range(k_heads) for b, s in enumerate(starts)
               for t in torch.nonzero(w[k, b]).flatten().tolist()]
    expected = [(k, p) for k in range(k_heads) for p in range(len(segments))
                if p + 2 + k < len(segments) and segments[p + 2 + k] == segments[p] and mask[p + 2 + k]]
    assert sorted(trained) == sorted(expected)
    if whole_documents:
        assert starts.tolist() == [0, 12, 24, 28]  # 5 + 7 | 3 + 9 | 4 (+ 12 would not fit) | 12
        doc_starts = {lo for lo, _ in data.doc_slices()}
        for b, s in enumerate(starts.tolist()):
            first = min(s + t for k in range(k_heads) for t in torch.nonzero(w[k, b]).flatten().tolist())
            assert max(lo for lo in doc_starts if lo <= first) >= s  # the document began inside this window
        with pytest.raises(ValueError, match="max_doc_len"):
            D.make_windows(data, seq_len=8, num_heads=k_heads, whole_documents=True)


def test_kl_loss_is_zero_when_heads_reproduce_the_teacher():
    torch.manual_seed(0)
    k_heads, b, t, v = 3, 2, 12, 11
    teacher = torch.randn(b, t, v)
    heads = torch.stack([torch.roll(teacher, shifts=-(1 + k), dims=1) for k in range(k_heads)])  # head k at t = teacher at t+1+k
    weights = torch.ones(k_heads, b, t)
    loss, stats = heads_loss(heads, teacher, weights, loss="kl", decay=0.8)
    assert loss.abs() < 1e-5
    assert torch.equal(stats["top1"], stats["count"])
    ids = torch.randint(0, v, (b, t))
    ce, _ = heads_loss(heads, teacher, weights, ids, loss="ce")
    assert ce > 0


def test_tvd_loss_is_one_minus_the_expected_acceptance_of_a_sampled_draft():
    """loss="tvd" per position is 1 - sum_v min(p_v, q_v) (the chance rejection sampling rejects the head's draw),
    zero when the head reproduces the teacher; "kl+tvd" is the sum of the two."""
    torch.manual_seed(0)
    k_heads, b, t, v = 2, 2, 10, 7
    teacher = torch.randn(b, t, v)
    weights = torch.ones(k_heads, b, t)
    exact = torch.stack([torch.roll(teacher, shifts=-(1 + k), dims=1) for k in range(k_heads)])
    assert heads_loss(exact, teacher, weights, loss="tvd", decay=1.0)[0].abs() < 1e-6
    heads = torch.randn(k_heads, b, t, v)
    n = t - k_heads - 1  # positions every head is trained on (num_positions)
    p = torch.stack([teacher.softmax(-1)[:, 1 + k: 1 + k + n] for k in range(k_heads)])
    accept = torch.minimum(p, heads[:, :, :n].softmax(-1)).sum(-1)                  # [K, B, n]
    _, stats = heads_loss(heads, teacher, weights, loss="tvd", decay=1.0)
    assert torch.allclose(stats["loss"], 1 - accept.mean((1, 2)), atol=1e-5)
    from medusa_lite.train.loss import sampled_acceptance  # the held-out report of the same quantity
    assert torch.allclose(sampled_acceptance(heads, teacher, weights) / (b * n), accept.mean((1, 2)), atol=1e-5)
    kl, _ = heads_loss(heads, teacher, weights, loss="kl", decay=0.8)
    tvd, _ = heads_loss(heads, teacher, weights, loss="tvd", decay=0.8)
    both, _ = heads_loss(heads, teacher, weights, loss="kl+tvd", decay=0.8)
    assert torch.allclose(both, kl + tvd, atol=1e-5)
    with pytest.raises(ValueError, match="loss must be one of"):
        heads_loss(heads, teacher, weights, loss="js")


@pytest.mark.parametrize("kl,tvd", [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0)])
def test_distill_loss_gradient_in_closed_form_is_autograds(kl, tvd):
    """The fused loss's hand-written backward against finite differences (gradcheck, fp64) and its value against the
    plain formula; a wrong sign or a missing term of either gradient fails."""
    from medusa_lite.drafters.heads import DistillLoss
    torch.manual_seed(0)
    z = torch.randn(2, 5, 9, dtype=torch.float64, requires_grad=True)
    logp = torch.randn(2, 5, 9, dtype=torch.float64).log_softmax(-1)
    p = logp.exp()
    assert torch.autograd.gradcheck(lambda z: DistillLoss.apply(z, p, logp, kl, tvd), (z,))
    logq = z.log_softmax(-1)
    plain = kl * (p * (logp - logq)).sum(-1) + tvd * 0.5 * (p - logq.exp()).abs().sum(-1)
    assert torch.allclose(DistillLoss.apply(z, p, logp, kl, tvd), plain, atol=1e-12)


def test_reader_counts_malformed_records_and_keeps_a_truncated_array(tmp_path):
    records = [{"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2 w3"}]}] * 3
    text = json.dumps(records + [{"id": "x"}, {"conversations": [{"from": "human", "value": "hi"}]}])
    truncated = tmp_path / "sharegpt.json"
    truncated.write_text(text[:-40])  # cut inside the last record, like the packaged ShareGPT file
    good, skipped = D.read_records(truncated)
    assert len(good) == 3 and sum(skipped.values()) == 2 and skipped["invalid JSON"] == 1
    good, skipped = D.read_records(write_chat_jsonl(tmp_path / "c.jsonl", n=5, malformed=True))
    assert len(good) == 5 and sum(skipped.values()) == 4


def test_several_sources_concatenate_their_seeded_slices(tmp_path):
    a, b = write_chat_jsonl(tmp_path / "a.jsonl", n=10, seed=1), write_chat_jsonl(tmp_path / "b.jsonl", n=12, seed=2)
    whole_b, _ = D.read_records(b, seed=3)
    assert D.parse_sources(f"{a}, {b}[4:9]") == [(str(a), 0, None), (str(b), 4, 9)]
    records, skipped, paths = D.read_sources(f"{a},{b}[4:9]", seed=3)
    key = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs)  # noqa: E731
    assert paths == [a, b] and not skipped
    assert key(records) == key(D.read_records(a, seed=3)[0] + whole_b[4:9])  # b's records 4..8 of its shuffle
    assert D.read_sources(str(b), seed=3)[0] == whole_b  # one source: its own shuffle, as before
    assert D.read_sources(f"{b}[7:]", seed=3)[0] == whole_b[7:]
    for bad in (f"{b}[5]", f"{b}[5:2]", f"{b}[x:]", f"{a},,{b}"):
        with pytest.raises(ValueError, match="source"):
            D.parse_sources(bad)


def test_missing_data_is_a_clear_error_and_a_template_less_tokenizer_reads_chats_as_text(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        D.resolve_data_path(str(tmp_path / "nope.jsonl"))
    records, _ = D.read_records(write_chat_jsonl(tmp_path / "c.jsonl", n=3))
    data = D.build_token_data(role_tokenizer(chat_template=None), records, max_len=64)  # a base model's reading
    assert data.num_docs == 3 and 0 < data.num_loss_tokens < data.ids.numel()  # the answers, not the prompts


# ------------------------------------------------------------------------------------------- training
def test_one_step_changes_heads_and_leaves_every_target_tensor_bit_identical(material, tmp_path):
    cfg = TrainConfig(target=str(material["target"]), data=str(material["data"]), precision="fp32",
                      seq_len=32, micro_batch_size=4, lr=1e-2, warmup_steps=1, output_dir=str(tmp_path))
    rt = init_runtime(cfg)
    model, tok = build_model(cfg, rt)
    records, _ = D.read_records(material["data"])
    data = D.build_token_data(tok, records, max_len=128)
    before_target = {k: v.clone() for k, v in model.base_model.state_dict().items()}
    before_heads = {k: v.clone() for k, v in model.drafter.state_dict().items()}
    engine = Engine(cfg, model.drafter, rt)
    assert all(not p.requires_grad for p in model.base_model.parameters()) and not model.base_model.training
    optimised = {id(p) for group in engine.optimizer.bit16_groups for p in group}  # ZeRO-2's view of the params
    assert optimised == {id(p) for p in model.drafter.parameters()}
    starts = D.make_windows(data, seq_len=32, num_heads=cfg.num_heads)[:4]
    lm_head = model.base_model.get_output_embeddings()
    train_step(cfg, model, lm_head, engine, data, None, [starts], rt)  # target forward path (no cache)
    after_target = model.base_model.state_dict()
    assert all(torch.equal(before_target[k], after_target[k]) for k in before_target)
    assert any(not torch.equal(before_heads[k], v) for k, v in model.drafter.state_dict().items())


def test_the_learning_rate_decays_by_the_time_limit_when_the_steps_would_not():
    """A schedule sized at another machine's speed: at the time limit the rate is at its floor however few of
    ``max_steps`` are done; without a limit (or with time to spare) the steps alone set it."""
    from medusa_lite.train.engine import TrainClock, lr_lambda

    cfg = TrainConfig(max_steps=1000, warmup_steps=10, time_limit_minutes=1.0)
    clock = TrainClock(cfg.time_limit_minutes)
    fn = lr_lambda(cfg, clock)
    assert fn(5) == pytest.approx(0.6) and fn(10) == pytest.approx(1.0)  # warm-up, then the peak
    clock.start(before_seconds=30.0)  # half the limit trained before this resume
    assert fn(10) == pytest.approx(0.55, abs=0.01)  # cos at progress 0.5: halfway to the floor
    clock.start(before_seconds=60.0)
    assert fn(100) == pytest.approx(0.1)  # the limit: the floor, at step 100 of 1,000
    assert lr_lambda(cfg)(100) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 90 / 990)))  # steps only
    assert TrainClock(None).fraction() == 0.0


def test_resume_after_a_stop_ends_at_the_planned_step_with_the_same_data_order(material, tmp_path):
    common = [f"target={material['target']}", f"data={material['data']}", "precision=fp32",
              "seq_len=32", "micro_batch_size=4", "max_steps=6", "save_every=2", "log_every=1", "progress=false",
              "eval_samples=4", "lr=1e-2", "warmup_steps=1", "accept_prompts=2", "accept_tokens=16"]
    main([*common, f"output_dir={tmp_path / 'full'}"])
    partial = main([*common, f"output_dir={tmp_path / 'cut'}", "max_steps_this_run=3"])  # the "crash"
    assert partial["stats"]["step"] == 3 and not (tmp_path / "cut" / "heads").exists()
    resumed = main([*common, f"output_dir={tmp_path / 'cut'}"])
    assert resumed["stats"]["step"] == 6 and resumed["stats"]["this_run_steps"] == 3
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("step*")) == ["step4", "step6"]  # newest 2
    full = load_file(str(tmp_path / "full" / "heads" / "heads.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "heads" / "heads.safetensors"))
    assert all(torch.allclose(full[k], cut[k], atol=1e-6) for k in full)
    logs = [json.loads(x) for x in (tmp_path / "cut" / "train_log.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == list(range(1, 7))
    assert [x for r in logs for x in r["loss"]] == pytest.approx([x for r in ref for x in r["loss"]], abs=1e-4)


def test_lora_adapted_target_trains(material, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(material["target"])
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    out = main([f"target={material['target']}", f"adapter={tmp_path / 'adapter'}", f"data={material['data']}",
                "precision=fp32", "seq_len=32", "max_steps=2", "eval_samples=4",
                "progress=false", "accept_tokens=16", f"output_dir={tmp_path / 'out'}"])
    from medusa_lite import MedusaModel
    from medusa_lite.targets import load_target

    merged, _ = load_target(material["target"], adapter=tmp_path / "adapter")
    model = MedusaModel.from_pretrained(merged, out["heads_dir"])  # the heads belong to the adapted target
    assert model.config.training["config"]["adapter"] == str(tmp_path / "adapter")


def test_entry_point_one_process_with_deepspeed_zero2_and_cli(material, tmp_path):
    cfg = write_config(tmp_path / "tiny.yaml", material["target"], material["data"], tmp_path / "out",
                       deepspeed="zero2")
    proc = subprocess.run([sys.executable, "-m", "medusa_lite.cli", "train", "--config", str(cfg), "num_heads=3"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped 4 malformed record(s)" in proc.stdout
    heads = tmp_path / "out" / "heads"
    conf = json.loads((heads / "medusa_config.json").read_text())
    assert conf["num_heads"] == 3 and conf["training"]["engine"] == "deepspeed ZeRO-2"
    assert conf["training"]["command"] == f"medusa-lite train --config {cfg} num_heads=3"
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert len(log[-1]["loss"]) == 3 and len(log[-1]["top1"]) == 3
    _greedy_equal(material["target"], heads)


@pytest.mark.slow
def test_deepspeed_launcher_two_cpu_ranks_zero3(material, tmp_path):
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    cfg = write_config(tmp_path / "tiny.yaml", material["target"], material["data"], tmp_path / "out",
                       deepspeed="zero3")
    command = [launcher, "--num_gpus", "2", "--master_port", "29731", "--module", "medusa_lite.train.train",
               "--config", str(cfg), "--head_type", "hydra", "draft_vocab=40"]
    proc = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    if proc.returncode and "terminate called without an active exception" in proc.stderr:
        # seen once in ~5 loaded runs (make test's two xdist workers): a rank aborts at interpreter exit after the
        # heads are saved (a C++ thread of the process group). Resume makes the second launch a no-op save.
        proc = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    heads = tmp_path / "out" / "heads"
    conf = json.loads((heads / "medusa_config.json").read_text())
    assert conf["training"]["world_size"] == 2 and conf["training"]["engine"] == "deepspeed ZeRO-3"
    state = load_file(str(heads / "heads.safetensors"))
    assert all(v.numel() > 0 and v.abs().sum() > 0 for k, v in state.items() if k.endswith("weight"))  # gathered
    assert conf["head_type"] == "hydra" and state["draft_ids"].numel() == 40
    _greedy_equal(material["target"], heads)


def test_hydra_heads_with_draft_vocab_train_and_decode(material, tmp_path):
    """Hydra heads on the 40 most frequent trained tokens: they learn, the ids are stored, decoding stays exact."""
    out = main([f"target={material['target']}", f"data={material['data']}", "precision=fp32",
                "head_type=hydra", "draft_vocab=40", "seq_len=32", "max_steps=30", "lr=1e-2", "warmup_steps=2", "log_every=5",
                "eval_samples=4", "progress=false", "accept_tokens=16", f"output_dir={tmp_path}"])
    heads = Path(out["heads_dir"])
    state = load_file(str(heads / "heads.safetensors"))
    assert state["draft_ids"].numel() == 40 and len(set(state["draft_ids"].tolist())) == 40
    conf = json.loads((heads / "medusa_config.json").read_text())
    assert conf["head_type"] == "hydra" and conf["draft_vocab_size"] == 40
    assert 0.5 < conf["training"]["draft_vocab_coverage"] < 1
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert all(last < first for first, last in zip(log[0]["loss"], log[-1]["loss"]))  # every head learns
    _greedy_equal(material["target"], heads)


def test_resume_on_grown_data_keeps_the_checkpoints_draft_vocabulary(material, tmp_path, capsys):
    """Data that grew between two runs has other most frequent tokens; the resumed drafter keeps the vocabulary
    its lm_head rows were trained on, and the teacher projects onto those same tokens."""
    common = [f"target={material['target']}", "precision=fp32", "head_type=hydra", "draft_vocab=40", "seq_len=32",
              "max_steps=4", "log_every=1", "eval_samples=4", "progress=false",
              "accept_tokens=16", "lr=1e-2", "warmup_steps=1"]
    grown = tmp_path / "grown.jsonl"  # the first data and 140 new documents
    grown.write_text(material["data"].read_text() + write_chat_jsonl(tmp_path / "new.jsonl", n=140, seed=7).read_text())

    def ids(out):
        return load_file(str(Path(out["heads_dir"]) / "heads.safetensors"))["draft_ids"]

    first = main([*common, f"data={material['data']}", f"output_dir={tmp_path / 'first'}"])
    alone = main([*common, f"data={grown}", f"output_dir={tmp_path / 'alone'}"])
    assert not torch.equal(ids(first), ids(alone))  # the grown data alone chooses other tokens
    main([*common, f"data={material['data']}", f"output_dir={tmp_path / 'run'}", "max_steps_this_run=2"])
    capsys.readouterr()
    resumed = main([*common, f"data={grown}", f"output_dir={tmp_path / 'run'}"])
    log = capsys.readouterr().out
    assert "keeping the checkpoint's draft vocabulary" in log
    reused = int(log.split(" documents reused from")[0].rsplit(", ", 1)[1].split(" of ")[0])
    assert reused > 30  # the first data's training documents (less those the new shuffle holds out)
    features = [load_file(str(tmp_path / run / "features" / "train.safetensors")) for run in ("run", "alone")]
    assert torch.equal(features[0]["ids"], features[1]["ids"])  # same data, same split
    torch.testing.assert_close(features[0]["hidden"].float(), features[1]["hidden"].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(ids(resumed), ids(first))
    coverage = [json.loads((Path(o["heads_dir"]) / "medusa_config.json").read_text())["training"]
                ["draft_vocab_coverage"] for o in (resumed, alone)]
    assert coverage[0] < coverage[1]  # the teacher's rows are the checkpoint's tokens, not the grown data's top 40


def test_eval_data_holds_out_its_documents_even_when_data_contains_them(material, tmp_path, capsys):
    """``eval_data``: the held-out set comes from its own file (a metric that stays put as data grows); records of it
    that data also holds are not trained on."""
    lines = [x for x in material["data"].read_text().splitlines()[:60]]
    extra = write_chat_jsonl(tmp_path / "extra.jsonl", n=3, seed=11).read_text().splitlines()
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join(lines[:5] + extra) + "\n")
    out = main([f"target={material['target']}", f"data={material['data']}", f"eval_data={held}", "eval_samples=6",
                "precision=fp32", "seq_len=32", "max_steps=2", "progress=false",
                "accept_tokens=16", f"output_dir={tmp_path / 'run'}"])
    log = capsys.readouterr().out
    summary = json.loads((Path(out["heads_dir"]) / "medusa_config.json").read_text())["training"]["data"]
    assert summary["eval_docs"] == 6 and summary["eval_data"] == str(held)
    overlap = int(log.split(" record(s) of data are held out")[0].rsplit("data: ", 1)[1])
    assert 1 <= overlap <= 5 and summary["train_docs"] == 60 - overlap  # the 60 valid records of data, less those
    with pytest.raises(ValueError, match="no valid record"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text('{"messages": []}\n')
        main([f"target={material['target']}", f"data={material['data']}", f"eval_data={empty}", "precision=fp32",
              "max_steps=1", "progress=false", "accept_tokens=16", f"output_dir={tmp_path / 'bad'}"])


@pytest.mark.parametrize("cache_features", [True, False])
def test_eagle3_trains_through_the_same_entry_point_and_decodes(material, tmp_path, cache_features):
    """An EAGLE-3 drafter: three target layers cached (or run live), training-time test over num_heads steps,
    a 40-token draft vocabulary; it learns, it saves, it decodes exactly, and it exports to vLLM's layout."""
    out = main([f"target={material['target']}", f"data={material['data']}", "precision=fp32", "head_type=eagle3",
                "num_heads=3", "draft_vocab=40", "--intermediate-size", "48", "seq_len=32", "max_steps=30", "lr=3e-3", "warmup_steps=2",
                "log_every=5", "eval_samples=4", "progress=false",
                "accept_tokens=16", f"cache_features={cache_features}",
                f"output_dir={tmp_path}"])
    heads = Path(out["heads_dir"])
    conf = json.loads((heads / "medusa_config.json").read_text())
    assert conf["head_type"] == "eagle3" and conf["draft_vocab_size"] == 40 and len(conf["aux_layers"]) == 3
    assert conf["intermediate_size"] == 48
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert all(last < first for first, last in zip(log[0]["loss"], log[-1]["loss"]))  # every unrolled step learns
    if cache_features:
        features = load_file(str(tmp_path / "features" / "train.safetensors"))
        assert features["layers"].tolist() == [*conf["aux_layers"], -1]  # three layers + the teacher's input
    assert "EAGLE-3" in (heads / "README.md").read_text()
    _greedy_equal(material["target"], heads)
    from medusa_lite.train.export_vllm import main as export_main

    export_main([str(heads), str(tmp_path / "vllm"), "--target", str(material["target"]), "--dtype", "bf16"])
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"] and config["draft_vocab_size"] == 40
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert torch.equal(tensors["d2t"] + torch.arange(40), load_file(str(heads / "heads.safetensors"))["draft_ids"])


# ------------------------------------------------------------------------------------------- export
def test_export_vllm_key_names_and_config(material, tmp_path):
    from medusa_lite import MedusaConfig, MedusaModel
    from medusa_lite.targets import load_target

    from medusa_lite.train.export_vllm import main as export_main

    target, _ = load_target(material["target"])
    for share in (True, False):
        model = MedusaModel(target, MedusaConfig(num_heads=3, num_layers=2, share_lm_head=share))
        model.save_pretrained(tmp_path / f"heads{share}")
        export_main([str(tmp_path / f"heads{share}"), str(tmp_path / f"vllm{share}"),
                     "--target", str(material["target"]), "--dtype", "fp32"])
        config = json.loads((tmp_path / f"vllm{share}" / "config.json").read_text())
        assert config == {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 64,
                          "vocab_size": 64, "num_heads": 3, "num_hidden_layers": 2, "medusa_fc_bias": True,
                          "truncated_vocab_size": None}
        tensors = load_file(str(tmp_path / f"vllm{share}" / "model.safetensors"))
        expected = {f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")}
        expected |= {f"lm_heads.{h}.weight" for h in range(3)}
        assert set(tensors) == expected
        assert tensors["blocks.1.layers.0.weight"].shape == (64, 64) and tensors["blocks.1.layers.0.bias"].shape == (64,)
        assert torch.equal(tensors["lm_heads.2.weight"], target.get_output_embeddings().weight)
    # a reduced draft vocabulary becomes vLLM's truncated_vocab_size + token_map
    model = MedusaModel(target, MedusaConfig(num_heads=2, draft_vocab_size=16))
    model.drafter.draft_ids.copy_(torch.arange(16) * 3)
    model.save_pretrained(tmp_path / "small")
    export_main([str(tmp_path / "small"), str(tmp_path / "vllm-small"), "--target", str(material["target"]),
                 "--dtype", "fp32"])
    assert json.loads((tmp_path / "vllm-small" / "config.json").read_text())["truncated_vocab_size"] == 16
    tensors = load_file(str(tmp_path / "vllm-small" / "model.safetensors"))
    assert torch.equal(tensors["token_map"], torch.arange(16) * 3)
    assert torch.equal(tensors["lm_heads.1.weight"], target.get_output_embeddings().weight[torch.arange(16) * 3])
    # an EAGLE-3 drafter over the whole vocabulary has no d2t / t2d (vLLM has no such parameters and refuses them)
    from medusa_lite.drafters.eagle3 import Eagle3Config

    MedusaModel(target, Eagle3Config(num_heads=2)).save_pretrained(tmp_path / "eagle3-full")
    export_main([str(tmp_path / "eagle3-full"), str(tmp_path / "vllm-eagle3-full"), "--target", str(material["target"])])
    tensors = load_file(str(tmp_path / "vllm-eagle3-full" / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors and tensors["lm_head.weight"].shape[0] == 64
    # Hydra heads have no vLLM counterpart
    MedusaModel(target, MedusaConfig(num_heads=2, head_type="hydra")).save_pretrained(tmp_path / "hydra")
    with pytest.raises(ValueError, match="hydra"):
        export_main([str(tmp_path / "hydra"), str(tmp_path / "vllm-hydra"), "--target", str(material["target"])])


def test_distill_data_writes_the_targets_answers_and_resumes(material, tmp_path):
    from medusa_lite.train.distill_data import main as distill_main

    out = tmp_path / "distill.jsonl"
    args = ["--target", str(material["target"]), "--prompts", str(material["data"]), "--out", str(out),
            "--num-prompts", "6", "--max-new-tokens", "6", "--batch-size", "4", "--dtype", "fp32"]
    distill_main(args)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and len({r["source_index"] for r in rows}) == 6
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    distill_main(args)  # a finished (or interrupted) file is continued, never duplicated
    assert len(out.read_text().splitlines()) == 6
    records, skipped = D.read_records(out)  # and it is valid training data
    assert len(records) + sum(skipped.values()) == 6
    mixed = tmp_path / "mixed.jsonl"
    distill_main([*args[:5], str(mixed), *args[6:], "--mix", "chat,multi,arithmetic,summarize"])
    rows = [json.loads(x) for x in mixed.read_text().splitlines()]
    assert {r["kind"] for r in rows} >= {"chat", "multi", "arithmetic"}
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert any(len(r["messages"]) == 4 for r in rows if r["kind"] == "multi")  # user, assistant, user, target


@pytest.mark.parametrize("head_type", ["eagle3", "hydra"])
def test_warm_start_grows_a_draft_vocabulary_and_keeps_the_trained_rows(tmp_path, head_type):
    """init_heads with a larger draft_vocab: every saved token stays (its trained lm_head rows with it), the most
    frequent trained tokens fill the rest from the target's rows carried into the trained rows' space, so the drafter
    ranks the saved tokens as before; a smaller vocabulary is refused."""
    from conftest import random_heads, tiny_model

    from medusa_lite import MedusaModel
    from medusa_lite.drafters import config_class
    from medusa_lite.train.data import TokenData
    from medusa_lite.train.train import warm_start

    target = tiny_model("llama", layers=4)
    make = lambda size: MedusaModel(target, config_class(head_type)(num_heads=2, head_type=head_type,  # noqa: E731
                                                                    draft_vocab_size=size))
    small = random_heads(make(16), std=0.2, seed=1)
    small.drafter.draft_ids.copy_(torch.arange(16) * 3)
    small.drafter.vocabulary_changed()
    random_heads(small, std=0.2, seed=1)
    small.save_pretrained(tmp_path / "small")
    ids = torch.tensor([5, 5, 5, 7, 7, 1, 0, 3] * 4)
    data = TokenData(ids=ids, mask=torch.ones_like(ids), segments=torch.zeros_like(ids), num_docs=1)
    big = make(20)
    assert warm_start(big, tmp_path / "small", data) == 16
    new = big.drafter.draft_ids
    assert {*range(0, 48, 3), 5, 7, 1} <= set(new.tolist())  # the saved tokens, then the most frequent others
    assert new.numel() == 20 and torch.equal(new, new.sort().values)
    if head_type == "eagle3":
        rows = torch.searchsorted(new, small.drafter.draft_ids)
        assert torch.equal(big.drafter.lm_head.weight[rows], small.drafter.lm_head.weight)
        fresh = [i for i, token in enumerate(new.tolist()) if token not in set(small.drafter.draft_ids.tolist())]
        rows_of = target.get_output_embeddings().weight
        carry = torch.linalg.lstsq(rows_of[small.drafter.draft_ids], small.drafter.lm_head.weight).solution
        assert torch.allclose(big.drafter.lm_head.weight[fresh], rows_of[new[fresh]] @ carry, atol=1e-5)
    with pytest.raises(ValueError, match="can grow, not shrink"):
        warm_start(make(8), tmp_path / "small", data)


def test_grown_vocabulary_rows_start_where_training_moved_the_saved_ones():
    """Trained rows that are a linear transform of their fresh start: the new tokens' rows get the same transform,
    exactly (a fresh row beside trained ones would be on another scale and outscore them); trained rows stay."""
    from medusa_lite.train.train import merge_vocabulary_rows

    g = torch.Generator().manual_seed(0)
    fresh = torch.randn(40, 8, generator=g)                     # [V1, H]
    moved = torch.randn(8, 8, generator=g)                      # what training did to every row
    rows = torch.arange(0, 40, 2)                               # [V0] where the saved tokens sit
    merged = merge_vocabulary_rows(fresh, fresh[rows] @ moved, rows)
    assert torch.equal(merged[rows], fresh[rows] @ moved)
    assert torch.allclose(merged[1::2], fresh[1::2] @ moved, atol=1e-4)
    norms = torch.ones(40)
    assert torch.equal(merge_vocabulary_rows(norms, torch.full((20,), 2.0), rows)[1::2], norms[1::2])  # 1-D: fresh


def test_distill_data_continues_text_for_a_base_model_and_trains_on_the_continuation(material, tmp_path):
    """A target without a chat template (a base model) continues the prompt's text: each record is the text and its
    continuation with ``prompt_chars``, and training learns the continuation only."""
    import shutil

    from transformers import AutoTokenizer

    from medusa_lite.train.distill_data import main as distill_main

    base = tmp_path / "base-target"
    shutil.copytree(material["target"], base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(base)
    assert not tok.chat_template
    out = tmp_path / "continued.jsonl"
    distill_main(["--target", str(base), "--prompts", str(material["data"]), "--out", str(out), "--num-prompts", "6",
                  "--max-new-tokens", "6", "--batch-size", "4", "--dtype", "fp32", "--mix", "chat,multi,continue"])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and all("messages" not in r and 0 < r["prompt_chars"] < len(r["text"]) for r in rows)
    records, _ = D.read_records(out)
    enc = D.encode_record(tok, records[0], max_len=200)
    learnt = [i for i, m in zip(enc["input_ids"], enc["loss_mask"]) if m]
    assert learnt and tok.decode(learnt).strip() == records[0]["text"][records[0]["prompt_chars"]:].strip()
    with pytest.raises(ValueError, match="prompt_chars"):
        D.normalize_record({"text": "abc", "prompt_chars": 4})
    # chat records (ShareGPT) read as their turns' text: the answers are learnt
    chat = D.normalize_record({"messages": [{"role": "user", "content": "w1 w2"},
                                            {"role": "assistant", "content": "w3 w4 w5"}]})
    enc = D.encode_record(tok, chat, max_len=50)
    assert tok.decode([i for i, m in zip(enc["input_ids"], enc["loss_mask"]) if m]) == "w3 w4 w5"
