"""The drafter campaign: committed data chunks that resume, a held-out set, training that warm-starts from the
committed drafter and writes it back in bf16, a ledger of it all; and the diagnosis tool's pure parts.
Tiny random targets only, offline."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import write_chat_jsonl, write_config, write_target

from medusa_lite.train import data as D
from medusa_lite.train.campaign import main as campaign
from medusa_lite.train.diagnose import Tally, copyable, position_hits


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    base = tmp_path_factory.mktemp("campaign")
    return {"target": write_target(base / "target"), "data": write_chat_jsonl(base / "chat.jsonl", n=80),
            "base": base}


def test_campaign_data_resumes_its_chunk_then_trains_twice_from_what_is_committed(material, tmp_path, monkeypatch,
                                                                                 capsys):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "campaign"
    common = [f"--root={root}", f"--target={material['target']}", f"--prompts={material['data']}",
              "--eval-start=60", "--eval-prompts=6", "--batch-size=2", "--chunk=8"]
    # a data run cut short by its budget leaves a partial chunk, committed as it stands ...
    campaign(["data", *common, "--minutes=0.0001"])
    ledger = json.loads((root / "ledger.json").read_text())
    first = ledger["data"][0]
    assert (first["skip_prompts"], first["num_prompts"], first["complete"]) == (0, 8, False)
    assert first["records"] == 2 and (root / first["file"]).is_file()
    # ... which the next run finishes (never answering a prompt twice) before it starts the next chunk
    campaign(["data", *common, "--minutes=10", "--max-chunks=2"])
    ledger = json.loads((root / "ledger.json").read_text())
    rows = [json.loads(x) for x in gzip.decompress((root / first["file"]).read_bytes()).splitlines()]
    assert ledger["data"][0]["complete"] and len({r["source_index"] for r in rows}) == len(rows) > 2
    assert all(0 <= r["source_index"] < 8 for r in rows) and ledger["data"][1]["complete"]
    assert ledger["data"][1]["skip_prompts"] == 8 and "distill-data" in ledger["data"][0]["command"]
    campaign(["eval", *common])
    ledger = json.loads((root / "ledger.json").read_text())
    assert ledger["eval"]["complete"] and ledger["eval"]["records"] > 0
    records, _ = D.read_records(root / ledger["eval"]["file"])  # committed .gz is training-data format
    assert len(records) == ledger["eval"]["records"]
    with pytest.raises(ValueError, match="seed"):
        campaign(["status", *common, "--seed=1"])

    # training: a fresh drafter, written back in bf16 with the run in the ledger; the next run warm-starts from it
    config = write_config(tmp_path / "tiny.yaml", material["target"], material["data"], tmp_path / "unused",
                          head_type="hydra", num_heads=2, eval_samples=4, save_every=0)
    train = ["train", *common, f"--train-config={config}", "--minutes=1", "--extra=max_steps=2,warmup_steps=1"]
    campaign(train)
    weights = load_file(str(root / "hydra" / "heads.safetensors"))
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.bfloat16}
    ledger = json.loads((root / "ledger.json").read_text())
    run = ledger["runs"][0]
    assert run["steps"] == 2 and len(run["heldout_top1"]) == 2 and "init_heads" not in run["command"]
    assert "eval_data=" in run["command"] and str(root / first["file"]) in run["command"]
    assert not (Path("runs/campaign/train") / "checkpoints").exists()  # finished: nothing left to resume
    capsys.readouterr()
    campaign(train)
    second = json.loads((root / "ledger.json").read_text())["runs"][1]
    assert f"init_heads={root / 'hydra'}" in second["command"]
    assert f"warm start from {root / 'hydra'}" in capsys.readouterr().out
    again = load_file(str(root / "hydra" / "heads.safetensors"))
    changed = any(not torch.equal(again[k], v) for k, v in weights.items() if v.is_floating_point())
    assert changed == second["kept"]  # written back only when it is no worse on the held-out set (improves())


def test_a_later_round_asks_the_same_records_for_other_kinds_and_stops_before_the_heldout_range(material):
    from medusa_lite.train.campaign import next_chunk
    from medusa_lite.train.distill_data import ROUND, prompts_of

    kinds = ("chat", "summarize", "arithmetic")
    rounds = [{i % ROUND: kind for i, kind, _ in prompts_of(material["data"], kinds, limit=12, skip=r * ROUND, seed=0)}
              for r in range(3)]
    assert rounds[0] and all(kind == kinds[j % 3] for j, kind in rounds[0].items())  # round 0: kinds in turn
    for r in (1, 2):
        assert rounds[r] and all(kind == kinds[(j + r) % 3] for j, kind in rounds[r].items())  # then shifted

    ledger = {"mix": list(kinds), "eval_start": 60, "data": [{"skip_prompts": 50, "num_prompts": 8, "complete": True}]}
    entry = next_chunk(ledger, 8)
    assert (entry["skip_prompts"], entry["num_prompts"]) == (58, 2)  # a round ends where the held-out range begins
    entry["complete"] = True
    entry = next_chunk(ledger, 8)
    assert (entry["skip_prompts"], entry["num_prompts"], entry["file"]) == (ROUND, 8, f"data/distill-{ROUND}.jsonl.gz")
    ledger["data"] = [{"skip_prompts": 2 * ROUND + 52, "num_prompts": 8, "complete": True}]
    with pytest.raises(ValueError, match="in each of the 3 kinds"):
        next_chunk(ledger, 8)


def test_a_run_below_the_committed_drafter_on_heldout_is_recorded_but_not_kept():
    from medusa_lite.train.campaign import improves

    runs = [{"heldout_top1": [0.60, 0.50]}, {"heldout_top1": [0.70, 0.60], "kept": True},
            {"heldout_top1": [0.80, 0.80], "kept": False}]  # a run not kept is no bar
    assert improves(runs, [0.66, 0.64]) and improves(runs, [0.65, 0.65])
    assert not improves(runs, [0.70, 0.59])
    assert improves([], [0.1]) and improves(runs, None)


def test_the_schedule_runs_at_the_speed_of_the_last_run_kept(tmp_path):
    from types import SimpleNamespace

    from medusa_lite.train.campaign import train_overrides

    base = SimpleNamespace(micro_batch_size=2, grad_accum=2, seq_len=100, warmup_steps=1, data="sharegpt[0:9]",
                           head_type="eagle3")
    args = SimpleNamespace(minutes=10, output_dir="out", threads=None, extra=("lr=1e-5",), warm_lr=3e-4, device="cpu",
                           target=None, revision=None)
    runs = [{"positions_per_s": 40.0}, {"positions_per_s": 10.0, "kept": False}]  # a discarded larger drafter
    ledger = {"data": [], "eval": None, "runs": runs}
    fresh = train_overrides(tmp_path, ledger, args, base)
    assert "max_steps=60" in fresh  # 600 s x 40 pos/s / 400 pos a step
    assert not any(o.startswith("init_heads=") or o == "lr=0.0003" for o in fresh)  # fresh: the config's lr
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "medusa_config.json").write_text("{}")
    warm = train_overrides(tmp_path, ledger, args, base)
    assert "lr=0.0003" in warm and warm.index("lr=0.0003") < warm.index("lr=1e-5")  # --extra still wins


def test_a_resumed_run_keeps_its_settings_but_takes_this_commands_threads():
    from medusa_lite.train.campaign import resumed_overrides

    saved = ["data=a,b", "max_steps=1540", "threads=1", "init_heads=campaign/eagle3"]
    assert resumed_overrides(saved, 2) == ["data=a,b", "max_steps=1540", "init_heads=campaign/eagle3", "threads=2"]
    assert resumed_overrides(saved, None) == ["data=a,b", "max_steps=1540", "init_heads=campaign/eagle3"]


def test_glob_and_gzip_sources(tmp_path):
    for i in range(2):
        plain = write_chat_jsonl(tmp_path / f"part{i}.jsonl", n=5, seed=i)
        (tmp_path / f"part{i}.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    sources = D.parse_sources(f"{tmp_path}/part*.jsonl.gz,sharegpt[3:9]")
    assert [Path(s[0]).name for s in sources[:2]] == ["part0.jsonl.gz", "part1.jsonl.gz"] and sources[2][1:] == (3, 9)
    records, _ = D.read_records(tmp_path / "part1.jsonl.gz")
    assert len(records) == 5
    with pytest.raises(FileNotFoundError, match="matches no file"):
        D.parse_sources(f"{tmp_path}/nothing*.jsonl.gz")


def test_copyable_marks_tokens_prompt_lookup_would_find():
    # index:   0  1  2  3  4  5  6
    seq = [5, 6, 7, 9, 5, 6, 7]
    assert copyable(seq) == [False, False, False, False, False, False, True]  # (5, 6) -> 7 seen at 0..2


def test_position_hits_and_tally_by_facet():
    choice = torch.tensor([1, 2, 3, 4])               # the target's token for t + 1
    ranked = torch.tensor([[2, 9, 4, 0], [3, 4, 0, 0]])  # head 1 proposes t + 2 (= choice[t + 1]), head 2 t + 3
    hits = position_hits(ranked, choice)
    assert hits[0, :3].tolist() == [1.0, 0.0, 1.0] and hits[0, 3].isnan()
    assert hits[1, :2].tolist() == [1.0, 1.0] and hits[1, 2:].isnan().all()
    tally = Tally(2)
    tally.add("g", hits, {"copyable": ["True", "False", "True", "False"]})
    rows = {(r["facet"], r["value"]): r for r in tally.rows()}
    assert rows[("all", "all")]["top1"] == [round(2 / 3, 3), 1.0]
    assert rows[("copyable", "True")]["top1"] == [1.0, 1.0] and rows[("copyable", "False")]["top1"][0] == 0.0


def test_distill_drops_a_last_line_cut_off_by_an_interrupted_write(tmp_path):
    from medusa_lite.train.distill_data import answered_indices

    out = tmp_path / "part.jsonl"
    out.write_text(json.dumps({"source_index": 3}) + "\n" + json.dumps({"source_index": 5}) + "\n" + '{"source_in')
    assert answered_indices(out) == {3, 5}
    assert out.read_text().endswith("}\n")
    assert answered_indices(tmp_path / "none.jsonl") == set()


def test_an_interrupted_data_run_commits_what_it_answered(material, tmp_path, monkeypatch):
    """SIGTERM (raised as KeyboardInterrupt) mid-chunk: the batches written are compressed into the chunk and the
    ledger says so; the next run goes on from there."""
    from medusa_lite.train import distill_data

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "campaign"
    common = [f"--root={root}", f"--target={material['target']}", f"--prompts={material['data']}",
              "--eval-start=60", "--batch-size=2", "--chunk=8"]
    real, calls = distill_data.answer_batch, []

    def answer_then_interrupt(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(distill_data, "answer_batch", answer_then_interrupt)
    campaign(["data", *common, "--minutes=10"])
    entry = json.loads((root / "ledger.json").read_text())["data"][0]
    assert (entry["records"], entry["complete"], len(calls)) == (2, False, 2)
    assert len(gzip.decompress((root / entry["file"]).read_bytes()).splitlines()) == 2
    monkeypatch.setattr(distill_data, "answer_batch", real)
    campaign(["data", *common, "--minutes=10", "--max-chunks=1"])
    entry = json.loads((root / "ledger.json").read_text())["data"][0]
    assert entry["complete"] and entry["records"] > 2


def test_two_runs_trained_side_by_side_keep_the_better_whichever_finishes_last(tmp_path, monkeypatch):
    """Two recipes trained at once (one per core) both start from the same committed drafter; the one finishing
    second is judged against the ledger as it stands when it finishes, not as it stood when it began."""
    from types import SimpleNamespace

    from medusa_lite.train import campaign as C
    from medusa_lite.train import train as T

    root = tmp_path / "campaign"
    base = SimpleNamespace(micro_batch_size=1, grad_accum=1, seq_len=8, warmup_steps=1, data="x", head_type="eagle3")
    monkeypatch.setattr(T, "build_config", lambda *a: base)
    shipped = []
    monkeypatch.setattr(C, "ship_drafter", lambda heads, dest: shipped.append(heads))
    args = C.CampaignSettings(root=str(root), output_dir=str(tmp_path / "out"))
    C.save_ledger(root, {**C.load_ledger(root, args), "runs": [{"heldout_top1": [0.5], "positions_per_s": 1.0}]})
    stats = {"step": 1, "tokens": 8, "this_run_steps": 1, "positions_per_step": 8, "this_run_seconds": 1.0}

    def train_while_the_other_run_finishes(argv):
        ledger = C.load_ledger(root, args)  # the run on the other core finishes first, better, and is kept
        C.save_ledger(root, {**ledger, "runs": ledger["runs"] + [{"heldout_top1": [0.7], "kept": True}]})
        return {"heads_dir": "mine", "eval": {"top1": [0.6]}, "stats": stats}

    monkeypatch.setattr(T, "main", train_while_the_other_run_finishes)
    C.run_train(root, C.load_ledger(root, args), args)  # began when the bar was 0.5
    runs = C.load_ledger(root, args)["runs"]
    assert shipped == [] and [r.get("kept") for r in runs[1:]] == [True, False]


def test_every_shipped_campaign_config_parses_and_names_a_shipped_training_config():
    from medusa_lite.paths import shipped_configs
    from medusa_lite.train.campaign import parse_args
    from medusa_lite.train.train import build_config

    assert "gemma3-270m" in shipped_configs("campaign")
    for name in shipped_configs("campaign"):
        settings, _ = parse_args(["status", "--config", name])
        train = build_config(settings.train_config, [])
        assert train.head_type == "eagle3" and train.target == settings.target


def test_campaign_all_goes_from_nothing_to_a_drafter_in_one_command(material, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "campaign"
    config = write_config(tmp_path / "tiny.yaml", material["target"], material["data"], tmp_path / "unused",
                          head_type="hydra", num_heads=2, eval_samples=4, save_every=0)
    campaign(["all", f"--root={root}", f"--target={material['target']}", f"--prompts={material['data']}",
              "--eval-start=60", "--eval-prompts=6", "--batch-size=2", "--chunk=8", "--max-chunks=1", "--minutes=5",
              f"--train-config={config}", "--extra=max_steps=2,warmup_steps=1"])
    ledger = json.loads((root / "ledger.json").read_text())
    assert ledger["eval"]["complete"] and ledger["data"][0]["complete"] and ledger["runs"][0]["steps"] == 2
    assert (root / "hydra" / "heads.safetensors").is_file()
