"""medusa_lite.targets: a target named by Hub id (offline cache, any revision), folder or GGUF file, on the device and
in the dtype asked for; what cannot be found or loaded is one error that says what was tried."""

from __future__ import annotations

import pytest
import torch
from target_helpers import HUB_ID, named_targets

from medusa_lite import cli, targets
from medusa_lite.paths import TargetError
from medusa_lite.targets import load_target, locate_target, resolve_device, resolve_dtype


@pytest.fixture
def named(tmp_path, monkeypatch):
    return named_targets(tmp_path, monkeypatch)


def _logits(model) -> torch.Tensor:
    ids = torch.arange(1, 13)[None]
    return model(input_ids=ids).logits.float()


def test_a_hub_id_a_folder_and_a_gguf_file_load_the_same_model(named):
    reference = _logits(named["models"]["main"])
    for name in (named["hub"], str(named["folder"]), str(named["gguf"])):
        model, tokenizer = load_target(name, device="auto", dtype="auto")  # this CPU: cpu, fp32
        assert (model.device.type, model.dtype) == ("cpu", torch.float32)
        assert torch.equal(_logits(model), reference), name
        assert tokenizer("hi")["input_ids"] == [104, 105]
    other, _ = load_target(named["hub"], revision="v2")
    assert torch.equal(_logits(other), _logits(named["models"]["v2"]))
    assert load_target(named["gguf"], dtype="bf16")[0].dtype == torch.bfloat16
    assert "at revision v2" in locate_target(HUB_ID, "v2")[2]


@pytest.mark.parametrize("name, revision, said", [
    ("no/such-repo", None, "Hub repo no/such-repo at revision main could not be read from the cache"),
    (HUB_ID, "v9", f"Hub repo {HUB_ID} at revision v9 could not be read"),
    ("missing-folder", None, "is no folder or .gguf file here, nor a Hub id"),
    ("missing/model.gguf", None, "is no folder or .gguf file here"),
    ("{folder}", "v2", "is a local path; revision 'v2' applies to a Hub id"),
    ("{root}", None, "has no config.json"),
    ("{broken}", None, "could not be loaded as a causal LM"),
])
def test_a_target_that_cannot_be_found_or_loaded_says_what_was_tried(named, tmp_path, name, revision, said):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file")
    name = name.format(folder=named["folder"], root=tmp_path, broken=tmp_path / "broken.gguf")
    with pytest.raises(TargetError, match=said.replace("(", r"\(")):
        load_target(name, revision=revision)


def test_a_command_prints_the_error_without_a_traceback(named, capsys):
    assert cli.main(["diagnose", "--target", "no/such-repo", "--heads", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: target 'no/such-repo'") and "Traceback" not in err and "HF_HUB_OFFLINE" in err


def test_auto_means_the_cuda_device_and_bf16_where_there_is_one(monkeypatch):
    assert (resolve_device("auto"), resolve_dtype("auto", "auto")) == (torch.device("cpu"), torch.float32)
    assert resolve_dtype("fp16", "cpu") == torch.float16
    with pytest.raises(TargetError, match="0 CUDA device"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("medusa_lite.machine.native_bf16", lambda device: (True, "made up"))
    assert resolve_device("auto") == torch.device("cuda", 0) and resolve_dtype("auto", "auto") == torch.bfloat16
    monkeypatch.setenv("LOCAL_RANK", "1")  # under a launcher: this rank's device
    assert resolve_device("cuda") == torch.device("cuda", 1) and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(TargetError, match="2 CUDA device"):
        resolve_device("cuda:2")
    assert targets.resolve_dtype("auto", "cpu") == torch.float32  # the CPU stays fp32 where CUDA is present


def test_a_gguf_target_is_dequantised_once_and_a_packaged_one_loads_by_name(named, monkeypatch):
    folder, gguf_file, what = locate_target(str(named["gguf"]))
    assert gguf_file is None and (folder / "model.safetensors").is_file() and str(named["gguf"]) in what
    assert locate_target(str(named["gguf"]))[0] == folder  # the second time from the cache
    monkeypatch.setitem(targets.PACKAGED_TARGETS, "tiny-packaged", lambda: named["gguf"])
    model, _ = load_target("tiny-packaged")
    assert torch.equal(_logits(model), _logits(load_target(named["folder"])[0]))
    with pytest.raises(TargetError, match="revision"):
        locate_target("tiny-packaged", revision="v2")
