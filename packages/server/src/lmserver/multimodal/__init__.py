"""Multimodal inputs (images, video): loading, preprocessing, token counts; see docs/multimodal.md."""
