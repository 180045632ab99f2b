"""What each draft prediction is trained to minimise (`train.loss`) and how a block's positions are weighed
(`head.position_weights`): pure functions on tensors, used by every loss in train/losses/.

p is the target's distribution over the draft vocabulary (the teacher row), q = softmax(draft logits), and
alpha = sum_v min(p_v, q_v) = 1 - TV(p, q), the probability that a token sampled from q is accepted by
rejection sampling against p (docs/design.md#objectives). Under `train.alpha_on=target` the p in alpha (TV,
NLA, LK's acceptance and lambda) is the target's own probability of each draft token, p x mass (mass = the
target's probability on the whole draft vocabulary): what vLLM accepts with, and SpecForge's LK form; KL
and RKL keep the renormalised p. The divergences, per token:

- `kl`   forward KL(p || q), computed as the soft cross-entropy -sum_v p_v log q_v (KL plus the teacher's
         entropy, which has no gradient): the objective every head trained with before there was a choice.
- `rkl`  reverse KL(q || p) = sum_v q_v (log q_v - log p_v).
- `tv`   1 - alpha. Its gradient vanishes where p and q do not overlap.
- `nla`  -log(max(alpha, 1e-5)).
- `lk`   lambda kl + (1 - lambda) tv with lambda = exp(-eta sg(alpha)) per token (LK, arXiv 2602.23881): KL
         while the draft is far from the target (alpha ~ 0: lambda ~ 1), acceptance once it is close.

`train.loss` names one, or a weighted sum such as "0.1*kl+0.9*tv" (`parse_objective`).

D-PACE (arXiv 2605.18810, `dpace_weights`) replaces a draft chain's fixed position weights (a DFlash
block's exp(-(k-1)/decay), gamma^k over TTT steps and P-EAGLE depths) by weights that follow the draft's
own chance to get there (train/losses/positions.py `chain_weights` lays every chain out per anchor):
c_j = exp(-CE_j) the draft's probability of the target's argmax at slot j (no gradient),
c~_j = (1 - a) c_j + a, P_j = prod_{i<=j} c~_i, w_j = sum_{m>=j} P_m.

    objective = parse_objective("lk", eta=3.0)
    loss_C = token_losses(objective, p_CVd, log_probs(logits_CVd))     # [C]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from artifacts.config import loss_terms

NLA_FLOOR = 1e-5  # -log alpha is capped at -log(1e-5) = 11.5 where the draft misses the target entirely


class Objective(NamedTuple):
    """A weighted sum of divergences: terms ((name, weight), ...), LK's eta, and whether alpha is taken on
    the target's own probabilities of the draft tokens (`train.alpha_on=target`) or on the teacher
    renormalised over the draft vocabulary."""

    terms: tuple[tuple[str, float], ...]
    eta: float = 3.0
    alpha_on_target: bool = False
    # How it is computed, not what (`train.fused_loss`): each chunk of rows with its gradients in the forward
    # (train/losses/rows.py `fused_rows`), or under checkpointing, recomputed in backward.
    fused: bool = True


KL = Objective((("kl", 1.0),))


def parse_objective(
    spec: str, eta: float = 3.0, alpha_on: str = "draft_vocab", fused: bool = True
) -> Objective:
    """`spec` a divergence name ("kl") or a weighted sum ("0.1*kl+0.9*tv": artifacts/config/checks.py loss_terms);
    ValueError naming what is wrong."""
    if not eta >= 0:
        raise ValueError(f"train.lk_eta={eta}: must be >= 0")
    return Objective(loss_terms(spec), float(eta), alpha_on == "target", bool(fused))


def acceptance(p_CV: Tensor, q_CV: Tensor) -> Tensor:
    """[C] alpha = sum_v min(p_v, q_v): a token sampled from q is accepted with this probability."""
    return torch.minimum(p_CV, q_CV).sum(-1)


def log_probs(logits_CV: Tensor) -> Tensor:
    """log q from the draft's logits, in fp32 at least (bf16 logits under autocast; fp64 stays fp64)."""
    return torch.log_softmax(logits_CV.to(torch.promote_types(logits_CV.dtype, torch.float32)), dim=-1)


def token_losses(objective: Objective, p_CV: Tensor, logq_CV: Tensor, mass_C: Tensor | None = None) -> Tensor:
    """[C] the objective at each row: teacher rows p_CV (fp32, summing to 1) against the draft's
    log-probabilities (`log_probs`); only the divergences it names are computed. `mass_C`, the target's
    probability on the draft vocabulary per row, is needed when `objective.alpha_on_target`."""
    names = {name for name, _ in objective.terms}
    values = {}
    if names & {"kl", "lk"}:
        values["kl"] = -(p_CV * logq_CV).sum(-1)
    if names - {"kl"}:
        q_CV = logq_CV.exp()
        if objective.alpha_on_target and mass_C is None:
            raise ValueError(
                "alpha on the target's probabilities needs the teacher's mass on the draft vocabulary"
            )
        alpha_C = acceptance(p_CV * mass_C[:, None] if objective.alpha_on_target else p_CV, q_CV)
        values["tv"] = 1 - alpha_C
        if "nla" in names:
            values["nla"] = -torch.log(alpha_C.clamp(min=NLA_FLOOR))
        if "rkl" in names:
            logp_CV = torch.log(p_CV.clamp(min=torch.finfo(p_CV.dtype).tiny))
            values["rkl"] = (q_CV * (logq_CV - logp_CV)).sum(-1)
        if "lk" in names:
            lam_C = torch.exp(-objective.eta * alpha_C.detach())
            values["lk"] = lam_C * values["kl"] + (1 - lam_C) * values["tv"]
    return sum(weight * values[name] for name, weight in objective.terms)


def dpace_weights(ce_RK: Tensor, keep_RK: Tensor, a: float = 0.5) -> Tensor:
    """[R, K] D-PACE weights (no gradient) of the K slots of R blocks from their cross-entropies to the
    target's argmax; slots not kept (past a block's end, no answer token) count as certain (c~ = 1) in the
    products and get weight 0."""
    with torch.no_grad():
        c_RK = torch.where(keep_RK, (1 - a) * torch.exp(-ce_RK.float()) + a, torch.ones_like(ce_RK.float()))
        reach_RK = torch.cumprod(c_RK, dim=1) * keep_RK
        weights_RK = reach_RK.flip(1).cumsum(1).flip(1)
        return weights_RK * keep_RK
