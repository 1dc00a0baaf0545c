"""ipc.pack / unpack: messages to the core with their arrays (a request's pixels) as frames of their own."""

from __future__ import annotations

import pickle

import numpy as np
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lmserver.edge.ipc import AbortReq, pack, unpack
from lmserver.io_struct import GenerateReq, MultimodalItem, SamplingParams

_ARRAYS = hnp.arrays(dtype=st.sampled_from([np.uint8, np.float32, np.int64]),
                     shape=hnp.array_shapes(min_dims=1, max_dims=4, max_side=9))


def _request(arrays: list[np.ndarray]) -> GenerateReq:
    items = [MultimodalItem("image", i, 2 * i, 1, a, (3, 4)) for i, a in enumerate(arrays)]
    return GenerateReq("r", [1, 2, 3], SamplingParams(max_new_tokens=2), mm_items=items)


@settings(max_examples=40, deadline=None)
@given(st.lists(_ARRAYS, max_size=3))
def test_pack_round_trips_arrays_out_of_band(arrays: list[np.ndarray]) -> None:
    req = _request(arrays)
    frames = pack(req)
    assert len(frames) == 1 + len(arrays)  # one frame per array, none copied into the pickle
    back = unpack([bytes(f) for f in frames])
    assert back.rid == req.rid and back.input_ids == req.input_ids
    assert back.sampling_params == req.sampling_params
    for got, want in zip(back.mm_items, req.mm_items, strict=True):
        assert got.pixel_values.dtype == want.pixel_values.dtype
        np.testing.assert_array_equal(got.pixel_values, want.pixel_values)
        assert (got.offset, got.content_hash, got.image_size) == (want.offset, want.content_hash, want.image_size)


def test_message_without_arrays_is_one_plain_pickle() -> None:
    frames = pack(AbortReq("x"))
    assert len(frames) == 1
    assert pickle.loads(frames[0]) == AbortReq("x")  # what recv_pyobj of an older peer reads


def test_through_zmq_without_copies_and_mixed_with_send_pyobj() -> None:
    ctx = zmq.Context()
    try:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind("inproc://frames")
        pull.connect("inproc://frames")
        pixels = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
        frames = pack(_request([pixels]))
        assert len(frames) == 2 and len(frames[0]) < 4096  # the pixels travel beside the pickle
        push.send_multipart(frames, copy=False)
        push.send_pyobj(AbortReq("y"))  # the front end's other messages stay plain pickles, in order
        got = unpack(pull.recv_multipart(copy=False))
        np.testing.assert_array_equal(got.mm_items[0].pixel_values, pixels)
        assert unpack(pull.recv_multipart(copy=False)) == AbortReq("y")
    finally:
        ctx.destroy(linger=0)  # closes both sockets (also after a failed assertion)
