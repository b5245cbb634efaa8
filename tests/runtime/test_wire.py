"""The wire format: which tensors ride in the header and which travel apart, and back."""

from __future__ import annotations

import gc

import pytest
import torch

from pipetrain.runtime.wire import (
    DEVICE,
    HOST,
    INLINE,
    KIND_DATA,
    KIND_LARGE,
    decode,
    encode,
    encode_notice,
)


def _round_trip(value: object, **options: object) -> tuple[object, list[int]]:
    encoded = encode(value, tag=3, microbatch=5, **options)  # type: ignore[arg-type]
    header = decode(encoded.header)
    assert (header.kind, header.tag, header.microbatch) == (KIND_DATA, 3, 5)
    assert [a.route for a in header.apart] == [route for route, _ in encoded.apart]
    # what the receiver allocates is what the sender sends
    assert [a.nbytes for a in header.apart] == [t.numel() for _, t in encoded.apart]
    return header.value([t.clone() for _, t in encoded.apart]), [a.route for a in header.apart]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def test_host_tensors_ride_inline_until_the_limit_then_travel_apart() -> None:
    small, large = torch.randn(4, 4), torch.randn(64, 64)  # 64 and 16384 bytes
    value, routes = _round_trip((small, large), inline_limit=1000)
    assert routes == [DEVICE]  # on a gloo job the data group takes host tensors
    assert torch.equal(value[0], small) and torch.equal(value[1], large)
    value, routes = _round_trip((small, large), inline_limit=1000, device_type="cuda")
    assert routes == [HOST]  # under NCCL, host tensors too large to ride inline go on gloo
    assert torch.equal(value[1], large)
    _, routes = _round_trip((small, large), inline_limit=1 << 20)
    assert routes == []
    encoded = encode(small, tag=0, microbatch=0, inline_limit=0)
    assert decode(encoded.header).apart[0].route == DEVICE and INLINE not in routes


def test_every_dtype_shape_and_grad_flag_survives_both_routes() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    value = {
        "x": x, "t": x.t(), "ids": torch.arange(6).view(2, 3), "mask": torch.tensor([True, False]),
        "bf16": torch.randn(2, 2).to(torch.bfloat16), "c": torch.complex(torch.ones(2), torch.zeros(2)),
        "scalar": torch.tensor(1.5, dtype=torch.float64), "empty": torch.empty(0, 7), "n": None,
        "fp8": torch.randn(4).to(torch.float8_e4m3fn), "text": "kept",
    }
    for limit in (0, 1 << 20):
        got, _ = _round_trip(value, inline_limit=limit)
        assert isinstance(got, dict) and list(got) == list(value)
        for key, want in value.items():
            if isinstance(want, torch.Tensor):
                assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
                assert torch.equal(_bytes(got[key]), _bytes(want)), key
                assert got[key].requires_grad == want.requires_grad and got[key].is_leaf, key
            else:
                assert got[key] == want


def test_notices_and_corrupt_headers() -> None:
    notice = encode_notice(tag=1, microbatch=2, total=12345)
    assert (decode(notice).kind, decode(notice).total) == (KIND_LARGE, 12345)
    header = encode(torch.ones(2), tag=0, microbatch=0).header
    header[0] ^= 0xFF
    with pytest.raises(RuntimeError, match="corrupt pipeline message"):
        decode(header)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_travel_apart_from_device_memory() -> None:
    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    encoded = encode((x, torch.arange(3)), tag=0, microbatch=0, device_type="cuda")
    assert [route for route, _ in encoded.apart] == [DEVICE]
    assert encoded.apart[0][1].is_cuda  # no host staging
    got = decode(encoded.header).value([encoded.apart[0][1].clone()])
    assert got[0].is_cuda and torch.equal(got[0], x.detach()) and got[0].requires_grad
    assert torch.equal(got[1], torch.arange(3))  # the host tensor rode inline


def test_an_empty_device_tensor_is_announced_but_carries_no_bytes() -> None:
    empty = torch.empty(0, 4, device="meta")  # stands for a device tensor: never inline
    encoded = encode((empty, torch.ones(2)), tag=0, microbatch=0, device_type="meta")
    assert [(route, t.numel()) for route, t in encoded.apart] == [(DEVICE, 0)]
    header = decode(encoded.header)
    assert (header.apart[0].nbytes, header.apart[0].shape) == (0, (0, 4))
    got = header.value([torch.empty(0, dtype=torch.uint8)])
    assert got[0].shape == (0, 4) and torch.equal(got[1], torch.ones(2))


def test_a_small_header_in_a_large_buffer_gives_copies_a_full_one_views() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    value = (x * 2, torch.arange(6).view(2, 3), None, torch.tensor(True), torch.randn(2).to(torch.bfloat16))
    header = encode(value, tag=0, microbatch=0).header
    received = torch.zeros(header.numel() * 8, dtype=torch.uint8)  # a pre-posted buffer
    received[: header.numel()] = header
    start, stop = received.data_ptr(), received.data_ptr() + received.numel()
    for capacity, shares in ((received.numel(), False), (None, True)):
        got = decode(received, capacity=capacity).value()
        assert isinstance(got, tuple) and got[2] is None
        for have, want in zip(got, value):
            if want is None:
                continue
            assert have.dtype == want.dtype and have.shape == want.shape
            assert torch.equal(have, want.detach()) and have.requires_grad == want.requires_grad
            assert (start <= have.data_ptr() < stop) == shares
    views = decode(received).value()
    del received, header
    gc.collect()  # the views keep the buffer they read from
    assert torch.equal(views[0], value[0].detach()) and torch.equal(views[4], value[4])
