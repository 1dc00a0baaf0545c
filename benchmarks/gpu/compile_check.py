"""Compile the FP8 kernels' launches for sm_90 on any machine, with whatever Triton is importable (no GPU needed).

The device runs its own Triton (3.6 on the H200 machines), older than the CPU machines' one: a kernel that the
interpreter and a newer Triton accept can still fail to compile there (a `tl.constexpr` parameter left at a string
default in a nested `@triton.jit` call did, 2026-12-03). Put the device's Triton first on the path and run this
before a device call:

    pip install --no-deps --target DIR triton==3.6.0
    PYTHONPATH=DIR python benchmarks/gpu/compile_check.py

Groups: `fp8_quant` (the per-token FP8 quantizers), `extend_attention` (lmserver's prefill attention kernel: a fresh
prompt, an FP8 cache's prefix), `kv_store` (the KV store of a 4k prompt, FP8 and bf16 caches), `fp8_gemv` (lmserver's FP8 decode GEMV at the LM heads' shapes,
`--quantize-lm-head`, and the 8B decoder projections', 1-16 rows, the launches `config_for` chooses), `fused_moe` (lmserver's fused MoE, bf16 and FP8 experts, decode and
prefill), `lowlat` (the dense FP8 stages at 1 and 8 rows; the attention also as verify rows, with
`LaunchConfig.attn_f16` on and off, KV blocks tuned and 64, 4 and 8 warps), `lowlat_w8a8` (the W8A8 multi-row
candidates of benchmarks/fp8/device_fp8_w8a8.sh at 2-16 rows), `lowlat_moe` (the MoE stack's MLP half, bf16 and FP8). Each
case calls a public entry point on `meta` tensors with its kernels captured (`ptx_mix.Captured`), then
compiles every captured launch with its arguments specialized as at run time (`ptx_mix.compile_launch`). Prints one
line per launch and exits 1 if any fails to compile. Says nothing about speed or numerics.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lowlat"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fp8"))
from ptx_mix import Captured, compile_launch  # noqa: E402

import lmserver.kernels.fp8_quant as FQ  # noqa: E402

META, BF16, F32 = torch.device("meta"), torch.bfloat16, torch.float32


def _t(*size: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*size, device=META, dtype=dtype)


def captured(module: Any, names: tuple[str, ...], call: Callable[[], object]) -> list[tuple[Any, tuple, dict]]:
    """The launches of ``module``'s kernels ``names`` made by ``call()`` (nothing runs)."""
    sink: list[tuple[Any, tuple, dict]] = []
    saved = {name: getattr(module, name) for name in names}
    for name, fn in saved.items():
        setattr(module, name, Captured(fn, sink))
    try:
        call()
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
    return sink


def fp8_quant_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    kernels = ("_quantize_per_token_kernel", "_silu_and_mul_quantize_kernel", "_rmsnorm_quantize_kernel")
    cases: dict[str, list[tuple[Any, tuple, dict]]] = {}
    for m, k in ((4096, 4096), (4096, 14336), (16, 64)):
        cases[f"quantize_fp8_per_token {m}x{k}"] = captured(FQ, kernels, lambda m=m, k=k: FQ.quantize_fp8_per_token(_t(m, k)))
        cases[f"silu_and_mul_quantize_fp8 {m}x{k}"] = captured(
            FQ, kernels, lambda m=m, k=k: FQ.silu_and_mul_quantize_fp8(_t(m, 2 * k)))
    for residual in (False, True):
        cases[f"rmsnorm_quantize_fp8 residual={residual}"] = captured(
            FQ, kernels, lambda r=residual: FQ.rmsnorm_quantize_fp8(_t(4096, 4096), _t(4096), 1e-5,
                                                                      _t(4096, 4096) if r else None))
    return cases


def fp8_gemv_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    import lmserver.kernels.fp8_gemv as FG

    kernels = ("_fp8_gemv_rows_kernel", "_fp8_gemv_dot_kernel")
    cases: dict[str, list[tuple[Any, tuple, dict]]] = {}
    # (K, N): the LM heads of Llama-3-8B, Mixtral-8x7B and SmolLM2-135M, then the 8B decoder projections; the launch
    # is config_for's on the H200 (TUNED entries, else the default rule)
    shapes = {"lm_head 8b": (4096, 128256), "lm_head mixtral": (4096, 32000), "lm_head smollm2": (576, 49152),
              "qkv 8b": (4096, 6144), "down 8b": (14336, 4096)}
    for name, (k, n) in shapes.items():
        for m in (1, 2, 8, 16):
            cfg = FG._config_for(m, k, n, "NVIDIA H200")
            cases[f"fp8_gemv {name} M={m} {cfg.variant}"] = captured(
                FG, kernels, lambda m=m, k=k, n=n, cfg=cfg: FG.fp8_gemv(_t(m, k), _t(n, k, dtype=torch.float8_e4m3fn),
                                                                      _t(n, 1, dtype=F32), k, config=cfg))
    return cases


def fused_moe_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    from ptx_fp8_moe import EXPERTS, TOP_K, capture

    import lmserver.kernels.fused_moe as FM

    # (capture: the MoE kernels' launches and, for W8A8 launches, the per-token quantizers' of x and h)
    cases: dict[str, list[tuple[Any, tuple, dict]]] = {}
    for tokens in (1, 8, 4096):
        for name, fp8, block in (("bf16", False, None), ("fp8 rows", True, None), ("fp8 128x128", True, (128, 128))):
            launch = FM.choose_moe_launch(tokens * TOP_K, EXPERTS, 2, False, fp8, block[1] if block else None)
            cases[f"fused_moe {name} tokens={tokens}"] = capture(tokens, fp8, launch, block)
    # the prefill launches choose_moe_launch gives with TMA descriptors (the H200's): bf16, and per-row FP8's W8A8;
    # W8A8's pointer tiles at 512, with float32 promotion every 128 K (`MoeLaunch.fp8_acc_k`), in groups of 8 blocks
    # (`MoeLaunch.group_m`); per-row FP8 on the fp16-operand prefill tiles (its prefill default before W8A8)
    for name, fp8, tokens, launch in (
            ("bf16 tma", False, 4096, FM.choose_moe_launch(4096 * TOP_K, EXPERTS, 2, True)),
            ("fp8 rows w8a8 tma", True, 4096, FM.choose_moe_launch(4096 * TOP_K, EXPERTS, 2, True, True)),
            ("fp8 rows w8a8", True, 512, FM.FP8_PREFILL_LAUNCH),
            ("fp8 rows w8a8 promoted", True, 4096, replace(FM.FP8_PREFILL_TMA_LAUNCH, block_n_down=128, fp8_acc_k=128)),
            ("fp8 rows w8a8 tma grouped", True, 4096, replace(FM.FP8_PREFILL_TMA_LAUNCH, group_m=8)),
            ("fp8 rows fp16 operands", True, 4096, FM.PREFILL_LAUNCH)):
        cases[f"fused_moe {name} tokens={tokens}"] = capture(tokens, fp8, launch, None)
    # block-scaled W8A8 (opt-in): TMA and pointer tiles, rows quantized per token and 128 columns
    for launch in (FM.FP8_PREFILL_BLOCKS_W8A8_LAUNCH, replace(FM.FP8_PREFILL_BLOCKS_W8A8_LAUNCH, tma=False)):
        cases[f"fused_moe fp8 128x128 w8a8{' tma' if launch.tma else ''} tokens=4096"] = capture(4096, True, launch,
                                                                                                (128, 128))
    return cases


def lowlat_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    from ptx_mix import SHAPES, capture

    from lowlat.kernels import ops
    from lowlat.kernels.tuning import tuned_attention, tuned_pdl_release, tuned_table

    shape, gpu = SHAPES["llama3-8b"], "NVIDIA H200"
    cases: dict[str, list[tuple[Any, tuple, dict]]] = {}
    # the H200's FP8 tables, as the plugin builds them there (ptx_mix's LaunchConfig)
    lc = ops.LaunchConfig(use_pdl=True, qkv_block_p=min(16, shape.head_dim // 2), num_sms=132,
                          tuned=tuned_table(gpu, shape, True), pdl_release=tuned_pdl_release(gpu, shape),
                          attn_tuned=tuned_attention(gpu, shape), fp8=True)
    for batch in (1, 8):
        for stage in ("qkv", "attention", "o_proj", "gate_up", "down"):
            cases[f"lowlat {stage} fp8 batch={batch}"] = capture(stage, shape, batch, lc, fp8=True)
    # the attention on the FP8 cache, per-row and verify-rows kernels (at 8 rows: a verify step of 6 + 2 padding rows
    # compiles the same code), with its dots widened to bf16 or in fp16 (LaunchConfig.attn_f16), at the tuned KV blocks
    # and at 64, at 4 warps and at 8 (LaunchConfig.attn_warps; issues 33 / 34)
    for f16 in (False, True):
        for block, warps in ((0, 0), (64, 0), (0, 8)):
            alc = replace(lc, attn_f16=f16, attn_tuned=((1 << 30, block),) if block else lc.attn_tuned, attn_warps=warps)
            for batch in (1, 8):
                for stage in ("attention", "rows_attention"):
                    if stage == "attention" and not f16 and not block and not warps:
                        continue  # above
                    name = (f"lowlat {stage} fp8 {'attn-f16' if f16 else 'attn-bf16'}{f' block {block}' if block else ''}"
                            f"{f' warps {warps}' if warps else ''}")
                    cases[f"{name} batch={batch}"] = capture(stage, shape, batch, alc, fp8=True)
    return cases


def lowlat_w8a8_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    """The W8A8 multi-row GEMV launches (``mrow_w8a8`` / ``mrow_w8a8b``) the device sweep times: each candidate of
    ``W8A8_SWEEP`` at 8 rows, the first of each stage at every row count the sweep times (a compile per count)."""
    from ptx_mix import SHAPES, capture
    from w8a8_sweep import ALL_ROWS, W8A8_SWEEP

    from lowlat.kernels import ops

    shape = SHAPES["llama3-8b"]
    base = ops.LaunchConfig(use_pdl=True, qkv_block_p=min(16, shape.head_dim // 2), num_sms=132, fp8=True)
    cases: dict[str, list[tuple[Any, tuple, dict]]] = {}
    for stage, cfgs in W8A8_SWEEP.items():
        for j, cfg in enumerate(cfgs):
            lc = replace(base, tuned=((stage, 16, cfg),))
            for batch in (8,) if j else ALL_ROWS:
                cases[f"lowlat {stage} {cfg.variant} {cfg.block_n}x{cfg.block_k} split {cfg.split_k} batch={batch}"] = (
                    capture(stage, shape, batch, lc, fp8=True))
    return cases


def lowlat_moe_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    """The lowlat MoE stack's MLP half (``moe_ops.moe_mlp``: route, expert gate-up, expert down, combine) at
    Mixtral-8x7B's layer, bf16 and FP8 experts, with the H200's expert tiles (``moe_ops.expert_configs``)."""
    from ptx_mix import SHAPES

    from lowlat import MoEShape
    from lowlat.kernels import moe as K
    from lowlat.kernels import moe_ops, ops
    from lowlat.kernels.tuning import tuned_pdl_release, tuned_table

    shape, moe, gpu = SHAPES["llama3-8b"], MoEShape(8, 2, 14336), "NVIDIA H200"
    names = tuple(n for n in dir(K) if n.endswith("_kernel"))
    cases: dict[str, list[tuple[Any, tuple, dict]]] = {}
    h, i, e = shape.hidden_size, moe.expert_intermediate_size, moe.num_experts
    for fp8 in (False, True):
        lc = ops.LaunchConfig(use_pdl=True, qkv_block_p=min(16, shape.head_dim // 2), num_sms=132,
                              tuned=tuned_table(gpu, shape, fp8), pdl_release=tuned_pdl_release(gpu, shape), fp8=fp8)
        wdt = torch.float8_e4m3fn if fp8 else BF16
        ws = moe_ops.MoEWorkspace.allocate(moe, h, 8, META, BF16, fp8=fp8)
        scales = dict(w13_scale=_t(e, 2 * i, dtype=F32), w2_scale=_t(e, h, dtype=F32)) if fp8 else {}
        for tokens in (1, 8):
            cases[f"lowlat moe_mlp {'fp8' if fp8 else 'bf16'} tokens={tokens}"] = captured(
                K, names, lambda t=tokens, lc=lc, wdt=wdt, ws=ws, sc=scales: moe_ops.moe_mlp(
                    _t(t, h), _t(h), _t(e, h), _t(e, 2 * i, h, dtype=wdt), _t(e, h, i, dtype=wdt), _t(t, h), moe,
                    1e-5, ws, lc, **sc))
    return cases


def extend_attention_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    """lmserver's extend kernel for a fresh 4,096-token prompt of the 8B shape as the triton backend launches it
    (64 x 64 tiles on a GPU), and over a cached prefix of an FP8 cache."""
    import lmserver.kernels.extend_attention as EA

    n, i64, table = 4096, torch.empty(1, device=META, dtype=torch.int64), torch.empty(1, 8192, device=META,
                                                                                        dtype=torch.int32)
    q, k = _t(n, 32, 128), _t(n, 8, 128)
    cache8 = _t(8192, 8, 128, dtype=torch.float8_e4m3fn)
    fresh = lambda: EA.extend_attention(q, k, k, k, k, table, i64, i64, i64, i64, 128**-0.5, n,  # noqa: E731
                                        out=_t(n, 32, 128), has_prefix=False, block_m=64, block_n=64)
    prefix = lambda: EA.extend_attention(q, k, k, cache8, cache8, table, i64, i64, i64, i64, 128**-0.5, n,  # noqa: E731
                                         out=_t(n, 32, 128), k_scale=0.1, v_scale=0.1, block_m=64, block_n=64)
    return {"fresh prompt": captured(EA, ("_extend_kernel",), fresh),
            "FP8 cache prefix": captured(EA, ("_extend_kernel",), prefix)}


def kv_store_cases() -> dict[str, list[tuple[Any, tuple, dict]]]:
    """lmserver's KV store of a 4,096-token prompt of the 8B shape: into an FP8 cache with the values written back
    (the FP8 prefill's path), and into a bf16 cache."""
    import lmserver.kernels.kv_store as KS

    n, loc = 4096, torch.empty(4096, device=META, dtype=torch.int64)
    k, out = _t(n, 8, 128), _t(n, 8, 128)
    fp8 = lambda: KS.store_kv(k, k, _t(8192, 8, 128, dtype=torch.float8_e4m3fn),  # noqa: E731
                              _t(8192, 8, 128, dtype=torch.float8_e4m3fn), loc, k_scale=0.1, v_scale=0.2, k_out=out,
                              v_out=out)
    bf16 = lambda: KS.store_kv(k, k, _t(8192, 8, 128), _t(8192, 8, 128), loc)  # noqa: E731
    return {"FP8 cache, values written back": captured(KS, ("_store_kv_kernel",), fp8),
            "bf16 cache": captured(KS, ("_store_kv_kernel",), bf16)}


GROUPS = {"fp8_quant": fp8_quant_cases, "extend_attention": extend_attention_cases, "kv_store": kv_store_cases, "fp8_gemv": fp8_gemv_cases, "fused_moe": fused_moe_cases, "lowlat": lowlat_cases,
          "lowlat_w8a8": lowlat_w8a8_cases, "lowlat_moe": lowlat_moe_cases}


def main() -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    failed = 0
    for group in args.groups:
        for case, launches in GROUPS[group]().items():
            if not launches:
                print(f"  {case}: no launch captured")
                continue
            for fn, largs, kwargs in launches:
                try:
                    compile_launch(fn, largs, kwargs, args.arch)
                    print(f"  ok      {case}: {fn.__name__}")
                except Exception as exc:  # noqa: BLE001 - report every failing launch, then exit 1
                    failed += 1
                    print(f"  FAILED  {case}: {fn.__name__}: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}")
                    if failed == 1:
                        traceback.print_exc(limit=1)
    print(f"{failed} launch(es) failed to compile" if failed else "every launch compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
