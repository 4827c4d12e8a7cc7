"""medusa_lite.settings: one mechanism (dataclass < YAML < flags) for every command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from medusa_lite.settings import Ints, Names, SettingsError, SettingsParser, option


@dataclass
class Example:
    name: str = option("a", "a name")
    count: int | None = option(3, "a count")
    mode: Literal["x", "y"] = option("x", "a mode")
    fit: bool = option(True, "a switch")
    sizes: Ints = option(Ints((1, 2)), "sizes")
    methods: Names = option(Names(("plain",)), "methods")


def parse(*argv: str, config=None):
    return SettingsParser(Example, prog="example", kind="example").parse(
        (["--config", str(config)] if config else []) + list(argv))[0]


def test_defaults_yaml_flags_precedence_and_every_flag_form(tmp_path):
    assert parse() == Example()
    path = tmp_path / "c.yaml"
    path.write_text("name: from-yaml\ncount: null\nsizes: [4, 8]\nmethods: [plain, pld]\nfit: false\n")
    s = parse(config=path)
    assert (s.name, s.count, s.sizes, s.methods, s.fit) == ("from-yaml", None, (4, 8), ("plain", "pld"), False)
    s = parse("--name", "flag", "count=7", "--sizes", "16", "--fit", config=path)  # flags win over the file
    assert (s.name, s.count, s.sizes, s.fit, s.mode) == ("flag", 7, (16,), True, "x")
    assert parse("--no-fit").fit is False and parse("--sizes", "").sizes == ()
    assert parse("--name", "k=v").name == "k=v"  # key=value only for known settings
    assert parse("--name", "count=5").name == "count=5"  # a flag's value is never rewritten
    assert parse("--name=count=5", "count=2").count == 2


@pytest.mark.parametrize("argv, yaml, key", [
    (["--count", "2.5"], None, "'count'"), (["--mode", "z"], None, "'mode'"), (["--fit", "maybe"], None, "'fit'"),
    (["--sizes", "1,x"], None, "'sizes'"), (["--nmae", "b"], None, "--nmae"), (["--name", "none"], None, "'name'"),
    ([], "count: many\n", "'count'"), ([], "nmae: b\n", "nmae"), ([], "name: {a: 1}\n", "'name'"),
    ([], "- a\n", "mapping"), ([], "name: yes\n", "'name'"), ([], "name: [a, b]\n", "'name'"),
    ([], "count: [3]\n", "'count'"), (["--nam", "b"], None, "--nam"),
])
def test_unknown_or_ill_typed_settings_name_the_key(tmp_path, argv, yaml, key):
    path = None
    if yaml is not None:
        path = tmp_path / "c.yaml"
        path.write_text(yaml)
    with pytest.raises(SettingsError, match=key):
        parse(*argv, config=path)


def test_missing_config_names_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        SettingsParser(Example, prog="example", kind="train").parse(["--config", "no-such-config"])


def test_command_settings():
    from medusa_lite.serve.bench import parse_args as bench
    from medusa_lite.serve.calibrate import parse_args as calibrate
    from medusa_lite.serve.demo import parse_args as demo

    assert bench(["--methods", "pld,medusa"]).methods == ("plain", "pld", "medusa")  # plain is the reference
    with pytest.raises(SettingsError, match="unknown"):
        bench(["--methods", "fast"])
    assert calibrate(["--fallback-only", "--probe-budget", "2"]).fallback_only is True
    with pytest.raises(SettingsError, match="unrecognized"):  # 0.1's offline tree chooser is gone: one path, the fit
        calibrate(["--temperature", "1.0"])
    assert demo(["--no-fit", "--max-new-tokens", "16"]).fit is False
    assert demo(["--threads", "1"]).threads == 1 and demo([]).threads is None


def test_demo_guard_summary_names_every_rung_the_guard_ran():
    from types import SimpleNamespace

    from medusa_lite.serve.demo import guard_summary

    fit = SimpleNamespace(ladders=[[SimpleNamespace(tokens_per_second=20.25)]])
    fitted = {"realized_tokens_per_second": [13.9, None], "steps_by_tree": {"[]": 81, "[[0],[0,0]]": 8}}
    line = guard_summary(fit, fitted)
    assert "predicted 20.2 tok/s" in line and "realized 13.9 tok/s" in line
    assert line.endswith("(steps per tree, as the guard chose: root alone: 81, [[0],[0,0]]: 8)")


# the commands that load a target, by their name in medusa_lite.cli.COMMANDS
LOADING = ("train", "distill-data", "calibrate", "diagnose", "bench", "serve", "demo", "export-vllm")


def _target_settings(command: str) -> type:
    """The settings class of ``command`` (the one class in its module built on TargetOptions)."""
    import importlib

    from medusa_lite.cli import COMMANDS
    from medusa_lite.settings import TargetOptions

    module = importlib.import_module(COMMANDS[command][0])
    found = {v for v in vars(module).values() if isinstance(v, type) and issubclass(v, TargetOptions)}
    found.discard(TargetOptions)
    assert len(found) == 1, f"{command}: settings built on TargetOptions: {found}"
    return found.pop()


def test_every_loading_command_names_its_target_device_and_dtype_one_way(tmp_path, monkeypatch):
    """Each command that loads a target takes a Hub id, a folder or a GGUF file, ``--revision``, ``--device`` and
    ``--dtype`` as the same flags (YAML keys too), and they resolve the same way; ``auto`` is the default (export
    writes bf16 unless told)."""
    from target_helpers import named_targets

    from medusa_lite.targets import locate_target

    named = named_targets(tmp_path, monkeypatch)
    config = tmp_path / "target.yaml"
    config.write_text(f"target: {named['folder']}\ndevice: cuda:0\ndtype: fp16\n")
    for command in LOADING:
        cls = _target_settings(command)
        parser = SettingsParser(cls, prog=command, kind=command)
        required = ["--out", "x.jsonl"] if command == "distill-data" else []
        defaults = parser.parse(required)[0]
        assert (defaults.target, defaults.revision, defaults.device) == (None, None, "auto"), command
        assert defaults.dtype == ("bf16" if command == "export-vllm" else "auto"), command
        for kind, revision in (("hub", "v2"), ("folder", None), ("gguf", None)):
            argv = ["--target", str(named[kind]), "--device", "cuda:1", "--dtype", "bf16"]
            s = parser.parse(required + argv + (["--revision", revision] if revision else []))[0]
            assert s.load_kwargs() == {"target": str(named[kind]), "revision": revision, "device": "cuda:1",
                                       "dtype": "bf16"}, command
            tried = locate_target(s.target, s.revision)[2]  # what it was found as
            assert tried.startswith({"hub": "the Hub repo", "folder": "the folder", "gguf": "the GGUF file"}[kind])
        s = parser.parse(required + ["--config", str(config), "--device", "cpu"])[0]
        assert (s.target, s.device, s.dtype) == (str(named["folder"]), "cpu", "fp16"), command
        assert s.resolve().load_kwargs()["device"] == "cpu" and s.dtype == "fp16"
        assert parser.parse(required + ["--dtype", "auto"])[0].resolve().dtype == "fp32"  # this CPU
        for bad in (["--device", "gpu"], ["--dtype", "fp8"]):
            with pytest.raises(SettingsError, match="'device'|'dtype'"):
                parser.parse(required + bad)
