"""``medusa-lite`` console command: one sub-command per script of the installed ``medusa_lite.train`` and
``medusa_lite.serve`` packages (``train/`` and ``serve/`` in a checkout).

``medusa-lite train ARGS`` calls ``medusa_lite.train.train.main(ARGS)``, the same as
``python -m medusa_lite.train.train ARGS``. The scripts' heavy imports load only for the command that runs.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("medusa_lite.serve.demo", "chat prompts on the default model: plain generate vs medusa_lite"),
    "campaign": ("medusa_lite.train.campaign", "the drafter campaign: committed data, resumable training, ledger"),
    "diagnose": ("medusa_lite.train.diagnose", "a drafter's top-1 by task, context length, answer position, copyability"),
    "distill-data": ("medusa_lite.train.distill_data", "the target's own answers to ShareGPT prompts (training data)"),
    "train": ("medusa_lite.train.train", "fine-tune heads (DeepSpeed, one CPU process or many GPUs)"),
    "export-vllm": ("medusa_lite.train.export_vllm", "write heads in vLLM's Medusa checkpoint layout"),
    "serve": ("medusa_lite.serve.server", "OpenAI-compatible server"),
    "loadtest": ("medusa_lite.serve.loadtest", "concurrent clients against a running (or spawned) server"),
    "bench": ("medusa_lite.serve.bench", "Spec-Bench benchmark vs plain generate and prompt lookup"),
    "compare": ("medusa_lite.serve.compare", "two bench reports paired by question: B - A with a 95% interval"),
    "calibrate": ("medusa_lite.serve.calibrate", "fit the tree to the heads and this hardware"),
}


def _usage() -> str:
    lines = ["usage: medusa-lite COMMAND [ARGS]   (medusa-lite COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"medusa-lite: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from .paths import TargetError
    from .settings import SettingsError

    try:
        result = importlib.import_module(COMMANDS[name][0]).main(rest)
    except (SettingsError, TargetError) as e:  # a bad setting or a target that does not load: the message says
        print(f"error: {e}", file=sys.stderr)  # what was wrong or tried; no traceback
        return 2
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
