"""Images end to end through the offline Engine on tiny random LLaVA folders (CPU, float32).

Oracle: HF transformers' LlavaForConditionalGeneration / LlavaNextForConditionalGeneration on
the same folder, fed our preprocessed pixels (the preprocessing has its own oracle tests):
greedy tokens equal, with 0, 1 and 3 images, through chunked prefill, with radix hits. Reuse:
a repeated image is a radix hit and an encoder-cache hit; two different images of the same size
never share KV (the second's output equals a cold run).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from lmserver import Engine
from lmserver.io_struct import InvalidRequestError
from lmserver.multimodal.processor import ImageProcessor
from lmserver.testing.multimodal import random_png

MAX_NEW = 8


def _png(seed: int, size: tuple[int, int] = (40, 56)) -> bytes:
    return random_png(seed, *size)


@pytest.fixture(scope="module", params=["llava", "llava_next"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmserver.testing.multimodal import make_tiny_llava_folder

    return make_tiny_llava_folder(tmp_path_factory.mktemp(request.param), request.param, seed=3)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    base = tmp_path_factory.mktemp("images")
    paths = []
    for i, size in enumerate([(40, 56), (40, 56), (90, 30), (28, 28)]):  # 0 and 1: same size, other pixels
        path = base / f"img{i}.png"
        path.write_bytes(_png(i, size))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def hf(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration

    arch = AutoConfig.from_pretrained(folder).architectures[0]
    cls = LlavaNextForConditionalGeneration if arch.startswith("LlavaNext") else LlavaForConditionalGeneration
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


def _engine(folder: Path, **config: object) -> Engine:
    return Engine(str(folder), dtype="float32", device="cpu", max_total_tokens=8192, max_running_requests=8,
                  **config)


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[Engine]:
    eng = _engine(folder)
    yield eng
    eng.shutdown()


def _prompt(n_images: int) -> str:
    return "USER: " + "".join(f"<image>\nlook {i}. " for i in range(n_images)) + "What is it? ASSISTANT:"


def _hf_greedy(hf, folder: Path, engine: Engine, prompt: str, paths: list[str]) -> list[int]:  # type: ignore[no-untyped-def]
    """HF's greedy tokens for the prompt, its image tokens expanded as our frontend does."""
    return _hf_run(hf, folder, engine, prompt, paths)[0]


def _hf_run(hf, folder: Path, engine: Engine, prompt: str, paths: list[str]) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    """HF's greedy tokens and their logprobs."""
    proc = ImageProcessor.from_model_folder(folder)
    assert proc is not None
    processed = [proc.process_image(Path(p).read_bytes()) for p in paths]
    ids = list(engine.tokenizer(prompt)["input_ids"])
    image_id = hf.config.image_token_id
    expanded: list[int] = []
    queue = list(processed)
    for t in ids:
        expanded.extend([t] * queue.pop(0).num_tokens if t == image_id else [t])
    kwargs = {}
    if processed:
        pixels = [torch.from_numpy(p.pixel_values) for p in processed]
        if pixels[0].ndim == 4:  # NeXT: (patches, 3, H, W) per image, padded to the most patches
            most = max(p.shape[0] for p in pixels)
            pixels = [torch.cat([p, p.new_zeros(most - p.shape[0], *p.shape[1:])]) for p in pixels]
            kwargs["image_sizes"] = torch.tensor([p.image_size for p in processed])
        kwargs["pixel_values"] = torch.stack(pixels)
    with torch.no_grad():
        out = hf.generate(torch.tensor([expanded]), attention_mask=torch.ones(1, len(expanded), dtype=torch.long),
                          max_new_tokens=MAX_NEW, do_sample=False, output_scores=True, return_dict_in_generate=True,
                          **kwargs)
    tokens = [int(t) for t in out.sequences[0, len(expanded):]]
    logprobs = [float(torch.log_softmax(score[0].double(), -1)[t]) for score, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def _ours(engine: Engine, prompt: str, paths: list[str], **kw: object) -> dict:  # type: ignore[type-arg]
    out = engine.generate(prompt, {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
                          image_data=paths or None, **kw)
    assert isinstance(out, dict)
    return out


def _logprobs(out: dict) -> list[float]:  # type: ignore[type-arg]
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_greedy_equals_hf(engine: Engine, hf, folder: Path, images: list[str], n_images: int) -> None:  # type: ignore[no-untyped-def]
    paths = [images[0], images[2], images[3]][:n_images]
    prompt = _prompt(n_images)
    want, want_lp = _hf_run(hf, folder, engine, prompt, paths)
    engine.flush_cache()
    cold = _ours(engine, prompt, paths, return_logprob=True)
    assert cold["output_ids"] == want
    np.testing.assert_allclose(_logprobs(cold), want_lp, rtol=0, atol=1e-4)
    # a warm run (radix hit on the whole prompt but its last token, encoder cache hits)
    warm = _ours(engine, prompt, paths)
    assert warm["output_ids"] == want
    assert warm["meta_info"]["cached_tokens"] > 0
    engine.core.check_memory_invariant()


def test_chunked_prefill_splits_images(folder: Path, hf, images: list[str]) -> None:  # type: ignore[no-untyped-def]
    eng = _engine(folder, chunked_prefill_size=5, disable_radix_cache=True)
    try:
        paths = [images[0], images[2], images[3]]
        prompt = _prompt(3)
        assert _ours(eng, prompt, paths)["output_ids"] == _hf_greedy(hf, folder, eng, prompt, paths)
        eng.core.check_memory_invariant()
    finally:
        eng.shutdown()


def test_same_image_hits_and_other_images_never_share_kv(engine: Engine, images: list[str]) -> None:
    prompt = _prompt(1)
    engine.flush_cache()
    cold_b = _ours(engine, prompt, [images[1]], return_logprob=True)
    engine.flush_cache()
    first = _ours(engine, prompt, [images[0]], return_logprob=True)
    stats0 = engine.get_stats()
    other = _ours(engine, prompt, [images[1]], return_logprob=True)  # same size, other pixels: same token ids
    image_at = len(engine.tokenizer("USER: ")["input_ids"])
    assert other["meta_info"]["cached_tokens"] <= image_at  # the text before the image only
    assert other["output_ids"] == cold_b["output_ids"]
    np.testing.assert_allclose(_logprobs(other), _logprobs(cold_b), rtol=0, atol=1e-5)
    # the images matter to this model (else the comparison above proves nothing)
    assert np.abs(np.subtract(_logprobs(other), _logprobs(first))).max() > 1e-4
    again = _ours(engine, prompt, [images[0]], return_logprob=True)
    assert again["output_ids"] == first["output_ids"]
    np.testing.assert_allclose(_logprobs(again), _logprobs(first), rtol=0, atol=1e-5)
    assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 1
    stats = engine.get_stats()
    assert stats["mm_encoder_cache_misses"] == stats0["mm_encoder_cache_misses"] + 1  # only image 1 was new
    assert stats["mm_cached_tokens"] > stats0["mm_cached_tokens"]
    engine.core.check_memory_invariant()


def test_encoder_cache_alone_keeps_outputs(folder: Path, images: list[str]) -> None:
    """Radix cache off: a repeated image skips the encoder only; outputs do not change."""
    eng = _engine(folder, disable_radix_cache=True)
    try:
        a = _ours(eng, _prompt(1), [images[2]])
        b = _ours(eng, _prompt(1), [images[2]])
        assert a["output_ids"] == b["output_ids"] and b["meta_info"]["cached_tokens"] == 0
        stats = eng.get_stats()
        assert (stats["mm_encoder_cache_hits"], stats["mm_encoder_cache_misses"]) == (1, 1)
    finally:
        eng.shutdown()


def test_an_eagle_head_over_a_multimodal_target_keeps_greedy_outputs(engine: Engine, folder: Path, images: list[str],
                                                                     tmp_path: Path) -> None:
    """A random EAGLE head over the LLaVA target (its text model's embedding and LM head; image positions' features
    as any other): prompts with no image, one and two give the plain engine's greedy tokens; the drafts were verified."""
    from lmserver.testing import write_eagle_head

    text = engine.core.model_config
    write_eagle_head(tmp_path / "head", dict(
        architectures=["LlamaForCausalLM"], vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=128, num_hidden_layers=1, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, max_position_embeddings=2048, rms_norm_eps=1e-5))
    eng = _engine(folder, speculative_algorithm="eagle", speculative_draft_model_path=str(tmp_path / "head"),
                  speculative_num_draft_tokens=3)
    try:
        for paths in ([], images[:1], images[1:3]):
            assert _ours(eng, _prompt(len(paths)), paths)["output_ids"] == \
                _ours(engine, _prompt(len(paths)), paths)["output_ids"]
        stats = eng.get_stats()
        assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0, stats
        eng.core.check_memory_invariant()
        assert eng.core.spec is not None and eng.core.spec.draft_model is not None
        eng.core.spec.draft_model.check_empty()
    finally:
        eng.shutdown()


def test_bad_requests(engine: Engine, images: list[str], tmp_path: Path) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not an image")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(_png(5)[:200])
    cases = [
        (_prompt(1), [str(text_file)]),  # not an image
        (_prompt(1), [str(truncated)]),  # a truncated PNG
        (_prompt(1), [images[0], images[1]]),  # more images than placeholders
        (_prompt(2), [images[0]]),  # fewer
        (_prompt(1), ["data:image/png;base64,@@not-base64"]),
    ]
    for prompt, paths in cases:
        with pytest.raises(InvalidRequestError):
            _ours(engine, prompt, paths)
    assert not engine.core.has_work()
    engine.core.check_memory_invariant()
    assert _ours(engine, _prompt(1), [images[0]])["meta_info"]["completion_tokens"] == MAX_NEW


def test_text_only_model_refuses_images(images: list[str]) -> None:
    with Engine(dtype="float32", max_total_tokens=1024, max_running_requests=2) as eng, \
            pytest.raises(InvalidRequestError, match="text-only"):
        eng.generate("<image> hi", {"max_new_tokens": 2}, image_data=images[0])


def test_readme_example() -> None:
    from pathlib import Path

    from lmserver.testing import run_readme_section

    namespace = run_readme_section(Path(__file__).parents[1] / "README.md", "## Images and video (LLaVA)")
    again = namespace["again"]
    assert isinstance(again, dict)
    image_at = 3  # "USER: " then the image: everything up to the end of the image is a hit
    assert again["meta_info"]["cached_tokens"] > image_at + 16


def _mp4(tmp_path: Path, frames: int = 6) -> str:
    av = pytest.importorskip("av")
    rng = np.random.default_rng(7)
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w", format="mp4") as file:
        stream = file.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                file.mux(packet)
        for packet in stream.encode():
            file.mux(packet)
    return str(path)


def test_video_and_image_equal_hf(tmp_path: Path, images: list[str]) -> None:
    """LLaVA-NeXT-Video: a video and an image in one prompt; greedy tokens and logprobs equal HF's."""
    from transformers import LlavaNextVideoForConditionalGeneration

    from lmserver.testing.multimodal import make_tiny_llava_folder

    folder = make_tiny_llava_folder(tmp_path / "video", "llava_next_video", seed=2)
    video = _mp4(tmp_path)
    prompt = "USER: <video>\nand <image>\nWhat happens? ASSISTANT:"
    eng = _engine(folder)
    try:
        ours = _ours(eng, prompt, [images[2]], video_data=video, return_logprob=True)
        stats = eng.get_stats()
        assert stats["mm_items"] == 2 and stats["mm_encoded_items"] == 2
        proc = ImageProcessor.from_model_folder(folder)
        assert proc is not None
        frames = eng._mm.default_num_frames  # type: ignore[union-attr]
        vid = proc.process_video(Path(video).read_bytes(), frames)
        img = proc.process_image(Path(images[2]).read_bytes())
        ids = list(eng.tokenizer(prompt)["input_ids"])
    finally:
        eng.shutdown()
    hf = LlavaNextVideoForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    expanded: list[int] = []
    for t in ids:
        n = vid.num_tokens if t == hf.config.video_token_id else img.num_tokens if t == hf.config.image_token_id else 1
        expanded.extend([t] * n)
    with torch.no_grad():
        out = hf.generate(torch.tensor([expanded]), attention_mask=torch.ones(1, len(expanded), dtype=torch.long),
                          pixel_values_videos=torch.from_numpy(vid.pixel_values)[None],
                          pixel_values=torch.from_numpy(img.pixel_values)[None],
                          image_sizes=torch.tensor([img.image_size]), max_new_tokens=MAX_NEW, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
    tokens = [int(t) for t in out.sequences[0, len(expanded):]]
    assert ours["output_ids"] == tokens
    want = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, tokens, strict=True)]
    np.testing.assert_allclose(_logprobs(ours), want, rtol=0, atol=1e-4)


def test_device_preprocessing_path_gives_the_same_outputs(folder: Path, images: list[str]) -> None:
    """The frontend only decodes and the engine runs the plan (the GPU set-up, here on the CPU):
    identical logprobs to the CPU preprocessing path (NeXT anyres has no plan: unchanged)."""
    from lmserver.multimodal.frontend import MultimodalFrontend

    eng = _engine(folder, disable_radix_cache=True, mm_encoder_cache_size=0)
    try:
        prompt, paths = _prompt(2), [images[0], images[2]]
        cpu = _ours(eng, prompt, paths, return_logprob=True)
        eng._mm = MultimodalFrontend.for_model(folder, eng.tokenizer, eng.core.resolved_config, "cuda")
        assert eng._mm is not None
        assert eng._mm.device_preprocess == (eng.core.model_config.architecture == "LlavaForConditionalGeneration")
        planned = _ours(eng, prompt, paths, return_logprob=True)
        assert planned["output_ids"] == cpu["output_ids"]
        assert _logprobs(planned) == _logprobs(cpu)
    finally:
        eng.shutdown()


def test_engine_refuses_items_the_model_would_not_encode_so(engine: Engine, images: list[str]) -> None:
    """A direct EngineCore user with a wrong token count or pixel layout gets a 400-class error, never a
    failed forward."""
    import dataclasses

    from lmserver.io_struct import GenerateReq, InvalidRequestError, SamplingParams

    fe = engine._mm
    if fe is None:  # built on first use
        engine.generate(_prompt(1), {"max_new_tokens": 1}, image_data=images[0])
        fe = engine._mm
    assert fe is not None
    from lmserver.multimodal.frontend import MediaRef

    ids = list(engine.tokenizer(_prompt(1))["input_ids"])
    expanded, items = fe.expand(ids, fe.prepare_blocking([MediaRef("image", images[0])]))
    bad = dataclasses.replace(items[0], num_tokens=items[0].num_tokens - 1)
    shorter = expanded[: bad.offset] + expanded[bad.offset + 1 :]
    with pytest.raises(InvalidRequestError, match="takes"):
        engine.core.add_request(GenerateReq("bad-count", shorter, SamplingParams(max_new_tokens=1), mm_items=[bad]))
    moved = dataclasses.replace(items[0], offset=0)
    with pytest.raises(InvalidRequestError, match="not all the model's image token"):
        engine.core.add_request(GenerateReq("bad-offset", expanded, SamplingParams(max_new_tokens=1), mm_items=[moved]))
    assert not engine.core.has_work()
    engine.core.check_memory_invariant()
