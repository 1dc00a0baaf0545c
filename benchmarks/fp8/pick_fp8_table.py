"""Write bench_gemv's winners at one batch into ``lowlat.kernels.tuning.FP8_TABLES`` (the H200 Llama-3-8B entry).

    python benchmarks/fp8/pick_fp8_table.py GEMV_JSON [--batch 1] [--tuning packages/lowlat/src/lowlat/kernels/tuning.py]

``GEMV_JSON``: ``bench_gemv.py --fp8 --batches B --json``'s output. Each stage's fastest config at batch ``--batch``
(every config was checked against the float32 reference before it was timed) replaces that stage's line of the entry
whose max batch is ``--batch``; the other lines stay. Used by ``device_fp8_gemv.sh`` so that the end-to-end run in the same device call serves
exactly the table that is then committed (the rewritten file comes back under ``$OUT``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KEY = '("NVIDIA H200", (4096, 32, 8, 128, 14336)): ('


def config_text(cfg: dict) -> str:
    extra = f", {cfg['programs']}" if cfg.get("programs") else ""
    extra += f", vec={cfg['vec']}" if cfg.get("vec") else ""
    extra += ", acc2d=True" if cfg.get("acc2d") else ""
    extra += f", split_k={cfg['split_k']}" if cfg.get("split_k") else ""
    return (f'GemvConfig("{cfg["variant"]}", {cfg["block_n"]}, {cfg["block_k"]}, {cfg["num_warps"]}, '
            f'{cfg["num_stages"]}{extra})')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gemv_json")
    ap.add_argument("--batch", type=int, default=1, help="the batch whose winners to write (the lines of that max batch)")
    ap.add_argument("--tuning", default="packages/lowlat/src/lowlat/kernels/tuning.py")
    args = ap.parse_args()
    best = {b["stage"]: b for b in json.loads(Path(args.gemv_json).read_text())["best"] if b["batch"] == args.batch}
    path = Path(args.tuning)
    text = path.read_text()
    start = text.index("FP8_TABLES")
    start = text.index(KEY, start)
    end = text.index("\n    ),", start)
    block = text[start:end]
    for stage, cfg in best.items():
        if stage == "attention":
            continue
        block, n = re.subn(rf'\("{stage}", {args.batch}, GemvConfig\([^\n]*\)\),',
                           f'("{stage}", {args.batch}, {config_text(cfg)}),', block)
        print(f"{stage}: {config_text(cfg)} ({'replaced' if n else 'NOT FOUND'})")
    path.write_text(text[:start] + block + text[end:])


if __name__ == "__main__":
    main()
