"""Image preprocessing cost per request: the pillow/numpy path vs decode + the torch plan.

    python benchmarks/multimodal/bench_preprocess.py [--config clip-336|llava-pad|siglip-384]
        [--repeats 20] [--threads N] [--json OUT]

For a 640x480 and a 1920x1080 JPEG (quality 90, photo-like content), the median of `--repeats`
timed calls (after one warm-up) of:

- `pil`: `ImageProcessor.process_image` (decode + pillow resize + crop + lookup table), what the
  HTTP process runs today;
- `decode`: `ImageProcessor.decode_image` (decode + EXIF + RGB, the uint8 pixels and the plan),
  what the HTTP process keeps with the device path;
- `torch-cpu`: `gpu_preprocess.run_plan` on the CPU, from the decoded pixels (coefficients cached);
- `cold-cpu`: the same, once, with the coefficient caches cleared (a new image size);
- `cuda-h2d` / `cuda`: `run_plan` on CUDA from the host pixels (the uint8 copy included) and from
  pixels already on the device, synchronized before and after each call (CUDA only).

Each torch result is checked equal to `process_image`'s pixel_values (exact) before timing.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from lmserver.multimodal import gpu_preprocess
from lmserver.multimodal.gpu_preprocess import run_plan
from lmserver.multimodal.processor import ImageProcessor

CLIP_TOWER = {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}
LLAVA = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "vision_config": CLIP_TOWER,
         "vision_feature_select_strategy": "default", "image_token_index": 32000}
CLIP_336 = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336},
            "crop_size": {"height": 336, "width": 336}, "resample": 3,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "clip-336": (LLAVA, CLIP_336),  # LLaVA-1.5
    "llava-pad": (LLAVA, dict(CLIP_336, image_processor_type="LlavaImageProcessor", do_pad=True)),
    "siglip-384": (dict(LLAVA, vision_config={"model_type": "siglip_vision_model", "image_size": 384,
                                              "patch_size": 14}),
                   {"image_processor_type": "SiglipImageProcessor", "size": {"height": 384, "width": 384},
                    "resample": 2}),
}
SIZES = [(640, 480), (1920, 1080)]  # (width, height)


def photo_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """Smooth color fields with edges and some noise, JPEG quality 90 (about a photo's entropy)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 40 + 2, width // 40 + 2, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    noisy = np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(noisy).save(out, "JPEG", quality=90)
    return out.getvalue()


def median_ms(fn: Callable[[], object], repeats: int, sync: bool = False) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def clear_caches() -> None:
    gpu_preprocess.pil_resize_coefficients.cache_clear()
    gpu_preprocess._device_pass.cache_clear()  # private: this measures the cold path


def measure(processor: ImageProcessor, width: int, height: int, repeats: int, cuda: bool) -> dict[str, Any]:
    data = photo_jpeg(width, height)
    expected = processor.process_image(data).pixel_values
    decoded = processor.decode_image(data)
    assert decoded is not None, "this config has no plan"
    np.testing.assert_array_equal(run_plan(decoded.pixels, decoded.plan).numpy(), expected)
    row: dict[str, Any] = {"image": f"{width}x{height}", "jpeg_bytes": len(data)}
    row["pil"] = median_ms(lambda: processor.process_image(data), repeats)
    row["decode"] = median_ms(lambda: processor.decode_image(data), repeats)
    row["torch-cpu"] = median_ms(lambda: run_plan(decoded.pixels, decoded.plan), repeats)
    clear_caches()
    start = time.perf_counter()
    run_plan(decoded.pixels, decoded.plan)
    row["cold-cpu"] = (time.perf_counter() - start) * 1e3
    if cuda:
        device = torch.device("cuda")
        on_device = torch.from_numpy(decoded.pixels).to(device)
        np.testing.assert_array_equal(run_plan(on_device, decoded.plan).cpu().numpy(), expected)
        row["cuda-h2d"] = median_ms(lambda: run_plan(decoded.pixels, decoded.plan, device), repeats, sync=True)
        row["cuda"] = median_ms(lambda: run_plan(on_device, decoded.plan), repeats, sync=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="clip-336")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    processor = ImageProcessor.from_configs(*CONFIGS[args.config])
    assert processor is not None
    cuda = torch.cuda.is_available()
    print(f"config {args.config}, torch {torch.__version__} ({torch.get_num_threads()} CPU threads), "
          f"{torch.cuda.get_device_name() if cuda else 'no CUDA'}, median of {args.repeats}")
    columns = ["pil", "decode", "torch-cpu", "cold-cpu"] + (["cuda-h2d", "cuda"] if cuda else [])
    print(f"{'image':>10} {'jpeg KB':>8} " + " ".join(f"{c + ' ms':>12}" for c in columns))
    results = []
    for width, height in SIZES:
        row = measure(processor, width, height, args.repeats, cuda)
        results.append(row)
        print(f"{row['image']:>10} {row['jpeg_bytes'] / 1024:>8.0f} " + " ".join(f"{row[c]:>12.3f}" for c in columns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "torch": torch.__version__, "cuda": cuda, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
