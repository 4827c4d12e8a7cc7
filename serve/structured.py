"""Structured output: a request's grammar, from OpenAI's ``response_format`` (``json_object``; ``json_schema``, strict
or not: the schema is enforced either way), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
as ``generate``'s ``grammar`` (:mod:`medusa_lite.constraints`: every tree node masked by the grammar after its own
path). One grammar per request; a malformed one is a 400 naming its field, before anything is generated."""

from __future__ import annotations

from typing import Any

from .schemas import APIError, Common

HONOURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "guided_whitespace_pattern")
ACCEPTED = {"guided_decoding_backend": "one backend (llguidance) serves every grammar: the grammar, not the backend "
                                       "name, decides what is allowed"}
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}  # structured_outputs' kinds -> generate's
_OPTIONS = {"disable_any_whitespace", "whitespace_pattern"}
_NO_FALLBACK = "disable_fallback"  # accepted: one backend, nothing to fall back to


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _response_format(value: dict) -> dict | None:
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return {"json_object": True}
    if kind != "json_schema" or set(value) != {"type", "json_schema"} or not isinstance(value["json_schema"], dict):
        raise _bad("response_format", "{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                                      f"'json_schema': {{'name': ..., 'schema': {{...}}, 'strict': ...}}}}, got {value!r}")
    spec = value["json_schema"]
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown or not isinstance(spec.get("name"), str):
        raise _bad("response_format", f"json_schema takes a name, and a schema, description, strict; got {sorted(spec)}")
    return {"json_schema": spec["schema"]} if spec.get("schema") is not None else {"json_object": True}


def _structured_outputs(value: dict) -> dict:
    out = {}
    for key, item in value.items():
        if key in _KINDS and item not in (None, False):
            out[_KINDS[key]] = item
        elif key in _OPTIONS and item is not None:
            out[key] = item
        elif key == "disable_additional_properties" and item:
            raise APIError(400, "structured_outputs.disable_additional_properties is not supported: write "
                                "additionalProperties: false in the schema", param="structured_outputs",
                           code="unsupported_parameter")
        elif key not in _KINDS and key not in _OPTIONS and key not in (_NO_FALLBACK, "disable_additional_properties"):
            raise APIError(400, f"structured_outputs.{key} is not supported (supported: {', '.join(_KINDS)}, "
                                f"{', '.join(sorted(_OPTIONS))})", param="structured_outputs",
                           code="unsupported_parameter")
    return out


def grammar_spec(req: Common) -> tuple[str, dict] | None:
    """(the field naming the request's grammar, the grammar as ``generate``'s ``grammar`` spec), or None; 400 for a
    malformed one or for two."""
    found: list[tuple[str, dict]] = []
    if req.response_format is not None and (spec := _response_format(req.response_format)) is not None:
        found.append(("response_format", spec))
    if req.structured_outputs is not None:
        spec = _structured_outputs(req.structured_outputs)
        if set(spec) - _OPTIONS:
            found.append(("structured_outputs", spec))
    guided = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}
    found += [(name, {kind: getattr(req, name)}) for name, kind in guided.items() if getattr(req, name) is not None]
    if len(found) > 1:
        raise APIError(400, f"one grammar per request: {found[0][0]} and {found[1][0]} are both set",
                       param=found[1][0], code="invalid_value")
    if not found:
        return None
    name, spec = found[0]
    if req.guided_whitespace_pattern is not None:
        spec["whitespace_pattern"] = req.guided_whitespace_pattern
    return name, spec


def compile_request_grammar(req: Common, engine) -> Any:
    """The request's grammar compiled for the served model (:func:`medusa_lite.constraints.compile_grammar`, its
    rows' matchers made from it), or None; 400 naming the field for a grammar that does not compile."""
    found = grammar_spec(req)
    if found is None:
        return None
    param, spec = found
    from medusa_lite.constraints import compile_grammar
    from medusa_lite.decode import eos_ids

    model = engine.model
    vocab = model.base_model.get_output_embeddings().weight.shape[0]
    try:
        with engine.tok_lock:  # the tokenizer is read once per server to build llguidance's
            return compile_grammar(spec, engine.tok, vocab, eos_ids(model.generation_config))
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None
    except ImportError as e:
        raise APIError(400, f"structured output is not installed on this server: {e}", code="unsupported_parameter")
