"""A hash of every benchmark grammar's compiled output (DFA arrays, byte classes, mask rows and the
state -> row map), per vocabulary and whitespace mode: run it at two commits and diff the output
to check that a compile-time change leaves every DFA and mask byte-identical.

    python benchmarks/cfsm/index_hashes.py [--vocab smollm2 tekken] > hashes.txt
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cfsm import VOCABS  # noqa: E402
from grammars import GRAMMARS  # noqa: E402

import cfsm  # noqa: E402


def index_hash(index: cfsm.Index) -> str:
    h = hashlib.sha256()
    dfa = index.dfa
    for a in (dfa.transitions, dfa.accepting, *dfa.byte_classes, index.masks, index.mask_row):
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    h.update(str(dfa.start).encode())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", nargs="+", default=list(VOCABS), choices=list(VOCABS))
    args = ap.parse_args()
    for name in args.vocab:
        bundle = VOCABS[name]()
        vocab = bundle.vocab.prepare()
        for grammar, (kind, value, _) in GRAMMARS.items():
            for ws in ("compact", "flexible"):
                cfg = cfsm.CfsmConfig(whitespace=ws)
                if kind == "regex":
                    if ws == "flexible":
                        continue
                    index = cfsm.compile_regex(value, vocab)
                elif kind == "schema":
                    index = cfsm.compile_json_schema(value, vocab, cfg)
                else:
                    index = cfsm.compile_json_object(vocab, cfg)
                print(f"{bundle.name}\t{grammar}\t{ws}\t{index.dfa.num_states}\t{index_hash(index)}", flush=True)


if __name__ == "__main__":
    main()
