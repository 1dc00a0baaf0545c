"""Host time of incremental detokenization per generated token: the direct `tokenizers` path vs
`tokenizer.decode` through transformers (never collected by pytest).

Every decode step of the engine detokenizes one token per running request, so this is host time
spent per row per step (at 8 rows and 1 ms steps, 60 us per row is half the step). Same token
streams on both paths; the emitted text is checked equal.

    python benchmarks/serving/bench_detokenizer.py [--tokens 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import time

from transformers import AutoTokenizer

from lmserver.engine.detokenizer import IncrementalDetokenizer
from lmserver.models.default_model import default_model_path

WORDS = ["the", "model", "answers", "in", "plain", "text,", "with", "numbers", "12", "345,", "code", "`x", "=", "f(y)`,", "accents", "é", "ü,", "CJK", "你好", "and", "emoji", "🙂🚀", "so", "that", "multi-byte", "tokens", "are", "held", "back", "now", "and", "then"]


def stream(tokenizer: object, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    return tokenizer(text, add_special_tokens=False)["input_ids"][:n]  # type: ignore[operator, index]


def run(tokenizer: object, ids: list[int], backend: bool) -> tuple[float, str]:
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    if not backend:
        detok._backend = None
    t = time.perf_counter()
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    return (time.perf_counter() - t) / len(ids) * 1e6, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    ids = stream(tok, args.tokens, 0)
    best: dict[str, float] = {}
    texts: dict[str, str] = {}
    for _ in range(args.repeat):
        for name, backend in (("tokenizers (direct)", True), ("transformers decode", False)):
            us, texts[name] = run(tok, ids, backend)
            best[name] = min(best.get(name, float("inf")), us)
    assert len(set(texts.values())) == 1, "the two paths emitted different text"
    print(f"SmolLM2 tokenizer, {len(ids)} tokens, best of {args.repeat}: us per token")
    for name, us in best.items():
        print(f"  {name:22s} {us:7.2f}")
    print(f"  ratio                  {best['transformers decode'] / best['tokenizers (direct)']:.2f}x")


if __name__ == "__main__":
    main()
