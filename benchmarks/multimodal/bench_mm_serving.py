"""Images through the HTTP server: reuse, time to first token, decode speed (issue 28's targets).

    python benchmarks/multimodal/bench_mm_serving.py --model-path LLAVA_FOLDER \\
        --server-args "--load-format dummy --dtype bfloat16 --device cuda" [--json OUT]

Three measurements, each against a reference in the same run:

1. reuse: a llava-bench-in-the-wild-shaped workload (24 images, 5 questions each, arriving
   interleaved: every image once, then again with the next question...) on a server with the
   radix cache and the encoder cache, then on one with both off; throughput ratio, and the
   radix hit rate next to the optimal one (each request reusing its longest prefix of any
   earlier request, computed on the token keys).
2. TTFT of one-image requests (fresh images) vs the vision tower's own time (timed in this
   process on the same model class, CUDA events) plus the TTFT of text-only requests of the same
   token count.
3. per-user decode speed at batch 1 with an image in the context vs text-only at the same length.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

QUESTIONS = ["Describe this image in detail.", "What is unusual about this image?",
             "What colors dominate the picture?", "Write a short story inspired by the image.",
             "How many distinct objects can you see, and where are they?"]


def make_jpeg(seed: int, width: int = 640, height: int = 480) -> bytes:
    """A smooth random picture (a small noise grid upscaled), about the size of a photo's JPEG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((width, height), Image.Resampling.BICUBIC).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def prompt_of(question: str) -> str:
    return f"USER: <image>\n{question} ASSISTANT:"


@dataclass
class Done:
    latency_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    itl_s: list[float]


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> Done:
    """One streamed /generate; times the first token and the gaps after it."""
    start = time.perf_counter()
    first: float | None = None
    stamps: list[float] = []
    meta: dict[str, Any] = {}
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            now = time.perf_counter()
            if first is None:
                first = now
            stamps.append(now)
            meta = event["meta_info"]
    end = time.perf_counter()
    assert first is not None
    return Done(end - start, first - start, meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"],
                [b - a for a, b in zip(stamps, stamps[1:], strict=False)])


def reuse_requests(images: list[bytes], max_new: int) -> list[tuple[int, int, dict[str, Any]]]:
    """(image, question, body) in arrival order: every image with question 0, then 1, ..."""
    out = []
    for q in range(len(QUESTIONS)):
        for i, img in enumerate(images):
            out.append((i, q, {"text": prompt_of(QUESTIONS[q]), "image_data": data_url(img),
                               "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0,
                                                   "ignore_eos": True}}))
    return out


def optimal_hit_tokens(keys: list[list[int]]) -> int:
    """Σ over requests of the longest prefix shared with any earlier request (capped at len - 1)."""
    total = 0
    for j, key in enumerate(keys):
        best = 0
        for other in keys[:j]:
            n = 0
            for a, b in zip(key, other, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        total += min(best, len(key) - 1)
    return total


async def run_reuse(base_url: str, reqs: list[tuple[int, int, dict[str, Any]]], concurrency: int) -> dict[str, Any]:
    """Sends `reqs` in order from `concurrency` workers, each with an HTTP client (and connection) of its own.

    NOTE: one httpx client shared by all workers scans its whole connection pool on every request event
    (httpcore's `_assign_requests_to_connections`, quadratic in the connections): at 120 connections that
    was most of the client's CPU time in a profile on the dev CPU, so the client, not the server, bounded
    the cached server's throughput. A client per worker keeps each pool at one connection."""
    import ssl

    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for _, _, body in reqs:
        queue.put_nowait(body)
    done: list[Done] = []
    context = ssl.create_default_context()  # one for all clients (each would load the CA bundle)
    # NOTE: the clients exist before the clock starts (120 of them took 0.29 s to build on the dev CPU, time
    # in which the later workers' first requests waited): the run times the server, not the client's set-up
    clients = [httpx.AsyncClient(base_url=base_url, timeout=600, verify=context)
               for _ in range(min(concurrency, len(reqs)))]
    sent: list[float] = []

    async def worker(client: httpx.AsyncClient) -> None:
        async with client:
            while not queue.empty():
                sent.append(time.perf_counter())
                done.append(await generate(client, queue.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*(worker(client) for client in clients))
    wall = time.perf_counter() - start
    prompt = sum(d.prompt_tokens for d in done)
    return {"requests": len(done), "wall_s": wall, "req_per_s": len(done) / wall,
            "output_tok_per_s": sum(d.completion_tokens for d in done) / wall,
            "prompt_tokens": prompt, "cached_tokens": sum(d.cached_tokens for d in done),
            "hit_rate": sum(d.cached_tokens for d in done) / prompt,
            "mean_latency_s": statistics.mean(d.latency_s for d in done),
            "mean_ttft_s": statistics.mean(d.ttft_s for d in done),
            # when the last request left the client, from the start (all 120 at once: the client's own pace)
            "last_sent_s": max(sent) - start}


def start_server(model_path: str, server_args: str, extra: list[str]) -> Any:
    from lmserver.testing import ServerProcess

    srv = ServerProcess(["--model-path", model_path, *shlex.split(server_args), *extra], core=None)
    srv.start(timeout_s=900)
    return srv


def vision_tower_ms(model_path: str, dtype: str, image: bytes, device: str, repeats: int = 20,
                    graphs: bool = False) -> float:
    """Median time of one image through our model's encoder (tower + projector), synchronized;
    `graphs`: replayed from the CUDA graphs the server captures (runner/encoder_graph.py)."""
    import torch

    from lmserver.models.loader import DTYPES, load_model, read_model_config
    from lmserver.multimodal.processor import ImageProcessor

    config = read_model_config(model_path)
    model = load_model(config, model_path, load_format="dummy", dtype=DTYPES[dtype], device=device,
                       max_positions=4096)
    proc = ImageProcessor.from_model_folder(model_path)
    assert proc is not None
    pixels = torch.from_numpy(proc.process_image(image).pixel_values).to(device, DTYPES[dtype])
    if graphs:
        from lmserver.engine.multimodal import MultimodalInputs

        if not MultimodalInputs(model, torch.device(device), DTYPES[dtype], 0).capture_encoder_graphs():
            raise RuntimeError("no encoder graphs on this device / model")
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 3):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.encode_images([pixels], [(480, 640)])
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[3:])


def preprocess_ms(model_path: str, image: bytes, repeats: int = 20) -> float:
    """Median time of the server's preprocessing of one image (decode, resize, crop, normalize)."""
    from lmserver.multimodal.processor import ImageProcessor

    proc = ImageProcessor.from_model_folder(model_path)
    assert proc is not None
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        proc.process_image(image)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


async def sequential(base_url: str, bodies: list[dict[str, Any]]) -> list[Done]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        return [await generate(client, body) for body in bodies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--server-args", default="--load-format dummy --dtype bfloat16 --device cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-new-tokens", type=int, nargs="*", default=[32, 128],
                        help="answer lengths of the reuse workload (one run per value; none: no reuse runs)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32],
                        help="clients of the reuse workload (one run per value; 120: every request at once)")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_path)
    image_id = tok.convert_tokens_to_ids("<image>")
    images = [make_jpeg(i) for i in range(24)]
    result: dict[str, Any] = {"vision_tower_ms": vision_tower_ms(args.model_path, args.dtype, images[0], args.device),
                              "preprocess_ms": preprocess_ms(args.model_path, images[0])}
    if args.device == "cuda":
        result["vision_tower_graph_ms"] = vision_tower_ms(args.model_path, args.dtype, images[0], args.device,
                                                          graphs=True)
    print(f"vision tower + projector, one image: {result['vision_tower_ms']:.2f} ms eager, "
          f"{result.get('vision_tower_graph_ms', float('nan')):.2f} ms from CUDA graphs (as the server runs it); "
          f"preprocessing (this host's CPU, one thread): {result['preprocess_ms']:.2f} ms", flush=True)

    srv = start_server(args.model_path, args.server_args, [])
    try:
        # 2. TTFT: fresh images vs text-only prompts of the same token count (random ids, no hits)
        fresh = [make_jpeg(1000 + i) for i in range(12)]
        one = [{"text": prompt_of(QUESTIONS[0]), "image_data": data_url(img),
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}} for img in fresh]
        img_runs = asyncio.run(sequential(srv.base_url, one))[2:]
        n_prompt = img_runs[0].prompt_tokens
        tokens_per_image = n_prompt - len(tok(prompt_of(QUESTIONS[0]))["input_ids"]) + 1
        rng = np.random.default_rng(0)
        texts = [{"input_ids": rng.integers(100, image_id - 1, n_prompt).tolist(),
                  "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}} for _ in range(12)]
        text_runs = asyncio.run(sequential(srv.base_url, texts))[2:]
        ttft_img = statistics.median(d.ttft_s for d in img_runs) * 1e3
        ttft_text = statistics.median(d.ttft_s for d in text_runs) * 1e3
        tower = result.get("vision_tower_graph_ms", result["vision_tower_ms"])
        result["ttft"] = {"prompt_tokens": n_prompt, "image_ms": ttft_img, "text_ms": ttft_text,
                          "ratio_to_tower_plus_text": ttft_img / (tower + ttft_text),
                          "ratio_to_eager_tower_plus_text": ttft_img / (result["vision_tower_ms"] + ttft_text)}
        print(f"TTFT ({n_prompt} tokens): one image {ttft_img:.1f} ms, text-only {ttft_text:.1f} ms, "
              f"image / (tower + text) = {result['ttft']['ratio_to_tower_plus_text']:.3f} with the graphed tower, "
              f"{result['ttft']['ratio_to_eager_tower_plus_text']:.3f} with the eager one (target <= 1.10)", flush=True)

        # 3. decode at batch 1: an image in the context vs text-only of the same length
        gen = {"max_new_tokens": args.decode_tokens, "temperature": 0.0, "ignore_eos": True}
        dec_img = asyncio.run(sequential(srv.base_url, [{"text": prompt_of(QUESTIONS[1]), "image_data":
                                                         data_url(fresh[0]), "sampling_params": gen}] * 3))
        dec_txt = asyncio.run(sequential(srv.base_url, [{"input_ids": texts[0]["input_ids"],
                                                         "sampling_params": gen}] * 3))

        def tok_s(runs: list[Done]) -> float:
            return statistics.median(1.0 / statistics.median(d.itl_s) for d in runs)

        result["decode"] = {"image_tok_s": tok_s(dec_img), "text_tok_s": tok_s(dec_txt)}
        result["decode"]["ratio"] = result["decode"]["image_tok_s"] / result["decode"]["text_tok_s"]
        print(f"decode at batch 1: with an image {result['decode']['image_tok_s']:.1f} tok/s, text-only "
              f"{result['decode']['text_tok_s']:.1f} tok/s, ratio {result['decode']['ratio']:.3f} (target 1 +- 0.05)",
              flush=True)

        # 1. reuse: caches on (this server, caches flushed), then a server with both off
        result["reuse"] = {}
        info = httpx.get(srv.base_url + "/get_server_info", timeout=60).json()["scheduler"]
        result["server_encode_ms"] = 1e3 * info["mm_encode_time_s"] / max(info["mm_encoded_items"], 1)
        print(f"encoder time per item inside the server (host time, includes the copy): "
              f"{result['server_encode_ms']:.2f} ms", flush=True)
        keys = []
        for i, _q, body in reuse_requests(images, 1):
            ids = tok(body["text"])["input_ids"]
            key: list[int] = []
            for t in ids:
                key.extend([-1 - i] * tokens_per_image if t == image_id else [t])
            keys.append(key)
        optimal = optimal_hit_tokens(keys) / sum(len(k) for k in keys)
        runs = [(n, c) for n in args.max_new_tokens for c in args.concurrency]
        rows: dict[tuple[int, int], dict[str, Any]] = {run: {"optimal_hit_rate": optimal} for run in runs}
        for name, extra in (("cached", []), ("off", ["--disable-radix-cache", "--mm-encoder-cache-size", "0"])):
            if not runs:
                break
            if name == "off":
                srv.stop()
                srv = start_server(args.model_path, args.server_args, extra)
            for max_new, clients in runs:
                warm = reuse_requests([make_jpeg(2000 + i) for i in range(4)], max_new)[:4]
                asyncio.run(run_reuse(srv.base_url, warm, 4))  # warm-up (first forwards, graphs): other images
                if httpx.post(srv.base_url + "/flush_cache", timeout=60).status_code != 200:
                    raise RuntimeError("flush_cache failed")
                before = httpx.get(srv.base_url + "/get_server_info", timeout=60).json()["scheduler"]
                row = asyncio.run(run_reuse(srv.base_url, reuse_requests(images, max_new), clients))
                after = httpx.get(srv.base_url + "/get_server_info", timeout=60).json()["scheduler"]
                counts = {k: v - before.get(k, 0) for k, v in after.items()
                          if k.startswith("mm_") and isinstance(v, (int, float)) and not k.endswith(("_rate", "_rows"))}
                counts["mm_radix_hit_rate"] = counts["mm_cached_tokens"] / max(counts["mm_tokens"], 1)
                row["server"] = counts
                rows[(max_new, clients)][name] = row
        for (max_new, clients), row in rows.items():
            row["throughput_ratio"] = row["cached"]["req_per_s"] / row["off"]["req_per_s"]
            result["reuse"][f"{max_new}tok_c{clients}"] = row
            print(f"reuse, {max_new} new tokens, {clients} clients: cached {row['cached']['req_per_s']:.2f} req/s, off "
                  f"{row['off']['req_per_s']:.2f} req/s, ratio {row['throughput_ratio']:.2f} (target >= 3); hit "
                  f"rate {row['cached']['hit_rate']:.3f} vs optimal {optimal:.3f}", flush=True)
        srv.stop()
        srv = None
    finally:
        if srv is not None:
            srv.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
