"""A profile scaled to one micro-batch: what each layer costs when a step's batch is cut.

A profile holds each layer's times and activation bytes for its ``batch_size`` samples
``B`` (:mod:`pipetrain.plan.profile`). A step of ``N`` micro-batches runs every layer
``N`` times on ``b = B / N`` samples. :func:`microbatch_profile` gives the profile of one
such micro-batch:

- times: where the profile also measured the layer at its ``microbatch_size`` ``m``
  (``microbatch_forward_s`` ...), on the line through the two measurements
  ``t(b) = t(m) + (t(B) - t(m)) (b - m) / (B - m)`` (a fixed cost per call plus a cost
  per sample; small batches use a device less well than a proportional share suggests),
  and below ``m`` at least the share ``t(m) b / m``; else the proportional share
  ``t(B) b / B``;
- output and saved activation bytes: the proportional share;
- parameters, gradients, optimizer state and the optimizer step: unchanged (once per
  step, whatever the batch).

:func:`microbatch_counts` lists the micro-batch counts a planner tries.

Example:
    >>> from pipetrain.plan.profile import LayerProfile, Profile
    >>> layer = LayerProfile(name="0", forward_s=0.010, backward_s=0.020, output_bytes=800,
    ...                      microbatch_forward_s=0.004, microbatch_backward_s=0.005)
    >>> profile = Profile(layers=(layer,), batch_size=8, microbatch_size=2)
    >>> one = microbatch_profile(profile, 4).layers[0]  # 2 samples: as measured
    >>> one.forward_s, one.backward_s, one.output_bytes
    (0.004, 0.005, 200)
    >>> round(microbatch_profile(profile, 2).layers[0].forward_s, 6)  # 4 samples: on the line
    0.006
"""

from __future__ import annotations

import dataclasses

from pipetrain.plan.profile import LayerProfile, Profile

__all__ = ["MAX_MICROBATCHES", "microbatch_counts", "microbatch_profile"]

MAX_MICROBATCHES = 64
"""The most micro-batches per step a planner tries unless told."""

_UNKNOWN_BATCH_COUNTS = (1, 2, 4, 8, 16, 32)
"""Counts tried for PipeDream's profiles, which do not record their minibatch size."""


def microbatch_counts(profile: Profile, *, limit: int = MAX_MICROBATCHES) -> tuple[int, ...]:
    """The micro-batch counts worth trying: the divisors of the profile's batch size up to
    ``limit`` (micro-batches of whole, equal sizes); for a PipeDream profile (whose
    minibatch size is not recorded, read as 1) powers of two up to 32, the minibatch
    split evenly.

    Example:
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> one = (LayerProfile(name="0", forward_s=1.0, backward_s=1.0),)
        >>> microbatch_counts(Profile(layers=one, batch_size=12))
        (1, 2, 3, 4, 6, 12)
    """
    size = profile.batch_size
    if size <= 1 and profile.source.startswith("pipedream"):
        return tuple(n for n in _UNKNOWN_BATCH_COUNTS if n <= limit)
    return tuple(n for n in range(1, min(size, limit) + 1) if size % n == 0)


def _scaled(whole: float, measured: float | None, *, b: float, m: int | None, size: int) -> float:
    """A time at ``b`` samples from the time at ``size`` and the one measured at ``m``.

    Below ``m`` the line is extrapolated, and it can fall far below what the layer costs
    (to 0 when the full batch ran much less efficiently per sample): there the time is at
    least the proportional share of the time at ``m`` (fewer samples never run more
    efficiently per sample than those measured).
    """
    if measured is None or m is None or m == size:
        return whole * b / size
    line = measured + (whole - measured) * (b - m) / (size - m)
    if b < m:
        return max(line, measured * b / m)
    return max(0.0, line)


def microbatch_profile(profile: Profile, num_microbatches: int) -> Profile:
    """The profile of one of ``num_microbatches`` equal micro-batches of the profile's
    batch (see the module docstring); its ``metadata["microbatch_size"]`` is ``B / N``.

    Raises:
        ValueError: ``num_microbatches`` is not a whole number >= 1.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
            or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number >= 1")
    size = profile.batch_size
    b = size / num_microbatches
    m = profile.microbatch_size

    def scale(whole: float | None, measured: float | None) -> float | None:
        return None if whole is None else _scaled(whole, measured, b=b, m=m, size=size)

    def layer_at(layer: LayerProfile) -> LayerProfile:
        share = b / size
        forward = scale(layer.forward_s, layer.microbatch_forward_s)
        backward = scale(layer.backward_s, layer.microbatch_backward_s)
        assert forward is not None and backward is not None
        return dataclasses.replace(
            layer,
            forward_s=forward,
            backward_s=backward,
            backward_input_s=scale(layer.backward_input_s, layer.microbatch_backward_input_s),
            backward_weight_s=scale(layer.backward_weight_s, layer.microbatch_backward_weight_s),
            output_bytes=round(layer.output_bytes * share),
            saved_bytes=round(layer.saved_bytes * share),
            backward_workspace_bytes=_bytes_at(layer.backward_workspace_bytes, share),
            backward_input_workspace_bytes=_bytes_at(layer.backward_input_workspace_bytes, share),
            microbatch_forward_s=None,
            microbatch_backward_s=None,
            microbatch_backward_input_s=None,
            microbatch_backward_weight_s=None,
        )

    return dataclasses.replace(
        profile,
        layers=tuple(layer_at(layer) for layer in profile.layers),
        batch_size=max(1, size // num_microbatches),
        microbatch_size=None,
        metadata={**profile.metadata, "microbatch_size": b, "num_microbatches": num_microbatches},
    )


def _bytes_at(whole: int | None, share: float) -> int | None:
    """Bytes that grow with the batch, at ``share`` of it (None stays None)."""
    return None if whole is None else round(whole * share)
