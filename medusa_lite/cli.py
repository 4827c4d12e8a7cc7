"""``medusa-lite`` console command: one sub-command per script of the installed ``medusa_lite.train`` and
``medusa_lite.serve`` packages (``train/`` and ``serve/`` in a checkout).

``medusa-lite train ARGS`` calls ``medusa_lite.train.train.main(ARGS)``, the same as
``python -m medusa_lite.train.train ARGS``. The scripts' heavy imports load only for the command that runs.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # what users do: train a drafter, generate with it, serve it, measure it
    "demo": ("medusa_lite.serve.demo", "chat prompts on the default model: plain generate vs medusa_lite"),
    "train": ("medusa_lite.train.train", "train a drafter for a target (DeepSpeed, one CPU process or many GPUs)"),
    "calibrate": ("medusa_lite.serve.calibrate", "fit the tree to the heads and this hardware"),
    "serve": ("medusa_lite.serve.server", "OpenAI-compatible server"),
    "bench": ("medusa_lite.serve.bench", "Spec-Bench benchmark vs plain generate and prompt lookup"),
    "export-vllm": ("medusa_lite.train.export_vllm", "write a drafter in vLLM's checkpoint layout"),
    # maintainers': the long-running drafter campaigns, their diagnosis, server load (campaign/README.md)
    "campaign": ("medusa_lite.train.campaign", "a drafter campaign: committed data, resumable training, ledger"),
    "distill-data": ("medusa_lite.train.distill_data", "the target's own answers or continuations (training data)"),
    "diagnose": ("medusa_lite.train.diagnose", "a drafter's top-1 by task, context length, answer position, copyability"),
    "loadtest": ("medusa_lite.serve.loadtest", "concurrent clients against a running (or spawned) server"),
    "compare": ("medusa_lite.serve.compare", "two bench reports paired by question: B - A with a 95% interval"),
}
MAINTAINER_COMMANDS = ("campaign", "distill-data", "diagnose", "loadtest", "compare")


def _usage() -> str:
    lines = ["usage: medusa-lite COMMAND [ARGS]   (medusa-lite COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items() if name not in MAINTAINER_COMMANDS]
    lines += ["", "maintainer commands:"]
    lines += [f"  {name:<12} {COMMANDS[name][1]}" for name in MAINTAINER_COMMANDS]
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
