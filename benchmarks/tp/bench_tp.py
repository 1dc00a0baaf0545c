"""Tensor parallelism: greedy tokens of TP=N vs TP=1, and decode tokens/s at batch 1 and 8.

Random ("dummy") weights of a model shape (default: Llama-3-8B) in one process per TP size,
through the offline `lmserver.Engine`; prompts are random token ids. A tokenizer folder is
needed only for detokenization (`--tokenizer`, default: the embedded SmolLM2 tokenizer; ids
beyond its vocabulary decode to nothing, which does not matter here).

    python benchmarks/tp/bench_tp.py --tp-sizes 1,2 [--shape llama3-8b] [--cuda-graph] [--json out.json]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 128001,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
}


def model_folder(shape: str, tokenizer: Path) -> str:
    folder = Path(tempfile.mkdtemp(prefix=f"bench-tp-{shape}-"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / f, folder / f)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape]))
    return str(folder)


def decode_step_s(engine: Any, prompts: list[list[int]], decode_tokens: int) -> float:
    """Seconds per decode step of `prompts` together (greedy): a warm-up, a prefill-only run, then `decode_tokens`
    steps after the prefill, the prefill-only run's time taken off; the prefix cache flushed between runs."""
    greedy = {"temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": 4})  # warm-up
    engine.core.flush_cache()
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": 1})
    prefill_s = time.perf_counter() - t
    engine.core.flush_cache()
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": decode_tokens + 1})
    total_s = time.perf_counter() - t
    engine.core.flush_cache()
    return (total_s - prefill_s) / decode_tokens


def run(tp: int, path: str, args: argparse.Namespace) -> dict[str, Any]:
    from lmserver import Engine

    t0 = time.perf_counter()
    engine = Engine(
        model_path=path,
        load_format="dummy",
        dtype=args.dtype,
        context_length=2048,
        max_total_tokens=args.kv_tokens,
        tp_size=tp,
        log_level="warning",
        attention_backend=args.attention_backend,
        disable_cuda_graph=not args.cuda_graph,
        enable_tp_cuda_graph=args.cuda_graph,
        cuda_graph_max_bs=8,
    )
    build_s = time.perf_counter() - t0
    print(f"[tp={tp}] built in {build_s:.1f} s", flush=True)
    rng = random.Random(0)
    check_prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (16, 64)]
    greedy = {"temperature": 0, "ignore_eos": True}
    try:
        outs = engine.generate(
            input_ids=check_prompts, sampling_params={**greedy, "max_new_tokens": args.check_tokens}
        )
        tokens = [o["output_ids"] for o in outs]
        result: dict[str, Any] = {"tp": tp, "build_s": build_s, "tokens": tokens}
        print(f"[tp={tp}] greedy check done", flush=True)
        for bs in args.batch_sizes:
            prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(bs)]
            step_s = decode_step_s(engine, prompts, args.decode_tokens)
            result[f"bs{bs}_step_ms"] = step_s * 1e3
            result[f"bs{bs}_tok_s_per_user"] = 1 / step_s
            print(f"[tp={tp}] bs{bs}: {step_s * 1e3:.2f} ms/step", flush=True)
        return result
    finally:
        if engine.core.tp is not None:
            engine.core.tp.shutdown()
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json and tokenizer_config.json")
    p.add_argument(
        "--batch-sizes", default="1,8", help='decode timing batch sizes; "none" checks tokens only'
    )
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                   help="decode CUDA graphs on every rank (--enable-tp-cuda-graph under TP; sizes up to 8)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=32768)
    p.add_argument("--json", default=None)
    p.add_argument("--hang-s", type=float, default=900, help="dump stacks and exit after this many seconds")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip() and b != "none"]
    if args.tokenizer is None:
        from lmserver.models.default_model import default_model_path

        args.tokenizer = str(default_model_path())
    path = model_folder(args.shape, Path(args.tokenizer))
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hang prints every thread's stack
    runs = [run(int(tp), path, args) for tp in args.tp_sizes.split(",")]
    faulthandler.cancel_dump_traceback_later()
    base = runs[0]["tokens"]
    print(
        f"\n{args.shape} ({args.dtype}, dummy weights), prompt {args.prompt_len}, {args.decode_tokens} decode steps, "
        f"CUDA graphs {'on' if args.cuda_graph else 'off'}"
    )
    head = f"{'tp':>3} {'build s':>8} {'same as tp1':>13}" + "".join(
        f" {f'bs{b} ms/step':>13} {f'bs{b} tok/s/user':>15}" for b in args.batch_sizes
    )
    print(head)
    for r in runs:
        # tokens before the first divergence from TP=1, summed over prompts
        same = sum(len(os.path.commonprefix([x, y])) for x, y in zip(base, r["tokens"], strict=True))
        total = sum(len(x) for x in base)
        r["greedy_match"] = f"{same}/{total}"
        r["greedy_identical"] = r["tokens"] == base
        line = f"{r['tp']:>3} {r['build_s']:>8.1f} {r['greedy_match']:>13}"
        for b in args.batch_sizes:
            line += f" {r[f'bs{b}_step_ms']:>13.2f} {r[f'bs{b}_tok_s_per_user']:>15.1f}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    sys.stdout.flush()
    # NOTE: after NCCL collectives were captured in CUDA graphs, tearing the communicator down can
    # hang (pytorch/pytorch#115388): leave without the interpreter's exit hooks.
    os._exit(0)


if __name__ == "__main__":
    main()
