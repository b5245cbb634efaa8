"""Worker functions for the transport tests: messages of every shape through DistTransport.

Both ends make the value of a (channel, micro-batch) with :func:`message_value`, so the
receiver checks what arrived against what was sent without sending it twice.
"""

from __future__ import annotations

import os
import signal
import time
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from pipetrain.runtime.distributed import DistTransport
from pipetrain.runtime.errors import PipelineError
from pipetrain.runtime.links import TAG_DATA, TAG_HEADER, link_groups
from pipetrain.runtime.transport import ACTIVATION, GRADIENT, Channel, Placement
from pipetrain.runtime.wire import encode

Pair = namedtuple("Pair", ["left", "right"])

# (name, placement, transport options): every path a message can take
PATHS: tuple[tuple[str, tuple[tuple[int, ...], ...], dict[str, Any]], ...] = (
    ("inline, main thread", ((0,), (1,), (0,)), {}),
    ("inline, receive threads", ((0,), (1,), (0,)), {"receive_thread": True}),
    ("apart (the NCCL path), link groups, receive threads", ((0,), (1,), (0,)),
     {"inline_limit": 0, "receive_thread": True, "link_groups": True}),
    ("apart, main thread", ((0,), (1,), (0,)), {"inline_limit": 0}),
    ("small capacity: large headers and apart data", ((0,), (1,), (0,)),
     {"capacity": 4096, "receive_thread": True}),
    ("replicated stage, apart, link groups", ((0,), (1, 2)),
     {"inline_limit": 0, "receive_thread": True, "link_groups": True}),
    ("replicated stage, inline, main thread", ((0,), (1, 2)), {}),
)
NUM_MICROBATCHES = 5


def channels_of(placement: Placement, rank: int) -> tuple[list[Channel], list[Channel]]:
    """``(inbound, outbound)`` channels of ``rank`` under ``placement``."""
    inbound: list[Channel] = []
    outbound: list[Channel] = []
    last = placement.num_stages - 1
    for j in range(placement.num_stages):
        if rank not in placement.ranks(j):
            continue
        if j > 0 and placement.ranks(j - 1) != (rank,):
            inbound.append(Channel(ACTIVATION, j - 1, j))
            outbound.append(Channel(GRADIENT, j, j - 1))
        if j < last and placement.ranks(j + 1) != (rank,):
            outbound.append(Channel(ACTIVATION, j, j + 1))
            inbound.append(Channel(GRADIENT, j + 1, j))
    return inbound, outbound


def message_value(channel: Channel, microbatch: int) -> Any:
    """A value whose shapes, dtypes, nesting and sizes depend on the channel and micro-batch."""
    g = torch.Generator().manual_seed(1000 * channel.tag + microbatch)
    rows = 1 + microbatch % 3  # uneven micro-batches: 1, 2, 3, 1, 2 rows
    width = 3 + channel.tag + microbatch  # a dynamic shape
    x = torch.randn(rows, width, generator=g).requires_grad_(True)
    kind = microbatch % 5
    if kind == 0:  # a plain activation / gradient
        return x
    if kind == 1:  # a flat tuple with None and a no-grad integer tensor
        return (x, None, torch.randint(0, 9, (rows,), generator=g))
    if kind == 2:  # nested: dict of namedtuple and list, integer / bool / 0-dim / empty tensors
        return {"pair": Pair(x.t(), torch.arange(rows * 2, dtype=torch.int8).view(rows, 2)),
                "mask": torch.rand(rows, width, generator=g) > 0.5, "step": 7, "name": "mb",
                "list": [torch.tensor(2.5, dtype=torch.float64), torch.empty(0, 4), None],
                "half": torch.randn(rows, 2, generator=g).to(torch.bfloat16)}
    if kind == 3:  # large: well above any small capacity, and a large pickled header
        big = torch.randn(300, 257, generator=g)
        return {"big": big, "keys": {f"key-{n}": n for n in range(400)},
                "ids": torch.randint(0, 2**40, (2000,), generator=g)}
    return [x.detach(), torch.complex(x.detach(), x.detach())]


def _same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} instead of a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype} {tuple(got.shape)} instead of {want.dtype} {tuple(want.shape)}")
        assert got.requires_grad == want.requires_grad and got.is_leaf, f"{where}: grad flags"
        assert torch.equal(got.detach(), want.detach()), f"{where}: values differ"
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} instead of {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)}"
        for key in want:
            _same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{where}: {len(got)} items instead of {len(want)}"
        for n, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{n}]")
    else:
        assert got == want, f"{where}: {got!r} instead of {want!r}"


def _exchange(ctx: Any, groups: Sequence[tuple[int, ...]], options: dict[str, Any]) -> int:
    """Every rank sends its channels' messages and checks what it receives; receives are
    asked for in reverse micro-batch order (the mailbox keeps the early ones)."""
    placement = Placement(groups)
    options = dict(options)
    data_groups = link_groups(placement, rank=ctx.rank) if options.pop("link_groups", False) else {}
    inbound, outbound = channels_of(placement, ctx.rank)
    transport = DistTransport(placement=placement, inbound=inbound, outbound=outbound, timeout=60,
                              data_groups=data_groups, **options)
    checked = 0
    try:
        for channel in inbound:
            mine = [i for i in range(NUM_MICROBATCHES)
                    if placement.rank(channel.dst_stage, i) == ctx.rank]
            transport.expect(channel, mine)
        for channel in outbound:
            for i in range(NUM_MICROBATCHES):
                if placement.rank(channel.src_stage, i) == ctx.rank:
                    transport.send(channel, i, message_value(channel, i))
        for channel in inbound:
            for i in reversed(range(NUM_MICROBATCHES)):
                if placement.rank(channel.dst_stage, i) == ctx.rank:
                    _same(transport.recv(channel, i), message_value(channel, i), f"{channel} mb {i}")
                    checked += 1
        transport.flush()
    finally:
        transport.close()
    dist.barrier()
    return checked


def every_path_job(ctx: Any) -> dict[str, int]:
    """Run every path of :data:`PATHS`; the messages each rank checked, by path."""
    return {name: _exchange(ctx, groups, options) for name, groups, options in PATHS}


def dies_mid_message_job(ctx: Any, receive_thread: bool) -> tuple[str, float] | None:
    """Rank 1 (stage 0) sends rank 0 (stage 1) the header and the first of two apart
    tensors of a message, then is killed; rank 0 reports the error it got and how long
    it took."""
    placement = Placement.single([1, 0])
    channel = Channel(ACTIVATION, 0, 1)
    if ctx.rank == 1:
        encoded = encode((torch.ones(64, 64), torch.zeros(1000, 100)), tag=channel.tag,
                         microbatch=0, inline_limit=0)
        dist.barrier()  # rank 0 posted its receive
        dist.isend(encoded.header, dst=0, tag=TAG_HEADER).wait()
        dist.isend(encoded.apart[0][1], dst=0, tag=TAG_DATA).wait()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    transport = DistTransport(placement=placement, inbound=[channel], outbound=[], timeout=120,
                              inline_limit=0, receive_thread=receive_thread)
    transport.expect(channel, [0])
    dist.barrier()
    started = time.monotonic()
    try:
        transport.recv(channel, 0)
    except PipelineError as error:
        return f"{type(error).__name__}: {error}", time.monotonic() - started
    finally:
        transport.close()
    return None


def sent_buffers_job(ctx: Any) -> list[bool] | None:
    """Rank 0 (stage 0) sends four activations apart from their headers; rank 1 takes the
    first two and answers micro-batch 1's gradient. Rank 0 reports, after that answer and
    before the end of the step (``flush``), which of its sent tensors are still alive."""
    placement = Placement.single([0, 1])
    forward, backward = Channel(ACTIVATION, 0, 1), Channel(GRADIENT, 1, 0)
    inbound, outbound = ([backward], [forward]) if ctx.rank == 0 else ([forward], [backward])
    transport = DistTransport(placement=placement, inbound=inbound, outbound=outbound, timeout=60,
                              inline_limit=0, receive_thread=False)
    alive: list[bool] | None = None
    try:
        if ctx.rank == 0:
            transport.expect(backward, [1])
            refs = []
            for i in range(4):
                sent = torch.full((256, 256), float(i))
                refs.append(StorageWeakRef(sent.untyped_storage()))  # the memory, not the object
                transport.send(forward, i, sent)
                del sent
            transport.recv(backward, 1)
            deadline = time.monotonic() + 10
            while not all(r.expired() for r in refs[:2]) and time.monotonic() < deadline:
                time.sleep(0.05)
            alive = [not r.expired() for r in refs]
        else:
            transport.expect(forward, range(4))
            for i in range(2):
                assert float(transport.recv(forward, i)[0, 0]) == i
            transport.send(backward, 1, torch.ones(3))
            dist.barrier()
            for i in range(2, 4):
                assert float(transport.recv(forward, i)[0, 0]) == i
        if ctx.rank == 0:
            dist.barrier()
        transport.flush()
    finally:
        transport.close()
    return alive


CUDA_PATHS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("default (receive threads, host tensors inline)", {}),
    ("host tensors apart too", {"inline_limit": 0}),
    ("small capacity: large headers", {"capacity": 4096}),
)


def _on_device(value: Any, device: torch.device) -> Any:
    """Floating tensors on ``device`` (sent from device memory), the others left on the host."""
    from pipetrain.nested import map_tensors

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device).requires_grad_(t.requires_grad) if t.is_floating_point() else t

    return map_tensors(move, value)


def _same_on_devices(got: Any, want: Any, device: torch.device, where: str) -> None:
    from pipetrain.nested import flatten

    got_leaves, got_structure = flatten(got)
    want_leaves, want_structure = flatten(want)
    assert got_structure == want_structure, where
    for n, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"{where} leaf {n}"
            expected_device = device if w.is_cuda else torch.device("cpu")
            assert g.device == expected_device, f"{where} leaf {n}: on {g.device}, not {expected_device}"
            assert g.is_leaf and g.requires_grad == w.requires_grad, f"{where} leaf {n}: grad flags"
            assert g.dtype == w.dtype and g.shape == w.shape, f"{where} leaf {n}: {g.dtype} {g.shape}"
            assert torch.equal(g.detach().cpu(), w.detach().cpu()), f"{where} leaf {n}: values differ"
        else:
            assert g == w, f"{where} leaf {n}"


def cuda_paths_job(ctx: Any) -> dict[str, int]:
    """Two ranks on two GPUs (NCCL): device tensors through per-link NCCL groups, host
    tensors inline or on the gloo header group; each message checked on arrival."""
    placement = Placement([(0,), (1,), (0,)])
    header_group = dist.new_group(backend="gloo")
    data_groups = link_groups(placement, rank=ctx.rank)
    inbound, outbound = channels_of(placement, ctx.rank)
    checked: dict[str, int] = {}
    for name, options in CUDA_PATHS:
        transport = DistTransport(placement=placement, inbound=inbound, outbound=outbound, timeout=60,
                                  group=header_group, data_groups=data_groups, device=ctx.device,
                                  **options)
        count = 0
        for channel in inbound:
            transport.expect(channel, list(range(NUM_MICROBATCHES)))
        for channel in outbound:
            for i in range(NUM_MICROBATCHES):
                transport.send(channel, i, _on_device(message_value(channel, i), ctx.device))
        for channel in inbound:
            for i in reversed(range(NUM_MICROBATCHES)):
                got = transport.recv(channel, i)
                # the compute stream must see the data: reduce it there, then compare
                torch.cuda.current_stream(ctx.device).synchronize()
                _same_on_devices(got, _on_device(message_value(channel, i), ctx.device), ctx.device,
                                 f"{name}: {channel} mb {i}")
                count += 1
        transport.flush()
        transport.close()
        checked[name] = count
    dist.barrier(group=header_group)
    return checked
