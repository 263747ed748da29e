r"""Log-probs of the sampled tokens: :func:`completion_logprobs` and the log-softmax under it.

What lives here, and why it is apart from sampling (:mod:`gbmpo.rollout.sampling`): these are
the passes the loss differentiates (policy, old policy, reference), run several times per
generation batch, where the cost is the forward, the ``[B, C, V]`` logits and the backward.

* :func:`completion_logprobs` returns
  :math:`\log\pi(o_t\mid h_t) = z_{o_t} - \operatorname{logsumexp}_v z_v` per completion token.
  It picks a forward implementation once (:func:`logits_forward`) and asks it, through the one
  small interface :class:`CompletionLogits`, for the logits that predict the completion
  tokens: in one forward over ``[prompt | completion]`` rows, or, when rows share a prompt,
  with each distinct prompt forwarded once. Two implementations: the lean forward
  (:class:`~gbmpo.rollout.lean_forward.LeanForward`, Llama-shaped models) and the model's own
  transformers forward (any causal LM).
* :func:`linear_selective_log_softmax` (:mod:`gbmpo.rollout.fused_head`) takes the final
  hidden states and the LM head instead of logits, chunk by chunk: no ``[B, T, V]`` logits.
  :func:`completion_logprobs` uses it wherever the model's logits are a plain linear head's
  (:func:`_body_and_head`; the lean forward always).
* :func:`selective_log_softmax`, :func:`selective_log_softmax_and_entropy` and
  :func:`token_entropy` (:mod:`gbmpo.rollout.log_softmax`) take logits already made.

Both are re-exported here.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from gbmpo.rollout.fused_head import fused_chunk_rows, linear_selective_log_softmax
from gbmpo.rollout.lean_forward import LeanForward
from gbmpo.rollout.log_softmax import (
    DEFAULT_CHUNK_ROWS,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    token_entropy,
)

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "CompletionLogits",
    "completion_hidden",
    "completion_logits",
    "completion_logprobs",
    "fused_chunk_rows",
    "linear_selective_log_softmax",
    "logits_forward",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "token_entropy",
]

# ------------------------------------------------------ the logits of the completion tokens


class CompletionLogits(Protocol):
    """A forward implementation for :func:`completion_logprobs`: the logits that predict each
    completion token (at the last prompt position and at completion positions ``0..C-2``; the
    last completion token is never fed), returned as pieces ``[B, n_i, V]`` along the
    completion axis with :math:`\\sum_i n_i = C`; or, where :attr:`head` is not ``None``, the
    final hidden states ``[B, n_i, H]`` those logits are :math:`h W^\\top + b` of, for a caller
    that applies the head chunk by chunk (:func:`linear_selective_log_softmax`)."""

    #: the LM head ``(weight [V, H], bias [V] or None)`` when the ``*_hidden`` methods apply
    #: (the logits are exactly ``F.linear(hidden, *head)``), else ``None``
    head: tuple[Tensor, Tensor | None] | None

    def sequence_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        """One forward over ``[prompt | completion[:, :-1]]`` per row."""
        ...

    def shared_prompt_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        """Each distinct prompt (``first`` ``[U]``: a row holding it; ``inverse`` ``[B]``: the
        distinct prompt of each row, from :func:`_distinct_prompts`) forwarded once, its
        keys/values gathered to its rows (gradients summed over them), the completions run on
        top; ``None`` when this model cannot share a prompt (the caller then uses
        :meth:`sequence_logits`)."""
        ...

    def sequence_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        """:meth:`sequence_logits` before the LM head (only where :attr:`head` is set)."""
        ...

    def shared_prompt_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        """:meth:`shared_prompt_logits` before the LM head (only where :attr:`head` is set)."""
        ...


class _LeanLogits:
    """:class:`CompletionLogits` through :class:`~gbmpo.rollout.lean_forward.LeanForward`."""

    def __init__(self, forward: LeanForward) -> None:
        self.forward = forward
        self.head = forward.lm_head

    def sequence_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        return [F.linear(h, *self.head) for h in self.sequence_hidden(
            prompt_ids, prompt_mask, completion_ids, completion_mask)]

    def shared_prompt_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        return [F.linear(h, *self.head) for h in self.shared_prompt_hidden(
            prompt_ids, prompt_mask, completion_ids, completion_mask, first, inverse)]

    def sequence_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        attention = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
        ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)
        return [self.forward.sequence_hidden(ids, attention, completion_ids.shape[1])]

    def shared_prompt_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor]:
        return [self.forward.shared_prompt_hidden(
            prompt_ids, prompt_mask, first, inverse, completion_ids, completion_mask
        )]


#: config fields by which a transformers model transforms its head's output (softcapping,
#: scaling; the list TRL's ``add_fused_lm_head`` reads): a model setting one keeps its own
#: forward, whose logits are then not ``F.linear(hidden, *head)``
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                     "lm_head_multiplier", "logits_scaling")


def _body_and_head(model: Any) -> tuple[Any, tuple[Tensor, Tensor | None] | None]:
    """``(decoder body, (head weight, bias))`` of a transformers ``*ForCausalLM`` (under a PEFT
    wrapper too) whose logits are its plain linear head applied to the body's last hidden state;
    ``(None, None)`` otherwise (remote code, multimodal configs, a transformed or adapted
    head), which keeps the model's own forward."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    cls = type(base)
    config = getattr(base, "config", None)
    if (not cls.__module__.startswith("transformers.") or not cls.__name__.endswith("ForCausalLM")
            or config is None or not hasattr(config, "get_text_config")
            or config.get_text_config() is not config
            or any(getattr(config, name, None) is not None for name in _LOGIT_TRANSFORMS)):
        return None, None
    head = base.get_output_embeddings()
    body = getattr(base, getattr(base, "base_model_prefix", "") or "", None)
    if type(head) is not torch.nn.Linear or body is None or body is base:
        return None, None
    return body, (head.weight, head.bias)


class _ModelLogits:
    """:class:`CompletionLogits` through the model's own (transformers) forward, for any
    causal LM. Position ids come from the mask's cumulative sum, so left padding does not shift
    positions (as in generation); with ``logits_to_keep`` only the ``C`` needed positions get
    logits. The ``*_hidden`` methods run the decoder body alone (PEFT adapters included: they
    live inside its layers) where :func:`_body_and_head` finds one."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.keep = _accepts_logits_to_keep(model)
        self.body, self.head = _body_and_head(model)

    def _run(self, hidden: bool, keep: int | None, **kwargs: Any) -> tuple[Tensor, Any]:
        """(rows ``[B, n, H]`` of the body with ``hidden``, else logits ``[B, n, V]``; the
        cache) of one forward, ``n = keep`` last positions (all with ``None``)."""
        if hidden:
            out = self.body(**kwargs)
            rows = out.last_hidden_state
        else:
            if self.keep and keep is not None:
                kwargs["logits_to_keep"] = keep
            out = self.model(**kwargs)
            rows = out.logits
        if keep is not None and rows.shape[1] != keep:  # every position came back
            rows = rows[:, -keep:]
        return rows, getattr(out, "past_key_values", None)

    def _sequence(self, hidden: bool, prompt_ids: Tensor, prompt_mask: Tensor,
                  completion_ids: Tensor, completion_mask: Tensor) -> list[Tensor]:
        attention = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
        rows, _ = self._run(
            hidden, completion_ids.shape[1],
            input_ids=torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
            attention_mask=attention,
            position_ids=(attention.long().cumsum(-1) - 1).clamp_min(0),
            use_cache=False,
        )
        return [rows]

    def _shared(self, hidden: bool, prompt_ids: Tensor, prompt_mask: Tensor,
                completion_ids: Tensor, completion_mask: Tensor, first: Tensor,
                inverse: Tensor) -> list[Tensor] | None:
        """Two pieces: ``[B, 1, *]`` at the last prompt position (the prompt's forward, its KV
        cache gathered to the rows by a differentiable index) and ``[B, C-1, *]`` at completion
        positions ``0..C-2`` (the completions run on that cache). ``None`` when the model's
        cache is not a plain dynamic cache (:func:`_shareable`)."""
        mask_u = prompt_mask[first]
        head, cache = self._run(
            hidden, 1, input_ids=prompt_ids[first], attention_mask=mask_u,
            position_ids=(mask_u.long().cumsum(-1) - 1).clamp_min(0), use_cache=True,
        )
        if cache is None or not _shareable(cache):
            return None
        cache.batch_select_indices(inverse)
        head = head[:, -1][inverse].unsqueeze(1)
        c = completion_ids.shape[1]
        if c == 1:
            return [head]
        start = prompt_mask.long().sum(dim=1, keepdim=True)
        rows, _ = self._run(
            hidden, None,
            input_ids=completion_ids[:, :-1],
            attention_mask=torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1),
            position_ids=start + torch.arange(c - 1, device=start.device).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
        )
        return [head, rows]

    def sequence_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        return self._sequence(False, prompt_ids, prompt_mask, completion_ids, completion_mask)

    def shared_prompt_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        return self._shared(False, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            first, inverse)

    def sequence_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        return self._sequence(True, prompt_ids, prompt_mask, completion_ids, completion_mask)

    def shared_prompt_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        return self._shared(True, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            first, inverse)


def logits_forward(model: Any, lean: bool = True) -> CompletionLogits:
    """The forward implementation for ``model``: :class:`~gbmpo.rollout.lean_forward.LeanForward`
    with ``lean`` and a model it supports (the same arithmetic on the model's own parameters
    without transformers' per-call overhead), otherwise the model's own forward."""
    forward = LeanForward.for_model(model) if lean else None
    return _ModelLogits(model) if forward is None else _LeanLogits(forward)


def _accepts_logits_to_keep(model: Any) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (logits only at the last positions;
    also used by the sampling generator's prefill)."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    if "logits_to_keep" in params:
        return True
    # PEFT wrappers forward **kwargs to the base model
    base = getattr(model, "get_base_model", None)
    return bool(base is not None and _accepts_logits_to_keep(base()))


def _distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(row of the first occurrence of each distinct prompt [U], prompt index of each row [B])."""
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(inverse.shape[0], device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), inverse.shape[0], device=inverse.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def _shareable(cache: Any) -> bool:
    """True for a plain dynamic cache (every layer a ``DynamicLayer``): its rows can be
    gathered with gradients and later tokens attend to all of it. Sliding-window, static,
    quantized or custom caches go through the single forward instead."""
    # deferred: transformers is heavy; gbmpo.rollout imports without it
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    return (
        isinstance(cache, DynamicCache)
        and bool(layers)
        and all(type(layer) is DynamicLayer for layer in layers)
    )


def completion_logprobs(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    with_entropy: bool = False,
    share_prompts: bool = True,
    lean: bool = True,
    fused_head: bool = True,
) -> tuple[Tensor, Tensor | None]:
    r"""Per-token :math:`\log\pi_\theta(o_t \mid q, o_{<t})` of the completion tokens.

    The logits of token :math:`t` (divided by ``temperature``) sit at the last prompt position
    (:math:`t=0`) and at completion position :math:`t-1`. One forward over
    ``[prompt | completion[:, :-1]]``, or with ``share_prompts`` each distinct prompt forwarded
    once, its KV cache gathered to its rows (plain dynamic caches); ``lean``: through
    :class:`~gbmpo.rollout.lean_forward.LeanForward` where supported (:func:`logits_forward`);
    ``fused_head``: a plain linear head (:func:`_body_and_head`) applied chunk by chunk by
    :func:`linear_selective_log_softmax`, else :func:`selective_log_softmax` of the logits.
    All equal up to float rounding. Returns ``(logp [B, C] float32, entropy [B, C] or None)``
    with gradients when grad is enabled; masked positions must be masked by the caller.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    b, c = completion_ids.shape
    if c == 0:
        empty = torch.zeros(b, 0, device=device)
        return empty, (empty.clone() if with_entropy else None)

    forward = logits_forward(model, lean)  # picked once: the lean forward or the model's own
    head = forward.head if fused_head else None
    pieces = _pieces(forward, prompt_ids, prompt_mask, completion_ids, completion_mask,
                     share_prompts, hidden=head is not None)
    logps, entropies = [], []
    start = 0
    for piece in pieces:  # [B, n, H or V] predicting completion tokens start .. start+n-1
        targets = completion_ids[:, start : start + piece.shape[1]]
        start += piece.shape[1]
        entropy = None
        if head is not None:
            logp, entropy = linear_selective_log_softmax(
                piece, *head, targets, temperature=temperature, chunk_rows=chunk_rows,
                with_entropy=with_entropy,
            )
        else:
            logits = piece / temperature if temperature != 1.0 else piece
            if with_entropy:  # one pass over the logits for both
                logp, entropy = selective_log_softmax_and_entropy(logits, targets, chunk_rows)
            else:
                logp = selective_log_softmax(logits, targets, chunk_rows)
        logps.append(logp)
        entropies.append(entropy)
    logp = logps[0] if len(logps) == 1 else torch.cat(logps, dim=1)
    if not with_entropy:
        return logp, None
    return logp, entropies[0] if len(entropies) == 1 else torch.cat(entropies, dim=1)


def _pieces(
    forward: CompletionLogits, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
    completion_mask: Tensor, share_prompts: bool, *, hidden: bool = False,
) -> list[Tensor]:
    """The ``[B, n_i, V]`` pieces of logits predicting the completion tokens (inputs on the
    model's device, ``C >= 1``), or with ``hidden`` the final hidden states ``[B, n_i, H]``
    before ``forward.head``, with each shared prompt forwarded once where possible."""
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    b = completion_ids.shape[0]
    pieces: list[Tensor] | None = None
    if share_prompts and b > 1:
        first, inverse = _distinct_prompts(prompt_ids, prompt_mask)
        if first.shape[0] < b:  # rows share a prompt: forward it once for all of them
            shared = forward.shared_prompt_hidden if hidden else forward.shared_prompt_logits
            pieces = shared(*batch, first, inverse)
    if pieces is None:  # every prompt distinct, or a model cache that cannot be shared
        pieces = (forward.sequence_hidden if hidden else forward.sequence_logits)(*batch)
    return pieces


def completion_hidden(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    share_prompts: bool = True,
    lean: bool = True,
) -> tuple[Tensor, tuple[Tensor, Tensor | None]] | None:
    """The final hidden states ``[B, C, H]`` whose LM-head product ``F.linear(hidden, *head)``
    is :func:`completion_logits` (at temperature 1), and that ``head`` ``(weight [V, H], bias)``,
    from the same forward as :func:`completion_logprobs`; ``None`` for a model whose logits are
    not a plain linear head's (:func:`_body_and_head`). For what needs the whole next-token
    distribution in chunks (the exact full-vocabulary divergence, :mod:`gbmpo.train.full`)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    if completion_ids.shape[1] == 0:
        raise ValueError("completion_hidden: the batch has no completion tokens")
    forward = logits_forward(model, lean)
    if forward.head is None:
        return None
    pieces = _pieces(forward, prompt_ids, prompt_mask, completion_ids, completion_mask,
                     share_prompts, hidden=True)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), forward.head

def completion_logits(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    share_prompts: bool = True,
    lean: bool = True,
) -> Tensor:
    """The logits ``[B, C, V]`` (divided by ``temperature``) that predict each completion token,
    from the same forward as :func:`completion_logprobs` (gradients flow when grad is enabled),
    for what needs the whole next-token distribution (the exact full-vocabulary divergence);
    :func:`selective_log_softmax` of them against ``completion_ids`` is
    :func:`completion_logprobs`'s ``logp``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    if completion_ids.shape[1] == 0:
        raise ValueError("completion_logits: the batch has no completion tokens")
    pieces = _pieces(logits_forward(model, lean), prompt_ids, prompt_mask, completion_ids,
                     completion_mask, share_prompts)
    logits = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    return logits / temperature if temperature != 1.0 else logits
