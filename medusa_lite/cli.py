"""``medusa-lite`` console command: dispatches sub-commands to the scripts in the source tree.

The library never imports ``train/`` or ``serve/``; each sub-command runs its script's ``main()`` with
the remaining arguments, so ``medusa-lite train ARGS`` is ``python train/train.py ARGS``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "demo": ("serve/demo.py", "chat prompts on the default model: plain generate vs medusa_lite"),
    "distill-data": ("train/distill_data.py", "the target's own answers to ShareGPT prompts (training data)"),
    "train": ("train/train.py", "fine-tune heads (DeepSpeed or one CPU process)"),
    "export-vllm": ("train/export_vllm.py", "write heads in vLLM's Medusa checkpoint layout"),
    "serve": ("serve/server.py", "OpenAI-compatible server"),
    "bench": ("serve/bench.py", "Spec-Bench benchmark vs plain generate and prompt lookup"),
    "calibrate": ("serve/calibrate.py", "fit the tree to the heads and this hardware"),
}


def _usage() -> str:
    lines = ["usage: medusa-lite COMMAND [ARGS]", "", "commands:"]
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
    script = ROOT / COMMANDS[name][0]
    if not script.is_file():
        print(f"medusa-lite {name}: {script} not found; run from a source checkout (pip install -e .)",
              file=sys.stderr)
        return 2
    sys.argv = [f"medusa-lite {name}", *rest]
    sys.path.insert(0, str(ROOT))
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
