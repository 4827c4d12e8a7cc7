"""What medusa_lite asks of transformers and torch: public API only, nothing of theirs replaced.

Importing medusa_lite, building a MedusaModel and decoding through every kernel leave every function and class of
transformers and ``torch.nn`` as it was, and every entry of transformers' attention registries; the only change is
one added name (:data:`medusa_lite.attention.NAME`). The kernels reach only the model they decode, only while held.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r'''
import sys
import torch
import transformers
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, modeling_utils
from transformers.integrations import sdpa_attention  # noqa: F401  (loaded: its functions are compared too)
from conftest import tiny_model


def snapshot() -> dict:
    """Every callable of transformers' and torch.nn's loaded modules, of nn.Module, nn.Linear and PreTrainedModel, and
    every entry of the attention registries: name -> the object's id."""
    out = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".")[0] == "transformers" or name.startswith("torch.nn"):
            out.update({f"{name}.{key}": id(value) for key, value in list(vars(module).items()) if callable(value)})
    for cls in (nn.Module, nn.Linear, modeling_utils.PreTrainedModel):
        out.update({f"{cls.__name__}::{key}": id(value) for key, value in vars(cls).items()})
    for kind, registry in (("attention", AttentionInterface), ("mask", AttentionMaskInterface)):
        out.update({f"{kind}[{key}]": id(value) for key, value in registry._global_mapping.items()})
    return out


def changed(before: dict, after: dict) -> list:
    return sorted(key for key in before if key in after and after[key] != before[key])


target, other = tiny_model(), tiny_model(seed=1)
start = snapshot()
import medusa_lite
from medusa_lite import MedusaConfig, MedusaModel
from medusa_lite.attention import NAME
from medusa_lite.decode import make_plan, speculative_generate
from medusa_lite.kernels import Kernels, SkinnyLinears, VerifyKernels, drafting_linears, skinny_kernel
print("import", changed(start, snapshot()))
model = MedusaModel(target, MedusaConfig(num_heads=3, head_type="hydra"))
print("build", changed(start, snapshot()))
prompt = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
model.generate(prompt, max_new_tokens=8, do_sample=False, tree=[[0], [1], [0, 0]])
if skinny_kernel() is not None:  # every kernel at once: verify and drafting linears, attention
    kernels = Kernels.defaults(target, linears=VerifyKernels(target, 1, kind=SkinnyLinears),
                               draft_linears=drafting_linears(model.drafter))
    config = model.prepare_config(do_sample=False)
    plan = make_plan(model.drafter, [[0], [1], [0, 0]], "cpu")
    seen = set()
    speculative_generate(target, model.drafter, plan, prompt[0], config, max_new_tokens=8, kernels=kernels,
                         on_step=lambda *_: seen.add((target.config._attn_implementation,
                                                      other.config._attn_implementation)))
    print("during", *sorted(seen))
after = snapshot()
print("decode", changed(start, after))
print("added", sorted(set(after) - set(start) & {k for k in after if k.startswith(("attention[", "mask["))}))
print("restored", target.config._attn_implementation, other.config._attn_implementation, NAME,
      sum("forward" in vars(m) for m in list(target.modules()) + list(model.drafter.modules())))
'''


def test_import_build_and_decode_replace_nothing_of_transformers_or_torch():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600,
                         cwd=ROOT / "tests", env={**os.environ, "MEDUSA_LITE_FIT": "0", "PYTHONPATH": str(ROOT / "tests")})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["import"] == "[]" and lines["build"] == "[]" and lines["decode"] == "[]"
    assert lines["added"] == "['attention[medusa_lite]', 'mask[medusa_lite]']"  # one name added, on first use
    assert lines["restored"] == "sdpa sdpa medusa_lite 0"  # the models' own attention and linears back afterwards
    if "during" in lines:  # while a model decodes, it alone is routed
        assert lines["during"] == "('medusa_lite', 'sdpa')"


def test_grouped_heads_take_torchs_gqa_kernel_only_inside_medusa_lites_forwards(monkeypatch):
    """A masked forward of grouped heads: torch's SDPA takes the key/value heads as they are (``enable_gqa``, no
    repeated copy) inside :func:`~medusa_lite.attention.attending`; outside, and for another model at the same time,
    transformers' own path; the target's own attention setting is back afterwards."""
    from medusa_lite.attention import NAME, attending

    target, other = tiny_model(), tiny_model(seed=1)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((q.shape[1], k.shape[1], kw.get("enable_gqa", False)))
                        or sdpa(q, k, v, **kw))
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        plain = target(input_ids=ids, attention_mask=mask).logits
        assert calls and all(kv == 4 and not gqa for _, kv, gqa in calls)  # transformers repeats the 2 heads
        calls.clear()
        with attending(target):
            assert target.config._attn_implementation == NAME and other.config._attn_implementation == "sdpa"
            grouped = target(input_ids=ids, attention_mask=mask).logits
            assert calls and all(kv == 2 and gqa for _, kv, gqa in calls)
            calls.clear()
            other(input_ids=ids, attention_mask=mask)
            assert all(kv == 4 and not gqa for _, kv, gqa in calls)
    assert torch.equal(plain, grouped) and target.config._attn_implementation == "sdpa"


def test_generation_config_is_transformers_own():
    """``generate``'s arguments become the config transformers' ``generate`` would build (its defaults table
    included), with the arguments that name no field handed back."""
    from transformers import GenerationConfig

    from medusa_lite._hf import GENERATION_DEFAULTS, resolve_generation_config

    assert GENERATION_DEFAULTS == GenerationConfig._get_default_generation_params()
    target = tiny_model()
    target.generation_config.top_k = 7
    target.generation_config.custom_entry = 3
    for config, kwargs in ((None, {}), (None, dict(do_sample=True, temperature=0.5, max_new_tokens=4)),
                           (GenerationConfig(top_p=0.9), {}), (None, dict(unknown=1, use_cache=False)),
                           (None, dict(output_hidden_states=True))):
        theirs, their_unused = target._prepare_generation_config(config, **kwargs)
        ours, unused = resolve_generation_config(target, config, **kwargs)
        assert ours.to_dict() == theirs.to_dict() and unused == their_unused
