"""One settings mechanism for every command: a dataclass, a YAML file and the command line.

Precedence: the dataclass defaults < the YAML file given by ``--config`` < flags on the command line.
``--config`` takes a path or the name of a file shipped under ``configs/<kind>/`` (installed as ``medusa_lite.configs``)
(``medusa-lite train --config smollm2-135m``). Flags are transformers' ``HfArgumentParser`` flags of the
dataclass fields (``--max_steps 10`` or ``--max-steps 10``; booleans ``--fit false`` / ``--no-fit``);
``key=value`` is the same flag. A YAML value is checked exactly as the same value typed as a flag, so an
unknown or ill-typed key is a :class:`SettingsError` naming it, whichever source it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Callable, Literal

from .paths import resolve_config, shipped_configs

_NONE = ("none", "null", "~")
_KEY_VALUE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The scripts' docstrings as written, every setting with its default (unless its help names it)."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


class SettingsError(ValueError):
    """An unknown, ill-typed or invalid setting; the message names it."""


def option(default: Any = dataclasses.MISSING, help: str = "", **kwargs) -> Any:
    """A settings field with its ``--help`` text: ``lr: float = option(1e-3, "peak learning rate")``."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


class Ints(tuple):
    """A comma-separated list of integers as one flag: ``--sizes 4,8,16``; ``''`` is empty (YAML: a list)."""

    label = "comma-separated integers"

    def __new__(cls, items: str | tuple | list = ()):
        parts = items.split(",") if isinstance(items, str) else items
        return super().__new__(cls, (cls.item(x) for x in parts if str(x).strip()))

    item = staticmethod(int)


class Names(Ints):
    """A comma-separated list of names as one flag: ``--methods plain,medusa``."""

    label = "comma-separated names"
    item = staticmethod(lambda x: str(x).strip())


class Device(str):
    """``--device``, checked as it is parsed; what it means on this machine is decided when the target loads
    (:func:`medusa_lite.targets.resolve_device`)."""

    label = "auto, cpu, cuda or cuda:N"

    def __new__(cls, text: str = "auto"):
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(text)):
            raise ValueError(f"device {text!r}: expected {cls.label}")
        return super().__new__(cls, text)


@dataclasses.dataclass(kw_only=True)
class TargetOptions:
    """The options of every command that loads a target (train, distill-data, calibrate, diagnose, bench, serve, demo,
    export-vllm): their settings inherit these, so each flag means the same in every command."""

    target: str | None = option(None, "Hub repo id (org/name, read through the Hugging Face cache), model folder or "
                                      ".gguf file; none: the bundled default target")
    revision: str | None = option(None, "Hub revision (branch, tag or commit) of a Hub id target; none: main")
    device: Device = option(Device("auto"), "auto: the CUDA device where there is one, else the CPU; cpu; cuda; "
                                            "cuda:N")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", "the target's dtype; auto: bf16 on a CUDA device that runs it natively, else fp32")

    def resolve(self):
        """``auto`` replaced by what it means on this machine (``device`` e.g. 'cpu' or 'cuda:0', ``dtype`` 'fp32' or
        'bf16'), so reports and caches name what ran; returns self."""
        from ._hf import dtype_name
        from .targets import resolve_device, resolve_dtype

        device = resolve_device(self.device)
        dtype = dtype_name(resolve_dtype(self.dtype, device))
        self.device = Device(str(device))
        self.dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        return self

    def load_kwargs(self) -> dict[str, Any]:
        """``target``, ``revision``, ``device`` and ``dtype`` as :func:`medusa_lite.targets.load_target` and
        :func:`~medusa_lite.targets.load_model` take them."""
        return {"target": self.target, "revision": self.revision, "device": self.device, "dtype": self.dtype}


class SettingsParser:
    """Parses ``argv`` into the dataclass ``cls`` (defaults < YAML < flags); ``kind`` names the shipped configs
    ``--config`` may name, ``default_config`` is read when no ``--config`` is given."""

    def __init__(self, cls: type, *, prog: str, description: str | None = None, kind: str | None = None,
                 default_config: str | None = None):
        from transformers import HfArgumentParser

        class _Parser(HfArgumentParser):
            def error(self, message: str):  # argparse would print and exit; callers decide that
                raise SettingsError(f"{self.prog}: {message}")

        self.cls, self.kind, self.default_config = cls, kind, default_config
        self.parser = _Parser(cls, prog=prog, description=description, allow_abbrev=False,
                              formatter_class=_HelpFormatter)
        if kind is not None:
            names = ", ".join(shipped_configs(kind)) or "none"
            self.parser.add_argument("--config", default=default_config,
                                     help=f"YAML file of these settings, or a shipped name ({names})")
        self.fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for action in self.parser._actions:
            if action.dest in self.fields and action.type is not None:
                action.type = _checked(action, _optional(self.fields[action.dest], cls))

    def add_argument(self, *args, **kwargs) -> None:
        """A flag outside the dataclass (e.g. positionals); :meth:`parse` returns it in the namespace."""
        self.parser.add_argument(*args, **kwargs)

    def parse(self, argv: list[str] | None = None) -> tuple[Any, argparse.Namespace]:
        """(settings, namespace of the extra flags) from ``argv`` (default ``sys.argv[1:]``). ``SettingsError``
        on any unknown or bad setting."""
        argv = list(sys.argv[1:] if argv is None else argv)
        argv = [arg if i and self._takes_value(argv[i - 1]) else self._as_flag(arg) for i, arg in enumerate(argv)]
        config = self._config_path(argv)
        namespace = self.parser.parse_args(self._yaml_flags(config) + argv)
        values = {name: getattr(namespace, name) for name in self.fields}
        for name in self.fields:
            delattr(namespace, name)
        try:
            return self.cls(**values), namespace
        except (TypeError, ValueError) as e:
            raise SettingsError(f"{self.parser.prog}: {e}") from e

    def _takes_value(self, arg: str) -> bool:
        """Whether ``arg`` is a flag that takes the next token as its value (``--output_dir seed=3``)."""
        action = self.parser._option_string_actions.get(arg)
        return action is not None and action.nargs is None and action.type is not None

    def _as_flag(self, arg: str) -> str:
        """``key=value`` of a known setting (the form training commands have always taken) -> ``--key=value``."""
        match = _KEY_VALUE.match(arg)
        return f"--{match.group(1)}={match.group(2)}" if match and match.group(1) in self.fields else arg

    def _config_path(self, argv: list[str]) -> Path | None:
        if self.kind is None:
            return None
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", default=self.default_config)
        given = pre.parse_known_args(argv)[0].config
        return None if given is None else resolve_config(self.kind, given)

    def _yaml_flags(self, path: Path | None) -> list[str]:
        """The YAML file as flags placed before the command line's, so the command line wins."""
        import yaml

        if path is None:
            return []
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise SettingsError(f"{path}: expected a mapping of settings")
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise SettingsError(f"{path}: unknown setting(s) {unknown}; known: {sorted(self.fields)}")
        flags = []
        for key, value in data.items():
            kind = _base_type(self.fields[key], self.cls)
            if isinstance(value, dict):
                raise SettingsError(f"{path}: setting {key!r} expects a value, got a mapping {value!r}")
            if isinstance(value, list) != (isinstance(kind, type) and issubclass(kind, Ints)):
                raise SettingsError(f"{path}: setting {key!r} expects {getattr(kind, '__name__', kind)}, got {value!r}")
            if isinstance(value, bool) and kind is not bool:  # YAML 1.1 reads yes / off as booleans
                raise SettingsError(f"{path}: setting {key!r} expects {getattr(kind, '__name__', kind)}, got {value!r}")
            if isinstance(value, list):
                text = ",".join(map(str, value))
            else:
                text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            flags.append(f"--{key}={text}")
        return flags


def _base_type(field: dataclasses.Field, cls: type):
    """The field's type without ``| None``."""
    import typing

    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) is not typing.Literal else hint


def _optional(field: dataclasses.Field, cls: type) -> bool:
    import typing

    return type(None) in typing.get_args(typing.get_type_hints(cls)[field.name])


def _checked(action: argparse.Action, optional: bool) -> Callable[[str], Any]:
    """The flag's converter, taking 'none'/'null' for optional settings, with an error that names the setting."""
    name, convert = action.dest, action.type
    if action.choices:
        kind = "one of " + ", ".join(map(str, action.choices))
    else:
        kind = getattr(convert, "label", None) or {"string_to_bool": "true or false"}.get(
            getattr(convert, "__name__", ""), getattr(convert, "__name__", "a value"))

    def parse(text: str) -> Any:
        if text.lower() in _NONE:
            if optional:
                return None
            raise argparse.ArgumentTypeError(f"setting {name!r} may not be null")
        try:
            value = convert(text)
            if action.choices and value not in action.choices:
                raise ValueError(text)
            return value
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"setting {name!r} expects {kind}"
                                             f"{' or null' if optional else ''}, got {text!r}") from None
    return parse
