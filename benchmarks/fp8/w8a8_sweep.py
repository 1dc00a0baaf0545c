"""The W8A8 multi-row GEMV candidates (``mrow_w8a8`` / ``mrow_w8a8b``, issues 33 / 34) for the H200 Llama-3-8B FP8
stages, and the ``bench_gemv.py --configs`` list that times them next to the FP8 table's row-wise and ``mrow_f16s``
entries (used by ``device_fp8_w8a8.sh`` and ``benchmarks/gpu/compile_check.py --groups lowlat_w8a8``).

    python benchmarks/fp8/w8a8_sweep.py        # prints the --configs argument

Every candidate has 64 weight rows per warp group (sm_90's FP8 ``wgmma`` is m64; with 32 rows Triton falls back to an
fp16 ``mma.sync`` with both operands widened, no gain over ``mrow_f16s``). qkv: ``block_n`` rotary pairs (32 pairs =
64 rows, 96 tiles); o_proj / down: split over K in 2-4 so that the 64 tiles of 64 rows fill 132 SMs. The first
candidate of each stage runs at every row count (``ALL_ROWS``), the others at 8 rows only (a verify step of 6-8 rows,
a decode batch of 8).
"""

from __future__ import annotations

from lowlat.kernels.ops import GemvConfig

ALL_ROWS = (8, 1, 16, 4, 2, 6)  # bench_gemv --batches: 8 first (the budget may stop the sweep)
W8A8_SWEEP: dict[str, tuple[GemvConfig, ...]] = {
    "qkv": (GemvConfig("mrow_w8a8b", 32, 256, 4, 3), GemvConfig("mrow_w8a8", 32, 256, 4, 3),
            GemvConfig("mrow_w8a8b", 32, 128, 4, 4)),
    "o_proj": (GemvConfig("mrow_w8a8b", 64, 256, 4, 3, split_k=2), GemvConfig("mrow_w8a8", 64, 256, 4, 3, split_k=2),
               GemvConfig("mrow_w8a8b", 64, 256, 4, 3), GemvConfig("mrow_w8a8b", 64, 128, 4, 4, split_k=4)),
    "gate_up": (GemvConfig("mrow_w8a8b", 64, 256, 4, 3), GemvConfig("mrow_w8a8", 64, 256, 4, 3),
                GemvConfig("mrow_w8a8b", 64, 128, 4, 4)),
    "down": (GemvConfig("mrow_w8a8b", 64, 512, 4, 3, split_k=2), GemvConfig("mrow_w8a8", 64, 512, 4, 3, split_k=2),
             GemvConfig("mrow_w8a8b", 64, 256, 4, 4, split_k=4), GemvConfig("mrow_w8a8b", 64, 512, 4, 3)),
}
# the FP8 table's entries they replace (tuning.FP8_TABLES, H200 8B): row-wise at one row, mrow_f16s at 2-8
TABLE = {"qkv": ("rows:2:1024:1:2:8", "mrow_f16s:32:256:4:3"), "o_proj": ("rows:4:2048:4:2:16", "mrow_f16s:32:256:4:4"),
         "gate_up": ("rows:4:2048:4:2:16", "mrow_f16s:64:256:4:3"), "down": ("rows:4:2048:4:2", "mrow_f16s:32:512:4:3")}


def spec(cfg: GemvConfig) -> str:
    """``cfg`` in ``bench_gemv.py --configs`` syntax."""
    tail = f":0:0:{cfg.split_k}" if cfg.split_k else ""
    return f"{cfg.variant}:{cfg.block_n}:{cfg.block_k}:{cfg.num_warps}:{cfg.num_stages}{tail}"


def configs_arg() -> str:
    """The --configs list: per stage the table's two entries and the first W8A8 candidate at every row count, the
    other candidates at 8 rows only (``8@`` prefix)."""
    items = []
    for stage, cands in W8A8_SWEEP.items():
        items += [f"{stage}={t}" for t in TABLE[stage]]
        items.append(f"{stage}={spec(cands[0])}")
        items += [f"8@{stage}={spec(c)}" for c in cands[1:]]
    return ",".join(items)


if __name__ == "__main__":
    print(configs_arg())
