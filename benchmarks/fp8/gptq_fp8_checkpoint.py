"""Offline FP8 with GPTQ rounding (issue 33): writes a compressed-tensors FP8 checkpoint of a model
(default: the embedded SmolLM2-135M) whose decoder projections are rounded onto e4m3 with GPTQ's
error compensation, and with calibrated per-layer FP8 KV-cache scales; `lmserver serve --model-path
OUT --kv-cache-dtype fp8_e4m3` loads it as any FP8 checkpoint.

    python benchmarks/fp8/gptq_fp8_checkpoint.py OUT [--model-path SRC] [--calib-tokens 4096] [--calib-len 512]
        [--keep-last] [--no-kv-scales] [--lm-head]

Calibration text: bench_fp8_accuracy.py's `calibration_sequences` (standard library module sources,
not the evaluation text), fed as one forward (sequential GPTQ: each projection rounded when the
forward reaches it, later ones see FP8 inputs); the KV scales from a second forward through the
rounded model (lmserver.models.fp8_gptq).

`--lm-head`: the LM head FP8 too, GPTQ-rounded (`gptq_quantize_lm_head_`) with the Hessian of its
input over every position of the same calibration sequences, run through the rounded projections
(one prefill each, logits at every position); per-row scales (round to nearest's, as
`--quantize-lm-head`), written as the checkpoint's FP8 `lm_head`. A tied head is untied: config.json
says `tie_word_embeddings: false` and the embedding stays as the source stores it. The server loads
that head as FP8 with or without `--quantize-lm-head` (which never re-rounds an FP8 head).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_accuracy import calibration_sequences  # noqa: E402


def make_gptq_checkpoint(src: Path, out: Path, calib_tokens: int, calib_len: int, keep_last: bool = False,
                         kv_scales: bool = True, lm_head: bool = False) -> Path:
    """Calibrates, rounds and writes the checkpoint (`lm_head`: with a GPTQ-rounded FP8 LM head); prints what it
    did; returns `out`."""
    from transformers import AutoTokenizer

    from lmserver.models.fp8_gptq import (
        calibrate_kv_scales,
        gptq_quantize_linears_,
        gptq_quantize_lm_head_,
        write_fp8_checkpoint,
    )
    from lmserver.models.loader import load_model, read_model_config
    from lmserver.runner.accuracy import calibration_forward, window_logits, window_runner

    calib = calibration_sequences(AutoTokenizer.from_pretrained(str(src)), calib_tokens, calib_len)
    model = load_model(read_model_config(src), src, dtype=torch.float32, max_positions=calib_len)
    t0 = time.perf_counter()
    reports = gptq_quantize_linears_(model, lambda: calibration_forward(model, calib),
                                     keep_layers=(-1,) if keep_last else ())
    g, r = (sum(getattr(x, a) for x in reports) / len(reports) for a in ("gptq", "rtn"))
    print(f"GPTQ: {len(reports)} projections rounded in {time.perf_counter() - t0:.0f} s on "
          f"{sum(map(len, calib))} calibration tokens ({len(calib)} x {calib_len}); mean relative output error on "
          f"them {g:.3g} (round to nearest {r:.3g})", flush=True)
    if lm_head:
        t0 = time.perf_counter()
        head = gptq_quantize_lm_head_(model, lambda: [window_logits(window_runner(model, calib_len), seq)
                                                      for seq in calib])
        print(f"GPTQ LM head: rounded in {time.perf_counter() - t0:.0f} s on every position of the calibration "
              f"sequences; relative output error on them {head.gptq:.3g} (round to nearest {head.rtn:.3g})",
              flush=True)
    if kv_scales:
        scales = calibrate_kv_scales(model, lambda: calibration_forward(model, calib))
        print("KV scales (k, v) of layers 0-2: "
              + ", ".join(f"{s['k']:.4f}/{s['v']:.4f}" for _, s in sorted(scales.items())[:3]), flush=True)
    return write_fp8_checkpoint(model, src, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--calib-len", type=int, default=512)
    parser.add_argument("--keep-last", action="store_true", help="leave the last decoder layer unquantized")
    parser.add_argument("--no-kv-scales", action="store_true", help="no calibrated KV scales (1.0 when served)")
    parser.add_argument("--lm-head", action="store_true",
                        help="also a GPTQ-rounded FP8 LM head (per-row scales; a tied head untied)")
    args = parser.parse_args()
    if args.model_path is None:
        from lmserver.models.default_model import default_model_path

        src = default_model_path()
    else:
        src = Path(args.model_path)
    out = make_gptq_checkpoint(src, Path(args.out), args.calib_tokens, args.calib_len, args.keep_last,
                               not args.no_kv_scales, args.lm_head)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
