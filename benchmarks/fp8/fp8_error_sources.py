"""Where the FP8 error of the embedded SmolLM2-135M comes from (issue 33): one quantized part at a time
against the float32 model, top-1 agreement and mean KL over the windows of bench_fp8_accuracy.py.

    python benchmarks/fp8/fp8_error_sources.py [--tokens 1024] [--window 256] [VARIANT ...]

Variants (default: all): weights `w_all` (every decoder projection, per channel, what
`--quantization fp8` does), one projection kind (`w_qkv`, `w_o`, `w_gateup`, `w_down`), or all but
some layers (`w_skip0`, `w_skiplast`, `w_skip_first_last`, `w_skip01last`); KV cache rounded to e4m3
(a float32 pool whose `quantize` rounds through FP8, so K and V can be tried apart and with scales the
pool does not offer): `kv_k_t1` / `kv_v_t1` (K or V only, scale 1.0), `kv_t1` (both), `kv_head`
(one dynamic scale per head: its absolute max over the window's tokens / 448), `kv_token` (per token
and head), `kv_k_smooth` / `kv_smooth` (K minus its mean over the window's tokens per head and
channel before rounding, as SageAttention smooths K: softmax is unchanged by that shift).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_accuracy import text_windows  # noqa: E402


def round_fp8(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x (T, H, D) rounded through e4m3 with the `mode`'s scales, back in float32. Pure."""
    from lmserver.kernels.fp8_ref import FP8_DTYPE, FP8_MAX

    x = x.float()
    if mode == "smooth":
        x = x - x.mean(dim=0, keepdim=True)
    if mode == "head":
        s = x.abs().amax(dim=(0, 2), keepdim=True).clamp_min(1e-6) / FP8_MAX
    elif mode == "token":
        s = x.abs().amax(dim=2, keepdim=True).clamp_min(1e-6) / FP8_MAX
    else:
        s = torch.ones(())
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("variants", nargs="*")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lmserver.forward import kv_pool
    from lmserver.models.default_model import default_model_path
    from lmserver.models.loader import load_model, read_model_config
    from lmserver.models.quantization import FP8_LINEAR_NAMES, replace_with_fp8_, use_fp8_path
    from lmserver.runner.accuracy import Agreement, agreement, merge, window_logits, window_runner

    path = default_model_path()
    config = read_model_config(path)
    windows = text_windows(AutoTokenizer.from_pretrained(str(path)), args.tokens, args.window)
    ref = load_model(config, path, dtype=torch.float32, max_positions=args.window)
    last = config.num_hidden_layers - 1

    def layer(name: str) -> int:
        found = re.search(r"layers\.(\d+)\.", name)
        return int(found.group(1)) if found else -1

    def fp8_model(select: Callable[[str], bool]) -> torch.nn.Module:
        m = load_model(config, path, dtype=torch.float32, max_positions=args.window)
        names = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)
                 and n.rpartition(".")[2] in FP8_LINEAR_NAMES and select(n)]
        replace_with_fp8_(m, names, None, quantize=True)
        use_fp8_path(m, "cpu")
        return m

    weights: dict[str, Callable[[str], bool]] = {
        "w_all": lambda n: True, "w_qkv": lambda n: n.endswith("qkv_proj"), "w_o": lambda n: n.endswith("o_proj"),
        "w_gateup": lambda n: n.endswith("gate_up_proj"), "w_down": lambda n: n.endswith("down_proj"),
        "w_skip0": lambda n: layer(n) != 0, "w_skiplast": lambda n: layer(n) != last,
        "w_skip_first_last": lambda n: layer(n) not in (0, last), "w_skip01last": lambda n: layer(n) not in (0, 1, last),
    }
    kv: dict[str, tuple[str | None, str | None]] = {
        "kv_k_t1": ("tensor1", None), "kv_v_t1": (None, "tensor1"), "kv_t1": ("tensor1", "tensor1"),
        "kv_head": ("head", "head"), "kv_token": ("token", "token"), "kv_k_smooth": ("smooth", None),
        "kv_smooth": ("smooth", "tensor1"),
    }
    chosen = args.variants or [*weights, *kv]
    unknown = [v for v in chosen if v not in weights and v not in kv]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {[*weights, *kv]}")
    original = kv_pool.KVPool.quantize

    def rounding(k_mode: str | None, v_mode: str | None) -> Any:
        def quantize(self: Any, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return ((round_fp8(k, k_mode) if k_mode else k).to(self.dtype),
                    (round_fp8(v, v_mode) if v_mode else v).to(self.dtype))
        return quantize

    ref_runner = window_runner(ref, args.window)
    runners = {v: window_runner(fp8_model(weights[v]) if v in weights else ref, args.window) for v in chosen}
    parts: dict[str, list[Agreement]] = {v: [] for v in chosen}
    start = time.perf_counter()
    try:
        for i, w in enumerate(windows):
            kv_pool.KVPool.quantize = original  # type: ignore[method-assign]
            ref_logits = window_logits(ref_runner, w)
            for v in chosen:
                kv_pool.KVPool.quantize = rounding(*kv[v]) if v in kv else original  # type: ignore[method-assign]
                parts[v].append(agreement(ref_logits, window_logits(runners[v], w)))
            print(f"window {i + 1}/{len(windows)}: " + "; ".join(
                f"{v} {merge(parts[v]).top1:.4f} / {merge(parts[v]).mean_kl:.5f}" for v in chosen), flush=True)
    finally:
        kv_pool.KVPool.quantize = original  # type: ignore[method-assign]
    print(f"\n{len(windows)} windows x {args.window} tokens, reference float32; {time.perf_counter() - start:.0f} s\n")
    print("| variant | positions | top-1 agreement | mean KL (nats) | max KL |")
    print("|---|---|---|---|---|")
    for v in chosen:
        s = merge(parts[v])
        print(f"| {v} | {s.num_positions} | {s.top1:.4f} | {s.mean_kl:.5f} | {s.max_kl:.3f} |")


if __name__ == "__main__":
    main()
