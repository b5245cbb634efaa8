"""The optimizers ``pipetrain train`` offers by name, built from torch's own.

``pipetrain train --optimizer NAME`` (and a run's config) picks one of :data:`OPTIMIZERS`;
:func:`make_optimizer` builds it over a stage's parameters with the run's hyper-parameters.
The Python API takes any optimizer factory instead (``Pipeline(..., optimizer=...)``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["OPTIMIZERS", "default_weight_decay", "make_optimizer"]

OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")
"""``adamw``: :class:`torch.optim.AdamW` (decoupled weight decay; the default), ``adam``:
:class:`torch.optim.Adam` (weight decay added to the gradient), ``sgd``:
:class:`torch.optim.SGD` with momentum, ``adafactor``: :class:`torch.optim.Adafactor`
(factored second moments: about one parameter's size of state less than Adam's two)."""


def default_weight_decay(name: str) -> float:
    """The weight decay an optimizer gets unless told: 0.1 for ``adamw`` (GPT training's
    usual value), 0 for the others (Adam's and SGD's decay is an L2 term on the gradient).

    Example:
        >>> default_weight_decay("adamw"), default_weight_decay("sgd")
        (0.1, 0.0)
    """
    return 0.1 if name == "adamw" else 0.0


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float,
                   weight_decay: float | None = None, betas: tuple[float, float] = (0.9, 0.95),
                   momentum: float = 0.9) -> torch.optim.Optimizer:
    """Optimizer ``name`` over ``params``. ``betas`` apply to ``adamw`` and ``adam``
    (Adafactor's second-moment decay is its own), ``momentum`` to ``sgd``;
    ``weight_decay=None`` takes :func:`default_weight_decay`.

    Raises:
        ValueError: an unknown ``name``.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = make_optimizer("sgd", [w], lr=0.1, momentum=0.5)
        >>> type(opt).__name__, opt.defaults["momentum"], opt.defaults["weight_decay"]
        ('SGD', 0.5, 0.0)
    """
    decay = default_weight_decay(name) if weight_decay is None else weight_decay
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=decay)
    raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}; fix: "
                     "--optimizer adamw (or pass your own optimizer factory in Python)")
