"""Time to first token of one-image requests with the engine's image upload through its reusable
page-locked staging buffer (engine/multimodal.py `HostStaging`) next to the previous path
(`pin_memory()` and a copy per image), alternating in one in-process engine; text-only prompts
of the same length and the tower alone (as the engine runs it: CUDA graphs) as the references of
issue 28's TTFT target; last, both paths' rows for one image compared bit for bit.

    python benchmarks/multimodal/bench_mm_upload.py --model-path LLAVA_FOLDER [--device cuda]

Each encode of the two timed paths is synchronized before and after (to time it), so its device
work does not overlap the prefill's launches as it does in the server: those TTFTs are upper
bounds; `ttft_server` is the staging path untimed, as the server runs it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
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
    parser.add_argument("--warmup-s", type=float, default=5.0, help="text-only prefills before the timed rounds")
    args = parser.parse_args()

    import torch

    from lmserver.config import ServerConfig
    from lmserver.engine.core import EngineCore
    from lmserver.io_struct import GenerateReq, MultimodalItem, SamplingParams
    from lmserver.multimodal.frontend import MediaRef, MultimodalFrontend
    from lmserver.multimodal.gpu_preprocess import run_plan

    core = EngineCore(ServerConfig(model_path=args.model_path, load_format="dummy", dtype=args.dtype,
                                   device=args.device, context_length=4096))
    frontend = MultimodalFrontend.for_model(args.model_path, core.tokenizer, core.resolved_config,
                                            engine_device=args.device)
    assert core.mm is not None and frontend is not None
    mm = core.mm
    frontend.device_preprocess = bool(getattr(frontend.processor, "has_image_plan", False))  # on a CPU too
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    staged = mm._encode

    def pinned_per_image(items: Sequence[MultimodalItem]) -> list[torch.Tensor]:
        tensors = []
        for item in items:
            pixels = torch.from_numpy(item.pixel_values)
            if args.device == "cuda":
                pixels = pixels.pin_memory().to(mm.device, non_blocking=True)
            tensors.append(run_plan(pixels, item.plan, mm.device).to(mm.dtype))
        with torch.inference_mode():
            return mm.model.encode_images(tensors, [tuple(i.image_size) for i in items])  # type: ignore[no-any-return, operator]

    encode_ms: dict[str, list[float]] = {"staged": [], "pinned": []}

    def timed(fn: Callable[[Sequence[MultimodalItem]], list[torch.Tensor]], key: str) -> Any:
        def run(items: Sequence[MultimodalItem]) -> list[torch.Tensor]:
            sync()
            start = time.perf_counter()
            out = fn(items)
            sync()
            encode_ms[key].append((time.perf_counter() - start) * 1e3)
            return out
        return run

    ids = list(core.tokenizer(prompt_of("Describe this image in detail."))["input_ids"])
    params = SamplingParams(max_new_tokens=1, temperature=0.0)

    def first_token(req: GenerateReq) -> float:
        sync()
        start = time.perf_counter()
        core.add_request(req)
        while core.has_work():
            if any(out.new_token_ids for out in core.step()):
                break
        ms = (time.perf_counter() - start) * 1e3
        while core.has_work():
            core.step()
        return ms

    model: Any = core.model
    tile = torch.randn((1, *model.tile_shape()), device=args.device).to(core.dtype)
    tower = []
    with torch.inference_mode():
        for _ in range(args.repeats + 3):
            sync()
            start = time.perf_counter()
            model.project_tiles(tile)
            sync()
            tower.append((time.perf_counter() - start) * 1e3)
    ttft: dict[str, list[float]] = {"staged": [], "pinned": [], "server": [], "text": []}
    rng = np.random.default_rng(0)
    n_tokens = len(ids) + 575
    # NOTE: on the H200 the GPU ran the first rounds of a cold run ~1.45x slower, then switched speed midway (text-only
    # TTFT 20.7-22.6 ms, then 14.1-18.5 ms): text-only prefills first, until the clock has settled
    warm_end = time.perf_counter() + args.warmup_s
    while time.perf_counter() < warm_end:
        first_token(GenerateReq(f"warm{time.perf_counter()}", rng.integers(100, 40000, n_tokens).tolist(), params))
    paths = (("staged", staged), ("pinned", pinned_per_image), ("server", staged))
    for i in range(args.repeats + 2):
        for j, (key, fn) in enumerate(paths if i % 2 else paths[::-1]):
            media = frontend.prepare_blocking([MediaRef("image", data_url(make_jpeg(7000 + 3 * i + j)))])
            expanded, items = frontend.expand(ids, media)
            n_tokens = len(expanded)
            mm._encode = fn if key == "server" else timed(fn, key)  # type: ignore[method-assign]
            ttft[key].append(first_token(GenerateReq(f"{key}{i}", expanded, params, mm_items=items)))
        ttft["text"].append(first_token(GenerateReq(f"text{i}", rng.integers(100, 40000, n_tokens).tolist(), params)))
    med = {f"ttft_{k}": statistics.median(v[2:]) for k, v in ttft.items()}
    med.update({f"encode_{k}": statistics.median(v[2:]) for k, v in encode_ms.items()})
    med["tower_alone"] = statistics.median(tower[3:])
    print(f"{n_tokens} prompt tokens; medians of {args.repeats} (ms), in-process, synchronized:")
    for name, value in med.items():
        print(f"  {name:14s} {value:8.2f}")
    for key in ("staged", "pinned", "server"):
        ratio = med[f"ttft_{key}"] / (med["tower_alone"] + med["ttft_text"])
        # each round's image TTFT over the same round's text-only one (seconds apart: clock changes cancel)
        rounds = statistics.median(a / (med["tower_alone"] + b) for a, b in zip(ttft[key][2:], ttft["text"][2:],
                                                                                strict=True))
        print(f"  {key}: image / (tower + text) = {ratio:.3f} of the medians, {rounds:.3f} per round (median) "
              "(target <= 1.10)")
    media = frontend.prepare_blocking([MediaRef("image", data_url(make_jpeg(9999)))])
    _, items = frontend.expand(ids, media)
    same = torch.equal(staged(items)[0], pinned_per_image(items)[0])
    print(f"  rows of both paths bit-identical: {same}")


if __name__ == "__main__":
    main()
