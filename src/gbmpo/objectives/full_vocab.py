"""Full-vocabulary Bregman divergences between whole next-token distributions.

For a separable potential h (see :mod:`gbmpo.objectives.potentials`) and each token position,

    D_full = sum_{v in V} D_h(pi_theta(v | h_t), pi_ref(v | h_t))

(docs/methods.md, section "Sampled-token and full-vocabulary divergences"; the vocabulary-level
reading of GBMPO, arXiv 2602.04380). With h = negative entropy this is the exact KL(pi_theta ||
pi_ref), computed from log-softmax directly (sum_v p_v (log p_v - log q_v); no floor); with h = y^2
it is sum_v (p_v - q_v)^2; any :class:`NeuralMirrorMap` works as h. It is a different regularizer
from the selected-token one (which estimates it only after reweighting by 1/p).

Gradients. With p = softmax(x) and u_v = dD/dp_v = h'(p_v) - h'(q_v), the gradient with respect
to the policy logits of one row is the softmax Jacobian applied to u:

    dD/dx_j = p_j (u_j - sum_v p_v u_v)

(KL: u = log p - log q, and sum_v p_v u_v = D itself; square: u = 2 (p - q)). For these two
potentials the gradient is computed in closed form, chunk by chunk, into preallocated buffers
(no autograd graph over vocabulary-sized tensors); other potentials (neural mirror maps) use
autograd inside each chunk.

Memory (N = B*T rows, V vocabulary, C = chunk_size, H hidden size, 4-byte floats):

* :func:`full_vocab_bregman` takes both logit tensors (2 N V elements, owned by the caller). With
  grad, the forward computes each row's gradient while it has the row's probabilities at hand and
  stores it in one [N, V] buffer, which the backward scales in place by the incoming gradient and
  returns as the logits' gradient (it is that gradient, so it costs nothing beyond it); the
  kernel's scratch space is the not-yet-written part of that buffer (8 V floats for the last
  chunk): extra peak ~ N V + 8 V floats, one pass over the logits, no recomputation. The backward
  can run only once per forward (the buffer is reused in place). Without grad the rows are
  processed C at a time (k C V floats of temporaries, k ~ 6).
* :func:`full_vocab_bregman_from_hidden` takes hidden states [B, T, H] and the LM-head weight
  [V, H] and projects inside each chunk, so no [N, V] tensor ever exists: forward and backward
  peak ~ 3 C V floats (reused chunk buffers) plus the inputs and the weight's gradient; with a
  shared head the policy and reference rows of a chunk go through one product of 2C rows.
  The backward recomputes each chunk's policy and reference logits (two extra projections per
  chunk: six [C, H] x [H, V] products per chunk in all, against four for an unchunked
  forward/backward). This is the path for training with large vocabularies.

Reused buffers also avoid glibc malloc's fragmentation of repeatedly freed ~20 MB chunks (a
freed buffer below malloc's 32 MB mmap threshold moves to the heap and keeps the resident size
high): each call allocates its chunk buffers once.

Why one module of ~630 lines: the two public functions share the chunking, the closed-form row
kernels and the two custom autograd functions whose memory accounting is given above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.utils.checkpoint import checkpoint

from gbmpo.objectives.potentials import NegEntropy, Potential, Square, as_potential
from gbmpo.objectives.tensors import compute_dtype

__all__ = [
    "LOGIT_FLOOR",
    "RowDivergence",
    "bregman_rows",
    "finite_logits",
    "full_vocab_bregman",
    "full_vocab_bregman_from_hidden",
    "total_variation_rows",
]



#: -inf logits are replaced by (row max - LOGIT_FLOOR) in the KL (see :func:`finite_logits`).
LOGIT_FLOOR = 1e4


def finite_logits(logits: Tensor) -> Tensor:
    """``logits`` with every -inf entry replaced by (its row's max - :data:`LOGIT_FLOOR`), for
    the KL path, whose log p - log q is NaN or +-inf at a -inf logit.

    The softmax is bit for bit unchanged (e^(-1e4) is 0 in every float dtype); only the
    log-probability of zero-probability entries becomes finite (~-1e4). In KL(p || q): -inf in
    the policy row gives the exact 0 log 0 = 0 term; -inf in the reference row where the policy
    has mass (exact KL +inf) gives a finite ~LOGIT_FLOOR * p_v, whose gradient lowers the
    policy's mass there. A row of all -inf (or NaN / +inf) stays NaN: mask it out.
    """
    row_max = logits.detach().amax(dim=-1, keepdim=True)
    return torch.where(logits == float("-inf"), row_max - LOGIT_FLOOR, logits)


class RowDivergence:
    """A divergence between whole next-token distributions given by a row function of the two
    log-softmax rows, ``rows(log_p [C, V], log_q [C, V]) -> [C]`` (differentiable by autograd).

    The exact full-vocabulary form of a regularizer that is not a separable Bregman divergence
    (the f-divergences of :mod:`gbmpo.objectives.f_divergences`, or a plugin's own form): every
    function of this module takes one where it takes a potential; its values and gradients go
    through the autograd path of each chunk (:func:`_autograd_rows`), with the same memory bound
    as a neural mirror map. -inf logits are made finite first (:func:`finite_logits`), so
    ``rows`` sees finite log-probabilities only. ``description`` is the formula, for messages
    and docs.
    """

    def __init__(self, name: str, rows: Callable[[Tensor, Tensor], Tensor],
                 description: str = "") -> None:
        self.name = name
        self.rows = rows
        self.description = description or name

    def __repr__(self) -> str:
        return f"RowDivergence({self.name!r})"


def bregman_rows(
    policy_logits: Tensor, ref_logits: Tensor, potential: Potential | RowDivergence
) -> Tensor:
    """sum_v D_h(softmax(policy)_v, softmax(ref)_v) over the last dimension (float32 math).

    For :class:`NegEntropy` this is KL(softmax(policy) || softmax(ref)) = sum_v p_v (log p_v -
    log q_v) from log-softmax (exact, equal to ``F.kl_div(log q, log p, log_target=True)``
    summed over v, after :func:`finite_logits`, which only matters for -inf logits); otherwise
    h's own elementwise ``bregman`` on the probabilities (finite with -inf logits as they are).
    """
    dt = compute_dtype(policy_logits, ref_logits)
    x, y = policy_logits.to(dt), ref_logits.to(dt)
    if isinstance(potential, (NegEntropy, RowDivergence)):
        x, y = finite_logits(x), finite_logits(y)
    log_p = torch.log_softmax(x, dim=-1)
    log_q = torch.log_softmax(y, dim=-1)
    if isinstance(potential, RowDivergence):
        return potential.rows(log_p, log_q)
    if isinstance(potential, NegEntropy):
        # kl_div(input=log q, target=log p, log_target=True) = exp(log p) (log p - log q)
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    return potential.bregman(log_p.exp(), log_q.exp()).sum(-1)


def total_variation_rows(policy_logits: Tensor, ref_logits: Tensor) -> Tensor:
    """TV(p, q) = 1/2 sum_v |p_v - q_v| over the last dimension, p = softmax(policy_logits),
    q = softmax(ref_logits) (float32 math; float64 stays).

    The total-variation distance between the two next-token distributions (Levin, Peres and
    Wilmer, "Markov Chains and Mixing Times", Prop. 4.2: TV = 1/2 ||p - q||_1), in [0, 1]. It is
    not a Bregman divergence (|.| is not strictly convex), so it has no potential; it is used to
    measure drift (:mod:`gbmpo.eval.drift`), not as a regularizer. A -inf logit is probability 0.
    """
    dt = compute_dtype(policy_logits, ref_logits)
    p = torch.softmax(policy_logits.to(dt), dim=-1)
    q = torch.softmax(ref_logits.to(dt), dim=-1)
    return 0.5 * (p - q).abs().sum(-1)


def _check_chunk(chunk_size: int | None) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _check_mask(mask: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    if mask is None:
        return None
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {shape}")
    return mask.to(torch.bool)


def _run_chunks(fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor, step: int) -> Tensor:
    """Apply ``fn`` to matching row chunks of x and y ([N, V] each) and concatenate; each chunk
    is checkpointed when a gradient is being recorded and there is more than one chunk."""
    n_rows = x.shape[0]
    use_ckpt = (
        torch.is_grad_enabled() and (x.requires_grad or y.requires_grad) and step < n_rows
    )
    outs = []
    for start in range(0, n_rows, step):
        args = (x[start : start + step], y[start : start + step])
        outs.append(checkpoint(fn, *args, use_reentrant=False) if use_ckpt else fn(*args))
    if not outs:
        return torch.zeros(0, dtype=compute_dtype(x, y), device=x.device)
    return torch.cat(outs)


# --- closed-form chunk kernel -----------------------------------------------------------------

#: rows per sub-chunk when the last chunk of :class:`_LogitsBregman` needs its own scratch buffer
_TAIL_ROWS = 8


def _closed_form_kind(potential: Potential | RowDivergence) -> str | None:
    """``"kl"`` / ``"square"`` for the potentials with a closed-form kernel, else None."""
    if isinstance(potential, NegEntropy):
        return "kl"
    if isinstance(potential, Square):
        return "square"
    return None


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """sum_v a[r, v] b[r, v] per row, as a batched matrix product (no [C, V] temporary)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


def _closed_form_rows(
    x: Tensor,
    y: Tensor,
    kind: str,
    p_out: Tensor,
    scratch: Tensor | None,
    want_grad: bool,
) -> Tensor:
    """D[r] = sum_v D_h(softmax(x[r])_v, softmax(y[r])_v) for h = neg-entropy ("kl") or y^2
    ("square"), and with ``want_grad`` dD[r]/dx[r] (module docstring), in preallocated buffers.

    ``x``, ``y``, ``p_out`` (and ``scratch``) are [C, V] in the compute dtype; ``p_out``
    receives softmax(x), then the gradient. With ``scratch=None`` ``x`` and ``y`` may be
    overwritten. -inf logits (KL) take :func:`finite_logits`' values: replaced in place in owned
    buffers, else the chunk is recomputed from finite copies only if a row came out non-finite.
    """
    if kind == "kl" and scratch is None:
        for t in (x, y):
            if bool((t.amin(dim=-1) == float("-inf")).any()):
                torch.where(t == float("-inf"), t.amax(dim=-1, keepdim=True) - LOGIT_FLOOR, t,
                            out=t)
    d = _closed_form_rows_raw(x, y, kind, p_out, scratch, want_grad)
    if kind == "kl" and scratch is not None and not bool(torch.isfinite(d).all()):
        d = _closed_form_rows_raw(finite_logits(x), finite_logits(y), kind, p_out, scratch,
                                  want_grad)
    return d


def _closed_form_rows_raw(
    x: Tensor,
    y: Tensor,
    kind: str,
    p_out: Tensor,
    scratch: Tensor | None,
    want_grad: bool,
) -> Tensor:
    """The kernel of :func:`_closed_form_rows` on logits as given (no -inf handling)."""
    mx = x.amax(dim=-1, keepdim=True)
    torch.sub(x, mx, out=p_out).exp_()
    sx = p_out.sum(dim=-1, keepdim=True)
    p_out.div_(sx)  # p = softmax(x)
    my = y.amax(dim=-1, keepdim=True)
    if kind == "kl":
        if scratch is None:
            u = torch.sub(x, y, out=x)  # x is no longer needed
            e = y.sub_(my).exp_()
        else:
            e = torch.sub(y, my, out=scratch).exp_()
        sy = e.sum(dim=-1, keepdim=True)
        if scratch is not None:
            u = torch.sub(x, y, out=scratch)
        # u = log p - log q = (x - y) - (logsumexp x - logsumexp y)
        u.sub_((mx + sx.log()) - (my + sy.log()))
        d = _rowdot(p_out, u)
        if want_grad:
            p_out.mul_(u.sub_(d.unsqueeze(-1)))  # p (u - D)
        return d
    if kind == "square":
        q = y.sub_(my).exp_() if scratch is None else torch.sub(y, my, out=scratch).exp_()
        q.div_(q.sum(dim=-1, keepdim=True))
        w = torch.sub(p_out, q, out=q)  # p - q
        d = _rowdot(w, w)
        if want_grad:
            c = _rowdot(p_out, w)
            p_out.mul_(w.sub_(c.unsqueeze(-1)).mul_(2.0))  # p * 2 (w - <p, w>)
        return d
    raise ValueError(f"no closed-form kernel for {kind!r}")


def _autograd_rows(
    x: Tensor, y: Tensor, potential: Potential | RowDivergence, grad_out: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Values and gradient w.r.t. ``x`` of :func:`bregman_rows` for any potential, by autograd on
    one chunk. ``grad_out`` [C] weights the rows (None: 1, i.e. each row's own gradient)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        d = bregman_rows(xg, y.detach(), potential)
        (g,) = torch.autograd.grad(d, xg, grad_outputs=torch.ones_like(d) if grad_out is None
                                   else grad_out.to(d.dtype))
    return d.detach(), g


class _LogitsBregman(torch.autograd.Function):
    """full_vocab_bregman with grad into the policy logits only: the forward stores each row's
    gradient dD_r/dx_r in one [N, V] buffer, the backward scales it in place by dL/dD_r."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        x: Tensor,
        y: Tensor,
        potential: Potential,
        step: int,
        keep: Tensor | None = None,
    ) -> Tensor:
        n, vocab = x.shape
        dt = compute_dtype(x, y)
        kind = _closed_form_kind(potential)
        grad = torch.empty((n, vocab), dtype=x.dtype, device=x.device)
        out = torch.empty(n, dtype=dt, device=x.device)
        c = max(min(step, n), 1)
        stage = None if x.dtype == dt else torch.empty((c, vocab), dtype=dt, device=x.device)
        # Scratch for the closed-form kernel: the not-yet-written rows of ``grad`` after the
        # current chunk when there are enough of them (and ``grad`` has the compute dtype), so
        # the extra memory is the gradient alone; the last chunk(s) use a small buffer instead,
        # in sub-chunks of at most ``tail`` rows.
        tail = min(c, _TAIL_ROWS) if stage is None else c
        small = torch.empty((tail, vocab), dtype=dt, device=x.device) if kind else None
        for s0 in range(0, n, step):
            e0 = min(n, s0 + step)
            reuse = stage is None and e0 + (e0 - s0) <= n
            sub = e0 - s0 if reuse else tail
            for s in range(s0, e0, sub):
                e = min(e0, s + sub)
                xc, yc = x[s:e].to(dt), y[s:e].to(dt)
                g = grad[s:e] if stage is None else stage[: e - s]
                if kind is not None:
                    assert small is not None
                    scratch = grad[e0 : e0 + (e - s)] if reuse else small[: e - s]
                    out[s:e] = _closed_form_rows(xc, yc, kind, g, scratch, want_grad=True)
                else:
                    out[s:e], gi = _autograd_rows(xc, yc, potential, None)
                    g.copy_(gi)
                if keep is not None:  # masked rows: 0 and no gradient, whatever they hold
                    kept = keep[s:e]
                    out[s:e] = torch.where(kept, out[s:e], 0.0)
                    g.masked_fill_(~kept.unsqueeze(-1), 0.0)
                if stage is not None:
                    grad[s:e].copy_(g)
        ctx.save_for_backward(grad)
        ctx.used = False  # type: ignore[attr-defined]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        if ctx.used:
            raise RuntimeError(
                "full_vocab_bregman: backward can run only once per forward (its stored "
                "gradient is scaled in place); compute the divergence again to differentiate "
                "again"
            )
        ctx.used = True
        (grad,) = ctx.saved_tensors
        grad.mul_(grad_out.to(grad.dtype).unsqueeze(-1))
        return grad, None, None, None, None


def _same_storage(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` view the same memory with the same layout (e.g. ``w`` and
    ``w.detach()``)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _project(rows: Tensor, weight: Tensor, bias: Tensor | None, buf: Tensor) -> Tensor:
    """``rows @ weight.T + bias`` (in the weight's dtype, like the model's head) into ``buf``
    (compute dtype)."""
    if rows.dtype == buf.dtype and weight.dtype == buf.dtype:
        torch.mm(rows, weight.t(), out=buf)
        if bias is not None:
            buf.add_(bias.to(buf.dtype))
    else:
        buf.copy_(F.linear(rows, weight, bias))
    return buf


class _HiddenBregman(torch.autograd.Function):
    """full_vocab_bregman_from_hidden: chunked projection + divergence; the backward recomputes
    each chunk's logits (nothing vocabulary-sized is saved) and accumulates the gradients of the
    hidden rows, the head weight and its bias."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        h: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ref: Tensor,
        ref_w: Tensor | None,
        ref_b: Tensor | None,
        potential: Potential,
        step: int,
    ) -> Tensor:
        n = h.shape[0]
        dt = compute_dtype(h, weight)
        out = torch.empty(n, dtype=dt, device=h.device)
        for s, e, logits, ref_logits, p_buf in _HiddenBregman._chunks(
            h, weight, bias, ref, ref_w, ref_b, step, dt
        ):
            kind = _closed_form_kind(potential)
            if kind is not None:
                out[s:e] = _closed_form_rows(logits, ref_logits, kind, p_buf, None, False)
            else:
                out[s:e] = bregman_rows(logits, ref_logits, potential)
        ctx.save_for_backward(h, weight, bias, ref, ref_w, ref_b)
        ctx.potential, ctx.step, ctx.dt = potential, step, dt  # type: ignore[attr-defined]
        return out

    @staticmethod
    def _chunks(
        h: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ref: Tensor,
        ref_w: Tensor | None,
        ref_b: Tensor | None,
        step: int,
        dt: torch.dtype,
    ) -> Any:
        """Yield (start, end, policy logits, reference logits, spare buffer) per chunk; the
        [2C, V] and [C, V] buffers are allocated once and reused. When the reference uses the
        same head weight (the default: tied head, LoRA), the policy and reference rows of a chunk
        are projected by one [2C, H] x [H, V] product, which runs faster than two of C rows."""
        n, vocab = h.shape[0], weight.shape[0]
        c = max(min(step, n), 1)
        both = torch.empty((2 * c, vocab), dtype=dt, device=h.device)
        spare = torch.empty((c, vocab), dtype=dt, device=h.device)
        stacked = (
            ref_w is not None
            and _same_storage(ref_w, weight)
            and ref.shape[-1] == h.shape[-1]
            and h.dtype == ref.dtype == weight.dtype == dt
        )
        for s in range(0, n, step):
            e = min(n, s + step)
            k = e - s
            lb, rb_, pb = both[:k], both[k : 2 * k], spare[:k]
            if stacked:
                torch.mm(torch.cat([h[s:e], ref[s:e]]), weight.t(), out=both[: 2 * k])
                if bias is not None:
                    lb.add_(bias.to(dt))
                if ref_b is not None:
                    rb_.add_(ref_b.to(dt))
                yield s, e, lb, rb_, pb
                continue
            logits = _project(h[s:e], weight, bias, lb)
            if ref_w is None:
                ref_logits = rb_.copy_(ref[s:e])
            else:
                ref_logits = _project(ref[s:e], ref_w, ref_b, rb_)
            yield s, e, logits, ref_logits, pb

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        h, weight, bias, ref, ref_w, ref_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        potential, dt = ctx.potential, ctx.dt
        kind = _closed_form_kind(potential)
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=dt, device=weight.device) if need_b else None
        g_all = grad_out.to(dt)
        for s, e, logits, ref_logits, p_buf in _HiddenBregman._chunks(
            h, weight, bias, ref, ref_w, ref_b, ctx.step, dt
        ):
            g_rows = g_all[s:e]
            if kind is not None:
                _closed_form_rows(logits, ref_logits, kind, p_buf, None, True)
                grad = p_buf.mul_(g_rows.unsqueeze(-1))  # dL/dlogits of the chunk
            else:
                _, gi = _autograd_rows(logits, ref_logits, potential, g_rows)
                grad = p_buf.copy_(gi)
            if dh is not None:
                if dh.dtype == dt and weight.dtype == dt:
                    torch.mm(grad, weight, out=dh[s:e])
                else:
                    dh[s:e] = grad.to(weight.dtype) @ weight
            if dw is not None:
                dw.addmm_(grad.t(), h[s:e].to(dt))
            if db is not None:
                db.add_(grad.sum(dim=0))
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def full_vocab_bregman(
    policy_logits: Tensor,
    ref_logits: Tensor,
    potential: str | Potential | RowDivergence = "neg_entropy",
    chunk_size: int | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """D[b, t] = sum_v D_h(softmax(policy_logits[b, t])_v, softmax(ref_logits[b, t])_v), [B, T]
    from logits [B, T, V] (docs/methods.md, "Sampled-token and full-vocabulary divergences").

    ``potential``: a POTENTIALS name (``neg_entropy`` = exact KL, ``square``, ``neural_mirror``),
    a potential object, or a :class:`RowDivergence`. ``chunk_size`` rows at a time (None: all);
    with grad into the policy logits only, the forward stores the gradient ([B, T, V]; the
    backward runs once), with grad into ``ref_logits`` too each chunk is checkpointed. ``mask``
    [B, T]: masked positions give 0 and exactly 0 gradient whatever they hold. float32 (float64
    stays). A -inf logit is fine while its row keeps a finite one: 0 for the policy, a finite
    ~1e4 p_v penalty for the reference in the KL (:func:`finite_logits`); never NaN.
    """
    pot = potential if isinstance(potential, RowDivergence) else as_potential(potential)
    _check_chunk(chunk_size)
    if policy_logits.shape != ref_logits.shape or policy_logits.dim() < 2:
        raise ValueError(
            f"policy_logits {tuple(policy_logits.shape)} and ref_logits "
            f"{tuple(ref_logits.shape)} must have the same shape [..., V]"
        )
    lead = tuple(policy_logits.shape[:-1])
    keep = _check_mask(mask, lead)
    vocab = policy_logits.shape[-1]
    flat_p = policy_logits.reshape(-1, vocab)
    flat_q = ref_logits.reshape(-1, vocab)

    def fn(x: Tensor, y: Tensor) -> Tensor:
        return bregman_rows(x, y, pot)

    step = max(flat_p.shape[0], 1) if chunk_size is None else chunk_size
    grad_on = torch.is_grad_enabled() and (flat_p.requires_grad or flat_q.requires_grad)
    flat_keep = None if keep is None else keep.reshape(-1)
    if grad_on and not flat_q.requires_grad:
        # the usual case (reference logits without grad): closed-form / per-chunk gradients
        # stored during the forward, no recomputation; masked rows get exactly 0 gradient
        out = _LogitsBregman.apply(flat_p, flat_q, pot, step, flat_keep).reshape(lead)
    else:
        # no grad, or grad into the reference logits too: row chunks (checkpointed with grad)
        if grad_on and flat_keep is not None:
            # masked rows may hold anything (NaN, all -inf): give the backward zeros there
            k = flat_keep.unsqueeze(-1)
            flat_p = torch.where(k, flat_p, torch.zeros((), dtype=flat_p.dtype))
            flat_q = torch.where(k, flat_q, torch.zeros((), dtype=flat_q.dtype))
        out = _run_chunks(fn, flat_p, flat_q, step).reshape(lead)
    if keep is not None:
        out = torch.where(keep, out, 0.0)
    return out


def full_vocab_bregman_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    potential: str | Potential | RowDivergence = "neg_entropy",
    *,
    ref_hidden: Tensor | None = None,
    ref_lm_head_weight: Tensor | None = None,
    ref_logits: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    ref_lm_head_bias: Tensor | None = None,
    chunk_size: int | None = 128,
    mask: Tensor | None = None,
) -> Tensor:
    """:func:`full_vocab_bregman` [B, T] from policy hidden states: logits = hidden @
    lm_head_weight.T (+ lm_head_bias), formed chunk by chunk (``chunk_size`` rows) into reused
    buffers and recomputed in the backward, so no [B*T, V] tensor is ever held.

    The reference is either ``ref_hidden`` [B, T, H] with ``ref_lm_head_weight`` [V, H]
    (default ``lm_head_weight``: LoRA with adapters off, a tied head) and ``ref_lm_head_bias``,
    projected without grad, or precomputed ``ref_logits`` [B, T, V] (no grad). Policy logits
    are formed chunk by chunk and recomputed in the backward (no [B*T, V] tensor); a
    :class:`RowDivergence` ``potential`` goes through autograd inside each chunk. Masked rows
    are skipped (0). Matmuls in the input dtype, softmax and divergence in float32 (float64 stays);
    -inf reference logits as in :func:`full_vocab_bregman`.
    """
    pot = potential if isinstance(potential, RowDivergence) else as_potential(potential)
    _check_chunk(chunk_size)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [..., H], got shape {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, H={hidden.shape[-1]}], got {tuple(lm_head_weight.shape)}"
        )
    vocab = lm_head_weight.shape[0]
    if (ref_hidden is None) == (ref_logits is None):
        raise ValueError("pass exactly one of ref_hidden (with ref_lm_head_weight) or ref_logits")
    lead = tuple(hidden.shape[:-1])
    if ref_hidden is not None:
        ref_w = (lm_head_weight if ref_lm_head_weight is None else ref_lm_head_weight).detach()
        if tuple(ref_hidden.shape[:-1]) != lead or ref_w.dim() != 2 or (
            ref_w.shape != (vocab, ref_hidden.shape[-1])
        ):
            raise ValueError(
                f"ref_hidden {tuple(ref_hidden.shape)} / ref_lm_head_weight "
                f"{tuple(ref_w.shape)} do not match hidden {tuple(hidden.shape)} and V={vocab}"
            )
        ref_rows = ref_hidden.detach().reshape(-1, ref_hidden.shape[-1])
    else:
        assert ref_logits is not None
        if tuple(ref_logits.shape) != (*lead, vocab):
            raise ValueError(
                f"ref_logits has shape {tuple(ref_logits.shape)}, expected {(*lead, vocab)}"
            )
        ref_w = None
        if ref_lm_head_weight is not None or ref_lm_head_bias is not None:
            raise ValueError("ref_lm_head_weight/ref_lm_head_bias are only used with ref_hidden")
        ref_rows = ref_logits.detach().reshape(-1, vocab)
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (vocab,):
        raise ValueError(f"lm_head_bias must be [{vocab}], got {tuple(lm_head_bias.shape)}")
    ref_b = None if ref_lm_head_bias is None else ref_lm_head_bias.detach()
    keep = _check_mask(mask, lead)

    rows = hidden.reshape(-1, hidden.shape[-1])
    n_all = rows.shape[0]
    idx = None
    if keep is not None:
        idx = keep.reshape(-1).nonzero().squeeze(-1)
        rows = rows.index_select(0, idx)
        ref_rows = ref_rows.index_select(0, idx)

    n = rows.shape[0]
    step = max(n, 1) if chunk_size is None else chunk_size
    vals = _HiddenBregman.apply(rows, lm_head_weight, lm_head_bias, ref_rows, ref_w, ref_b, pot,
                                step)
    if idx is not None:
        full = torch.zeros(n_all, dtype=vals.dtype, device=vals.device)
        vals = full.index_copy(0, idx, vals)
    return vals.reshape(lead)
