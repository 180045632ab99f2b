"""`train.compile`: the head's decoder layers under torch.compile (Inductor's C++ on this CPU) train as the
eager ones do - the loss and every gradient - over batches of several lengths without a graph per length."""

import pytest
import torch

from tests.helpers import head_and_loss
from train.model import compile_layers


def loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    total, _ = loss_fn()
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "kind",
    [
        "eagle3",
        pytest.param("peagle", marks=pytest.mark.slow),
        pytest.param("dflash", marks=pytest.mark.slow),
    ],
)
def test_compiled_layers_train_as_the_eager_ones(kind):
    torch._dynamo.reset()
    eager = {seq_len: loss_and_grads(*head_and_loss(kind, seq_len)) for seq_len in (12, 17)}
    model, loss_fn = head_and_loss(kind, 12)
    compile_layers(model)
    compiled = {12: loss_and_grads(model, loss_fn)}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled[17] = loss_and_grads(model, head_and_loss(kind, 17, model=model)[1])
    # dynamic shapes: a batch of another length compiles nothing new
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs > 0
    for seq_len, (total, grads) in eager.items():
        torch.testing.assert_close(compiled[seq_len][0], total, rtol=1e-5, atol=1e-6)
        assert compiled[seq_len][1].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(
                compiled[seq_len][1][name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name
            )
