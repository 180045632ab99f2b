"""train/objectives.py: each divergence against hand-computed values, its gradient, D-PACE's weights, and
train.loss's grammar."""

import math

import pytest
import torch

from artifacts.config import loss_terms
from train.objectives import KL, acceptance, dpace_weights, log_probs, parse_objective, token_losses

P = [0.5, 0.3, 0.2]
Q = [0.2, 0.2, 0.6]


def logits_of(q):
    return torch.tensor([math.log(v) for v in q], dtype=torch.float64)[None]


def value(spec, p=P, q=Q, eta=3.0):
    return float(
        token_losses(
            parse_objective(spec, eta), torch.tensor([p], dtype=torch.float64), log_probs(logits_of(q))
        )
    )


def test_each_divergence_equals_its_hand_computed_value():
    alpha = 0.2 + 0.2 + 0.2  # sum of min(p_v, q_v)
    ce = -sum(p * math.log(q) for p, q in zip(P, Q))
    rkl = sum(q * math.log(q / p) for p, q in zip(P, Q))
    assert value("kl") == pytest.approx(ce, rel=1e-12)  # soft CE: KL(p||q) + H(p)
    assert value("rkl") == pytest.approx(rkl, rel=1e-12)
    assert value("tv") == pytest.approx(1 - alpha, rel=1e-12)
    assert value("nla") == pytest.approx(-math.log(alpha), rel=1e-12)
    lam = math.exp(-3.0 * alpha)
    assert value("lk") == pytest.approx(lam * ce + (1 - lam) * (1 - alpha), rel=1e-12)
    assert value("lk", eta=0.0) == pytest.approx(ce, rel=1e-12)  # eta 0: plain KL
    assert value("0.1*kl+0.9*tv") == pytest.approx(0.1 * ce + 0.9 * (1 - alpha), rel=1e-12)
    assert float(acceptance(torch.tensor([P]), torch.tensor([Q]))) == pytest.approx(alpha)


def test_each_divergence_is_least_where_the_draft_is_the_target():
    for spec in ("kl", "rkl", "tv", "nla", "lk"):
        assert value(spec, q=P) < value(spec), spec
    assert value("tv", q=P) == pytest.approx(0.0, abs=1e-12)
    assert value("rkl", q=P) == pytest.approx(0.0, abs=1e-12)
    assert value("nla", q=P) == pytest.approx(0.0, abs=1e-12)


def test_alpha_on_the_targets_own_probabilities():
    """train.alpha_on=target: alpha = sum_v min(mass p_v, q_v) (the target's unnormalised probabilities of the
    draft tokens, as vLLM accepts); KL keeps the renormalised p; a draft at p already reaches the most alpha
    can be (mass), so TV gives it no gradient."""
    mass = torch.tensor([0.8], dtype=torch.float64)
    target = parse_objective("tv", alpha_on="target")
    p, q = torch.tensor([P], dtype=torch.float64), log_probs(logits_of(Q))
    alpha = sum(min(0.8 * pv, qv) for pv, qv in zip(P, Q))
    assert float(token_losses(target, p, q, mass)) == pytest.approx(1 - alpha, rel=1e-12)
    for spec in ("kl", "rkl"):  # no alpha in them: the same either way
        assert float(token_losses(parse_objective(spec, alpha_on="target"), p, q, mass)) == (
            pytest.approx(value(spec), rel=1e-12)
        )
    lam = math.exp(-3.0 * alpha)
    lk = parse_objective("lk", alpha_on="target")
    assert float(token_losses(lk, p, q, mass)) == pytest.approx(
        lam * value("kl") + (1 - lam) * (1 - alpha), rel=1e-12
    )
    at_p = logits_of(P).requires_grad_(True)
    loss = token_losses(target, p, log_probs(at_p), mass)
    assert float(loss.detach()) == pytest.approx(1 - 0.8, rel=1e-12)
    loss.sum().backward()
    assert float(at_p.grad.abs().max()) == 0.0
    with pytest.raises(ValueError, match="mass"):
        token_losses(target, p, q)


def gradient(spec, p, logits):
    logits = logits.clone().requires_grad_(True)
    token_losses(
        parse_objective(spec), torch.tensor([p], dtype=torch.float64), log_probs(logits)
    ).sum().backward()
    return logits.grad


LOGITS = torch.tensor([[0.3, -1.2, 0.8, 0.1]], dtype=torch.float64)
P4 = [0.1, 0.4, 0.2, 0.3]


@pytest.mark.parametrize("spec", ["kl", "rkl", "tv", "nla", "0.1*kl+0.9*tv"])
def test_gradients_match_finite_differences(spec):
    objective = parse_objective(spec)

    def f(x):
        return token_losses(objective, torch.tensor([P4], dtype=torch.float64), log_probs(x))

    assert torch.autograd.gradcheck(f, (LOGITS.clone().requires_grad_(True),))


def test_lk_gradient_holds_lambda_fixed():
    """LK's lambda is a stop-gradient: its gradient is lambda kl' + (1 - lambda) tv' at this alpha."""
    q = torch.softmax(LOGITS, -1)
    lam = math.exp(-3.0 * float(acceptance(torch.tensor([P4], dtype=torch.float64), q)))
    want = lam * gradient("kl", P4, LOGITS) + (1 - lam) * gradient("tv", P4, LOGITS)
    torch.testing.assert_close(gradient("lk", P4, LOGITS), want)


def test_tv_gradient_vanishes_where_the_distributions_do_not_overlap_and_lk_does_not():
    # The target puts its mass on tokens 0-1, the draft (almost) all of its on 2-3.
    p = [0.6, 0.4, 0.0, 0.0]
    logits = torch.tensor([[-30.0, -30.0, 5.0, 5.0]], dtype=torch.float64)
    tv, lk = gradient("tv", p, logits), gradient("lk", p, logits)
    assert float(tv.abs().max()) < 1e-12
    assert float(lk.abs().max()) > 0.5
    assert float(lk[0, 0]) < 0 and float(lk[0, 1]) < 0  # LK raises the target's tokens (KL's pull)


def test_rkl_is_finite_where_the_target_gives_a_token_zero_probability():
    assert math.isfinite(value("rkl", p=[1.0, 0.0, 0.0]))


def test_dpace_weights_by_hand():
    a = 0.5
    ce = torch.tensor([[0.1, 0.7, 2.0], [0.3, 0.0, 0.0]])
    keep = torch.tensor([[True, True, True], [True, False, False]])
    c = [[(1 - a) * math.exp(-v) + a for v in row] for row in ce.tolist()]
    reach = [c[0][0], c[0][0] * c[0][1], c[0][0] * c[0][1] * c[0][2]]
    want = [[sum(reach[j:]) for j in range(3)], [c[1][0], 0.0, 0.0]]
    torch.testing.assert_close(dpace_weights(ce, keep, a), torch.tensor(want))
    # A slot the draft cannot hit (ce = inf) leaves only the floor a for the ones after it.
    ce_miss = torch.tensor([[math.inf, 0.0]])
    weights = dpace_weights(ce_miss, torch.tensor([[True, True]]), a)
    torch.testing.assert_close(weights, torch.tensor([[a + a * 1.0, a * 1.0]]))
    assert not dpace_weights(ce.requires_grad_(True), keep, a).requires_grad


def test_loss_grammar_names_the_term_at_fault():
    assert loss_terms("kl") == (("kl", 1.0),) and parse_objective("kl") == KL
    assert loss_terms(" 0.1 * kl + .9*tv ") == (("kl", 0.1), ("tv", 0.9))
    assert loss_terms("1e-3*kl+tv") == (("kl", 1e-3), ("tv", 1.0))
    for bad, fault in (("kll", "'kll' is not a term"), ("kl+0.5*jsd", "'0.5\\*jsd' is not a term"),
                       ("kl+kl", "at most once"), ("0*tv", "some weight > 0")):  # fmt: skip
        with pytest.raises(ValueError, match=fault):
            loss_terms(bad)
