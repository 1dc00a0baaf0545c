"""LLaVA-1.5 / LLaVA-NeXT / LLaVA-NeXT-Video vs HF transformers on tiny random models (float32).

Each model is written by `lmserver.testing.multimodal.make_tiny_llava_folder` (transformers'
`save_pretrained`), loaded by HF and by lmserver's loader (also from the checkpoint with its
tensors renamed to the other published layouts), and run through the real KV pool + torch_native
attention with the image rows given as `input_embeds`, as the engine does: logits, encoder
outputs and token counts must equal HF's (<= 1e-4 absolute).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.models.config import ModelConfig
from lmserver.models.llava import MultimodalInputError
from lmserver.models.loader import ModelLoadError, load_model, read_model_config
from lmserver.multimodal import token_counts
from lmserver.runner.attention.torch_native import TorchNativeBackend
from lmserver.runner.model_runner import ModelRunner
from lmserver.scheduler import ForwardItem, ScheduleDecision
from lmserver.testing.multimodal import make_tiny_llava_folder

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
HF_CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_next_video": "LlavaNextVideoForConditionalGeneration",
}
NEXT_SIZES = [(30, 70), (80, 20), (50, 50)]  # wide, tall, square: three different anyres grids


def _folder(tmp_path: Path, kind: str, overrides: dict[str, Any] | None = None, seed: int = 0) -> Path:
    return make_tiny_llava_folder(tmp_path / kind, kind, seed=seed, overrides=overrides)


def _hf(folder: Path, kind: str) -> Any:
    return getattr(transformers, HF_CLASSES[kind]).from_pretrained(folder, dtype=torch.float32).eval()


def _rename(folder: Path, dest: Path, layout: str) -> Path:
    """A copy of `folder` whose tensors have another layout's names: `modules` (transformers 5's
    module names) or `hub` (llava-hf's, with the tower's `vision_model.` level)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    state = load_file(str(folder / "model.safetensors"))
    renamed = {}
    for name, tensor in state.items():
        if layout == "modules":
            for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                             ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
                             ("image_newline", "model.image_newline"), ("vision_resampler.", "model.vision_resampler.")):
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
        else:
            assert layout == "hub"
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                name = "vision_tower.vision_model." + name[len("vision_tower."):]
        renamed[name] = tensor.contiguous()
    assert len(renamed) == len(state)
    save_file(renamed, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


class Harness:
    """Our model behind a KV pool and the torch_native backend; prompts go in as input_embeds."""

    def __init__(self, folder: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.config = read_model_config(folder)
        self.model = load_model(self.config, folder, dtype=dtype, device=device, max_positions=256)
        c = self.config
        self.pool = KVPool(512, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype, device)
        table = make_req_to_token(2, 256, device)
        self.runner = ModelRunner(self.model, self.pool, table, TorchNativeBackend(self.pool, table), torch.device(device))

    @torch.inference_mode()
    def forward(self, mode: str, prefix: int, ids: list[int], embeds: torch.Tensor | None) -> torch.Tensor:
        slots = list(range(1, 257))
        n = len(ids)
        item = ForwardItem(
            rid="r", req_pool_idx=0, prefix_len=prefix, token_ids=ids, out_slots=slots[prefix:prefix + n],
            table_start=prefix, table_slots=slots[prefix:prefix + n], logit_offsets=list(range(n)),
            completes_prefill=True,
        )
        batch, logit_idx = self.runner.build_batch(ScheduleDecision(mode, [item]))
        self.runner.attn_backend.plan(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch, input_embeds=embeds)
        return self.model.compute_logits(hidden[logit_idx])  # type: ignore[no-any-return]

    @torch.inference_mode()
    def embeds(self, ids: list[int], images: list[torch.Tensor], video: torch.Tensor | None = None) -> torch.Tensor:
        """embed_tokens(ids) with the image rows (in order) and the video rows written over."""
        model = self.model
        device = model.lm_head.weight.device
        tokens = torch.tensor(ids, device=device)
        embeds = model.embed_tokens(tokens)
        for token_id, rows in ((model.image_token_id, images), (model.video_token_id, [video] if video is not None else [])):
            if token_id is None:
                continue
            where = (tokens == token_id).nonzero().flatten()
            if rows:
                embeds[where] = torch.cat(rows).to(embeds.dtype)
            else:
                assert len(where) == 0
        return embeds

    def logits(self, ids: list[int], images: list[torch.Tensor], video: torch.Tensor | None = None,
               split: int | None = None, decode: int = 0) -> torch.Tensor:
        """Logits of every position: a prefill (in two chunks at `split`), then `decode` tokens
        one by one as decode steps (text tokens only)."""
        embeds = self.embeds(ids, images, video)
        n = len(ids) - decode
        cuts = [0, n] if split is None else [0, split, n]
        out = [self.forward("extend", a, ids[a:b], embeds[a:b].clone()) for a, b in zip(cuts, cuts[1:], strict=False)]
        out += [self.forward("decode", p, [ids[p]], None) for p in range(n, len(ids))]
        return torch.cat(out)


def _prompt(vocab_text: int, segments: list[int | str], seed: int = 0) -> list[int]:
    """Token ids: an int n is n random text tokens; a str is that many copies of a special id
    (`"<id>x<count>"`)."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for seg in segments:
        if isinstance(seg, int):
            ids += torch.randint(3, vocab_text, (seg,), generator=g).tolist()
        else:
            token, count = seg.split("x")
            ids += [int(token)] * int(count)
    return ids


def _with_images(n_text: int, image_id: int, counts: list[int]) -> list[int]:
    segments: list[int | str] = [5]
    for c in counts:
        segments += [f"{image_id}x{c}", 3]
    segments.append(n_text)
    return _prompt(49000, segments)


def _next_pixels(hf_config: dict[str, Any], sizes: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = token_counts.vision_geometry(hf_config)[0]
    return [torch.randn(token_counts.num_anyres_patches(hf_config, hw), 3, s, s, generator=g) for hw in sizes]


# --- LLaVA-1.5 ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["saved", "modules", "hub"])
def test_llava_logits_match_hf_with_0_1_3_images(tmp_path: Path, layout: str) -> None:
    folder = _folder(tmp_path, "llava")
    hf = _hf(folder, "llava")
    if layout != "saved":
        folder = _rename(folder, tmp_path / layout, layout)
    ours = Harness(folder)
    cfg = ours.config.hf_config
    per_image = token_counts.num_image_tokens(cfg, (56, 56))
    assert per_image == 16  # 4 x 4 patches, CLS dropped
    g = torch.Generator().manual_seed(1)
    for n_images in (0, 1, 3):
        pixels = torch.randn(n_images, 3, 56, 56, generator=g)
        ids = _with_images(9, ours.model.image_token_id, [per_image] * n_images)
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids]), pixel_values=pixels if n_images else None).logits[0]
            hf_feats = hf.get_image_features(pixel_values=pixels).pooler_output if n_images else []
        images = ours.model.encode_images(list(pixels), [(56, 56)] * n_images)
        assert [tuple(x.shape) for x in images] == [(per_image, 64)] * n_images
        for a, b in zip(images, hf_feats, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        got = ours.logits(ids, images, split=len(ids) // 2 if n_images else None, decode=3)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"vision_feature_layer": [-2, -1], "vision_feature_select_strategy": "full"},
        {"vision_feature_layer": [0, 1], "text_config": {"model_type": "qwen2", "num_key_value_heads": 4}},
        {"vision_feature_layer": -1, "projector_hidden_act": "silu", "text_config": {"tie_word_embeddings": True}},
    ],
    ids=["layers-list-full", "qwen2-text", "last-layer-tied"],
)
def test_llava_config_variants_match_hf(tmp_path: Path, overrides: dict[str, Any]) -> None:
    folder = _folder(tmp_path, "llava", overrides, seed=2)
    hf = _hf(folder, "llava")
    ours = Harness(folder)
    per_image = token_counts.num_image_tokens(ours.config.hf_config, (56, 56))
    assert per_image == (17 if overrides.get("vision_feature_select_strategy") == "full" else 16)
    pixels = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    ids = _with_images(6, ours.model.image_token_id, [per_image] * 2)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    got = ours.logits(ids, ours.model.encode_images(list(pixels), [(56, 56)] * 2), decode=2)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


# --- LLaVA-NeXT -----------------------------------------------------------------------------


def _hf_next_inputs(pixels: list[torch.Tensor], sizes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """HF's batched layout: (num_images, max_patches, 3, S, S) zero-padded, image_sizes (N, 2)."""
    most = max(p.shape[0] for p in pixels)
    padded = torch.zeros(len(pixels), most, *pixels[0].shape[1:])
    for i, p in enumerate(pixels):
        padded[i, : p.shape[0]] = p
    return {"pixel_values": padded, "image_sizes": torch.tensor(sizes)}


@pytest.mark.parametrize("kind", ["llava_next", "llava_next_video"])
def test_llava_next_logits_match_hf_with_anyres_images(tmp_path: Path, kind: str) -> None:
    folder = _folder(tmp_path, kind)
    hf = _hf(folder, kind)
    ours = Harness(_rename(folder, tmp_path / "modules", "modules") if kind == "llava_next" else folder)
    cfg = ours.config.hf_config
    grids = {token_counts.anyres_grid_shape(s, cfg) for s in NEXT_SIZES}
    assert len(grids) == 3
    for sizes in ([], NEXT_SIZES[:1], NEXT_SIZES):
        pixels = _next_pixels(cfg, sizes, seed=len(sizes))
        counts = [token_counts.num_image_tokens(cfg, s) for s in sizes]
        ids = _with_images(7, ours.model.image_token_id, counts)
        with torch.no_grad():
            inputs = _hf_next_inputs(pixels, sizes) if sizes else {}
            ref = hf(input_ids=torch.tensor([ids]), **inputs).logits[0]
            hf_feats = hf.get_image_features(**inputs).pooler_output if sizes else []
        images = ours.model.encode_images(pixels, sizes)
        assert [x.shape[0] for x in images] == counts
        for a, b in zip(images, hf_feats, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        got = ours.logits(ids, images, split=len(ids) // 3 if sizes else None, decode=2)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_llava_next_siglip_full_strategy_and_layer_list_match_hf(tmp_path: Path) -> None:
    siglip = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    overrides = {"vision_config": siglip, "vision_feature_select_strategy": "full", "vision_feature_layer": [-3, -2]}
    folder = _folder(tmp_path, "llava_next", overrides, seed=4)
    hf = _hf(folder, "llava_next")
    ours = Harness(_rename(folder, tmp_path / "hub", "hub"))
    cfg = ours.config.hf_config
    sizes = [(20, 90), (64, 60)]
    pixels = _next_pixels(cfg, sizes, seed=5)
    counts = [token_counts.num_image_tokens(cfg, s) for s in sizes]
    ids = _with_images(5, ours.model.image_token_id, counts)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), **_hf_next_inputs(pixels, sizes)).logits[0]
    images = ours.model.encode_images(pixels, sizes)
    assert [x.shape[0] for x in images] == counts
    torch.testing.assert_close(ours.logits(ids, images, decode=1), ref, atol=ATOL, rtol=0)


def test_anyres_token_counts_match_hf_helpers() -> None:
    """Against HF's modeling helpers and the count HF's LlavaNextProcessor expands `<image>` to."""
    from types import SimpleNamespace

    from transformers.models.llava_next import modeling_llava_next as hf_next

    processor = object.__new__(transformers.LlavaNextProcessor)
    processor.patch_size, processor.num_additional_image_tokens = 14, 1

    cfg = {"model_type": "llava_next", "vision_config": {"image_size": 336, "patch_size": 14},
           "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}
    pinpoints = cfg["image_grid_pinpoints"]
    processor.image_processor = SimpleNamespace(image_grid_pinpoints=pinpoints)
    for size in [(336, 336), (480, 640), (640, 480), (1000, 200), (200, 1000), (37, 1003), (768, 1024), (1, 1)]:
        assert token_counts.num_anyres_patches(cfg, size) == hf_next.image_size_to_num_patches(size, pinpoints, 336)
        assert token_counts.anyres_grid_shape(size, cfg) == tuple(hf_next.get_anyres_image_grid_shape(size, pinpoints, 336))
        rows, cols = token_counts.anyres_grid_shape(size, cfg)
        fmap = torch.zeros(1, rows * 24, cols * 24)  # (channels, height, width) of the tiles' features
        top, bottom, left, right = token_counts.unpad_bounds((rows * 24, cols * 24), size)
        assert hf_next.unpad_image(fmap, size).shape[1:] == (bottom - top, right - left)
        assert token_counts.num_image_tokens(cfg, size) == 576 + (bottom - top) * (right - left + 1)
        # the processor counts the CLS row, then drops one for the `default` strategy
        assert token_counts.num_image_tokens(cfg, size) == processor._get_number_of_features(*size, 336, 336) - 1
    assert token_counts.num_image_tokens({"model_type": "llava"}, (10, 10)) == 49  # CLIP defaults 224 / 32
    with pytest.raises(token_counts.TokenCountError):
        token_counts.num_image_tokens(cfg, (0, 5))
    with pytest.raises(token_counts.TokenCountError):
        token_counts.num_video_tokens(cfg, 4)


# --- LLaVA-NeXT-Video -----------------------------------------------------------------------


def _rows(x: Any) -> torch.Tensor:
    """(N, hidden) rows of a tensor or of (nested) tuples of tensors, in order."""
    if isinstance(x, (tuple, list)):
        return torch.cat([_rows(e) for e in x])
    return x.reshape(-1, x.shape[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("pool", ["average", "max", "conv"])
def test_llava_next_video_matches_hf_with_video_and_image(tmp_path: Path, pool: str) -> None:
    folder = _folder(tmp_path, "llava_next_video", {
        "spatial_pool_mode": pool, "vision_config": {"image_size": 56}, "image_grid_pinpoints": [[56, 112], [112, 56]],
    }, seed=6)
    hf = _hf(folder, "llava_next_video")
    ours = Harness(folder if pool != "conv" else _rename(folder, tmp_path / "modules", "modules"))
    cfg = ours.config.hf_config
    g = torch.Generator().manual_seed(7)
    frames = torch.randn(3, 3, 56, 56, generator=g)
    n_video = token_counts.num_video_tokens(cfg, 3)
    assert n_video == 3 * 2 * 2  # 4 x 4 patches pooled by 2
    size = (40, 100)
    pixels = _next_pixels(cfg, [size], seed=8)
    n_image = token_counts.num_image_tokens(cfg, size)
    vid, img = ours.model.video_token_id, ours.model.image_token_id
    ids = _prompt(49000, [4, f"{vid}x{n_video}", 3, f"{img}x{n_image}", 5])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values_videos=frames[None],
                 **_hf_next_inputs(pixels, [size])).logits[0]
        # positional, and rows of any nesting: the keyword and the return type changed in transformers 5.2x
        out = hf.get_video_features(frames[None])
        hf_video = _rows(out.pooler_output if hasattr(out, "pooler_output") else out[0])
    video = ours.model.encode_video(frames)
    assert video.shape == (n_video, 64)
    torch.testing.assert_close(video, hf_video, atol=ATOL, rtol=0)
    images = ours.model.encode_images(pixels, [size])
    torch.testing.assert_close(ours.logits(ids, images, video, split=9, decode=2), ref, atol=ATOL, rtol=0)


# --- config, loading, errors ----------------------------------------------------------------

# llava-hf/llava-1.5-7b-hf's config.json (partial text_config and vision_config)
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_partial_published_config_reads_with_llama_defaults() -> None:
    from lmserver.models.registry import get_model_class

    c = ModelConfig.from_hf(LLAVA_15_7B)
    assert c.is_multimodal and c.architecture == "LlavaForConditionalGeneration"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (32064, 4096, 11008, 32)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps) == (32, 32, 128, 1e-5)
    assert c.max_position_embeddings == 4096 and c.rope_parameters["rope_theta"] == 10000.0
    assert c.eos_token_ids == (2,) and not c.tie_word_embeddings and not c.attention_bias
    assert c.hf_config == LLAVA_15_7B
    assert token_counts.num_image_tokens(c.hf_config, (480, 640)) == 576
    # the full 7B model builds on the meta device (what the memory estimate does)
    with torch.device("meta"):
        model = get_model_class(c.architecture)(c, max_positions=64)
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith("vision_tower."))
    assert 290e6 < tower < 310e6  # CLIP ViT-L/14-336 without its last layer
    assert model.image_token_id == 32000 and model.video_token_id is None
    text = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    assert not text.is_multimodal


def test_unknown_and_missing_tensors_are_reported(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, "llava_next")
    path = folder / "model.safetensors"
    state = load_file(str(path))
    # tensors of the cut tower layer (feature layer -2 of 2) are skipped, not unknown
    assert any(k.startswith("vision_tower.encoder.layers.1.") for k in state)
    save_file({**state, "vision_tower.encoder.extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ModelLoadError, match="vision_tower.encoder.extra.weight"):
        load_model(read_model_config(folder), folder)
    save_file({k: v for k, v in state.items() if k != "image_newline"}, str(path))
    with pytest.raises(ModelLoadError, match="image_newline"):
        load_model(read_model_config(folder), folder)


def test_bad_pixel_values_raise(tmp_path: Path) -> None:
    llava = Harness(_folder(tmp_path, "llava")).model
    with pytest.raises(MultimodalInputError, match="takes \\(3, 56, 56\\)"):
        llava.encode_images([torch.zeros(3, 28, 28)], [(28, 28)])
    with pytest.raises(MultimodalInputError, match="no video"):
        llava.encode_video(torch.zeros(2, 3, 56, 56))
    nxt = Harness(_folder(tmp_path, "llava_next")).model
    with pytest.raises(MultimodalInputError, match="anyres"):
        nxt.encode_images([torch.zeros(2, 3, 28, 28)], [(50, 50)])  # a 2 x 2 grid: 5 patches


def test_dummy_weights_give_finite_outputs_in_bfloat16(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "llava_next_video")
    config = read_model_config(folder)
    model = load_model(config, None, load_format="dummy", dtype=torch.bfloat16, seed=1)
    params = dict(model.named_parameters())
    norms = [n for n in params if "layer_norm" in n or "layrnorm" in n]
    assert norms and all(torch.all(params[n] == (1 if n.endswith("weight") else 0)) for n in norms)
    again = load_model(config, None, load_format="dummy", dtype=torch.bfloat16, seed=1)
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in params.items())
    pixels = _next_pixels(config.hf_config, [(50, 50)])
    (image,) = model.encode_images(pixels, [(50, 50)])
    video = model.encode_video(torch.randn(2, 3, 28, 28))
    assert image.dtype == video.dtype == torch.bfloat16
    assert torch.isfinite(image).all() and torch.isfinite(video).all()


@pytest.mark.gpu
def test_bfloat16_on_cuda_stays_close_to_hf_float32(tmp_path: Path) -> None:
    """bf16 on CUDA (the fused layer kernels, SDPA in the tower) vs HF in float32 on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = _folder(tmp_path, "llava_next_video")
    hf = _hf(folder, "llava_next_video")
    ours = Harness(folder, dtype=torch.bfloat16, device="cuda")
    cfg = ours.config.hf_config
    pixels = _next_pixels(cfg, NEXT_SIZES)
    frames = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(9))
    counts = [token_counts.num_image_tokens(cfg, s) for s in NEXT_SIZES]
    ids = _with_images(7, ours.model.image_token_id, counts) + _prompt(
        49000, [f"{ours.model.video_token_id}x{token_counts.num_video_tokens(cfg, 2)}", 4])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values_videos=frames[None],
                 **_hf_next_inputs(pixels, NEXT_SIZES)).logits[0]
    images = ours.model.encode_images([p.cuda() for p in pixels], NEXT_SIZES)
    video = ours.model.encode_video(frames.cuda())
    assert all(x.dtype == torch.bfloat16 and x.is_cuda for x in [*images, video])
    got = ours.logits(ids, images, video, split=20, decode=2).cpu()
    err = (got - ref).abs().max().item()
    assert err < 0.02 * ref.abs().max().item(), (err, ref.abs().max().item())
