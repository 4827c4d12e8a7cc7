"""MedusaModel: a frozen Hugging Face causal LM plus draft heads, by composition (as PEFT's PeftModel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import logging
from dataclasses import replace

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteriaList

from ._hf import context_length, output_weight, resolve_generation_config, text_config
from .constraints import CompiledGrammar, Grammar, compile_grammar
from .kv import check_model
from .decode import (STOP_OPTIONS, FittedPlan, GenerationStats, PlanCache, Sequence, SpeculativeBatch, SpeedGuard,
                     eos_ids, make_plan, run_batch)
from .drafters import MedusaConfig, as_drafter_config, build_drafter, drafter_class, drafter_features
from .fit import (AcceptanceTable, FitState, HardwareFit, decoding_key, fit_enabled_default, fit_machine,
                  fit_state)
from .heads_io import (HeadsMismatchError, check_fingerprint, load_weights, read_heads, resolve_heads_dir, save_heads,
                       target_fingerprint)
from .sampling import SAMPLING_OPTIONS, DraftSampler, build_warpers, check_supported
from .tree import DynamicTree, TreeSpec, WithLookup, parse_tree

log = logging.getLogger("medusa_lite")


class MedusaModel(nn.Module):
    """Frozen target (``base_model``) + a registered drafter (``drafter``, :mod:`medusa_lite.drafters`): loads,
    saves, fits the tree to the machine and generates; the drafter drafts, trains and exports.

    >>> model = MedusaModel(target, MedusaConfig(num_heads=4))     # fresh, zero-initialised heads
    >>> model = MedusaModel.from_pretrained(target, "heads_dir")   # trained heads
    >>> out = model.generate(input_ids, max_new_tokens=64)          # same kwargs as transformers
    >>> model.last_stats.mean_accepted_tokens
    """

    def __init__(self, base_model, config: MedusaConfig | None = None, *, freeze: bool = True):
        super().__init__()
        config = config or MedusaConfig()
        config = as_drafter_config(config)  # e.g. MedusaConfig(head_type="eagle3") -> Eagle3Config
        cfg = text_config(base_model.config)
        lm_head = base_model.get_output_embeddings()
        if lm_head is None:
            raise ValueError(f"{type(base_model).__name__} has no output embeddings: not a causal LM")
        check_model(base_model)  # recurrent / linear-attention layers: refused here, naming the layer type
        vocab, hidden = lm_head.weight.shape
        for name, value in (("hidden_size", hidden), ("vocab_size", vocab)):
            saved = getattr(config, name)
            if saved is not None and saved != value:
                raise HeadsMismatchError(f"heads have {name}={saved} but the target has {name}={value}")
            setattr(config, name, value)
        config.base_model = config.base_model or getattr(cfg, "_name_or_path", None) or None
        config.target_fingerprint = config.target_fingerprint or target_fingerprint(base_model)
        self.base_model = base_model
        self.config = config
        drafter_class(config.head_type).complete_config(config, base_model.config)
        self.drafter = build_drafter(config).to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        self.drafter.attach(base_model)
        self.last_stats: GenerationStats | None = None
        self.last_batch_stats: list[GenerationStats] = []
        # hardware fit (medusa_lite.fit): the heads' acceptance table; the fit in use per (sampling, dtype, device)
        self.acceptance: AcceptanceTable | None = None
        self.fits: dict[tuple, FitState] = {}
        # whether generate decodes with the fitted tree by default (False as with MEDUSA_LITE_FIT=0)
        self.fit_enabled = fit_enabled_default()
        self.heads_dir: Path | None = None  # where from_pretrained read the heads; None: fresh heads
        if freeze:
            base_model.requires_grad_(False)
            base_model.eval()

    # ------------------------------------------------------------------ formats
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``medusa_config.json``, ``heads.safetensors`` and the acceptance table if any (never the target)."""
        save_heads(directory, self.config, self.drafter, self.acceptance)

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload medusa_lite drafter") -> str:
        """Upload what :meth:`save_pretrained` writes to the Hub repository ``repo_id`` (created if needed), as
        PEFT's ``push_to_hub``; returns the commit's URL. :meth:`from_pretrained` takes the same ``repo_id``."""
        import tempfile

        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return str(api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message))

    @classmethod
    def from_pretrained(cls, base_model, heads_dir: str | Path, *, revision: str | None = None,
                        **kwargs) -> "MedusaModel":
        """Attach the heads in ``heads_dir`` to ``base_model``; a mismatched target is an error. ``heads_dir``: a
        directory (this library's, or a published EAGLE-3 / Medusa checkpoint), or a Hub repo id resolved through
        ``huggingface_hub`` (its cache first; ``HF_HUB_OFFLINE=1`` reads the cache only) at ``revision``."""
        heads_dir = resolve_heads_dir(heads_dir, revision)
        config, state = read_heads(heads_dir)
        check_fingerprint(config.target_fingerprint, base_model, str(heads_dir))
        model = cls(base_model, config, **kwargs)
        load_weights(model.drafter, state, heads_dir)
        model.acceptance = AcceptanceTable.load(heads_dir)
        model.heads_dir = heads_dir
        return model

    # ------------------------------------------------------------------ properties
    @property
    def heads_device(self) -> torch.device:
        return output_weight(self.base_model).device

    @property
    def device(self) -> torch.device:
        return self.heads_device

    @property
    def dtype(self) -> torch.dtype:
        return output_weight(self.base_model).dtype

    @property
    def generation_config(self) -> GenerationConfig:
        return self.base_model.generation_config

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, **kwargs):
        """Target forward plus teacher-forced draft logits: (target output, drafter logits [K, B, T, V'])."""
        out = self.base_model(input_ids=input_ids, output_hidden_states=True, return_dict=True, **kwargs)
        return out, self.drafter(drafter_features(out.hidden_states, self.drafter.hidden_layers), input_ids)

    @property
    def choices(self) -> TreeSpec:
        """The tree greedy ``generate`` uses where no hardware fit is made (the heads' stored fallback)."""
        return self.tree_for(sample=False)

    def tree_for(self, sample: bool) -> TreeSpec:
        """The tree greedy decoding or sampling uses where no hardware fit is made (``MedusaConfig.choices_for``)."""
        return parse_tree(self.config.choices_for(sample), self.config.num_heads)

    @property
    def _topk(self) -> int:
        tree = self.choices
        tree = tree.tree if isinstance(tree, WithLookup) else tree
        return tree.topk if isinstance(tree, DynamicTree) else max((max(p) for p in tree), default=0) + 1

    def plan(self, tree: TreeSpec, sampler: DraftSampler | None = None):
        """The per-step plan of ``tree`` for :func:`medusa_lite.decode.speculative_generate`: a static tree the
        drafter fills, a tree it grows each step (:class:`DynamicTree`), either plus a prompt-lookup branch.

        ``sampler`` (sampling mode): static trees draw their tokens from the drafter's distributions;
        dynamic trees and prompt-lookup tokens stay deterministic (one-hot proposals)."""
        return make_plan(self.drafter, tree, self.heads_device, sampler)

    # ------------------------------------------------------------------ hardware fit
    def fit_hardware(self, sample: bool = False, *, force: bool = False, progress: bool = True,
                     budget_s: float | None = None) -> HardwareFit | None:
        """The trees fitted to this machine for greedy decoding or sampling (:func:`medusa_lite.fit.fit_machine`:
        the heads' acceptance table priced by a bounded probe on first use per machine, then a cache read), made
        the fit in use. The fit in use is returned as it is unless ``force`` (measure again). None when the heads
        have no acceptance table. ``generate`` calls it once per decoding mode unless fitting is off."""
        current = self.fits.get(decoding_key(self.base_model, sample))
        if current is not None and not force:
            return current.fit
        fit = fit_machine(self.base_model, self.drafter, self.config, self.acceptance, sample, force=force,
                          progress=progress, budget_s=budget_s)
        if fit is not None:
            self.use_fit(fit, sample)
        return fit

    def fitted(self, sample: bool = False) -> HardwareFit | None:
        """The fit in use for greedy decoding or sampling, without fitting (None: none yet)."""
        current = self.fits.get(decoding_key(self.base_model, sample))
        return None if current is None else current.fit

    def use_fit(self, fit: HardwareFit, sample: bool = False, *, guard=SpeedGuard, kernels=None) -> None:
        """Decode with ``fit`` (e.g. from :meth:`fit_hardware` of another process, or made up for a test), a fresh
        ``guard(ladder)`` per bucket (:class:`medusa_lite.fit.SpeedGuard`, or a ``functools.partial`` of it with
        another window) and ``kernels`` (:class:`medusa_lite.kernels.Kernels`; None: the fit's own)."""
        fit = fit if kernels is None else replace(fit, kernels=kernels)
        self.fits[decoding_key(self.base_model, sample)] = fit_state(fit, guard)

    def _fit_state(self, sample: bool, fit: bool | None) -> FitState | None:
        """The fit decoding uses (fitted now on first use), or None when fitting is off (``fit=False``, or
        ``fit=None`` with :attr:`fit_enabled` off) or impossible."""
        if fit is False or (fit is None and not self.fit_enabled):
            return None
        if self.fitted(sample) is None:
            log.info("medusa_lite: generate fits the tree to this machine on first use (fit_hardware(sample=%s)); "
                     "fit=False or MEDUSA_LITE_FIT=0 decodes with the heads' stored tree", sample)
        if self.fit_hardware(sample) is None:
            return None
        return self.fits.get(decoding_key(self.base_model, sample))

    # ------------------------------------------------------------------ generate
    def sequence(self, prompt: torch.Tensor, generation_config: GenerationConfig | None = None, **kwargs) -> Sequence:
        """One prompt ([L] long, no padding) made ready to decode in a :class:`~medusa_lite.decode.SpeculativeBatch`
        (the server's continuous batching): :meth:`sequences` of one prompt, one sequence."""
        kwargs.pop("num_return_sequences", None)
        return self.sequences([prompt], generation_config, **kwargs)[0]

    def sequences(
        self,
        prompts: list[torch.Tensor],
        generation_config: GenerationConfig | None = None,
        *,
        streamer=None,
        stopping_criteria: StoppingCriteriaList | None = None,
        tokenizer=None,
        tree: list[list[int]] | dict | None = None,
        fit: bool | None = None,
        generator: torch.Generator | None = None,
        sampled_drafts: bool = True,
        tag: Any = None,
        logprobs: int | None = None,
        grammar: dict | Grammar | CompiledGrammar | None = None,
        **kwargs,
    ) -> list[Sequence]:
        """Prompts ([L] long each, no padding) made ready to decode in a :class:`~medusa_lite.decode.SpeculativeBatch`
        (what :meth:`generate` runs): one generation config for all, checked once; per prompt
        ``num_return_sequences`` sequences in a row (which ``run_batch`` prefills once), each with its stopping
        criteria, its plan (the fitted tree, or ``tree``) and its plan for batched steps.
        ``logprobs=k``: each sequence records its tokens' log-probabilities under the target and the k likeliest
        (``Sequence.token_logprobs``). Other arguments as :meth:`generate`; ``ValueError`` for anything
        medusa_lite cannot honour exactly."""
        config = self.prepare_config(generation_config, **kwargs)
        copies = config.num_return_sequences or 1
        if streamer is not None and len(prompts) > 1:
            raise ValueError("streamers support batch size 1 only (as transformers' streamers)")
        if streamer is not None and copies > 1:
            raise ValueError("streamers support one sequence only (num_return_sequences=1)")
        options = dict(streamer=streamer, stopping_criteria=stopping_criteria, tokenizer=tokenizer, tree=tree,
                       fit=fit, generator=generator, sampled_drafts=sampled_drafts, tag=tag, logprobs=logprobs)
        if grammar is not None:  # compiled once, a fresh matcher per sequence; ending at the target's EOS ids
            grammar = compile_grammar(grammar, tokenizer, output_weight(self.base_model).shape[0], eos_ids(config))
        return [self._sequence(prompt, config, grammar=None if grammar is None else grammar.state(), **options)
                for prompt in prompts for _ in range(copies)]

    def prepare_config(self, generation_config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
        """transformers' generation config for these arguments (the target's defaults under them), checked:
        ``ValueError`` for anything medusa_lite cannot honour exactly."""
        # OpenAI's and vLLM's options (not transformers' fields): extra attributes of the config, as GenerationConfig
        # keeps them
        extra = {name: kwargs.pop(name) for name in SAMPLING_OPTIONS + STOP_OPTIONS if name in kwargs}
        config, unused = resolve_generation_config(self.base_model, generation_config, **kwargs)
        for name, value in extra.items():
            setattr(config, name, value)
        unused.pop("use_cache", None)
        if unused:
            raise ValueError(f"medusa_lite.generate got unsupported arguments {sorted(unused)}")
        check_supported(config, output_weight(self.base_model).shape[0])
        if (config.num_return_sequences or 1) > 1 and not config.do_sample:
            raise ValueError(f"num_return_sequences={config.num_return_sequences} needs do_sample=True (greedy decoding "
                             "returns one sequence per prompt, as in transformers)")
        return config

    def _sequence(self, prompt: torch.Tensor, config: GenerationConfig, *, streamer=None, stopping_criteria=None,
                  tokenizer=None, tree=None, fit=None, generator=None, sampled_drafts=True, tag=None,
                  logprobs=None, grammar=None) -> Sequence:
        """One of :meth:`sequences` (``config`` is shared by all of them: read, never written)."""
        max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt.numel()
        if max_new is None or max_new < 1:
            raise ValueError(f"nothing to generate: max_new_tokens={max_new}")
        limit = context_length(self.base_model.config)
        if limit is not None and prompt.numel() + max_new > limit:
            raise ValueError(
                f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new}) exceeds the target's context "
                f"length ({limit})")
        criteria = StoppingCriteriaList(stopping_criteria or []) or None
        sampler = DraftSampler(build_warpers(config), generator) if config.do_sample and sampled_drafts else None
        plan = plan_for = None
        if tree is None:  # one sequence's plans (each made once) for the trees its guards name
            plan_for = PlanCache(self.drafter, self.config.num_heads, self.heads_device, sampler)
            state = self._fit_state(config.do_sample, fit)
            plan = None if state is None else FittedPlan(plan_for, state.guards, state.fit.buckets)
            plan_for = plan_for if plan is not None else None
        if plan is None:
            tree = parse_tree(tree, self.config.num_heads) if tree is not None else self.tree_for(config.do_sample)
            plan = self.plan(tree, sampler)
        on_step = plan.record if isinstance(plan, FittedPlan) else None
        return Sequence(prompt, config, plan, max_new, criteria, generator, streamer, on_step, plan_for, tag,
                        logprobs=logprobs, tokenizer=tokenizer, grammar=grammar)

    def decoder(self, sample: bool = False, max_step_tokens: int | None = None, fit: bool | None = None,
                solo: bool = False) -> SpeculativeBatch:
        """An empty :class:`~medusa_lite.decode.SpeculativeBatch` on this model: its fitted verify kernels, and the
        guards choosing the tree of batched steps (fitted for ``sample``: rows of the other mode get the same trees).
        ``solo``: for one sequence (sliding-window layers then keep only their window)."""
        current = self.fitted(sample)  # its kernels even where this call decodes without its trees
        state = self._fit_state(sample, fit)
        return SpeculativeBatch(self.base_model, self.drafter, None if current is None else current.kernels,
                                max_step_tokens, None if state is None else state.batch, solo)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        generation_config: GenerationConfig | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        streamer=None,
        **kwargs,
    ) -> torch.Tensor:
        """Speculative ``generate`` with transformers' arguments; returns [B, prompt + new] token ids.

        Exact: greedy output equals ``base_model.generate`` (up to floating-point ties) and sampled
        output has the target's distribution. Stats of the call are in ``self.last_stats`` (the first row's) and
        ``self.last_batch_stats`` (every row's).
        Supported: greedy or sampling with temperature / top_k / top_p / min_p, ``repetition_penalty`` (transformers'),
        ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, over the new tokens), ``sequence_bias`` (single tokens),
        ``bad_words_ids``, ``min_new_tokens`` and vLLM's ``allowed_token_ids``, each applied at every tree node
        from that node's own prefix, ``grammar`` (with ``tokenizer``: ``{"json_schema": schema}``, ``{"json_object":
        True}``, ``{"regex": r}``, ``{"choice": [...]}`` or ``{"grammar": lark_or_gbnf}``; each node masked by the
        grammar after its own path: :mod:`medusa_lite.constraints`, needs ``medusa_lite[structured]``),
        ``max_new_tokens`` / ``max_length``, ``eos_token_id``, ``stop_strings`` (with ``tokenizer``),
        ``stopping_criteria`` and vLLM's ``stop_token_ids`` / ``ignore_eos`` / ``include_stop_str_in_output`` /
        ``skip_special_tokens`` / ``spaces_between_special_tokens`` (one stop rule: :mod:`medusa_lite.decode.stopping`;
        why each row stopped: ``finish_reason`` / ``stop_reason`` of its stats), streamers (batch size 1, as
        transformers' streamers). Anything else raises ``ValueError``.
        ``num_return_sequences`` (sampling): that many samples per prompt, in one batch sharing its prefill.
        Batches: left-padded ``input_ids`` with their ``attention_mask``, as transformers takes them; every row is
        verified in the same forward and stops on its own (its output equals its batch-1 output; rows that
        finish first are padded with ``pad_token_id`` on the right), sliding-window models included.
        When sampling, static trees draw their tokens from the heads' distributions (``sampled_drafts``,
        accepted with probability min(1, p/q)); ``sampled_drafts=False`` proposes the heads' top ranks.
        Without ``tree``, the tree is the one fitted to this machine per context length (heads with an
        acceptance table, :meth:`fit_hardware`), and an online guard shrinks it, down to no tree, while it does
        not pay (``last_stats.fitted``); with several rows it is the tree the latency model prices best for
        that many rows. ``fit=False``, or ``MEDUSA_LITE_FIT=0`` unless ``fit=True``: the heads' stored tree.
        Other keyword arguments: :meth:`sequences`.
        """
        prompts = _prompts(input_ids, attention_mask)
        # consecutive samples of each prompt, as transformers orders them; they share its prefill
        seqs = self.sequences(prompts, generation_config, streamer=streamer, **kwargs)
        if len(seqs) > len(prompts):
            input_ids = input_ids.repeat_interleave(len(seqs) // len(prompts), dim=0)
        sample = seqs[0].config.do_sample
        if streamer is not None:
            streamer.put(input_ids.cpu())
        try:
            run_batch(self.decoder(sample, fit=kwargs.get("fit"), solo=len(seqs) == 1), seqs)
        finally:
            if streamer is not None:
                streamer.end()
        for seq in seqs:
            if seq.error is not None:
                raise seq.error
        self.last_batch_stats = [seq.stats for seq in seqs]
        self.last_stats = seqs[0].stats
        return _outputs(input_ids, seqs)


def _outputs(input_ids: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[B, prompt + new]: each row's prompt and new tokens, rows that finished first padded with ``pad_token_id`` on
    the right (else the first EOS id, else 0)."""
    width = max(seq.stats.new_tokens for seq in seqs)
    pad = seqs[0].config.pad_token_id
    if pad is None:
        pad = next(iter(eos_ids(seqs[0].config)), 0)
    out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + width), int(pad))
    out[:, :input_ids.shape[1]] = input_ids
    for b, seq in enumerate(seqs):
        new = seq.new_tokens.to(input_ids.device)
        out[b, input_ids.shape[1]: input_ids.shape[1] + new.numel()] = new
    return out


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """[B, L] ids (+ mask of left padding) -> per row the unpadded prompt [L_b]."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] LongTensor")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if attention_mask is None:
        return list(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    prompts = []
    for b, mask in enumerate(attention_mask.bool()):
        pad = int((~mask).long().cumprod(0).sum())  # leading zeros
        if not bool(mask[pad:].all()) or pad == mask.numel():
            raise ValueError(f"attention_mask row {b} must mask left padding only and keep at least one token "
                             "(pad on the left, as for transformers' generate)")
        prompts.append(input_ids[b, pad:])
    return prompts
