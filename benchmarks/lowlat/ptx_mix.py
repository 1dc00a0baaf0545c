"""Instruction mix of the nvidia plugin's kernels, cross-compiled for Hopper on any machine (no GPU needed).

    python benchmarks/lowlat/ptx_mix.py [--shape llama3-8b] [--batches 1,4] [--stages qkv,o_proj,gate_up,down]
                                        [--gpu "NVIDIA H200"] [--arch 90] [--dump DIR] [--fp8]
                                        [--configs [stage=]variant:block_n:block_k:warps:stages,...] [--regs]
                                        [--attn-f16 off|on|both] [--attn-block N] [--attn-warps N]

``--fp8``: FP8 e4m3 projections with per-row scales and an FP8 KV cache (the FP8 table, where one exists).
``--configs``: these GEMV configs instead of the table's (bench_gemv's syntax; one line per config and batch), e.g. the
W8A8 multi-row kernels (``mrow_w8a8`` / ``mrow_w8a8b``: ``mma.e4m3`` counts FP8 x FP8 MMAs, ``cvt.f32>e4m3`` the row
quantization's conversions, ``cvt.e4m3>f16`` the weight widening of ``mrow_f16*``). ``--regs``: registers and spill
stores per thread from the cubin (``cuobjdump -res-usage`` of Triton's wheel).
Stages ``attention`` (``ops.attention``, the per-row decode kernel) and ``rows_attention`` (``ops.rows_attention``,
the verify-rows kernel: at batch 8 a verify step of 6 rows + 2 padding rows compiles the same code). ``--attn-f16``:
their dots on an FP8 cache in fp16 (``LaunchConfig.attn_f16``; ``both``: each attention launch with and without,
labelled ``attn-f16`` / ``attn-bf16``): ``cvt.e4m3>f16`` then counts the K / V widening (one per two elements),
``cvt.bf16.f16`` the second conversion of the bf16 path, ``mul 2^-4`` / ``cvt.f32>f16`` q's scaling and cast.
``--attn-block``: the attention's KV block at every batch instead of the tuned ones (``LaunchConfig.attn_tuned``);
``--attn-warps``: the attention launches' warps (``LaunchConfig.attn_warps``).

Each stage is launched through its real `lowlat.kernels.ops` launcher on `meta` tensors of the layer's shapes,
with the per-stage configs of `lowlat.kernels.tuning` for `--gpu`; the launch is captured instead of run, the
arguments are specialized the way Triton specializes them at run time (16-byte aligned pointers, an int equal
to 1 as a constant) and the kernel is compiled for `--arch` with `triton.compile`. Prints, per stage and batch:
PTX lines, shared memory, and counts of the instructions that decide a GEMV's speed (global loads by width:
ldg.v4 / ldg.v2 / ldg.1, cp.async, ldmatrix, mma, float32 fma, barriers, PDL's griddepcontrol). A way to compare code generation between configurations or batches
when no GPU time is left; it says nothing about speed by itself.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_gemv import configs_from_arg  # noqa: E402
from bench_layer import SHAPES  # noqa: E402

from lowlat import KVCache  # noqa: E402
from lowlat.kernels import gemv as GV  # noqa: E402
from lowlat.kernels import layer as K  # noqa: E402
from lowlat.kernels import mrow as MR  # noqa: E402
from lowlat.kernels import ops  # noqa: E402
from lowlat.kernels import rows_attn as RA  # noqa: E402
from lowlat.kernels.tuning import tuned_attention, tuned_pdl_release, tuned_table  # noqa: E402
from lowlat.layer import ForwardMeta, LayerShape, LayerWeights  # noqa: E402

KERNELS = ("qkv_rope_kernel", "gemv_residual_kernel", "norm_gate_up_kernel", "decode_attention_kernel",
           "merge_splits_kernel", "qkv_rope_rows_kernel", "gemv_rows_residual_kernel", "norm_gate_up_rows_kernel",
           "mrow_residual_kernel", "mrow_gate_up_kernel", "mrow_qkv_rope_kernel", "rows_attention_kernel",
           "rows_merge_kernel")
ATTENTION_STAGES = ("attention", "rows_attention")
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
COUNTED = [
    ("ldg.v4", r"ld\.global(\.[a-z]+)*\.v4"), ("ldg.v2", r"ld\.global(\.[a-z]+)*\.v2"),
    ("ldg.1", r"ld\.global(\.[a-z]+)*\.(b|u|s|f)(8|16|32|64)\b"), ("cp.async", r"cp\.async\.c[ag]"),
    ("ldmatrix", r"ldmatrix"), ("mma", r"\bmma\.sync|wgmma"), ("fma.f32", r"\bfma\.rn\.f32"),
    ("bar.sync", r"bar\.sync"), ("pdl", r"griddepcontrol"), ("cvt.fp8", r"cvt\.[a-z0-9.]*e4m3"),
    ("mma.e4m3", r"(mma\.sync|wgmma)\S*e4m3"), ("cvt.f32>e4m3", r"cvt\.rn\.satfinite\.e4m3x2\.f32"),
    ("cvt.e4m3>f16", r"cvt\.rn\.f16x2\.e4m3x2"), ("div.rn", r"div\.rn\.f32"),
    ("cvt.bf16.f16", r"cvt\.bf16\.f16"), ("cvt.f32>f16", r"cvt\.rn\.f16(x2)?\.f32"),
    ("mul 2^-4", r"mul\.rn\.f32 \S+, \S+, 0f3D800000"),
]


class Captured:
    """Stands in for a kernel module attribute: `kernel[grid](...)` records the call instead of launching."""

    def __init__(self, fn: Any, sink: list[tuple[Any, tuple, dict]]) -> None:
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.sink.append((self.fn, args, kwargs))
        return launch


def capture(stage: str, shape: LayerShape, batch: int, lc: ops.LaunchConfig, fp8: bool = False) -> list[tuple[Any, tuple, dict]]:
    """The kernel launches of one stage at `batch` rows, on meta tensors (nothing runs); `fp8`: FP8 weights and KV."""
    dev, bf16, f32 = torch.device("meta"), torch.bfloat16, torch.float32
    wdt = torch.float8_e4m3fn if fp8 else bf16

    def t(*size: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return torch.empty(*size, device=dev, dtype=dtype)

    sink: list[tuple[Any, tuple, dict]] = []
    saved = {(mod, name): getattr(mod, name) for mod in (K, GV, MR, RA) for name in KERNELS if hasattr(mod, name)}
    for (mod, name), fn in saved.items():
        setattr(mod, name, Captured(fn, sink))
    try:
        h, ctx, slots = shape.hidden_size, 512, batch * 512 + 64
        scales = (t(shape.qkv_size, dtype=f32), t(h, dtype=f32), t(2 * shape.intermediate_size, dtype=f32),
                  t(h, dtype=f32)) if fp8 else (None,) * 4
        w = LayerWeights(t(h), t(shape.qkv_size, h, dtype=wdt), t(h, shape.q_size, dtype=wdt), t(h),
                         t(2 * shape.intermediate_size, h, dtype=wdt), t(h, shape.intermediate_size, dtype=wdt),
                         t(shape.head_dim // 2, dtype=f32), *scales)
        kv = KVCache(t(slots, shape.num_kv_heads, shape.head_dim, dtype=wdt),
                     t(slots, shape.num_kv_heads, shape.head_dim, dtype=wdt))
        meta = ForwardMeta(t(batch, ctx + 1, dtype=torch.int32), t(batch, dtype=torch.int64), t(batch, dtype=torch.int32),
                           t(batch, dtype=torch.int64), t(batch, dtype=torch.int64), max_seq_len=ctx)
        x, a_q, act = t(batch, h), t(batch, shape.q_size), t(batch, shape.intermediate_size)
        if stage == "qkv":
            ops.qkv_rope(x, w, kv, meta, t(batch, shape.q_size), shape, lc)
        elif stage == "attention":
            splits = ops.num_splits(batch, shape, ctx, lc, 16)
            part_o, part_lse = t(batch, shape.num_heads, 16, shape.head_dim, dtype=f32), t(batch, shape.num_heads, 16, dtype=f32)
            ops.attention(a_q, kv, meta, part_o, part_lse, t(batch, shape.q_size), shape, lc, splits)
        elif stage == "rows_attention":  # the stack's launch (its per-row split count)
            splits = ops.num_splits(batch, shape, ctx, lc, 16)
            part_o, part_lse = t(batch, shape.num_heads, 16, shape.head_dim, dtype=f32), t(batch, shape.num_heads, 16, dtype=f32)
            ops.rows_attention(a_q, kv, meta, part_o, part_lse, t(batch, shape.q_size), shape, lc, splits)
        elif stage == "o_proj":
            ops.gemv_residual(a_q, w.o_proj, x, t(batch, h), lc, stage="o_proj", scale=w.o_proj_scale,
                              split_ws=(t(8 * batch * h, dtype=f32), t(h, dtype=torch.int32)))  # split-K configs
        elif stage == "gate_up":
            ops.norm_gate_up(x, w.post_norm, w.gate_up, act, shape.rms_eps, lc, scale=w.gate_up_scale)
        else:
            ops.gemv_residual(act, w.down, x, t(batch, h), lc, stage="down", scale=w.down_scale,
                              split_ws=(t(8 * batch * h, dtype=f32), t(h, dtype=torch.int32)))
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
    return sink


def compile_launch(fn: Any, args: tuple, kwargs: dict, arch: int) -> Any:
    """`triton.compile` of one captured launch, its arguments specialized as Triton does at run time."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    values = dict(zip([p.name for p in fn.params], args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, p in enumerate(fn.params):
        value = values.get(p.name, p.default)  # a parameter left at its default (pf_ptr, ...)
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":  # an int equal to 1
            signature[p.name], constexprs[(i,)] = "constexpr", key
            continue
        signature[p.name] = kind
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def res_usage(cubin: bytes) -> str:
    """"REG n, spill stores" of a cubin's kernel from ``cuobjdump -res-usage`` (Triton's wheel carries it)."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return f"{regs.group(1) if regs else '?'}r/{stack.group(1) if stack else '?'}st"


def mix(ptx: str) -> dict[str, int]:
    lines = [ln.strip() for ln in ptx.splitlines()]
    counts = Counter()
    for name, pattern in COUNTED:
        counts[name] = sum(1 for ln in lines if re.match(pattern, ln) or re.search(r"\s" + pattern, " " + ln))
    return dict(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--stages", default="qkv,attention,o_proj,gate_up,down")
    ap.add_argument("--gpu", default="NVIDIA H200", help="whose lowlat.kernels.tuning entries to use")
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an int (90: Hopper)")
    ap.add_argument("--dump", default=None, help="write each kernel's PTX into this folder")
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 weights (per-row scales) and KV cache")
    ap.add_argument("--vec", type=int, default=None, help="GemvConfig.vec of every tuned entry (rows kernels' loads)")
    ap.add_argument("--f16-variant", default=None, choices=["mrow_f16", "mrow_f16s"],
                    help="the variant of every tuned mrow_f16 entry (mrow_f16s: rows scaled into fp16's range)")
    ap.add_argument("--configs", default="", help="GEMV configs instead of the table's (bench_gemv.py --configs syntax)")
    ap.add_argument("--regs", action="store_true", help="registers / stack (spill) bytes per thread from the cubin")
    ap.add_argument("--attn-f16", default="off", choices=["off", "on", "both"],
                    help="the attention stages' dots on FP8 caches in fp16 (LaunchConfig.attn_f16); both: each way")
    ap.add_argument("--attn-block", type=int, default=0, help="the attention's KV block at every batch (0: tuned)")
    ap.add_argument("--attn-warps", type=int, default=0, help="the attention launches' warps (0: num_warps)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    tuned = tuned_table(args.gpu, shape, args.fp8)
    if args.vec is not None:
        tuned = tuple((stage, mb, replace(cfg, vec=args.vec)) for stage, mb, cfg in tuned)
    if args.f16_variant is not None:
        tuned = tuple((stage, mb, replace(cfg, variant=args.f16_variant) if cfg.variant.startswith("mrow_f16") else cfg)
                      for stage, mb, cfg in tuned)
    lc = ops.LaunchConfig(use_pdl=True, qkv_block_p=min(16, shape.head_dim // 2), num_sms=132, tuned=tuned,
                          pdl_release=tuned_pdl_release(args.gpu, shape), attn_tuned=tuned_attention(args.gpu, shape),
                          fp8=args.fp8)
    if args.attn_block:
        lc = replace(lc, attn_tuned=((1 << 30, args.attn_block),))
    lc = replace(lc, attn_warps=args.attn_warps)
    names = [n for n, _ in COUNTED]
    print(f"{'stage':>9s} {'bs':>3s} {'kernel':>26s} {'config':>24s} {'ptx':>5s} {'smem':>6s} " +
          ("regs/stk " if args.regs else "") + " ".join(f"{n:>8.8s}" for n in names))
    for b in [int(v) for v in args.batches.split(",")]:
        for stage in args.stages.split(","):
            # --configs: each of the stage's configs in turn (the table's entry otherwise)
            stage_lcs = [replace(lc, tuned=((stage, 1 << 30, cfg),)) for cfg in configs_from_arg(args.configs)(stage)]
            if stage in ATTENTION_STAGES:  # --attn-f16: the attention with its fp16 dots, or both ways
                stage_lcs = [replace(lc, attn_f16=f16) for f16 in {"off": [False], "on": [True],
                                                                    "both": [False, True]}[args.attn_f16]]
            for slc in stage_lcs if (args.configs and stage in ops.GEMV_STAGES) or stage in ATTENTION_STAGES else [lc]:
                for fn, largs, kwargs in capture(stage, shape, b, slc, args.fp8):
                    cfg = slc.gemv_config(stage, b) if stage in ops.GEMV_STAGES else None
                    label = f"{cfg.variant} {cfg.block_n}/{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}" if cfg else "-"
                    if stage in ATTENTION_STAGES:
                        label = "attn-f16" if slc.attn_f16 else "attn-bf16"
                    kernel = compile_launch(fn, largs, kwargs, args.arch)
                    ptx = kernel.asm["ptx"]
                    if args.dump:
                        Path(args.dump).mkdir(parents=True, exist_ok=True)
                        tag = f"_{cfg.variant}_{cfg.block_n}x{cfg.block_k}" if cfg and args.configs else ""
                        tag = f"_{label}" if stage in ATTENTION_STAGES else tag
                        (Path(args.dump) / f"{stage}_b{b}{tag}_{fn.__name__}.ptx").write_text(ptx)
                    counts = mix(ptx)
                    regs = f"{res_usage(kernel.asm['cubin']):>8s} " if args.regs else ""
                    print(f"{stage:>9s} {b:3d} {fn.__name__:>26.26s} {label:>24s} {len(ptx.splitlines()):5d} "
                          f"{kernel.metadata.shared:6d} {regs}" + " ".join(f"{counts[n]:8d}" for n in names), flush=True)


if __name__ == "__main__":
    main()
