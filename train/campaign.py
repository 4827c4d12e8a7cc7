"""medusa-lite campaign: the drafter's training campaign, kept in the repository so that every run, on whatever
machine, leaves it further along and never back at zero.

    medusa-lite campaign status                      # what the campaign holds
    medusa-lite campaign data --minutes 120          # self-distil the next prompt chunks (a partial chunk resumes)
    medusa-lite campaign eval                        # the held-out documents (once; a fixed yardstick)
    medusa-lite campaign train --minutes 120         # resume or warm-start training on all committed data
    medusa-lite campaign all --minutes 240           # all three from nothing in one time box (--data-share of it
                                                     # for the data, the rest for training)

Everything lives under ``--root`` (``campaign/`` in a checkout), small enough to commit:

* ``ledger.json``: every data chunk (the exact command, seed, prompt range, records, answer tokens, machine,
  tokens/s) and every training run (steps, tokens, minutes, machine, held-out top-1 per position);
* ``data/distill-NNNNN.jsonl.gz``: the target's own answers to prompts ``NNNNN .. NNNNN + chunk`` of the seeded
  ShareGPT shuffle, kinds taken in turn (``distill-data --mix``); a chunk cut short by ``--minutes`` is committed
  as it stands and finished by the next ``data`` run;
* ``eval/heldout.jsonl.gz``: answers to prompts of the range reserved at the end of the shuffle (never trained on);
* ``<head_type>/``: the drafter after the last run (bf16 weights, config, card), which the next run starts from.

``train`` runs ``medusa-lite train --config CONFIG`` with ``data`` = every committed chunk plus the config's own
sources, ``eval_data`` = the held-out file and ``init_heads`` = the committed drafter (a DeepSpeed checkpoint left
in ``output_dir`` by an interrupted run on the same machine is resumed instead), then writes the drafter back in
bf16 and records the run.
"""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean

from medusa_lite.config import CONFIG_NAME
from medusa_lite.settings import Names, SettingsParser, TargetOptions, option

LEDGER = "ledger.json"
STAGES = ("status", "data", "eval", "train", "all")
DEFAULT_POSITIONS_PER_S = 80  # EAGLE-3, one AMD EPYC (AVX2) core, fp32, no feature cache; then the last run's speed


@dataclass
class CampaignSettings(TargetOptions):
    """``medusa-lite campaign STAGE`` settings: these defaults < ``--config FILE`` < flags. The target options are the
    data's (``dtype``: the answers'; bf16 only where the hardware runs it natively) and the training's target."""

    root: str = option("campaign", "the campaign's directory (committed)")
    minutes: float = option(60.0, "wall-time budget of this data or train run")
    threads: int | None = option(1, "torch threads (1 leaves the other cores free)")
    # data
    prompts: str = option("sharegpt", "distill-data --prompts: where the prompts come from")
    chunk: int = option(350, "prompts per data chunk")
    max_chunks: int | None = option(None, "data: stop after this many chunks (finished or not) even with time left")
    mix: Names = option(Names(("chat", "multi", "summarize", "translate", "passage", "arithmetic", "code")),
                        "prompt kinds (distill-data --mix)")
    seed: int = option(0, "seed of the prompt shuffle (fixed for a campaign: the ledger refuses another)")
    eval_start: int = option(17000, "prompts from here on are reserved for the held-out set")
    eval_prompts: int = option(210, "prompts of the held-out set")
    batch_size: int = option(32, "distill-data --batch-size")
    # train
    train_config: str = option("smollm2-135m-eagle3", "training config (a shipped name or a YAML path)")
    warm_lr: float = option(3e-4, "peak learning rate of a run that warm-starts from the committed drafter (the "
                                  "config's is a fresh drafter's; runs 13/14 side by side: 3e-4 beat 1e-3)")
    extra: Names = option(Names(()), "further train overrides, key=value (after the campaign's own: they win)")
    output_dir: str | None = option(None, "the training run's scratch directory (checkpoints, features); none: "
                                          "runs/<the root's name>/train")
    data_share: float = option(0.5, "all: the share of --minutes for the held-out set and data; training gets the rest")


def parse_args(argv: list[str] | None = None) -> tuple[CampaignSettings, str]:
    parser = SettingsParser(CampaignSettings, prog="medusa-lite campaign", description=__doc__, kind="campaign")
    parser.add_argument("stage", choices=STAGES, help="what to do")
    settings, ns = parser.parse(argv)
    return settings, ns.stage


# ---------------------------------------------------------------------------------------------- ledger
def load_ledger(root: Path, args: CampaignSettings) -> dict:
    path = root / LEDGER
    if not path.is_file():
        return {"seed": args.seed, "mix": list(args.mix), "eval_start": args.eval_start, "data": [], "eval": None,
                "runs": []}
    ledger = json.loads(path.read_text())
    for key in ("seed", "mix", "eval_start"):
        if ledger[key] != (list(args.mix) if key == "mix" else getattr(args, key)):
            raise ValueError(f"{path}: the campaign was made with {key}={ledger[key]!r}; this run asks for "
                             f"{getattr(args, key)!r} (a campaign keeps one prompt order)")
    return ledger


def save_ledger(root: Path, ledger: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (LEDGER + ".tmp")
    tmp.write_text(json.dumps(ledger, indent=1) + "\n")
    tmp.replace(root / LEDGER)


def next_chunk(ledger: dict, chunk: int) -> dict:
    """The first unfinished chunk, else a new one after the last; never inside the reserved held-out range (nor
    past it: each round of prompts ends where the held-out range begins, and the next round starts at the next
    multiple of :data:`~medusa_lite.train.distill_data.ROUND`, asking the same records for other kinds)."""
    from medusa_lite.train.distill_data import ROUND

    for entry in ledger["data"]:
        if not entry["complete"]:
            return entry
    start = max((e["skip_prompts"] + e["num_prompts"] for e in ledger["data"]), default=0)
    if start % ROUND >= ledger["eval_start"]:
        start = (start // ROUND + 1) * ROUND
    if start // ROUND >= len(ledger["mix"]):
        raise ValueError(f"every prompt before the held-out range ({ledger['eval_start']}) is answered in each of "
                         f"the {len(ledger['mix'])} kinds")
    num = min(chunk, start - start % ROUND + ledger["eval_start"] - start)
    entry = new_entry(f"data/distill-{start:05d}.jsonl.gz", start, num)
    ledger["data"].append(entry)
    return entry


def new_entry(file: str, skip_prompts: int, num_prompts: int) -> dict:
    """A ledger entry for prompts ``skip_prompts .. + num_prompts`` answered into ``file`` (nothing done yet)."""
    return {"file": file, "skip_prompts": skip_prompts, "num_prompts": num_prompts, "records": 0,
            "answer_tokens": 0, "seconds": 0.0, "complete": False, "runs": []}


# ---------------------------------------------------------------------------------------------- data
def distill_chunk(root: Path, entry: dict, args: CampaignSettings, minutes: float, scratch: Path) -> bool:
    """Answer (the rest of) ``entry``'s prompts for at most ``minutes``; the chunk file is rewritten compressed.
    Returns whether the run was interrupted (what it answered is kept all the same)."""
    from medusa_lite.machine import hardware_summary
    from medusa_lite.train import distill_data

    committed, work = root / entry["file"], scratch / Path(entry["file"]).name.removesuffix(".gz")
    work.parent.mkdir(parents=True, exist_ok=True)
    saved = gzip.decompress(committed.read_bytes()) if committed.is_file() else b""
    if not work.is_file() or work.read_bytes().count(b"\n") < saved.count(b"\n"):  # else: this machine's newer part
        work.write_bytes(saved)
    argv = ["--out", str(work), "--prompts", args.prompts, "--mix", ",".join(args.mix), "--num-prompts", str(entry["num_prompts"]),
            "--skip-prompts", str(entry["skip_prompts"]), "--seed", str(args.seed), "--dtype", args.dtype,
            "--batch-size", str(args.batch_size)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    argv += target_flags(args) + ["--device", str(args.device)]
    result = distill_data.main(argv + ["--time-limit-minutes", f"{minutes:.1f}"])
    committed.parent.mkdir(parents=True, exist_ok=True)
    committed.write_bytes(gzip.compress(work.read_bytes(), mtime=0))
    entry["records"] = sum(1 for line in work.read_text().splitlines() if line.strip())
    entry["answer_tokens"] += result["answer_tokens"]
    entry["seconds"] += result["seconds"]
    entry["complete"] = result["complete"]
    entry["command"] = "medusa-lite distill-data " + " ".join(argv)  # the time budget aside: it does not shape the data
    entry["runs"].append({"date": time.strftime("%Y-%m-%d"), "machine": hardware_summary(),
                          "answer_tokens": result["answer_tokens"], "seconds": result["seconds"],
                          "tokens_per_s": round(result["answer_tokens"] / max(result["seconds"], 1e-9), 1)})
    return result.get("interrupted", False)


def target_flags(args: CampaignSettings) -> list[str]:
    """The target as the data and training commands are told it (what the campaign was told, nothing more)."""
    return (["--target", args.target] if args.target else []) + (["--revision", args.revision] if args.revision else [])


def run_data(root: Path, ledger: dict, args: CampaignSettings) -> None:
    """Chunk after chunk until ``--minutes`` are spent (the last one stops after the batch that reaches them). A
    SIGTERM or Ctrl-C stops it too, with the chunk's answered batches committed and in the ledger."""
    deadline, chunks = time.time() + 60 * args.minutes, 0
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while args.max_chunks is None or chunks < args.max_chunks:
            chunks += 1
            entry = next_chunk(ledger, args.chunk)
            interrupted = distill_chunk(root, entry, args, max(deadline - time.time(), 0) / 60,
                                        scratch_dir(root, "data"))
            save_ledger(root, ledger)
            print(f"campaign: {entry['file']}: {entry['records']} records, complete={entry['complete']}", flush=True)
            if interrupted or time.time() >= deadline:
                return
    finally:
        signal.signal(signal.SIGTERM, previous)


def scratch_dir(root: Path, stage: str) -> Path:
    """Where a stage's uncompressed work files live, a folder per campaign (``runs/campaign/data`` for the default
    ``campaign``, ``runs/gemma3-270m/data`` for ``campaign/gemma3-270m``): two campaigns on one machine never take
    each other's half-written chunks."""
    return Path("runs") / root.name / stage


def train_dir(root: Path, args: CampaignSettings) -> Path:
    return Path(args.output_dir) if args.output_dir else scratch_dir(root, "train")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_eval(root: Path, ledger: dict, args: CampaignSettings) -> None:
    """The held-out documents: answers to ``eval_prompts`` prompts from ``eval_start`` on (made once)."""
    entry = ledger["eval"] or new_entry("eval/heldout.jsonl.gz", args.eval_start, args.eval_prompts)
    ledger["eval"] = entry
    if not entry["complete"]:
        distill_chunk(root, entry, args, args.minutes, scratch_dir(root, "eval"))
        save_ledger(root, ledger)
    print(f"campaign: {entry['file']}: {entry['records']} held-out records, complete={entry['complete']}")


# ---------------------------------------------------------------------------------------------- train
def train_overrides(root: Path, ledger: dict, args: CampaignSettings, base) -> list[str]:
    """The train command's overrides: every committed chunk before the config's own ``data``, the held-out file,
    the committed drafter to start from, and a schedule (``max_steps``) that fits ``--minutes`` at the speed of the
    last run kept (the committed drafter's own shape: a run not kept may have tried another, e.g. a larger vocabulary)."""
    chunks = [str(root / e["file"]) for e in ledger["data"] if e["records"]]
    kept = [r for r in ledger["runs"] if r.get("kept", True)]
    positions_per_s = kept[-1]["positions_per_s"] if kept else DEFAULT_POSITIONS_PER_S
    steps = max(int(args.minutes * 60 * positions_per_s / (base.micro_batch_size * base.grad_accum * base.seq_len)),
                2 * base.warmup_steps)
    # no feature cache: a machine sees each token about once per run, and the cache (4.6 KB a token) is neither
    # committed nor kept, so computing it up front would cost more than the forward each step does
    out = [f"data={','.join(chunks + [base.data])}", f"output_dir={train_dir(root, args)}", f"max_steps={steps}",
           f"time_limit_minutes={args.minutes}", "cache_features=false", f"device={args.device}"]
    out += [f"{flag.removeprefix('--')}={value}" for flag, value in zip(*[iter(target_flags(args))] * 2)]
    if ledger["eval"] and ledger["eval"]["records"]:
        out.append(f"eval_data={root / ledger['eval']['file']}")
    if (root / base.head_type / CONFIG_NAME).is_file():
        out += [f"init_heads={root / base.head_type}", f"lr={args.warm_lr}"]
    if args.threads:
        out.append(f"threads={args.threads}")
    return out + list(args.extra)


def ship_drafter(heads_dir: Path, dest: Path) -> None:
    """Copy a trained heads directory to ``dest`` with its weights in bf16 (ids stay integers)."""
    import torch
    from safetensors.torch import load_file, save_file

    from medusa_lite.config import WEIGHTS_NAME

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(heads_dir, tmp)
    state = load_file(str(heads_dir / WEIGHTS_NAME))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
              str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "library": "medusa_lite"})
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def resumed_overrides(saved: list[str], threads: int | None) -> list[str]:
    """An unfinished run's overrides as it resumes: its own, on as many threads as the resuming command gives (how
    many cores are free now is not a property of the run; a run begun on one core may finish on two)."""
    return [o for o in saved if not o.startswith("threads=")] + ([f"threads={threads}"] if threads else [])


def run_train(root: Path, ledger: dict, args: CampaignSettings) -> None:
    from medusa_lite.machine import hardware_summary
    from medusa_lite.train import train as T

    base = T.build_config(args.train_config, list(args.extra))
    overrides = train_overrides(root, ledger, args, base)
    marker = train_dir(root, args) / "campaign-run.json"
    if marker.is_file():  # a run this machine did not finish: its checkpoint resumes under its own settings
        overrides = resumed_overrides(json.loads(marker.read_text()), args.threads)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(overrides) + "\n")
    result = T.main(["--config", args.train_config, *overrides])
    if "heads_dir" not in result:
        print("campaign: training stopped before its end (checkpoint kept in output_dir); rerun to finish")
        return
    ev = result.get("eval", {})
    # the bar as it stands now: a data run may have added chunks, and a run trained beside this one (another recipe
    # on the other core) may have finished first and been kept
    ledger = load_ledger(root, args)
    kept = improves(ledger["runs"], ev.get("top1"))
    if kept:
        ship_drafter(Path(result["heads_dir"]), root / base.head_type)
    else:
        print(f"campaign: held-out top-1 {ev.get('top1')} is below the committed drafter's: it stays; the run is "
              f"recorded, its heads left in {result['heads_dir']}")
    shutil.rmtree(train_dir(root, args) / "checkpoints", ignore_errors=True)  # finished: the next run warm-starts
    marker.unlink()
    stats = result["stats"]
    ledger["runs"].append({"date": time.strftime("%Y-%m-%d"), "machine": hardware_summary(),
                           "command": "medusa-lite train --config " + args.train_config + " " + " ".join(overrides),
                           "steps": stats["step"], "positions": stats["tokens"],
                           "positions_per_s": round(stats["this_run_steps"] * stats["positions_per_step"]
                                                    / max(stats["this_run_seconds"], 1e-9), 1),
                           "minutes": round(stats["this_run_seconds"] / 60, 1),
                           "data_chunks": sum(1 for e in ledger["data"] if e["records"]),
                           "answer_tokens": sum(e["answer_tokens"] for e in ledger["data"]),
                           "heldout_top1": ev.get("top1"), "heldout_top5": ev.get("top5"),
                           "heldout_accept_t1": ev.get("accept_t1"), "kept": kept})
    save_ledger(root, ledger)
    if kept:
        print(f"campaign: drafter written to {root / base.head_type}; held-out top-1 {ev.get('top1')}")


def run_all(root: Path, ledger: dict, args: CampaignSettings) -> dict:
    """One time box from nothing to a drafter: the held-out set (once), new data until ``data_share`` of
    ``--minutes`` is spent, then training for what is left. Returns the ledger as it stands at the end."""
    start = time.time()
    data_minutes = args.minutes * args.data_share
    run_eval(root, ledger, replace(args, minutes=data_minutes))
    left = data_minutes - (time.time() - start) / 60
    if left > 0:
        run_data(root, ledger, replace(args, minutes=left))
    run_train(root, ledger, replace(args, minutes=max(args.minutes - (time.time() - start) / 60, 1.0)))
    return load_ledger(root, args)


def improves(runs: list[dict], top1: list[float] | None) -> bool:
    """Whether a run's held-out top-1 (mean over depths) is at least the committed drafter's (the last run kept):
    a run never leaves the campaign behind where it was. Without figures to compare, the new run is kept."""
    kept = [r for r in runs if r.get("kept", True) and r.get("heldout_top1")]
    if not kept or not top1:
        return True
    return fmean(top1) >= fmean(kept[-1]["heldout_top1"])


def status(ledger: dict) -> str:
    done = [e for e in ledger["data"] if e["records"]]
    lines = [f"data: {len(done)} chunks, {sum(e['records'] for e in done)} records, "
             f"{sum(e['answer_tokens'] for e in done)} answer tokens"
             + ("" if all(e["complete"] for e in ledger["data"]) else " (one chunk unfinished)"),
             f"held-out: {ledger['eval']['records'] if ledger['eval'] else 0} records",
             f"training runs: {len(ledger['runs'])}"]
    lines += [f"  {r['date']} {r['steps']} steps, {r['minutes']} min, held-out top-1 {r['heldout_top1']}"
              + ("" if r.get("kept", True) else " (not kept: see its note in the ledger)") for r in ledger["runs"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args, stage = parse_args(argv)
    root = Path(args.root)
    ledger = load_ledger(root, args)
    if stage == "data":
        run_data(root, ledger, args)
    elif stage == "eval":
        run_eval(root, ledger, args)
    elif stage == "train":
        run_train(root, ledger, args)
    elif stage == "all":
        ledger = run_all(root, ledger, args)
    print(status(ledger))
    return ledger


if __name__ == "__main__":
    main()
