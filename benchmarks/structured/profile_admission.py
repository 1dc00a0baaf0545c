"""Where the engine thread's time goes when a compiled grammar is admitted (issue 27's storm stalls).

Compiles `--schemas` JSON Schemas of a folder at once in the server's own compile pool
(`GrammarBackend`, worker processes), and as each one is ready does on this thread what
`EngineCore._admit_constrained` and the first decode steps do with it, timing each part:
`make` (`ReqGrammar`), `stuck` (`is_stuck`), `forced` (`forced_text`), `plan` (`plan_jump` at
admission: retokenization), `apply`, then `--tokens` decode steps of random allowed tokens
(`mask` first fill, `mask_max` the slowest later fill, `accept`). A ticker thread meanwhile
sleeps 1 ms at a time and records how late it wakes: the longest time another thread (the
pool's dispatcher receiving and rebuilding indexes, or this one) held the interpreter.

    python benchmarks/structured/profile_admission.py --schema-dir DIR --tokenizer TOKENIZER_DIR
        [--vocab-size 128256] [--schemas 96] [--seed 27] [--workers 2] [--tokens 64] [--json OUT]

Prints one row per schema (slowest parts first) and the largest value of each part.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_storm import distinct, folder_schemas  # noqa: E402

from lmserver.engine.constrained.backend import GrammarBackend, GrammarError, grammar_key  # noqa: E402
from lmserver.engine.constrained.grammar import ReqGrammar  # noqa: E402
from lmserver.io_struct import SamplingParams  # noqa: E402


class Ticker(threading.Thread):
    """Sleeps `period_s` at a time; `late` collects (wake time, lateness) over 5 ms."""

    def __init__(self, period_s: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.late: list[tuple[float, float]] = []
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            t = time.perf_counter()
            time.sleep(self.period_s)
            over = time.perf_counter() - t - self.period_s
            if over > 0.005:
                self.late.append((time.perf_counter(), over))


def admit(index: Any, encode: Any, vocab_size: int, tokens: int, rng: random.Random) -> dict[str, float]:
    out: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        t = time.perf_counter()
        r = fn()
        out[name] = out.get(name, 0.0) + time.perf_counter() - t
        return r

    g = timed("make", lambda: ReqGrammar(index, encode))
    if timed("stuck", g.is_stuck):
        out["stuck_result"] = 1
        return out
    timed("forced", g.forced_text)
    jump = timed("plan", lambda: g.plan_jump([], tokens))
    if jump is not None:
        timed("apply", lambda: g.apply_jump(jump))
        timed("finished", g.is_finished)
        timed("stuck2", g.is_stuck)  # as `_jump` after it: the post-jump configuration's first mask
    words = (vocab_size + 31) // 32
    mask = np.zeros((1, words), dtype=np.int32)
    out["mask_max"] = 0.0
    out["accept_max"] = 0.0
    for i in range(tokens):
        if g.is_finished():
            break
        t = time.perf_counter()
        g.fill_mask(mask, 0)
        dt = time.perf_counter() - t
        if i == 0:
            out["mask"] = dt
        else:
            out["mask_max"] = max(out["mask_max"], dt)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        if not len(allowed):
            break
        tok = int(allowed[rng.randrange(len(allowed))])
        t = time.perf_counter()
        ok = g.accept(tok)
        out["accept_max"] = max(out["accept_max"], time.perf_counter() - t)
        if not ok:
            out["rejected"] = 1
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schema-dir", action="append", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vocab-size", type=int, default=0)
    ap.add_argument("--schemas", type=int, default=96)
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=15.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*", default=None, help="schema names to keep (after the draw)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = args.vocab_size or len(tok)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    backend = GrammarBackend(tok, vocab_size, eos, compile_timeout_s=args.timeout_s, compile_workers=args.workers)
    schemas = folder_schemas(args.schema_dir, args.schemas, args.seed)
    if args.only:
        schemas = [s for s in schemas if s[0] in args.only]
    tag = f"profile {time.time_ns()}"
    tickets = {}
    for name, schema in schemas:
        try:
            key = grammar_key(SamplingParams(json_schema=json.dumps(distinct(schema, tag))))
        except GrammarError as exc:
            print(f"{name}: refused before compile: {exc}")
            continue
        assert key is not None
        tickets[name] = backend.submit(key)
    ticker = Ticker()
    ticker.start()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)
    while tickets:
        backend.wait(list(tickets.values()), 0.05)
        for name, ticket in list(tickets.items()):
            try:
                index = backend.result(ticket)
            except GrammarError as exc:
                rows.append({"name": name, "error": str(exc)[:80], "ready_s": time.perf_counter() - t0})
                del tickets[name]
                continue
            if index is None:
                continue
            del tickets[name]
            row: dict[str, Any] = {"name": name, "ready_s": time.perf_counter() - t0,
                                   "kind": type(index).__name__}
            t = time.perf_counter()
            row.update(admit(index, backend.encode, vocab_size, args.tokens, rng))
            row["total"] = time.perf_counter() - t
            rows.append(row)
    ticker.stop = True
    stats = backend.pool_stats
    backend.shutdown()
    parts = ["make", "stuck", "forced", "plan", "apply", "stuck2", "mask", "mask_max", "accept_max", "total"]
    ok = [r for r in rows if "error" not in r]
    ok.sort(key=lambda r: -max(r.get(p, 0.0) for p in parts if p != "total"))
    print(f"load {os.getloadavg()}; {len(ok)} compiled, {len(rows) - len(ok)} failed")
    print(f"{'schema':>8} {'kind':>12} " + " ".join(f"{p:>9}" for p in parts) + "  (ms)")
    for r in ok[:20]:
        print(f"{r['name'][:8]:>8} {r['kind'][:12]:>12} " + " ".join(f"{1e3 * r.get(p, 0.0):9.1f}" for p in parts))
    print("max      " + " " * 13 + " ".join(f"{1e3 * max((r.get(p, 0.0) for r in ok), default=0):9.1f}" for p in parts))
    if stats is not None:
        print(f"dispatcher receive: total {stats.receive_s:.3f} s CPU, max {1e3 * stats.max_receive_s:.1f} ms")
    late = sorted(ticker.late, key=lambda x: -x[1])[:10]
    print("ticker lateness (ms, at s):", [(round(1e3 * o, 1), round(t - t0, 2)) for t, o in late])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "late": ticker.late}, f)


if __name__ == "__main__":
    main()
