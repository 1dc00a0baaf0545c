"""LLaVA-NeXT (anyres tiling) and LLaVA-NeXT-Video (pooled video frames) on the LLaVA-1.5 class.

An image arrives as the processor's (num_patches, 3, S, S): the whole image resized to the tower's
size S, then the tiles of the anyres grid that `image_grid_pinpoints` picks for the original
(height, width). The features of the tiles are laid out as one feature map, cut back to the
original aspect ratio (`unpad_image`) and given an `image_newline` row after each feature row;
the base image's features come first (HF's `pack_image_features`). The geometry comes from
`lmserver.multimodal.token_counts`, so `num_image_tokens` is the row count by construction.
"""

from __future__ import annotations

import torch
from torch import nn

from lmserver.models.config import ModelConfig
from lmserver.models.llava import LlavaForConditionalGeneration, MultimodalInputError
from lmserver.multimodal import token_counts


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: `encode_images` takes per image (num_patches, 3, S, S) and its original
    (height, width); num_patches must be the anyres grid's tiles + 1."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions=max_positions)
        self.image_newline = nn.Parameter(torch.empty(config.hidden_size))  # (hidden,)

    def pack_image(self, feats: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """Projected features (num_patches, rows, hidden) of one image -> its (num_tokens, hidden)
        embeddings: base image, then the unpadded tile map with a newline row after each row."""
        newline = self.image_newline.to(feats.dtype)
        if feats.shape[0] == 1:
            return torch.cat((feats[0], newline[None]), dim=0)
        hf = self.config.hf_config
        tile, patch, _ = token_counts.vision_geometry(hf)
        side = tile // patch
        rows, cols = token_counts.anyres_grid_shape(image_size, hf)
        grid = feats[1:].view(rows, cols, side, side, -1)
        grid = grid.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # (hidden, rows * side, cols * side)
        top, bottom, left, right = token_counts.unpad_bounds((rows * side, cols * side), image_size)
        grid = grid[:, top:bottom, left:right]
        grid = torch.cat((grid, newline[:, None, None].expand(*grid.shape[:-1], 1)), dim=-1)
        return torch.cat((feats[0], grid.flatten(1, 2).transpose(0, 1)), dim=0)

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: list[torch.Tensor], image_sizes: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Per image (num_patches, 3, S, S) and original (height, width) -> (num_tokens, hidden)
        in the text dtype; one tower pass over every tile of every image."""
        if len(pixel_values) != len(image_sizes):
            raise MultimodalInputError(f"{len(pixel_values)} images but {len(image_sizes)} image sizes")
        if not pixel_values:
            return []
        hf = self.config.hf_config
        size, _, _ = token_counts.vision_geometry(hf)
        counts = []
        for i, (pixels, image_size) in enumerate(zip(pixel_values, image_sizes, strict=True)):
            expected = token_counts.num_anyres_patches(hf, image_size)
            if tuple(pixels.shape) != (expected, 3, size, size):
                raise MultimodalInputError(
                    f"image {i} of size {tuple(image_size)}: pixel_values of shape {tuple(pixels.shape)}, "
                    f"this model takes ({expected}, 3, {size}, {size}) (the base image and the anyres tiles)"
                )
            counts.append(expected)
        feats = self.project_tiles(torch.cat(pixel_values))
        dtype = self._text_dtype()
        return [
            self.pack_image(part, (int(s[0]), int(s[1]))).to(dtype)
            for part, s in zip(feats.split(counts), image_sizes, strict=True)
        ]


class _SpatialPool(nn.Module):
    """HF's LlavaNextVideoPooler: each frame's square feature map pooled with `stride`."""

    def __init__(self, mode: str, stride: int, channels: int, out_channels: int) -> None:
        super().__init__()
        self.pool: nn.Module
        if mode == "average":
            self.pool = nn.AvgPool2d(kernel_size=stride, stride=stride)
        elif mode == "max":
            self.pool = nn.MaxPool2d(kernel_size=stride, stride=stride)
        elif mode == "conv":
            self.pool = nn.Conv2d(channels, out_channels, kernel_size=stride, stride=stride)
        else:
            raise ValueError(f"unknown spatial_pool_mode {mode!r}; one of 'average', 'max', 'conv'")

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """(F, side * side, dim) -> (F, pooled * pooled, dim_out)."""
        frames, rows, dim = feats.shape
        side = int(rows**0.5)
        spatial = feats.view(frames, side, side, dim).permute(0, 3, 1, 2)
        return self.pool(spatial).flatten(2).transpose(1, 2).contiguous()  # type: ignore[no-any-return]


class LlavaNextVideoForConditionalGeneration(LlavaNextForConditionalGeneration):
    """LLaVA-NeXT-Video: images as LLaVA-NeXT; a video's frames go through the tower, the
    spatial pooler (`spatial_pool_mode`, `spatial_pool_stride`) and the projector."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions=max_positions)
        hf = self.hf_vlm_config
        channels = int(hf.vision_config.hidden_size)
        self.vision_resampler = _SpatialPool(
            str(hf.spatial_pool_mode), int(hf.spatial_pool_stride), channels,
            int(getattr(hf, "spatial_pool_out_channels", channels)),
        )
        self.video_token_id = int(hf.video_token_id)

    @torch.inference_mode()
    def encode_video(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Frames (F, 3, S, S) -> (F * pooled rows, hidden) in the text dtype."""
        size, _, _ = token_counts.vision_geometry(self.config.hf_config)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, size, size) or not len(pixel_values):
            raise MultimodalInputError(
                f"video pixel_values of shape {tuple(pixel_values.shape)}, this model takes (frames, 3, {size}, {size})"
            )
        feats = self.multi_modal_projector(self.vision_resampler(self.vision_features(pixel_values)))
        return feats.flatten(0, 1).to(self._text_dtype())  # type: ignore[no-any-return]
