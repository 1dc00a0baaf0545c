"""Torch-light units of the engine's image path: the encoder LRU against a naive model, the
radix key of a prompt with images, the spans chunked prefill hands the runner, and the host
staging buffer images go to the device through."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.io_struct import MultimodalItem, SamplingParams, mm_pad_value
from lmserver.runner.encoder_cache import EncoderCache
from lmserver.scheduler import Req

IMAGE = 7


def _item(content_hash: int, offset: int = 0, num_tokens: int = 3) -> MultimodalItem:
    return MultimodalItem("image", content_hash, offset, num_tokens, np.zeros(1, np.float32))


def _encoder(calls: list[list[int]]):  # type: ignore[no-untyped-def]
    def encode(items: Sequence[MultimodalItem]) -> list[torch.Tensor]:
        calls.append([it.content_hash for it in items])
        return [torch.full((it.num_tokens, 2), float(it.content_hash)) for it in items]

    return encode


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 5)), min_size=1, max_size=40), st.integers(0, 12))
@settings(max_examples=80, deadline=None)
def test_encoder_cache_is_an_lru_by_rows(draws: list[tuple[int, int]], capacity: int) -> None:
    cache = EncoderCache(capacity)
    calls: list[list[int]] = []
    model: list[tuple[int, int]] = []  # naive LRU: (hash, rows), most recent last
    sizes: dict[int, int] = {}
    for h, n in draws:
        n = sizes.setdefault(h, n)  # one hash, one size
        hit = any(k == h for k, _ in model)
        before = len(calls)
        rows = cache.get_many([_item(h, num_tokens=n)], _encoder(calls))[0]
        assert torch.equal(rows, torch.full((n, 2), float(h)))
        assert calls[before:] == ([] if hit else [[h]])
        if hit:
            model = [e for e in model if e[0] != h] + [(h, n)]
        elif n <= capacity:
            while sum(r for _, r in model) + n > capacity:
                model.pop(0)
            model.append((h, n))
        assert [k for k, _ in model] == list(cache._entries)
        assert cache.rows == sum(r for _, r in model) <= capacity
    assert cache.hits + cache.misses == len(draws)


def test_one_forward_encodes_each_missing_hash_once() -> None:
    cache = EncoderCache(100)
    calls: list[list[int]] = []
    cache.get_many([_item(1)], _encoder(calls))
    out = cache.get_many([_item(2), _item(1), _item(2), _item(3)], _encoder(calls))
    assert calls == [[1], [2, 3]]
    assert [int(t[0, 0]) for t in out] == [2, 1, 2, 3]


def _req(ids: list[int], items: Sequence[MultimodalItem]) -> Req:
    return Req("r", ids, SamplingParams(), 4, arrival=0, mm_items=tuple(items))


def test_radix_key_carries_the_image_hash() -> None:
    ids = [1, 2, IMAGE, IMAGE, IMAGE, 5, IMAGE, IMAGE, 9]
    a = _req(ids, [_item(11, 2, 3), _item(22, 6, 2)])
    b = _req(ids, [_item(11, 2, 3), _item(33, 6, 2)])
    key_a, key_b = a.fill_key(), b.fill_key()
    assert key_a.tolist() == [1, 2, *[mm_pad_value(11)] * 3, 5, *[mm_pad_value(22)] * 2, 9]
    # the same first image: a shared prefix up to the second image, where the keys part
    assert key_a[:6].tolist() == key_b[:6].tolist() and key_a[6] != key_b[6]
    assert all(v < 0 for v in key_a[2:5]) and a.input_ids == ids  # the model still reads token ids
    assert a.fill_key_range(1, 4).tolist() == key_a[1:4].tolist()
    a.output_ids.append(4)
    assert a.fill_key().tolist() == [*key_a.tolist(), 4]


@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 3), st.integers(1, 9), st.data())
@settings(max_examples=80, deadline=None)
def test_chunk_spans_tile_every_item(sizes: list[int], gap: int, chunk: int, data: st.DataObject) -> None:
    ids: list[int] = []
    items = []
    for i, n in enumerate(sizes):
        ids.extend([3] * gap)
        items.append(_item(100 + i, len(ids), n))
        ids.extend([IMAGE] * n)
    ids.append(4)
    req = _req(ids, items)
    start = data.draw(st.integers(0, len(ids) - 1))  # a radix hit may end inside an image
    covered: dict[int, list[int]] = {i: [] for i in range(len(items))}
    pos = start
    while pos < len(ids):
        end = min(pos + chunk, len(ids))
        for span in req.mm_spans(pos, end):
            item = items[span.item_index]
            assert pos + span.token_offset == item.offset + span.item_start  # rows land on their tokens
            assert all(ids[pos + span.token_offset + k] == IMAGE for k in range(span.length))
            covered[span.item_index].extend(range(span.item_start, span.item_start + span.length))
        pos = end
    for i, item in enumerate(items):
        assert covered[i] == list(range(max(0, start - item.offset), item.num_tokens))


_DTYPES = [np.uint8, np.float32, np.int64, np.float16]


@given(st.lists(st.lists(st.tuples(st.sampled_from(range(len(_DTYPES))),
                                   st.lists(st.integers(0, 5), min_size=0, max_size=3)), min_size=0, max_size=5),
                min_size=1, max_size=6),
       st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_host_staging_uploads_equal_their_arrays(calls: list[list[tuple[int, list[int]]]], seed: int) -> None:
    """Oracle: the arrays themselves. Every upload's tensors keep their values after later uploads
    (the buffer is reused and grows), with shapes and dtypes preserved; arrays of odd byte sizes and
    non-contiguous ones included."""
    from lmserver.engine.multimodal import HostStaging

    staging = HostStaging(torch.device("cpu"))
    rng = np.random.default_rng(seed)
    kept: list[tuple[np.ndarray, torch.Tensor]] = []
    for call in calls:
        arrays = []
        for dtype_index, shape in call:
            a = (rng.random(shape) * 250).astype(_DTYPES[dtype_index])
            if a.ndim >= 2 and a.shape[0] > 1:
                a = a[::2]  # not contiguous
            arrays.append(a)
        got = staging.upload(arrays)
        assert len(got) == len(arrays)
        kept.extend(zip(arrays, got, strict=True))
        for a, t in kept:  # earlier uploads untouched by this one
            assert t.dtype == torch.from_numpy(np.empty(0, a.dtype)).dtype and tuple(t.shape) == a.shape
            np.testing.assert_array_equal(t.numpy(), a)
    assert staging.allocations <= len(calls)


def test_host_staging_reuses_its_buffer() -> None:
    from lmserver.engine.multimodal import HostStaging

    staging = HostStaging(torch.device("cpu"))
    image = np.arange(480 * 640 * 3, dtype=np.uint32).astype(np.uint8).reshape(480, 640, 3)
    for _ in range(5):
        (out,) = staging.upload([image])
        assert torch.equal(out, torch.from_numpy(image))
    assert staging.allocations == 1 and staging.uploads == 5
    assert staging.capacity_bytes == 1 << 20  # 921,600 bytes, rounded up to a power of two
    staging.upload([image, image])  # grows once
    assert staging.allocations == 2 and staging.capacity_bytes == 1 << 21


@pytest.mark.gpu
def test_host_staging_on_cuda_keeps_every_upload() -> None:
    """The page-locked path: back-to-back uploads (the second waits for the first's copy before
    it rewrites the buffer) each equal their arrays, behind a busy stream too."""
    from lmserver.engine.multimodal import HostStaging

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    staging = HostStaging(torch.device("cuda"))
    rng = np.random.default_rng(0)
    busy = torch.randn(2048, 2048, device="cuda")
    uploads = []
    for i in range(6):
        for _ in range(4):
            busy = busy @ busy / 2048  # queue work ahead of the copies
        arrays = [rng.integers(0, 255, (480, 640, 3), dtype=np.uint8), rng.random((3, 336, 336)).astype(np.float32)]
        uploads.append((arrays, staging.upload(arrays[: 1 + i % 2])))
    torch.cuda.synchronize()
    for arrays, got in uploads:
        for a, t in zip(arrays, got, strict=False):
            assert t.device.type == "cuda"
            np.testing.assert_array_equal(t.cpu().numpy(), a)
    assert staging.allocations <= 2
