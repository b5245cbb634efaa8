"""DistTransport over gloo: every path a message takes (inline in its header, or apart
from it as NCCL takes device tensors), every kind of value, and a peer dying mid-message."""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers
from helpers.transport_jobs import (
    NUM_MICROBATCHES,
    PATHS,
    dies_mid_message_job,
    every_path_job,
    sent_buffers_job,
)

pytestmark = pytest.mark.distributed


def test_every_value_arrives_whole_on_every_path() -> None:
    """Dynamic shapes, uneven micro-batches, nested values (dicts, namedtuples, lists,
    non-tensor leaves), integer / bool / bf16 / complex / 0-dim / empty tensors, no-grad
    tensors beside ones that require grad, non-contiguous tensors and messages larger than
    the receive buffers, on several channels of one link and from replicated stages,
    received out of order: each equals what was sent, dtype, shape and requires_grad."""
    outcome = run_workers(every_path_job, 3, timeout=240)
    for name, groups, _ in PATHS:
        # every micro-batch of every channel is checked once, by the rank that runs it
        num_channels = 2 * (len(groups) - 1)
        assert sum(checked[name] for checked in outcome) == num_channels * NUM_MICROBATCHES, name


@pytest.mark.parametrize("receive_thread", [False, True])
def test_a_peer_that_dies_mid_message_is_named_within_a_bound(receive_thread: bool) -> None:
    outcome = run_workers(dies_mid_message_job, 2, receive_thread, timeout=120, expect_errors=True)
    status, value = outcome[0]
    assert status == "ok" and value is not None, value
    message, seconds = value
    assert message.startswith("PeerFailure") and "rank 1" in message, message
    assert seconds < 30, f"the receiver took {seconds:.0f} s to notice"
    assert outcome[1][0] == "missing"  # killed


def test_a_sent_tensor_is_freed_once_its_peer_has_taken_it() -> None:
    """Not at the end of the step: over a step of M micro-batches, holding every sent
    message until then grew each stage's memory by M messages."""
    alive = run_workers(sent_buffers_job, 2, timeout=120)[0]
    assert alive == [False, False, True, True], alive
