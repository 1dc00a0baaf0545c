"""Compiles lowlat's attention kernels for sm_90 without a GPU (Triton's own ptxas) and prints each one's registers,
spills, shared memory and SASS instruction count: a free check that a refactor of the attention loops compiles and
keeps the resource use (``online_softmax``; benchmarks/RESULTS.md, lowlat). Run once per source tree:

    PYTHONPATH=<tree>/packages/lowlat/src python benchmarks/lowlat/attn_sass.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from lowlat.kernels import layer as K
from lowlat.kernels import persistent as P
from lowlat.kernels import rows_attn as RA

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
PTR16 = "*bf16"
STRIDES = ["stride_rt", "stride_ks", "stride_kh", "stride_vs", "stride_vh"]


def _sig(fn: triton.JITFunction, consts: dict[str, object], types: dict[str, str]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name in STRIDES or name in ("B", "SPIN_LIMIT"):
            sig[name] = "i32"
        else:
            sig[name] = "fp32"
    return sig


def compile_one(fn: triton.JITFunction, consts: dict[str, object], types: dict[str, str], warps: int = 4,
                stages: int = 3) -> dict[str, object]:
    src = ASTSource(fn, _sig(fn, consts, types), consts)
    k = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True, text=True).stdout
    use = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    insts = re.findall(r"/\*[0-9a-f]{4}\*/\s+([A-Z][A-Z0-9_.]*)", sass)
    return {"regs": int(use.get("REG", -1)), "stack": int(use.get("STACK", -1)), "local": int(use.get("LOCAL", -1)),
            "shared": k.metadata.shared, "sass": len(insts), "mufu": sum(i.startswith("MUFU") for i in insts),
            "hmma": sum(i.startswith("HMMA") for i in insts), "hgmma": sum(i.startswith("HGMMA") for i in insts), "stl": sum(i.startswith("STL") for i in insts),
            "ldl": sum(i.startswith("LDL") for i in insts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kv = {"q_ptr": PTR16, "k_cache_ptr": PTR16, "v_cache_ptr": PTR16, "req_to_token_ptr": "*i32", "req_idx_ptr": "*i64",
          "seq_lens_ptr": "*i32", "count_ptr": "*i32", "used_ptr": "*i32"}
    base = dict(NQ=32, G=4, D=128, DOT_F32=False, FRESH=8)
    cases: dict[str, tuple] = {}
    for bn, splits, fused, pdl in ((32, 8, False, True), (128, 1, False, True), (128, 4, False, True),
                                   (128, 4, True, True), (128, 4, False, False)):
        cases[f"decode n{bn} s{splits}{' fused' if fused else ''}{' pdl' if pdl else ''}"] = (
            K.decode_attention_kernel, {**base, "BLOCK_G": 16, "BLOCK_N": bn, "NUM_SPLITS": splits, "USE_PDL": pdl,
                                        "PDL_EARLY": False, "FUSED_MERGE": fused, "BLOCK_S": 4, "BLOCK_GM": 4}, kv)
    cases["merge s4"] = (K.merge_splits_kernel, dict(NQ=32, D=128, NUM_SPLITS=4, BLOCK_S=4, USE_PDL=True,
                                                     PDL_EARLY=False), {})
    for splits, skip in ((1, False), (5, False), (16, True)):
        cases[f"rows s{splits}{' skip' if skip else ''}"] = (
            RA.rows_attention_kernel, {**base, "KVH": 8, "R": 8, "BLOCK_GP": 4, "BLOCK_M": 32, "BLOCK_B": 8,
                                       "BLOCK_N": 128, "NUM_SPLITS": splits, "TARGET": 264, "USE_PDL": True,
                                       "PDL_EARLY": False, "BLOCK_G1": 16, "BLOCK_N1": 128, "SKIP_EMPTY": skip}, kv)
    cases["rows_merge s16"] = (RA.rows_merge_kernel, dict(NQ=32, D=128, NUM_SPLITS=16, BLOCK_S=16, USE_PDL=True,
                                                          PDL_EARLY=False), {"used_ptr": "*i32"})
    pk = {**kv, "x_ptr": PTR16, "wo_ptr": PTR16, "post_norm_ptr": PTR16, "wgu_ptr": PTR16, "wd_ptr": PTR16,
          "sync_ptr": "*i32", "err_ptr": "*i32"}
    cases["persistent s4"] = (P.attn_mlp_persistent_kernel, dict(H=4096, INTER=14336, NQ=32, NKV=8, D=128, NUM_SPLITS=4,
                                                                 BLOCK_S=4, BLOCK_G=16, BLOCK_NA=64, BLOCK_M=16,
                                                                 BLOCK_N=16, BLOCK_K=256, DOT_F32=False), pk)
    res = {}
    for name, (fn, consts, types) in cases.items():
        try:
            res[name] = compile_one(fn, consts, types)
        except Exception as e:  # noqa: BLE001 (reported per case)
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"{name:24s} {res[name]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
