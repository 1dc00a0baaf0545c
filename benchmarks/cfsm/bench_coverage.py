"""JSON Schema coverage of cfsm and its peers on cfsm's feature table (tests/test_json_schema.py).

A row passes when every valid instance is accepted token by token (then EOS) and every invalid
one is rejected, on the SmolLM2 vocabulary. Engines whose compile fails on a row fail that row.

    python benchmarks/cfsm/bench_coverage.py [--engines cfsm xgrammar outlines-core llguidance]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cfsm import load_smollm2  # noqa: E402
from engines import ENGINES  # noqa: E402

import cfsm  # noqa: E402

_TESTS = Path(__file__).resolve().parents[2] / "packages" / "cfsm" / "tests" / "test_json_schema.py"


def _features() -> list[tuple[str, Any, cfsm.CfsmConfig, list[str], list[str]]]:
    spec = importlib.util.spec_from_file_location("cfsm_feature_table", _TESTS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.FEATURES)


def _accepts(engine: Any, compiled: Any, tokenizer: Any, eos: int, text: str) -> bool:
    m = engine.matcher(compiled)
    try:
        for tok in tokenizer.encode(text, add_special_tokens=False) + [eos]:
            m.fill()
            if not m.allowed(tok):
                return False
            m.accept(tok)
    except Exception:  # noqa: BLE001 - a matcher error on this text is a rejection
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    bundle = load_smollm2()
    eos = bundle.vocab.eos_token_ids[0]
    features = _features()
    table: dict[str, dict[str, str]] = {name: {} for name, *_ in features}
    for ename in args.engines:
        try:
            engine = ENGINES[ename](bundle)
        except ImportError as exc:
            print(f"# {ename}: not installed ({exc}); skipped", file=sys.stderr)
            continue
        for name, schema, config, valid, invalid in features:
            if ename == "cfsm":
                engine.config = config
            try:
                compiled = engine.compile("schema", schema)
            except Exception as exc:  # noqa: BLE001 - a compile failure fails the row
                table[name][ename] = f"compile error ({type(exc).__name__})"
                continue
            if ename != "cfsm" and config.whitespace == "flexible":
                table[name][ename] = "no flexible mode in this harness"
                continue
            bad = [t for t in valid if not _accepts(engine, compiled, bundle.tokenizer, eos, t)]
            bad_inv = [t for t in invalid if _accepts(engine, compiled, bundle.tokenizer, eos, t)]
            if not bad and not bad_inv:
                table[name][ename] = "pass"
            else:
                table[name][ename] = ("rejects valid " + bad[0] if bad else "accepts invalid " + bad_inv[0])[:60]
    engines = [e for e in args.engines if any(e in row for row in table.values())]
    print("| row | " + " | ".join(engines) + " |")
    print("|---|" + "---|" * len(engines))
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(row.get(e, "") for e in engines) + " |")
    print("| **rows passed** | " + " | ".join(
        f"**{sum(r.get(e) == 'pass' for r in table.values())} / {len(table)}**" for e in engines) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
