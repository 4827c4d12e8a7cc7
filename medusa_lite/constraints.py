"""Grammar constraints (JSON Schema, any JSON object, a regular expression, a choice of strings, a Lark or GBNF
grammar) through llguidance (``pip install medusa_lite[structured]``, imported on first use), exact under speculation.

A grammar is a rule on which tokens may follow a prefix, applied as the penalties and token masks are: at every tree
node from that node's own path. The target's scores at node n keep only the tokens the grammar allows after root..n
(-inf elsewhere), after the penalties and before temperature / top-k / top-p (where transformers runs a user's
``logits_processor`` and vLLM its grammar bitmask), so the masked distribution is renormalised exactly as plain
constrained sampling renormalises it. Drafted children the grammar forbids are dropped before the verify forward
(:meth:`GrammarState.valid_nodes`), and the tokens it forces after the root are drafted as a branch
(:meth:`GrammarState.forced`).

Each sequence holds one matcher in the state after its emitted tokens (:class:`GrammarState`). A step's walk asks for
the masks of the nodes it visits only, root first and then each accepted child, so the matcher steps down the accepted
path and a step computes one mask per emitted token, as plain constrained decoding does.
:class:`GrammarLogitsProcessor` is that plain constrained decoding for transformers' ``generate``: the same masks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
ALIASES = {"json": "json_schema"}  # vLLM's structured_outputs name
OPTIONS = ("disable_any_whitespace", "whitespace_pattern")  # vLLM's JSON options


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - from_tokenizer
    except ImportError as e:  # the optional extra
        raise ImportError("grammar-constrained decoding needs llguidance: pip install 'medusa_lite[structured]'") from e
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What the output must match. ``kind``: ``json_schema`` (``value``: a schema, dict or JSON text), ``json_object``
    (any JSON object), ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark or GBNF text). JSON allows
    whitespace between tokens unless ``disable_any_whitespace`` (vLLM's option; then ``", "`` and ``": "``
    separate items and keys) or ``whitespace_pattern`` (a regex) says otherwise."""

    kind: str
    value: Any = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    @classmethod
    def of(cls, spec) -> "Grammar":
        """A Grammar, or a dict naming one kind (``{"json_schema": {...}}``, ``{"regex": "..."}``, ``{"choice":
        [...]}``, ``{"grammar": "..."}``, ``{"json_object": True}``; ``json`` for ``json_schema``) and options."""
        if isinstance(spec, Grammar):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"grammar: a dict such as {{'json_schema': {{...}}}} or {{'regex': '...'}}, got {spec!r}")
        unknown = sorted(k for k in spec if k not in KINDS and k not in ALIASES and k not in OPTIONS)
        kinds = [k for k in spec if (k in KINDS or k in ALIASES) and spec[k] not in (None, False)]
        if unknown or len(kinds) != 1:
            raise ValueError(f"grammar: exactly one of {', '.join(KINDS)} (and options {', '.join(OPTIONS)}), "
                             f"got {sorted(spec)}")
        kind = ALIASES.get(kinds[0], kinds[0])
        return cls(kind, spec[kinds[0]], bool(spec.get("disable_any_whitespace", False)), spec.get("whitespace_pattern"))

    def source(self) -> str:
        """The grammar in llguidance's form."""
        llg = _llguidance()
        if self.kind in ("json_schema", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else self.value
            if isinstance(schema, str):
                schema = _json(schema)
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema: a JSON Schema object, got {schema!r}")
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            if self.disable_any_whitespace:
                options.update(item_separator=", ", key_separator=": ")
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if self.kind == "choice":
            if not isinstance(self.value, list) or not self.value or not all(isinstance(c, str) for c in self.value):
                raise ValueError(f"choice: a non-empty list of strings, got {self.value!r}")
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        if not isinstance(self.value, str):
            raise ValueError(f"{self.kind}: a string, got {self.value!r}")
        try:
            return llg.grammar_from("regex" if self.kind == "regex" else "grammar", self.value)
        except ValueError as e:
            raise ValueError(f"{self.kind}: {e}") from None


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema: not JSON ({e})") from None


_TOKENIZERS: dict[tuple, tuple[Any, Any]] = {}  # (id, vocab, eos) -> (the tokenizer, kept alive; llguidance's)


def grammar_tokenizer(tokenizer, vocab: int, eos: tuple[int, ...]):
    """llguidance's tokenizer for a Hugging Face fast tokenizer (built once per tokenizer, vocabulary and EOS ids:
    about a second for a 50k vocabulary), or ``tokenizer`` itself when it is one already."""
    llg = _llguidance()
    if isinstance(tokenizer, llg.LLTokenizer):
        return tokenizer
    if tokenizer is None:
        raise ValueError("a grammar needs the tokenizer: generate(..., grammar=..., tokenizer=tok)")
    key = (id(tokenizer), vocab, eos)
    if key not in _TOKENIZERS:
        try:
            made = llg.hf.from_tokenizer(tokenizer, n_vocab=max(vocab, len(tokenizer)), eos_token=list(eos) or None)
        except ValueError as e:  # a slow (Python) tokenizer
            raise ValueError(f"a grammar needs a fast tokenizer: {e}") from None
        _TOKENIZERS[key] = (tokenizer, made)
    return _TOKENIZERS[key][1]


class CompiledGrammar:
    """A grammar compiled for one tokenizer: :meth:`state` gives each sequence a fresh matcher of it."""

    def __init__(self, matcher, vocab: int, eos: tuple[int, ...]):
        self.matcher, self.vocab, self.eos = matcher, vocab, eos

    def state(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy(), self.vocab, self.eos)


def compile_grammar(spec, tokenizer, vocab: int, eos: tuple[int, ...]) -> CompiledGrammar:
    """``spec`` (:meth:`Grammar.of`) compiled for ``tokenizer`` (a Hugging Face fast tokenizer or llguidance's).
    ``vocab``: the target's output vocabulary; ``eos``: the tokens allowed where the grammar may end (the target's
    EOS ids; empty: the tokenizer's). ``ValueError`` for a malformed or unsupported grammar."""
    if isinstance(spec, CompiledGrammar):
        return spec
    llg = _llguidance()
    source = Grammar.of(spec).source()
    tokens = grammar_tokenizer(tokenizer, vocab, eos)
    matcher = llg.LLMatcher(tokens, source, log_level=0)
    if matcher.is_error():
        raise ValueError(f"grammar: {matcher.get_error()}")
    return CompiledGrammar(matcher, vocab, tuple(tokens.eos_tokens))


class GrammarState:
    """One sequence's matcher. Between steps it stands after every emitted token; during a step's walk, after the
    tokens of the path to the node last asked for (:meth:`at`), which :meth:`sync` turns into the emitted tokens."""

    def __init__(self, matcher, vocab: int, eos: tuple[int, ...]):
        self.matcher, self.vocab, self.eos = matcher, vocab, frozenset(eos)
        self.consumed: list[int] = []  # the tokens the matcher stands after (the output so far, then a path)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows in the matcher's state (the EOS ids where it may end)."""
        bias = self.matcher.compute_logit_bias()  # one byte per tokenizer token, 0: forbidden
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        n = min(len(bias), self.vocab)
        allowed[:n] = torch.frombuffer(bytearray(bias[:n]), dtype=torch.uint8) != 0
        if not bool(allowed.any()):
            raise RuntimeError(f"grammar: no token is allowed ({self.matcher.get_error() or 'the grammar is stuck'})")
        return allowed

    def sync(self, tokens: list[int]) -> None:
        """Stand after ``tokens`` (the row's output so far): roll back what differs, consume the rest."""
        same = len(self.consumed)
        if tokens[:same] != self.consumed:  # rare: a walk went down another path than the one emitted
            same = next(i for i, (a, b) in enumerate(zip(self.consumed, tokens + [-1])) if a != b)
        if same < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - same)
        for token in tokens[same:]:
            if not self.matcher.consume_token(token):  # every emitted token was chosen under this grammar's mask
                raise RuntimeError(f"grammar: token {token} was emitted against the grammar "
                                   f"({self.matcher.get_error()})")
        self.consumed = list(tokens)

    def at(self, output: list[int], tokens: list[int], parents: list[int]) -> Callable[[int], torch.Tensor]:
        """node -> [V] bool, the tokens allowed after ``output`` and the node's path below the root (``tokens`` [N],
        ``parents`` [N], parents first). Cheapest when asked root first and then down one path, as the walks ask."""
        def allowed(node: int) -> torch.Tensor:
            path = []
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            self.sync(output + path[::-1])
            return self.allowed()
        return allowed

    def valid_nodes(self, tokens: list[int], parents: list[int]) -> list[bool]:
        """Per node of a tree after the root (``tokens`` [N], ``parents`` [N], parents first): whether the grammar
        allows its whole path below the root, from the matcher's state (the root emitted). The state is unchanged."""
        n = len(tokens)
        has_child = [False] * n
        for p in parents[1:]:
            has_child[p] = True
        valid = [True] + [False] * (n - 1)
        for leaf in (i for i in range(1, n) if not has_child[i]):
            path = []
            node = leaf
            while node > 0:
                path.append(node)
                node = parents[node]
            path.reverse()
            ok = self._valid_prefix([tokens[i] for i in path])
            for i in path[:ok]:
                valid[i] = True
        return valid

    def _valid_prefix(self, path: list[int]) -> int:
        """How many of ``path``'s tokens the grammar allows in turn, as :meth:`allowed` would: after an EOS it allows
        EOS again (the mask of a stopped matcher; validating forbids everything there)."""
        ok = self.matcher.validate_tokens(path)
        last = path[ok - 1] if ok else (self.consumed[-1] if self.consumed else None)
        if last in self.eos:
            while ok < len(path) and path[ok] in self.eos:
                ok += 1
        return ok

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next from the matcher's state, at most ``limit``."""
        return self.matcher.compute_ff_tokens()[:max(limit, 0)] if limit > 0 else []


def masked(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """scores [n, V] -> float32 [n, V] with -inf where ``allowed`` ([n, V] or [V] bool) is False."""
    return scores.float().masked_fill(~allowed.to(scores.device), float("-inf"))


class GrammarLogitsProcessor:
    """Plain constrained decoding with transformers' ``generate(..., logits_processor=[this])``: each row's scores
    masked by the grammar after that row's new tokens, the reference speculative decoding is compared with. Each
    processor serves one ``generate`` call (its rows' matchers remember their outputs)."""

    def __init__(self, spec, tokenizer, vocab: int, eos: tuple[int, ...]):
        self.grammar, self.vocab, self.eos = compile_grammar(spec, tokenizer, vocab, eos), vocab, set(eos)
        self.rows: list[GrammarState] = []
        self.start = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.rows:
            self.rows = [self.grammar.state() for _ in range(input_ids.shape[0])]
            self.start = input_ids.shape[1]
        allowed = torch.ones(input_ids.shape[0], self.vocab, dtype=torch.bool)  # [B, V]; a finished row: anything
        for b, (row, state) in enumerate(zip(input_ids, self.rows)):
            new = row[self.start:].tolist()
            if not self.eos.intersection(new):  # after a stop token transformers pads the row
                state.sync(new)
                allowed[b] = state.allowed()
        return masked(scores, allowed[:, :scores.shape[-1]]).to(scores.dtype)
