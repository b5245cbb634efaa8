"""GPipe's random streams (:mod:`pipetrain.api.random_streams`) share the Pipeline's
per-layer keys: the masks depend on the layer and the micro-batch, not on the balance."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import pipetrain
from pipetrain.api.random_streams import KEY_STRIDE, SessionRng
from pipetrain.runtime.stage import StageCompute


class FunctionalDropout(nn.Module):
    """``F.dropout`` in a custom layer: no dropout module, no ``dropout`` attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(self.proj(x)), 0.4, training=self.training)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), FunctionalDropout(), nn.Linear(8, 8), FunctionalDropout(),
                         nn.Dropout(0.3), nn.Linear(8, 8), FunctionalDropout())


def run(balance: list[int], checkpoint: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gpipe = pipetrain.GPipe(model(), balance, chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    outputs = []
    for call in range(3):  # the first calls watch the partitions, the later ones run freely
        torch.manual_seed(call)
        gpipe.zero_grad()
        out = gpipe(x)
        out.pow(2).sum().backward()
        outputs.append(out.detach())
    return torch.cat(outputs), [p.grad.clone() for p in gpipe.parameters()]


def test_the_masks_do_not_depend_on_the_balance_or_the_checkpoint_mode() -> None:
    out, grads = run([7], "never")
    assert (out == 0).any()  # something was dropped
    for balance in ([3, 4], [1, 2, 1, 3], [1] * 7):
        for checkpoint in ("always", "except_last"):
            other_out, other_grads = run(balance, checkpoint)
            assert torch.equal(other_out, out), (balance, checkpoint)
            for a, b in zip(other_grads, grads):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_draw_in_a_partitions_first_layer_is_noticed_although_the_next_is_reseeded() -> None:
    """The watch compares the generators after each layer, not only at the end: a
    later layer's seeding would hide the draw."""
    partitions = [nn.Sequential(FunctionalDropout(), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))]
    rng = SessionRng(partitions)
    assert rng.random == set()  # no known random layer type
    stages = [StageCompute(p, stage_index=j, device=torch.device("cpu"), rng=rng, first_layer=2 * j)
              for j, p in enumerate(partitions)]
    for call in range(2):
        offset = call * KEY_STRIDE
        rng.open(offset)
        value = torch.randn(4, 8)
        for stage in stages:
            value, _ = stage.forward(offset, value, checkpointed=False)
        rng.close(offset)
    assert rng.random == {0} and rng.quiet == {1}
