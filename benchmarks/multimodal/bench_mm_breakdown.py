"""Where the time to first token of a one-image request goes, without HTTP: preprocessing, the
engine's vision rows (encoder), and the prefill, next to a text-only prompt of the same length.

    python benchmarks/multimodal/bench_mm_breakdown.py --model-path LLAVA_FOLDER [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_mm_serving import data_url, make_jpeg, prompt_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch

    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore
    from lmserver.io_struct import GenerateReq, SamplingParams
    from lmserver.multimodal.frontend import MediaRef, MultimodalFrontend

    core = EngineCore(ServerConfig(model_path=args.model_path, load_format="dummy", dtype=args.dtype,
                                   device=args.device, context_length=4096))
    frontend = MultimodalFrontend.for_model(args.model_path, core.tokenizer, core.resolved_config)
    assert core.mm is not None and frontend is not None
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    mm = core.mm
    rows_ms: list[float] = []
    original_rows = mm.rows

    def timed_rows(*a: Any) -> Any:
        sync()
        start = time.perf_counter()
        out = original_rows(*a)
        sync()
        rows_ms.append((time.perf_counter() - start) * 1e3)
        return out

    mm.rows = timed_rows  # type: ignore[method-assign]
    ids = list(core.tokenizer(prompt_of("Describe this image in detail."))["input_ids"])
    params = SamplingParams(max_new_tokens=1, temperature=0.0)

    def first_token(req: GenerateReq) -> float:
        sync()
        start = time.perf_counter()
        core.add_request(req)
        while core.has_work():
            if any(out.new_token_ids for out in core.step()):
                break
        sync()
        ms = (time.perf_counter() - start) * 1e3
        while core.has_work():
            core.step()
        return ms

    model: Any = core.model
    tile = torch.randn((1, *model.tile_shape()), device=args.device).to(core.dtype)
    tower_ms = []
    with torch.inference_mode():
        for _ in range(args.repeats + 3):  # the tower + projector alone, as the engine runs it (graphs on CUDA)
            sync()
            start = time.perf_counter()
            model.project_tiles(tile)
            sync()
            tower_ms.append((time.perf_counter() - start) * 1e3)
    prep_ms, img_ms, text_ms = [], [], []
    rng = np.random.default_rng(0)
    n_tokens = 0
    for i in range(args.repeats + 2):
        start = time.perf_counter()
        media = frontend.prepare_blocking([MediaRef("image", data_url(make_jpeg(5000 + i)))])
        prep_ms.append((time.perf_counter() - start) * 1e3)
        expanded, items = frontend.expand(ids, media)
        n_tokens = len(expanded)
        img_ms.append(first_token(GenerateReq(f"img{i}", expanded, params, mm_items=items)))
        text = rng.integers(100, 40000, n_tokens).tolist()
        text_ms.append(first_token(GenerateReq(f"txt{i}", text, params)))
    med = {name: statistics.median(v[2:]) for name, v in
           (("preprocess", prep_ms), ("image_first_token", img_ms), ("text_first_token", text_ms),
            ("vision_rows", rows_ms), ("tower_alone", tower_ms))}
    print(f"{n_tokens} prompt tokens, medians in ms (engine in-process, synchronized):")
    for name, value in med.items():
        print(f"  {name:18s} {value:8.2f}")
    print(f"  image - text - vision_rows = {med['image_first_token'] - med['text_first_token'] - med['vision_rows']:.2f}")
    print(f"  image / (tower_alone + text) = {med['image_first_token'] / (med['tower_alone'] + med['text_first_token']):.3f}"
          " (target <= 1.10)")
    core.constrained.close() if hasattr(core.constrained, "close") else None


if __name__ == "__main__":
    main()
