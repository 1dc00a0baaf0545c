"""Images sent by their hash alone (the front end's fast path for an image the engine got before).

Oracle: the same requests with their pixels on an engine with no caches (radix and encoder cache
off), whose outputs equal HF transformers' (packages/server/tests/test_mm_engine.py). The front
end's record of sent images is checked against a naive LRU, the resend protocol against a
scripted core on the other end of the TokenizerManager's sockets.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.config import ServerConfig
from lmserver.edge.ipc import BatchOut, CoreReady, IpcAddrs, RpcReq, RpcResp, unpack
from lmserver.edge.tokenizer_manager import TokenizerManager
from lmserver.engine.core import EngineCore
from lmserver.io_struct import GenerateReq, MultimodalItem, PixelsNeededError, ReqOutput, SamplingParams
from lmserver.multimodal.frontend import MediaRef, MultimodalFrontend
from lmserver.multimodal.loader import LoadLimits
from lmserver.testing.multimodal import random_png

MAX_NEW = 6
PROMPTS = ["USER: <image>\nWhat is it? ASSISTANT:", "USER: <image>\nWhich colors? ASSISTANT:"]


def _png(seed: int, size: tuple[int, int] = (40, 56)) -> bytes:
    return random_png(seed, *size)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmserver.testing.multimodal import make_tiny_llava_folder

    return make_tiny_llava_folder(tmp_path_factory.mktemp("llava"), "llava", seed=3)


def _core(folder: Path, **config: Any) -> EngineCore:
    return EngineCore(ServerConfig(model_path=str(folder), dtype="float32", device="cpu", max_total_tokens=4096,
                                   max_running_requests=8, **config))


@pytest.fixture(scope="module")
def cold(folder: Path) -> Iterator[EngineCore]:
    """The oracle: no radix cache, no encoder cache (every request encodes its images)."""
    yield _core(folder, disable_radix_cache=True, mm_encoder_cache_size=0)


def _requests(core: EngineCore, folder: Path, images: list[int]) -> list[GenerateReq]:
    """One greedy request per image seed (prompts alternate), with every item's pixels."""
    fe = MultimodalFrontend.for_model(str(folder), core.tokenizer, core.resolved_config)
    assert fe is not None
    out = []
    for i, seed in enumerate(images):
        import base64

        url = "data:image/png;base64," + base64.b64encode(_png(seed)).decode()
        media = fe.prepare_blocking([MediaRef("image", url)])
        ids, items = fe.expand(list(core.tokenizer(PROMPTS[i % 2])["input_ids"]), media)
        out.append(GenerateReq(f"r{i}", ids, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                               mm_items=items))
    return out


def _by_hash(req: GenerateReq, rid: str | None = None) -> GenerateReq:
    """`req` with its images sent by their hash alone (as MultimodalFrontend.for_engine does)."""
    import dataclasses

    items = [dataclasses.replace(item, pixel_values=None) for item in req.mm_items]
    return dataclasses.replace(req, rid=rid or req.rid, mm_items=items)


def _run(core: EngineCore, reqs: list[GenerateReq]) -> dict[str, list[int]]:
    """Adds copies of `reqs` as the core process gets them (pickled; in order, before any step) and
    runs them to the end; output ids by rid."""
    for req in reqs:
        core.add_request(pickle.loads(pickle.dumps(req)))
    tokens: dict[str, list[int]] = {req.rid: [] for req in reqs}
    while core.has_work():
        for out in core.step():
            assert out.error is None, out.error
            tokens[out.rid].extend(out.new_token_ids)
    return tokens


def _oracle(cold: EngineCore, reqs: list[GenerateReq]) -> list[list[int]]:
    out = _run(cold, reqs)
    return [out[req.rid] for req in reqs]


def test_an_image_by_hash_takes_its_embeddings_from_the_encoder_cache(folder: Path, cold: EngineCore) -> None:
    core = _core(folder, disable_radix_cache=True)  # every request runs the image's rows through the model
    reqs = _requests(core, folder, [0, 1, 0, 1])
    first = _run(core, reqs[:2])
    encoded = core.get_stats()["mm_encoded_items"]
    again = _run(core, [_by_hash(reqs[2]), _by_hash(reqs[3])])
    stats = core.get_stats()
    assert stats["mm_encoded_items"] == encoded == 2  # no image decoded or encoded again
    assert stats["mm_items_by_hash"] == 2
    assert [first["r0"], first["r1"], again["r2"], again["r3"]] == _oracle(cold, reqs)


def test_an_image_by_hash_right_behind_its_pixels_takes_those_pixels(folder: Path, cold: EngineCore) -> None:
    core = _core(folder, disable_radix_cache=True)
    reqs = _requests(core, folder, [2, 2, 3])
    # both added before any forward: the second's image is neither encoded nor cached yet
    out = _run(core, [reqs[0], _by_hash(reqs[1]), reqs[2]])
    assert core.get_stats()["mm_items_by_hash"] == 1
    assert [out["r0"], out["r1"], out["r2"]] == _oracle(cold, reqs)


def test_embeddings_taken_at_admission_survive_an_eviction_before_the_forward(folder: Path, cold: EngineCore) -> None:
    core = _core(folder, disable_radix_cache=True)
    reqs = _requests(core, folder, [4, 5, 4])
    rows = reqs[0].mm_items[0].num_tokens
    core.mm.cache.capacity_rows = rows  # room for one image: encoding image 5 evicts image 4
    first = _run(core, [reqs[0]])
    out = _run(core, [reqs[1], _by_hash(reqs[2])])  # 4's rows taken at admission, then 5 encoded
    assert core.mm.cache.evictions >= 1
    assert [first["r0"], out["r1"], out["r2"]] == _oracle(cold, reqs)


def test_an_image_the_engine_does_not_hold_is_asked_for_and_nothing_leaks(folder: Path, cold: EngineCore) -> None:
    core = _core(folder, disable_radix_cache=True)
    reqs = _requests(core, folder, [6, 6])
    with pytest.raises(PixelsNeededError):  # never seen (or evicted and its request gone)
        core.add_request(_by_hash(reqs[0]))
    assert not core.has_work() and not core.states
    core.check_memory_invariant()
    first = _run(core, [reqs[0]])  # sent again with its pixels, as the front end does
    again = _run(core, [_by_hash(reqs[1])])
    assert [first["r0"], again["r1"]] == _oracle(cold, reqs)


def test_a_video_needs_its_pixels(folder: Path) -> None:
    core = _core(folder)
    req = _requests(core, folder, [7])[0]
    import dataclasses

    video = dataclasses.replace(req.mm_items[0], kind="video", pixel_values=None)
    with pytest.raises(Exception, match="pixels|video"):
        core.add_request(dataclasses.replace(req, mm_items=[video]))
    assert not core.states


# --- the front end's record of the images the engine got ---------------------------------------

class _Tok:
    def convert_ids_to_tokens(self, tid: int) -> str:
        return f"<t{tid}>"


def _frontend(rows: int) -> MultimodalFrontend:
    return MultimodalFrontend(None, 9, None, _Tok(), LoadLimits(), engine_cache_rows=rows)


def _item(h: int, rows: int, kind: str = "image") -> MultimodalItem:
    return MultimodalItem(kind, h, 0, rows, np.full((2, 2, 3), h % 256, dtype=np.uint8), (2, 2))


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 20), sends=st.lists(st.tuples(st.integers(0, 6), st.sampled_from([3, 5])),
                                                   max_size=30))
def test_for_engine_strips_exactly_the_images_a_naive_lru_still_holds(capacity: int,
                                                                      sends: list[tuple[int, int]]) -> None:
    fe = _frontend(capacity)
    rows_of = {h: rows for h, rows in sends}  # one token count per hash (as for one image's bytes)
    lru: list[int] = []  # the naive model: hashes sent in full, least recent first
    for h, _ in sends:
        rows = rows_of[h]
        [sent] = fe.for_engine([_item(h, rows)])
        held = h in lru
        assert (sent.pixel_values is None) == held
        if held:
            lru.remove(h)
            lru.append(h)
        elif rows <= capacity:
            lru.append(h)
            while sum(rows_of[x] for x in lru) > capacity:
                lru.pop(0)
        assert sent.content_hash == h and sent.num_tokens == rows


def test_videos_always_go_with_their_pixels_and_a_flush_forgets_everything() -> None:
    fe = _frontend(100)
    fe.for_engine([_item(1, 4, "video"), _item(2, 4)])
    video, image = fe.for_engine([_item(1, 4, "video"), _item(2, 4)])
    assert video.pixel_values is not None and image.pixel_values is None
    fe.forget_sent()
    assert fe.for_engine([_item(2, 4)])[0].pixel_values is not None


# --- the resend protocol, TokenizerManager against a scripted core ------------------------------

def test_the_manager_sends_an_image_by_hash_and_again_with_pixels_when_the_engine_asks() -> None:
    async def main() -> None:
        addrs = IpcAddrs.new()
        mgr = TokenizerManager(ServerConfig(), addrs)
        ctx = zmq.asyncio.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.connect(addrs.from_core)
        pull.connect(addrs.to_core)

        async def recv() -> Any:
            return unpack(await asyncio.wait_for(pull.recv_multipart(), 5))

        async def finish(rid: str) -> None:
            await push.send_pyobj(BatchOut([ReqOutput(rid, [5], "x", True, {"type": "length"})]))

        try:
            await push.send_pyobj(CoreReady(tokenizer=None, model_path="m", vocab_size=100, context_length=64,
                                            resolved_config={}))
            await mgr.wait_ready(5)
            mgr.mm = _frontend(100)
            pixels = _item(7, 4).pixel_values

            def req(rid: str) -> GenerateReq:
                return GenerateReq(rid, [9] * 4 + [1], SamplingParams(max_new_tokens=1), mm_items=[_item(7, 4)])

            async def generate(rid: str) -> list[int]:
                ids: list[int] = []
                async for state in mgr.generate(req(rid)):
                    ids = state.output_ids
                return ids

            task = asyncio.ensure_future(generate("a"))
            msg = await recv()
            assert np.array_equal(msg.mm_items[0].pixel_values, pixels)  # first time: the pixels
            await finish("a")
            assert await task == [5]

            task = asyncio.ensure_future(generate("b"))
            msg = await recv()
            assert msg.mm_items[0].pixel_values is None  # again: by hash
            await push.send_pyobj(BatchOut([ReqOutput("b", [], "", True, {"type": "abort"},
                                                      error="lost", error_status=PixelsNeededError.status)]))
            msg = await recv()
            assert msg.rid == "b" and np.array_equal(msg.mm_items[0].pixel_values, pixels)  # resent in full
            await finish("b")
            assert await task == [5]

            task = asyncio.ensure_future(mgr.rpc("flush_cache"))
            rpc = unpack([await asyncio.wait_for(pull.recv(), 5)])
            assert isinstance(rpc, RpcReq)
            await push.send_pyobj(RpcResp(rpc.id, result=True))
            assert await task is True
            task = asyncio.ensure_future(generate("c"))
            msg = await recv()
            assert msg.mm_items[0].pixel_values is not None  # the engine's cache was flushed: pixels again
            await finish("c")
            assert await task == [5]
        finally:
            ctx.destroy(linger=0)
            await mgr.shutdown()

    asyncio.run(main())
