"""FP8 accuracy of the embedded SmolLM2-135M: top-1 agreement and mean KL against the unquantized
model over a fixed text of >= 20k tokens (issue 33's CPU accuracy target).

    python benchmarks/fp8/bench_fp8_accuracy.py [--tokens 20480] [--window 1024] [--setups ...] [--json out.json]

The text: Python's own language reference topics (`pydoc_data.topics`, part of the standard
library, sorted by topic name), tokenized by the model's tokenizer, cut into windows of
`--window` tokens. Each window is one prefill through the real KV pool and torch_native
attention with logits at every position (so an FP8 KV cache is written and read back for every
position). Two references, every setup scored against both: the float32 model (float32 KV cache)
and the bf16 model (bf16 weights, activations and KV cache: issue 33 states its target against
bf16); the bf16 row against float32 says what bf16 itself costs. KL(reference || setup) in nats,
averaged over positions, and the fraction of positions whose argmax tokens agree. Rows: FP8
weights online (per channel, `--quantization fp8`; per (row, 128 columns) and per channel with
the last decoder layer left unquantized, not server options), FP8 KV cache (`--kv-cache-dtype
fp8_e4m3`, scales 1.0, K in the Hadamard basis as the engine stores it; the "K unrotated" rows as
before d88728f), and the combinations. A setup's model and KV cache compute in float32 unless
named bf16. The "gptq" rows: an offline FP8 checkpoint (gptq_fp8_checkpoint.py: GPTQ rounding and
calibrated per-layer KV scales from standard library sources, never the evaluation text), written
to a temporary folder (or `--gptq-checkpoint`) and loaded by `load_model` as the server loads it.
The "fp8 LM head" rows (weights kind `X+lmhead`): kind X's model with the LM head made FP8 per row as
`--quantize-lm-head` does (`quantize_lm_head_`: SmolLM2's head is tied, so it gets its own FP8 copy
and the embedding stays float32); "fp8 LM head only" on the float32 model (not a server option:
the LM head's own share of the error). `+lmhead-w8a8`: the same head fed per-token FP8 rows of its
input, the numerics of its CUDA path above 16 rows (`torch._scaled_mm`: prefill logit rows, decode
batches > 16), where the CPU and the GEMV read the float rows. The "W8A8" rows (weights kind `fp8-w8a8`): every FP8
decoder projection (not the LM head) fed per-token FP8 rows of its input at every position, the numerics of a server
whose decode steps quantize their rows too (the lowlat plugin's `mrow_w8a8` lines, issues 33 / 34) besides the
`_scaled_mm` prefill: where the CPU path reads the float rows, as the FP8 decode GEMVs do.
The "fp8 LM head GPTQ" rows (weights kind `X+lmhead-gptq`: what `gptq_fp8_checkpoint.py --lm-head`
writes into an offline checkpoint): the head's codes rounded by GPTQ (`fp8_gptq.gptq_quantize_lm_head_`,
RTN's per-row scales) with the Hessian of its input over every position of the calibration text. A
`--gptq-checkpoint` written with `--lm-head` carries its FP8 head into the "fp8 gptq" rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import torch

# (name, weights: "float32" | "bfloat16" | "fp8" (per channel) | "fp8-g128" | "fp8-keep-last" | "fp8-gptq*", each
# optionally "+lmhead" (the LM head FP8 too), kv_cache_dtype ("fp8_e4m3-unrotated": an FP8 cache with K as computed))
SETUPS = [
    ("fp8 weights + fp8 KV (target)", "fp8", "fp8_e4m3"),
    ("fp8 weights + fp8 KV, K unrotated", "fp8", "fp8_e4m3-unrotated"),
    ("fp8 weights", "fp8", "auto"),
    ("fp8 KV cache", "float32", "fp8_e4m3"),
    ("fp8 KV cache, K unrotated", "float32", "fp8_e4m3-unrotated"),
    ("fp8 weights g128 + fp8 KV", "fp8-g128", "fp8_e4m3"),
    ("bf16 weights + bf16 KV", "bfloat16", "auto"),
    ("fp8 weights, last layer bf16 + fp8 KV", "fp8-keep-last", "fp8_e4m3"),
    ("fp8 weights, last layer bf16", "fp8-keep-last", "auto"),
    ("fp8 gptq weights + fp8 KV", "fp8-gptq", "fp8_e4m3"),
    ("fp8 gptq weights", "fp8-gptq", "auto"),
    ("fp8 gptq weights (float Hessians) + fp8 KV", "fp8-gptq-float", "fp8_e4m3"),
    ("fp8 gptq weights, last layer bf16 + fp8 KV", "fp8-gptq-keep-last", "fp8_e4m3"),
    ("fp8 weights + fp8 LM head + fp8 KV", "fp8+lmhead", "fp8_e4m3"),
    ("fp8 weights + fp8 LM head", "fp8+lmhead", "auto"),
    ("fp8 gptq weights + fp8 LM head + fp8 KV", "fp8-gptq+lmhead", "fp8_e4m3"),
    ("fp8 LM head only", "float32+lmhead", "auto"),
    ("fp8 weights + fp8 LM head W8A8 + fp8 KV", "fp8+lmhead-w8a8", "fp8_e4m3"),
    ("fp8 weights + fp8 LM head GPTQ + fp8 KV", "fp8+lmhead-gptq", "fp8_e4m3"),
    ("fp8 gptq weights + fp8 LM head GPTQ + fp8 KV", "fp8-gptq+lmhead-gptq", "fp8_e4m3"),
    ("fp8 weights W8A8 + fp8 KV", "fp8-w8a8", "fp8_e4m3"),
    ("fp8 weights W8A8", "fp8-w8a8", "auto"),
]
# a weights kind with the LM head FP8 too (`--quantize-lm-head`); "-w8a8": its rows quantized per token first;
# "-gptq": its codes rounded by GPTQ on the calibration text
LM_HEAD_SUFFIXES = ("+lmhead-w8a8", "+lmhead-gptq", "+lmhead")


def gptq_lm_head_(model: torch.nn.Module, calib: list[list[int]], window: int) -> None:
    """`model`'s LM head made FP8 with GPTQ rounding (`fp8_gptq.gptq_quantize_lm_head_`, as gptq_fp8_checkpoint.py
    --lm-head writes it): the Hessian of its input over every position of the calibration sequences (each cut to
    `window` tokens, one prefill each), RTN's per-row scales. Mutates the model."""
    from lmserver.models.fp8_gptq import gptq_quantize_lm_head_
    from lmserver.runner.accuracy import window_logits, window_runner

    gptq_quantize_lm_head_(model, lambda: [window_logits(window_runner(model, window), seq[:window]) for seq in calib])


class RowsQuantizedHead(torch.nn.Module):
    """An FP8 LM head fed its input quantized per token (float8 rows, one scale each), as its CUDA path above
    16 rows (`Fp8Linear.forward_fp8_rows` after the per-token quantizer) computes it; the dequantizing torch
    arithmetic here."""

    def __init__(self, head: Any) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lmserver.kernels.fp8_ref import quantize_fp8_per_token

        q, scale = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
        return self.head.forward_fp8_rows(q, scale, x.dtype).view(*x.shape[:-1], -1)  # type: ignore[no-any-return]
REFERENCES = ("float32", "bfloat16")


def rows_quantized_(model: torch.nn.Module) -> None:
    """Every FP8 projection of ``model`` except the LM head fed its input quantized per token (``RowsQuantizedHead``
    around it: e4m3 rows, scale amax / 448 each); mutates ``model``."""
    from lmserver.layers.fp8_linear import Fp8Linear

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear) and name != "lm_head":
                setattr(parent, name, RowsQuantizedHead(child))


def text_windows(tokenizer: Any, num_tokens: int, window: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < num_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {num_tokens}")
    n = num_tokens // window
    return [ids[i * window : (i + 1) * window] for i in range(n)]


# calibration text of the GPTQ setups (not the evaluation text): the sources of these standard
# library modules (code, comments and docstrings), `--calib-tokens` in sequences of `--calib-len`,
# taken from each module in turn
CALIBRATION_MODULES = ("textwrap", "difflib", "argparse", "logging", "email.message", "http.client")


def calibration_sequences(tokenizer: Any, num_tokens: int, seq_len: int) -> list[list[int]]:
    import importlib

    sources = [tokenizer(Path(importlib.import_module(m).__file__ or "").read_text())["input_ids"]
               for m in CALIBRATION_MODULES]
    out: list[list[int]] = []
    offset = 0
    while sum(map(len, out)) < num_tokens:
        for ids in sources:
            chunk = ids[offset : offset + seq_len]
            if len(chunk) == seq_len and sum(map(len, out)) < num_tokens:
                out.append(chunk)
        offset += seq_len
        if offset >= max(map(len, sources)):
            break
    return out


def build(config: Any, path: Path, weights: str, window: int, calib: list[list[int]] | None = None,
          gptq_checkpoint: str | None = None) -> torch.nn.Module:
    from lmserver.models.loader import load_model
    from lmserver.models.quantization import quantize_linears_, use_fp8_path

    if weights == "bfloat16":
        return load_model(config, path, dtype=torch.bfloat16, max_positions=window)
    if weights == "fp8":
        return load_model(config, path, dtype=torch.float32, max_positions=window, quantization="fp8")
    if weights == "fp8-w8a8":  # per channel, every projection's rows quantized per token (W8A8 at every step)
        model = load_model(config, path, dtype=torch.float32, max_positions=window, quantization="fp8")
        rows_quantized_(model)
        return model
    if weights in ("fp8-gptq", "fp8-gptq-keep-last"):  # offline GPTQ checkpoint, loaded as the server loads it
        import tempfile

        from gptq_fp8_checkpoint import make_gptq_checkpoint

        from lmserver.models.loader import read_model_config

        assert calib is not None
        keep_last = weights.endswith("-keep-last")
        if gptq_checkpoint is not None and not keep_last:
            folder = Path(gptq_checkpoint)
        else:
            folder = Path(tempfile.mkdtemp(prefix="gptq-fp8-"))
            make_gptq_checkpoint(path, folder, sum(map(len, calib)), len(calib[0]), keep_last)
        return load_model(read_model_config(folder), folder, dtype=torch.float32, max_positions=window)
    if weights == "fp8-gptq-float":  # GPTQ with Hessians of the unquantized model (one pass per sequence)
        from lmserver.models.fp8_gptq import gptq_quantize_linears_
        from lmserver.runner.accuracy import calibration_forward

        assert calib is not None
        model = load_model(config, path, dtype=torch.float32, max_positions=max(window, *map(len, calib)))
        gptq_quantize_linears_(model, lambda: [calibration_forward(model, [c]) for c in calib], sequential=False)
        use_fp8_path(model, "cpu")
        return model
    model = load_model(config, path, dtype=torch.float32, max_positions=window)
    if weights == "fp8-g128":
        quantize_linears_(model, 128)
    elif weights == "fp8-keep-last":  # per channel, the last decoder layer's projections unquantized
        quantize_linears_(model, None, keep_layers=(-1,))
    use_fp8_path(model, "cpu")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--setups", nargs="*", default=None, help="names of SETUPS rows (default: all)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--calib-tokens", type=int, default=4096, help="GPTQ setups: calibration tokens")
    # NOTE: the calibration text is `calibration_sequences` (CALIBRATION_MODULES), disjoint from the evaluation text
    parser.add_argument("--calib-len", type=int, default=512, help="GPTQ setups: tokens per calibration sequence")
    parser.add_argument("--gptq-checkpoint", default=None,
                        help="the fp8-gptq setups' checkpoint, written by gptq_fp8_checkpoint.py (default: written now)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lmserver.models.loader import load_model, read_model_config
    from lmserver.models.quantization import quantize_lm_head_, use_fp8_path
    from lmserver.runner.accuracy import agreement, merge, window_logits, window_runner

    if args.model_path is None:
        from lmserver.models.default_model import default_model_path

        path = default_model_path()
    else:
        path = Path(args.model_path)
    config = read_model_config(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    windows = text_windows(tokenizer, args.tokens, args.window)
    start = time.perf_counter()
    ref_model = load_model(config, path, dtype=torch.float32, max_positions=args.window)
    bf16_model = build(config, path, "bfloat16", args.window)
    ref_runners = [window_runner(ref_model, args.window), window_runner(bf16_model, args.window)]
    setups = [s for s in SETUPS if not args.setups or s[0] in args.setups]
    models: dict[str, torch.nn.Module] = {"float32": ref_model, "bfloat16": bf16_model}
    calib = calibration_sequences(tokenizer, args.calib_tokens, args.calib_len)
    for _, weights, _ in setups:  # one model per weights kind (a GPTQ model is calibrated once)
        suffix = next((s for s in LM_HEAD_SUFFIXES if weights.endswith(s)), "")
        base = weights.removesuffix(suffix)
        if base not in models:
            models[base] = build(config, path, base, args.window, calib, args.gptq_checkpoint)
        if weights not in models:  # X+lmhead: a copy of X's model, its LM head FP8 (X's own model unchanged)
            model = models[weights] = copy.deepcopy(models[base])
            if suffix == "+lmhead-gptq":
                gptq_lm_head_(model, calib, args.window)
            else:
                quantize_lm_head_(model)
            use_fp8_path(model, "cpu")
            if suffix == "+lmhead-w8a8":
                model.lm_head = RowsQuantizedHead(model.lm_head)
    runners = [window_runner(models[weights], args.window, kv.removesuffix("-unrotated"),
                             rotate_k=not kv.endswith("-unrotated"))
               for _, weights, kv in setups]
    # parts[reference][setup]: the bf16 reference's own row against float32 comes first
    parts: list[list[list[Any]]] = [[[] for _ in setups] for _ in REFERENCES]
    bf16_vs_float32: list[Any] = []
    seconds = [0.0] * len(setups)
    # NOTE: window by window, every setup against the references' logits of that window (all kept
    # would be 20k x 49k floats)
    for i, w in enumerate(windows):
        refs = [window_logits(r, w) for r in ref_runners]
        bf16_vs_float32.append(agreement(refs[0], refs[1]))
        for j, (runner, (_, weights, kv)) in enumerate(zip(runners, setups, strict=True)):
            t0 = time.perf_counter()
            same = next((r for r, name in zip(refs, REFERENCES, strict=True) if weights == name and kv == "auto"), None)
            logits = same if same is not None else window_logits(runner, w)
            for ref, part in zip(refs, parts, strict=True):
                part[j].append(agreement(ref, logits))
            seconds[j] += time.perf_counter() - t0
        print(f"window {i + 1}/{len(windows)}: bf16 vs float32 {bf16_vs_float32[-1].top1:.4f}; " + ", ".join(
            f"{s[0]}: top-1 {p[-1].top1:.4f} / {q[-1].top1:.4f} KL {p[-1].mean_kl:.5f} / {q[-1].mean_kl:.5f}"
            for s, p, q in zip(setups, parts[0], parts[1], strict=True)), flush=True)
    rows: list[dict[str, Any]] = []
    for j, ((name, weights, kv), sec) in enumerate(zip(setups, seconds, strict=True)):
        row: dict[str, Any] = {"setup": name, "weights": weights, "kv_cache_dtype": kv, "seconds": sec}
        for ref_name, part in zip(REFERENCES, parts, strict=True):
            score = merge(part[j])
            row["positions"] = score.num_positions
            row[ref_name] = {"top1": score.top1, "mean_kl": score.mean_kl, "max_kl": score.max_kl}
        rows.append(row)
    own = merge(bf16_vs_float32)
    print(f"\n{len(windows)} windows x {args.window} tokens; {time.perf_counter() - start:.0f} s")
    print(f"bf16 model against the float32 model: top-1 {own.top1:.4f}, mean KL {own.mean_kl:.5f}, "
          f"max KL {own.max_kl:.3f}\n")
    print("| setup | weights | KV cache | positions | top-1 vs bf16 | mean KL vs bf16 | top-1 vs float32 | "
          "mean KL vs float32 | max KL vs float32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, f = r["bfloat16"], r["float32"]
        print(f"| {r['setup']} | {r['weights']} | {r['kv_cache_dtype']} | {r['positions']} | {b['top1']:.4f} | "
              f"{b['mean_kl']:.5f} | {f['top1']:.4f} | {f['mean_kl']:.5f} | {f['max_kl']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"bf16_vs_float32": own.__dict__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
