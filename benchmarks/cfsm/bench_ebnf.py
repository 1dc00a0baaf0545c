"""EBNF (GBNF) grammars: cfsm's pushdown matcher side by side with xgrammar and llguidance.

Grammars: JSON (GBNF), a C-like statement / expression language, an SQL SELECT subset (all three
recursive, so cfsm takes its pushdown path), each engine's own free-JSON grammar (cfsm compiles it
once per vocabulary: `free-json` times the per-request copy, `free-json-cold` the first compile),
and a Lark JSON grammar (xgrammar takes no Lark: cfsm and llguidance only). Vocabularies: SmolLM2 (49,152)
and Mistral's Tekken (131,072; from the mistral-common wheel, as `bench_cfsm.py` loads it).

Per-vocabulary work (once per tokenizer, shared by every grammar; timed as `prep_ms`, CPU time,
one line per engine and vocabulary): cfsm `Vocabulary.prepare()` (sorted trie tables and the trie
level by level, the JSON string / format tables of the schema path; of it, `trie_levels_ms` for
the trie the pushdown walks use); xgrammar `TokenizerInfo` + `GrammarCompiler`; llguidance its
tokenizer. Per-grammar work is the rest:

Per (vocabulary, grammar, engine):
- `compile_ms`: cold compile of the grammar on the prepared vocabulary (median of `--repeat`
  compiles, each from scratch: nothing a compile builds for a grammar is kept between compiles;
  wall or `--clock cpu` time; llguidance: its matcher's construction, which compiles lazily);
- `cold_*`: mask fill per token while replaying the tokenizer's tokenization of a valid target
  text on the first replay over a fresh compile (median over the compiles, per token);
- `warm_*`: the same on a later replay (fastest of `--repeat` replays, per token);
- `walk_*`: first-use masks: a fresh compile, then `--members` random members of the grammar
  (`cfsm.grammar.testing.draw_member`, seeded; the JSON grammars draw from the JSON GBNF), each
  tokenized and replayed through a new matcher, every mask fill timed once (mean, p99, max):
  masks of stack configurations no earlier text reached.
xgrammar and llguidance are optional (`pip install xgrammar llguidance`; Tekken needs
`mistral-common`); a missing peer is reported and skipped.

    python benchmarks/cfsm/bench_ebnf.py [--vocab smollm2 tekken] [--engines cfsm xgrammar llguidance]
        [--repeat 3] [--members 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cfsm import VOCABS, load_smollm2  # noqa: E402, F401
from engines import Bundle  # noqa: E402

import cfsm  # noqa: E402
from cfsm.grammar import parse_ebnf  # noqa: E402
from cfsm.grammar.testing import LARK_JSON, draw_member  # noqa: E402

try:
    from cfsm.masks.vocab import build_trie_levels  # noqa: E402
except ImportError:  # NOTE: a cfsm tree from before the trie levels (A/B runs of older commits)
    build_trie_levels = None  # type: ignore[assignment]

JSON_GBNF = r'''
root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9] [0-9]{0,15} )?
ws     ::= [ \t\n]{0,20}
'''

C_GBNF = r'''
root     ::= ws stmt+
stmt     ::= decl | assign | ifstmt | whilestmt | retstmt | block
block    ::= "{" ws stmt* "}" ws
decl     ::= ("int" | "float" | "char") " " ws ident ws ("=" ws expr)? ";" ws
assign   ::= ident ws ("=" | "+=" | "-=") ws expr ";" ws
ifstmt   ::= "if" ws "(" ws expr ")" ws stmt ("else" ws stmt)?
whilestmt ::= "while" ws "(" ws expr ")" ws stmt
retstmt  ::= "return" ws expr? ";" ws
expr     ::= unary (binop ws unary)*
binop    ::= "+" | "-" | "*" | "/" | "%" | "==" | "!=" | "<=" | ">=" | "<" | ">" | "&&" | "||"
unary    ::= ("-" | "!")? primary
primary  ::= number ws | ident ws ( "(" ws ( expr ("," ws expr)* )? ")" ws )? | "(" ws expr ")" ws
ident    ::= [a-zA-Z_] [a-zA-Z0-9_]{0,31}
number   ::= [0-9]+ ("." [0-9]+)?
ws       ::= [ \t\n]*
'''

SQL_GBNF = r'''
root     ::= select ";"
select   ::= "SELECT " ("DISTINCT ")? columns " FROM " tables where? group? order? limit?
columns  ::= "*" | column (", " column)*
column   ::= expr (" AS " ident)?
tables   ::= table (", " table | " JOIN " table " ON " cond)*
table    ::= ident (" " ident)? | "(" select ")" " " ident
where    ::= " WHERE " cond
group    ::= " GROUP BY " expr (", " expr)*
order    ::= " ORDER BY " expr (" ASC" | " DESC")? (", " expr (" ASC" | " DESC")?)*
limit    ::= " LIMIT " [0-9]+
cond     ::= pred ((" AND " | " OR ") pred)*
pred     ::= expr (" = " | " <> " | " < " | " > " | " <= " | " >= ") expr | expr " IN (" select ")" | "(" cond ")" | "NOT " pred
expr     ::= term ((" + " | " - " | " * " | " / ") term)*
term     ::= ident ("." ident)? | [0-9]+ | "'" [^'\n]* "'" | func "(" ("*" | expr) ")" | "(" expr ")"
func     ::= "COUNT" | "SUM" | "AVG" | "MIN" | "MAX"
ident    ::= [a-z_] [a-z0-9_]{0,30}
'''

JSON_TARGET = json.dumps({
    "id": 1042, "name": "Ada Lovelace", "tags": ["math", "engines", {"nested": [1, 2.5, -3e4, None, True]}],
    "address": {"street": "12 St James's Square", "city": "London", "geo": {"lat": 51.507, "lng": -0.1357}},
    "notes": "first \"programmer\"\nwrote notes on the analytical engine", "active": False,
    "history": [{"year": 1843, "event": "Notes"}, {"year": 1852, "event": "died", "age": 36}]}, indent=2)
C_TARGET = """int total = 0;
float ratio;
while (i < n) {
  if (values(i) % 2 == 0) total += values(i) * 3; else { total -= 1; }
  i = i + 1;
}
ratio = (total + 0.5) / (n - 1);
return total;
"""
SQL_TARGET = ("SELECT DISTINCT u.name, COUNT(o.id) AS orders, SUM(o.total) AS spent FROM users u JOIN orders o ON "
              "o.user_id = u.id WHERE u.created > '2024-01-01' AND o.status IN (SELECT s.code FROM statuses s WHERE "
              "s.active = 1) GROUP BY u.name ORDER BY spent DESC, u.name LIMIT 20;")

# "free-json": each engine's own free-JSON grammar (cfsm: `compile_json_object(object_only=False)`, no
# depth bound; xgrammar: its built-in JSON grammar), the same target. cfsm compiles it once per vocabulary
# (`Vocabulary.derived`) and hands each call a copy: "free-json" times that per-request copy, "free-json-cold"
# the first compile on the vocabulary (the memo cleared before each compile; xgrammar: as "free-json")
BUILTIN = "<builtin json>"
BUILTIN_COLD = "<builtin json, cold>"
GRAMMARS = {"json-gbnf": (JSON_GBNF, JSON_TARGET), "c-like": (C_GBNF, C_TARGET), "sql-select": (SQL_GBNF, SQL_TARGET),
            "free-json": (BUILTIN, JSON_TARGET), "free-json-cold": (BUILTIN_COLD, JSON_TARGET),
            "lark-json": (LARK_JSON, JSON_TARGET)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Rejected(Exception):
    """An engine refused a token of a text of the grammar."""


class _Cfsm:
    name = "cfsm"

    def __init__(self, vocab: cfsm.Vocabulary) -> None:
        self.vocab = vocab

    def compile(self, text: str) -> Any:
        if text == BUILTIN_COLD:
            self.vocab.__dict__.pop("_derived", None)  # NOTE: the per-vocabulary memo of `Vocabulary.derived`
            text = BUILTIN
        if text == BUILTIN:
            return cfsm.compile_json_object(self.vocab, object_only=False)
        if text == LARK_JSON:
            return cfsm.compile_lark(text, self.vocab)
        return cfsm.compile_ebnf(text, self.vocab)

    def replay(self, compiled: Any, ids: list[int]) -> list[float]:
        guide = cfsm.Guide(compiled)
        out = np.zeros((1, self.vocab.mask_words), dtype=np.int32)
        times = []
        for t in ids:
            start = time.perf_counter()
            guide.fill_mask(out, 0)
            times.append(time.perf_counter() - start)
            if not (int(out[0, t >> 5]) >> (t & 31)) & 1:
                raise Rejected(f"cfsm masked out token {t}")
            guide.advance(t)
        if not guide.can_stop():
            raise Rejected("cfsm: the text is incomplete")
        return times


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, bundle: Bundle) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.size = bundle.size
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(bundle.tokenizer, vocab_size=self.size),
                                            cache_enabled=False)

    def compile(self, text: str) -> Any:
        if text in (BUILTIN, BUILTIN_COLD):
            return self.compiler.compile_builtin_json_grammar()
        if text == LARK_JSON:
            raise NotImplementedError("xgrammar takes no Lark grammars")
        return self.compiler.compile_grammar(text)

    def replay(self, compiled: Any, ids: list[int]) -> list[float]:
        m = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.size)
        arr = mask.numpy()
        times = []
        for t in ids:
            start = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - start)
            if not (int(arr[0, t >> 5]) >> (t & 31)) & 1 or not m.accept_token(t):
                raise Rejected(f"xgrammar masked out token {t}")
        if not m.is_terminated() and not m.accept_token(self.eos):
            raise Rejected("xgrammar: the text is incomplete")
        return times


class _Llguidance:
    name = "llguidance"

    def __init__(self, bundle: Bundle) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        from llguidance.gbnf_to_lark import any_to_lark

        self.ll = llguidance
        self.to_lark = any_to_lark
        self.size = bundle.size
        self.tok = llguidance.hf.from_tokenizer(bundle.tokenizer, n_vocab=self.size)

    def compile(self, text: str) -> Any:
        ll = self.ll
        if text in (BUILTIN, BUILTIN_COLD):
            grm = ll.LLMatcher.grammar_from_json_schema({}, defaults={"whitespace_flexible": True})
        else:
            grm = ll.LLMatcher.grammar_from_lark(text if text == LARK_JSON else self.to_lark(text))
        matcher = ll.LLMatcher(self.tok, grm)  # compiles here (lazily: masks on first use)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grm

    def replay(self, compiled: Any, ids: list[int]) -> list[float]:
        ll = self.ll
        m = ll.LLMatcher(self.tok, compiled)
        mask = ll.numpy.allocate_token_bitmask(1, self.size)
        times = []
        for t in ids:
            start = time.perf_counter()
            ll.numpy.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - start)
            if not (int(mask[0, t >> 5]) >> (t & 31)) & 1 or not m.consume_token(t):
                raise Rejected(f"llguidance masked out token {t}")
        if not m.is_accepting():
            raise Rejected("llguidance: the text is incomplete")
        return times


def _members(gname: str, count: int, seed: int = 0) -> list[str]:
    """`count` random members of grammar `gname` (the JSON grammars draw from the JSON GBNF)."""
    text = GRAMMARS[gname][0]
    grammar = parse_ebnf(JSON_GBNF if text in (BUILTIN, BUILTIN_COLD, LARK_JSON) else text)
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < count:
        member = draw_member(grammar, rng, max_depth=8, max_repeat=4)
        if 0 < len(member) <= 4000:
            out.append(member)
    return out


def _engines(names: list[str], bundle: Bundle, vocab: cfsm.Vocabulary) -> list[Any]:
    out: list[Any] = []
    for name in names:
        start = time.process_time()
        try:
            if name == "cfsm":
                out.append(_Cfsm(vocab))
            elif name == "xgrammar":
                eng = _Xgrammar(bundle)
                eng.eos = vocab.eos_token_ids[0]
                out.append(eng)
            else:
                out.append(_Llguidance(bundle))
        except ImportError as exc:
            print(f"# {name} not available ({exc}); skipped")
            continue
        out[-1].prep_ms = 1e3 * (time.process_time() - start)
    return out


def _bench(eng: Any, bundle: Bundle, gname: str, repeat: int, members: list[str], cpu_clock: bool = False,
           compile_only: bool = False) -> dict[str, Any] | None:
    text, target = GRAMMARS[gname]
    ids = list(bundle.tokenizer.encode(target, add_special_tokens=False))
    try:
        eng.compile(text)  # warm-up (imports, first-use tables)
    except NotImplementedError:
        return None
    compiles, cold, warm_runs = [], [], []
    clock = time.process_time if cpu_clock else time.perf_counter
    for _ in range(repeat):
        start = clock()
        compiled = eng.compile(text)
        compiles.append(clock() - start)
        if not compile_only:
            cold.append(eng.replay(compiled, ids))
            warm_runs.append(eng.replay(compiled, ids))
    row: dict[str, Any] = {
        "vocab": bundle.name, "grammar": gname, "engine": eng.name, "tokens": len(ids),
        "compile_ms": 1e3 * statistics.median(compiles), "compile_min_ms": 1e3 * min(compiles)}
    if not compile_only:
        cold_t = [statistics.median(x) for x in zip(*cold, strict=True)]
        warm_t = [min(x) for x in zip(*warm_runs, strict=True)]
        row.update({"cold_mean_us": 1e6 * statistics.mean(cold_t), "cold_p99_us": 1e6 * _pct(cold_t, 0.99),
                    "warm_mean_us": 1e6 * statistics.mean(warm_t), "warm_p99_us": 1e6 * _pct(warm_t, 0.99)})
    if isinstance(compiled, cfsm.GrammarIndex):
        row["pda_states"] = compiled.pda.num_states
    if members:
        fresh = eng.compile(text)
        walk: list[float] = []
        rejected = 0
        for member in members:
            try:
                walk.extend(eng.replay(fresh, list(bundle.tokenizer.encode(member, add_special_tokens=False))))
            except Rejected:
                rejected += 1
        row.update({"walk_masks": len(walk), "walk_rejected": rejected,
                    "walk_mean_us": 1e6 * statistics.mean(walk) if walk else float("nan"),
                    "walk_p99_us": 1e6 * _pct(walk, 0.99) if walk else float("nan"),
                    "walk_max_us": 1e6 * max(walk) if walk else float("nan")})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--grammars", nargs="+", default=list(GRAMMARS), choices=list(GRAMMARS))
    ap.add_argument("--vocab", nargs="+", default=["smollm2"], choices=list(VOCABS))
    ap.add_argument("--engines", nargs="+", default=["cfsm", "xgrammar", "llguidance"],
                    choices=["cfsm", "xgrammar", "llguidance"])
    ap.add_argument("--members", type=int, default=30, help="random members per grammar for the first-use walk")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="compile_ms as wall time or as this process's CPU time (all its threads; steadier on a "
                         "loaded machine)")
    ap.add_argument("--compile-only", action="store_true",
                    help="time the compiles only (no replays; with --members 0 no mask is filled)")
    args = ap.parse_args()
    rows = []
    for vname in args.vocab:
        bundle = VOCABS[vname]()
        start = time.process_time()
        vocab = bundle.vocab.prepare()
        prep = {"vocab": bundle.name, "cfsm_prep_ms": 1e3 * (time.process_time() - start)}
        if build_trie_levels is not None:
            start = time.process_time()
            build_trie_levels(vocab.trie_tables)  # NOTE: timed again alone (prepare() built it once)
            prep["trie_levels_ms"] = 1e3 * (time.process_time() - start)
        engines = _engines(args.engines, bundle, vocab)
        for eng in engines:
            if eng.name != "cfsm":
                prep[f"{eng.name}_prep_ms"] = eng.prep_ms
        print("# per-vocabulary preparation, CPU ms: " + json.dumps(prep), flush=True)
        rows.append({"prep": prep})
        for gname in args.grammars:
            members = _members(gname, args.members) if args.members else []
            for eng in engines:
                row = _bench(eng, bundle, gname, args.repeat, members, args.clock == "cpu", args.compile_only)
                if row is not None:
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    head = ("vocab", "grammar", "engine", "tokens", "compile_ms", "compile_min_ms", "cold_mean_us", "cold_p99_us", "warm_mean_us",
            "warm_p99_us", "walk_masks", "walk_rejected", "walk_mean_us", "walk_p99_us", "walk_max_us")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        if "prep" in r:
            continue
        print("| " + " | ".join(f"{r[h]:.1f}" if isinstance(r.get(h), float) else str(r.get(h, "-"))
                                 for h in head) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
