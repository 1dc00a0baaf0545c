"""Host time per decode step of a batch of grammar rows: what ~100 constrained requests add to
the engine-core process each step, beside the forward (CPU only, no model).

Grammars: the JSON Schemas under `--schema-dir` (e.g. the storm's 96), compiled in this process
one at a time (`--compile-limit-s` CPU seconds each; slower ones skipped), `--rows` requests
spread over them. Each step, for the whole batch, the engine's per-step grammar work: the batch
mask fill (`BatchMasker.prepare`, the host buffer of the torch path), then per row the sampled
token's `accept`, the finished / stuck checks and the jump-forward check (`forced_text`), with
a random allowed token as the "sampled" one (rows whose grammar ended restart). Medians over
`--steps` steps of the per-step milliseconds of each part.

    python benchmarks/structured/bench_grammar_rows_host.py --schema-dir SCHEMAS [--rows 96] [--steps 60]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import resource
import signal
import statistics
import time
from typing import Any

import numpy as np
import torch

import cfsm
from lmserver.engine.constrained import BatchMasker, ReqGrammar


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _compile(paths: list[str], vocab: cfsm.Vocabulary, limit_s: float, want: int) -> list[tuple[str, Any]]:
    def alarm(*_: Any) -> None:
        raise TimeoutError

    signal.signal(signal.SIGVTALRM, alarm)
    out: list[tuple[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        start = _cpu_s()
        signal.setitimer(signal.ITIMER_VIRTUAL, limit_s)
        try:
            index = cfsm.compile_json_schema(text, vocab, cfsm.CfsmConfig())
        except Exception as exc:  # noqa: BLE001 - skipped, counted
            print(f"  skip {os.path.basename(path)}: {type(exc).__name__} after {_cpu_s() - start:.1f} s CPU")
            continue
        finally:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        out.append((os.path.basename(path), index))
        if len(out) == want:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schema-dir", required=True)
    ap.add_argument("--schemas", type=int, default=24, help="distinct compiled schemas to use")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--compile-limit-s", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from cfsm.hf import vocabulary_from_hf
    from lmserver.config import ServerConfig
    from lmserver.testing import load_test_tokenizer

    tok = load_test_tokenizer(ServerConfig())
    vocab = vocabulary_from_hf(tok, size=len(tok), eos_token_ids=[tok.eos_token_id])
    paths = sorted(glob.glob(os.path.join(args.schema_dir, "*.json")))
    rng = random.Random(args.seed)
    rng.shuffle(paths)
    t = time.perf_counter()
    compiled = _compile(paths, vocab, args.compile_limit_s, args.schemas)
    print(f"{len(compiled)} schemas compiled in {time.perf_counter() - t:.1f} s")

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def fresh(i: int) -> ReqGrammar:
        return ReqGrammar(compiled[i % len(compiled)][1], encode, jump_forward=True)

    grammars = [fresh(i) for i in range(args.rows)]
    masker = BatchMasker(vocab.size)
    words = (vocab.size + 31) // 32
    bit = np.arange(32, dtype=np.int64)
    parts: dict[str, list[float]] = {"fill": [], "accept": [], "checks": [], "forced_text": []}
    for _step in range(args.steps):
        t0 = time.perf_counter()
        masker.prepare(grammars, torch.device("cpu"))
        t1 = time.perf_counter()
        prepared = masker._prepared
        assert prepared is not None
        mask = prepared.mask.numpy()
        tokens = []
        for r in range(args.rows):  # the "sampled" tokens (not timed): a random allowed one
            row = mask[r][:words].astype(np.int64) & 0xFFFFFFFF
            allowed = np.nonzero(((row[:, None] >> bit) & 1).reshape(-1))[0]
            tokens.append(int(rng.choice(allowed.tolist())) if len(allowed) else vocab.eos_token_ids[0])
        masker._prepared = None
        acc = chk = fwd = 0.0
        for r, g in enumerate(grammars):
            a = time.perf_counter()
            ok = g.accept(tokens[r])
            b = time.perf_counter()
            done = g.is_finished() or g.is_stuck()
            c = time.perf_counter()
            if not done:
                g.forced_text()
            d = time.perf_counter()
            acc += b - a
            chk += c - b
            fwd += d - c
            if done or not ok:
                grammars[r] = fresh(r + rng.randrange(len(compiled)))
        parts["fill"].append(t1 - t0)
        parts["accept"].append(acc)
        parts["checks"].append(chk)
        parts["forced_text"].append(fwd)
    med = {k: 1e3 * statistics.median(v) for k, v in parts.items()}
    total = sum(med.values())
    print(f"rows {args.rows}, steps {args.steps}: per-step host ms (median): " +
          ", ".join(f"{k} {v:.3f}" for k, v in med.items()) + f"; total {total:.3f} ms "
          f"({1e3 * total / args.rows:.1f} us per row)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_ms": med, "schemas": [n for n, _ in compiled]}, f, indent=1)


if __name__ == "__main__":
    main()
