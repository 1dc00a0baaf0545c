"""A hash of every benchmark grammar's compiled output (DFA arrays, byte classes, every state's mask;
for a pushdown matcher, free JSON: its network, key rows and the masks along the target text),
per vocabulary and whitespace mode (compact and flexible; regexes also wrapped in flexible
whitespace): run it at two commits and diff the output to check that a compile-time change leaves
every DFA and every state's mask byte-identical.

The mask rows are hashed in a canonical order (by the first state that uses each, rows no state
uses left out), so a change in the order the index builds and stores equal rows does not count:
what a `Guide` reads (`masks[mask_row[s]]` for every state `s`) does.

    python benchmarks/cfsm/index_hashes.py [--vocab smollm2 tekken] > hashes.txt
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_cfsm import VOCABS  # noqa: E402
from grammars import GRAMMARS  # noqa: E402

import cfsm  # noqa: E402

_FLEXIBLE_WS = r"[ \t\n\r]*"


def canonical_rows(index: cfsm.Index) -> tuple[np.ndarray, np.ndarray]:
    """(masks, mask_row) with the rows renumbered by the first state using each (unused rows dropped)."""
    mask_row = index.mask_row
    used = mask_row[mask_row >= 0]
    _, first = np.unique(used, return_index=True)
    in_order = used[np.sort(first)]
    renumber = np.full(len(index.masks), -1, dtype=np.int32)
    renumber[in_order] = np.arange(len(in_order), dtype=np.int32)
    return np.ascontiguousarray(index.masks[in_order]), np.where(mask_row >= 0, renumber[mask_row], -1)


def index_hash(index: cfsm.Index) -> str:
    h = hashlib.sha256()
    dfa = index.dfa
    for a in (dfa.transitions, dfa.accepting, *dfa.byte_classes, *canonical_rows(index)):
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    h.update(str(dfa.start).encode())
    return h.hexdigest()[:16]


def grammar_hash(index: cfsm.GrammarIndex, target: str) -> str:
    """The network and key rows of a pushdown matcher, and the mask of every configuration its
    target text passes through (byte by byte)."""
    h = hashlib.sha256()
    payload = index.payload()
    for a in payload["pda"]:
        h.update(repr(a.tolist() if isinstance(a, np.ndarray) else a).encode())
    for key in sorted(payload["keys"]):
        h.update(repr(key).encode())
        h.update(payload["keys"][key][0].tobytes())
    sid = index.start
    h.update(index.mask(sid).tobytes())
    for b in target.encode():
        sid = index.walk(sid, bytes([b]))
        if sid == 0:
            break
        h.update(index.mask(sid).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", nargs="+", default=list(VOCABS), choices=list(VOCABS))
    args = ap.parse_args()
    for name in args.vocab:
        bundle = VOCABS[name]()
        vocab = bundle.vocab.prepare()
        for grammar, (kind, value, target) in GRAMMARS.items():
            for ws in ("compact", "flexible"):
                cfg = cfsm.CfsmConfig(whitespace=ws)
                if kind == "regex":  # flexible: the pattern between whitespace runs
                    pattern = value if ws == "compact" else f"{_FLEXIBLE_WS}(?:{value}){_FLEXIBLE_WS}"
                    index = cfsm.compile_regex(pattern, vocab)
                elif kind == "schema":
                    index = cfsm.compile_json_schema(value, vocab, cfg)
                else:
                    index = cfsm.compile_json_object(vocab, cfg)
                if isinstance(index, cfsm.GrammarIndex):
                    print(f"{bundle.name}\t{grammar}\t{ws}\tpda\t{grammar_hash(index, target)}", flush=True)
                else:
                    print(f"{bundle.name}\t{grammar}\t{ws}\t{index.dfa.num_states}\t{index_hash(index)}", flush=True)


if __name__ == "__main__":
    main()
