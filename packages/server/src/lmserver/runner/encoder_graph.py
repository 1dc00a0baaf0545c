"""EncoderGraphs: a vision encoder's fixed-shape work (tiles -> projected features) replayed
from CUDA graphs, one per captured tile count.

A LLaVA tower is hundreds of small kernels (CLIP-L: 24 layers) on a few hundred tokens: eager,
the host's kernel launches take longer than the GPU's work (measured on the H200: 6-11 ms
eager for a 576-token image, see benchmarks/RESULTS.md). Tiles are padded up to the nearest
captured count; more tiles than the largest count run in pieces. Outputs are copied out of the
graph's static buffer (the encoder cache keeps them).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

DEFAULT_TILE_COUNTS = (1, 2, 4, 8, 16)


class EncoderGraphs:
    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], tile_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, tile_counts: Sequence[int] = DEFAULT_TILE_COUNTS) -> None:
        if device.type != "cuda":
            raise ValueError("EncoderGraphs needs a CUDA device")
        self.encode = encode
        self.tile_shape = tuple(tile_shape)
        self.dtype = dtype
        self.device = device
        self.tile_counts = sorted(set(tile_counts))
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every tile count, the largest first (the smaller ones reuse its memory pool)."""
        for n in reversed(self.tile_counts):
            static_in = torch.randn((n, *self.tile_shape), device=self.device).to(self.dtype)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (lazy inits, autotuning)
                    self.encode(static_in)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                static_out = self.encode(static_in)
            self._inputs[n], self._outputs[n], self._graphs[n] = static_in, static_out, graph
        logger.info("vision encoder: CUDA graphs captured for %s tiles", self.tile_counts)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, *tile_shape) -> the encoder's output for the N tiles (a new tensor)."""
        if tuple(pixels.shape[1:]) != self.tile_shape or not self._graphs:
            return self.encode(pixels)
        largest = self.tile_counts[-1]
        parts = []
        for start in range(0, pixels.shape[0], largest):
            chunk = pixels[start : start + largest]
            n = chunk.shape[0]
            size = self.tile_counts[bisect.bisect_left(self.tile_counts, n)]
            self._inputs[size][:n].copy_(chunk)
            self._graphs[size].replay()
            self.replays += 1
            parts.append(self._outputs[size][:n].clone())
        return parts[0] if len(parts) == 1 else torch.cat(parts)
