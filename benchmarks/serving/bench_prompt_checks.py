"""The HTTP process's per-token checks of a prompt given as token ids, next to the per-element rule they replaced.

`tokenizer_manager.is_token_id_list` (a JSON list of ints, not bools; the native API's check) and `TokenizerManager.check_input_ids`'s vocabulary check run on
every /generate body with `input_ids`; both were per-element Python scans (the largest per-token costs of the HTTP
process in a cProfile of 2,000-id requests, 2026-12-04). Times each at `--tokens` random ids, best of `--repeat`
rounds of `--number` calls, microseconds per call.

    python benchmarks/serving/bench_prompt_checks.py [--tokens 4096] [--number 200] [--repeat 7]
"""

from __future__ import annotations

import argparse
import random
import timeit
from typing import Any


def per_element_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def per_element_vocab(ids: list[Any], vocab: int) -> list[Any]:
    return [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    from lmserver.edge.tokenizer_manager import TokenizerManager, is_token_id_list

    ids = [random.Random(0).randrange(args.vocab) for _ in range(args.tokens)]

    class Ready:  # what check_input_ids reads of a manager (vocab_size, context_length): no sockets
        vocab_size, context_length = args.vocab, args.tokens + 1

    from lmserver.io_struct import SamplingParams

    mgr = TokenizerManager.__new__(TokenizerManager)
    mgr.ready = Ready()  # type: ignore[assignment]
    params = SamplingParams(max_new_tokens=1)

    def us(fn: Any) -> float:
        return 1e6 * min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number

    rows = [("list of token ids", us(lambda: per_element_ids(ids)), us(lambda: is_token_id_list(ids))),
            ("ids in the vocabulary", us(lambda: per_element_vocab(ids, args.vocab)),
             us(lambda: mgr.check_input_ids(ids, params, max_new_tokens_given=True)))]
    print(f"{args.tokens} ids, us per call\n| check | per element | lmserver | ratio |\n|---|---|---|---|")
    for name, old, new in rows:
        print(f"| {name} | {old:.1f} | {new:.1f} | {old / new:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
