"""The fused MoE kernels' sm_90 code, bf16 and FP8 experts, cross-compiled on any machine (no GPU needed; issue 33).

Each launch of `lmserver.kernels.fused_moe.fused_moe` at Mixtral-8x7B's layer (hidden 4096, inter 14336, 8 experts,
top-2) is captured on `meta` tensors instead of run, compiled for `--arch` with `triton.compile` (arguments
specialized as at run time: benchmarks/lowlat/ptx_mix.py) and described: shared memory, registers and spills (the
PTX through Triton's bundled ptxas, when it takes the PTX's version), and per-thread counts of the instructions that
decide an FP8 tile's cost: e4m3 -> f16x2 conversions (one per two weights), the rows' inline-PTX 2^-4 multiplies and
f32 -> f16x2 casts (which must come before any `mul.f16x2`), bf16 conversions, MMAs. Says nothing about speed.

    python benchmarks/fp8/ptx_fp8_moe.py [--tokens 1,4096] [--arch 90] [--dump DIR]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lowlat"))
from ptx_mix import Captured, compile_launch  # noqa: E402

import lmserver.kernels.fp8_quant as FQ  # noqa: E402
import lmserver.kernels.fused_moe as FM  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
KERNELS = ("_gate_up_kernel", "_down_kernel", "_route_align_kernel", "_rows_f16_kernel", "_quantize_groups_kernel")
QUANT_KERNELS = ("_quantize_per_token_kernel",)  # fp8_quant's, launched by the W8A8 prefill (x, then h)
COUNTED = (("cvt.e4m3x2", r"cvt\.rn\.f16x2\.e4m3x2"), ("mul 2^-4", r"mul\.rn\.f32 \S+, \S+, 0f3D800000"),
           ("cvt f32>f16", r"cvt\.rn\.f16x2?\.f32"), ("mul.f16x2", r"mul(\.rn)?\.f16x2"), ("cvt bf16", r"cvt\.[a-z.]*bf16"),
           ("mma.sync", r"mma\.sync"), ("wgmma", r"wgmma\.mma_async"), ("ldmatrix", r"ldmatrix"))


def capture(tokens: int, fp8: bool, launch: FM.MoeLaunch, block: tuple[int, int] | None) -> list[tuple[Any, tuple, dict]]:
    """The Triton launches of one `fused_moe` call on meta tensors (nothing runs), the W8A8 quantizers' included."""
    dev, bf16 = torch.device("meta"), torch.bfloat16
    wdt = torch.float8_e4m3fn if fp8 else bf16
    sink: list[tuple[Any, tuple, dict]] = []
    saved = {(FM, name): getattr(FM, name) for name in KERNELS} | {(FQ, name): getattr(FQ, name) for name in QUANT_KERNELS}
    for (module, name), fn in saved.items():
        setattr(module, name, Captured(fn, sink))
    try:
        x = torch.empty(tokens, HIDDEN, device=dev, dtype=bf16)
        logits = torch.empty(tokens, EXPERTS, device=dev, dtype=bf16)
        w13 = torch.empty(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=wdt)
        w2 = torch.empty(EXPERTS, HIDDEN, INTER, device=dev, dtype=wdt)
        kw: dict[str, Any] = {}
        if fp8 and block:
            kw = dict(w13_scale=torch.empty(EXPERTS, -(-2 * INTER // block[0]), -(-HIDDEN // block[1]), device=dev),
                      w2_scale=torch.empty(EXPERTS, -(-HIDDEN // block[0]), -(-INTER // block[1]), device=dev),
                      scale_block=block)
        elif fp8:
            kw = dict(w13_scale=torch.empty(EXPERTS, 2 * INTER, device=dev), w2_scale=torch.empty(EXPERTS, HIDDEN, device=dev))
        FM.fused_moe(x, logits, w13, w2, TOP_K, launch=launch, **kw)
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
    return [c for c in sink if c[0].__name__ != "_route_align_kernel"]


def ptxas_usage(ptx: str, arch: int) -> str:
    """Registers and spill bytes from Triton's bundled ptxas (the PTX's .version lowered to what it takes)."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        return "-"
    version = re.search(r"current version is '([\d.]+)'",
                        subprocess.run([str(ptxas), "--input-as-string", ".version 99.0"], capture_output=True,
                                       text=True).stderr)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(re.sub(r"^\.version [\d.]+", f".version {version.group(1)}", ptx, flags=re.M) if version else ptx)
        f.flush()
        out = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", "-o", "/dev/null", f.name], capture_output=True,
                             text=True).stderr
    regs, spills = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
    return f"{regs.group(1)} regs / {spills.group(1)} B spilled" if regs and spills else "ptxas: " + out[-80:].strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4096")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", default=None, help="write each kernel's PTX into this folder")
    args = ap.parse_args()
    print("| case | tokens | kernel | tiles m/n_up/n_down/k/w/s | smem B | registers | "
          + " | ".join(n for n, _ in COUNTED) + " |")
    print("|---" * (6 + len(COUNTED)) + "|")
    for tokens in map(int, args.tokens.split(",")):
        for case, fp8, block, rows_f16 in (("bf16", False, None, True), ("fp8 rows", True, None, True),
                                           ("fp8 rows, rows in loop", True, None, False),
                                           ("fp8 128x128", True, (128, 128), True)):
            launch = FM.choose_moe_launch(tokens * TOP_K, EXPERTS, 2, False, fp8, block[1] if block else None)
            launch = replace(launch, rows_f16=rows_f16)
            for fn, largs, kwargs in capture(tokens, fp8, launch, block):
                kernel = compile_launch(fn, largs, kwargs, args.arch)
                ptx = kernel.asm["ptx"]
                if args.dump:
                    Path(args.dump).mkdir(parents=True, exist_ok=True)
                    (Path(args.dump) / f"{case.replace(' ', '_').replace(',', '')}_t{tokens}{fn.__name__}.ptx").write_text(ptx)
                counts = [len(re.findall(p, ptx)) for _, p in COUNTED]
                tiles = (f"{launch.block_m}/{launch.block_n_up}/{launch.block_n_down}/{launch.block_k}/"
                         f"{launch.num_warps}/{launch.num_stages}")
                print(f"| {case} | {tokens} | {fn.__name__.strip('_')} | {tiles} | {kernel.metadata.shared} | "
                      f"{ptxas_usage(ptx, args.arch)} | " + " | ".join(map(str, counts)) + " |", flush=True)


if __name__ == "__main__":
    main()
