"""How much FP8 math in a prefill's attention would cost in accuracy, against what the FP8 KV cache already costs
(issue 33; CPU, float64 emulation, no GPU).

The one large FP8-only lever left in the 4k prefill is the attention's own math (the FP8 path's GEMMs and quantizers
run at their floors, RESULTS.md "FP8 (issue 33)"): FP8 tensor cores for S = q k^T (q quantized per row) and / or
for P v (P scaled by 256 and rounded to e4m3, V the cache's e4m3 values). This script measures, per head, the
relative error (Frobenius) of causal attention against a float64 reference over the cache's dequantized K / V:

- `FP8 KV`: the reference itself against unquantized K / V (what the FP8 cache already costs);
- `bf16 q, P`: the kernel as built (q and P rounded to bf16, float32 elsewhere);
- `P e4m3`: P as e4m3 (scaled by 256, so the row maximum is 256 and e4m3's normal range covers P >= 2**-14);
- `q e4m3`: q as e4m3 with a per-row scale (max |q| -> 448);
- `both`.

Inputs: q ~ N(0, spread^2), k, v ~ N(0, 1), one attention-sink key (token 0, x6), per-layer K / V scales as the
cache's (max |x| / 448), causal.

    python benchmarks/fp8/attention_fp8_numerics.py [--tokens 1024] [--heads 8] [--spreads 1 2 4]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

E4M3 = torch.float8_e4m3fn


def e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`x` rounded to e4m3 in units of `scale` (float64 out)."""
    return (x / scale).to(E4M3).to(torch.float64) * scale


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float64)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     round_p: Callable[[torch.Tensor], torch.Tensor] = lambda p: p) -> torch.Tensor:
    """(H, T, D) float64; `round_p` rounds the unnormalized probabilities before P v (the row sums stay exact)."""
    t, d = q.shape[-2], q.shape[-1]
    s = q @ k.transpose(-1, -2) / d**0.5
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (round_p(p) @ v) / p.sum(-1, keepdim=True)


def errors(tokens: int, heads: int, dim: int, spread: float, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, tokens, dim, generator=gen, dtype=torch.float64) * spread
    k = torch.randn(heads, tokens, dim, generator=gen, dtype=torch.float64)
    k[:, 0] *= 6  # an attention sink
    v = torch.randn(heads, tokens, dim, generator=gen, dtype=torch.float64)
    k8, v8 = e4m3(k, k.abs().amax() / 448), e4m3(v, v.abs().amax() / 448)
    ref = causal_attention(q, k8, v8)
    q8 = e4m3(q, q.abs().amax(-1, keepdim=True) / 448)
    p8 = lambda p: e4m3(p, 1 / 256)  # noqa: E731

    def rel(out: torch.Tensor, against: torch.Tensor = ref) -> float:
        return float((out - against).norm() / against.norm())

    return {
        "FP8 KV": rel(ref, causal_attention(q, k, v)),
        "bf16 q, P": rel(causal_attention(bf16(q), k8, v8, bf16)),
        "P e4m3": rel(causal_attention(bf16(q), k8, v8, p8)),
        "q e4m3": rel(causal_attention(q8, k8, v8, bf16)),
        "both": rel(causal_attention(q8, k8, v8, p8)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--spreads", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [(s, errors(args.tokens, args.heads, args.dim, s, args.seed)) for s in args.spreads]
    cols = list(rows[0][1])
    print("| q spread | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for spread, errs in rows:
        print(f"| {spread:g} | " + " | ".join(f"{errs[c]:.2e}" for c in cols) + " |")


if __name__ == "__main__":
    main()
