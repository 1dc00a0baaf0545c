"""A storm of JSON Schema compiles next to plain streams: do the streams keep their pace?

Two phases against one server:
- `calm`: `--streams` streaming plain-text requests (native `/generate`, `ignore_eos`,
  `--stream-tokens` new tokens each) arrive at once;
- `storm`: the same streams again; once each has sent its first chunk, `--schemas` requests with
  distinct JSON Schemas (never compiled before on this server) arrive at once.

Per phase: the streams' per-user decode speed (tokens after the first over the time from the
first chunk to the last: mean and slowest), their largest gap between two chunks, and in the storm
the same over the storm window alone (from the schema requests' arrival to the last answer:
tokens of each stream that arrived in it, over the window). Per schema: its outcome — `valid`
(JSON that the `jsonschema` package validates against the schema), `truncated` (the request ran
out of `--schema-tokens`), `invalid` (finished, but not valid JSON or not valid for the schema),
`400` (with the server's message), or `other` (another status, an exception) — its time to the
first token (grammar compile and wait included) and the approximations the server reported.

Schemas: `--schema-dir DIR` (repeatable; every `*.json` below it, e.g. the `data/<subset>` folders
of a JSONSchemaBench checkout), `--schemas` of them drawn with `--seed`; by default a built-in
generator of distinct synthetic schemas (objects of 4 to 24 properties: bounded strings, enums,
numbers with ranges, formats, nested objects and arrays). Every schema gets a random unused
`description` prefix so that each one compiles, also on a server that saw the folder before.

    python benchmarks/structured/bench_storm.py --url http://127.0.0.1:30000 [--streams 8] [--schemas 96]
        [--schema-dir DIR] [--stream-tokens 256] [--schema-tokens 256] [--json out.json]
    python benchmarks/structured/bench_storm.py --server-args "--context-length 4096" ...   (starts a server)

Without `--url` it starts `lmserver serve` with `--server-args` (the embedded SmolLM2 by default)
and stops it after. The table ends with the storm/calm ratio of the per-user decode speed and
the largest gap (the issue's targets: >= 0.9 and <= 100 ms on the H200).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import math
import os
import random
import shlex
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import jsonschema

STREAM_PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how bread is made, step by step.",
                  "Describe a walk through a busy market.", "Tell the history of a small mountain town.",
                  "Write a letter to a friend about a long trip.", "Describe the life of a honeybee.",
                  "Explain how a sailing ship works.", "Write a story about two chess players."]


@dataclass
class StreamResult:
    index: int
    times: list[float] = field(default_factory=list)  # arrival of each chunk
    tokens: list[int] = field(default_factory=list)  # completion tokens at each chunk
    error: str | None = None

    def decode_tok_s(self) -> float:
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return float("nan")
        return (self.tokens[-1] - self.tokens[0]) / (self.times[-1] - self.times[0])

    def max_gap_s(self, start: float = float("-inf"), end: float = float("inf")) -> float:
        ts = [t for t in self.times if start <= t <= end]
        before = [t for t in self.times if t < start][-1:]
        after = [t for t in self.times if t > end][:1]
        ts = before + ts + after
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=float("nan"))

    def tok_s_in(self, start: float, end: float, stall_s: float = math.inf) -> float:
        """Tokens that arrived in [start, end] over the part of it this stream was decoding, less
        the gaps longer than `stall_s` that ended in it (default: none left out)."""
        inside = [(t, n) for t, n in zip(self.times, self.tokens, strict=True) if start <= t <= end]
        before = [n for t, n in zip(self.times, self.tokens, strict=True) if t < start]
        if not inside or not before:
            return float("nan")
        span = min(end, self.times[-1]) - max(start, self.times[0])
        span -= sum(b - a for a, b in zip(self.times, self.times[1:], strict=False)
                    if b - a > stall_s and start <= b <= end)
        return (inside[-1][1] - before[-1]) / span if span > 0 else float("nan")


@dataclass
class SchemaResult:
    name: str
    outcome: str = "other"  # valid | truncated | invalid | 400 | other
    status: int = 0
    message: str = ""
    ttft_s: float = float("nan")  # the first token after arrival: compile and queue included
    e2e_s: float = float("nan")
    approximations: list[str] = field(default_factory=list)
    decode_tok_s: float = float("nan")  # tokens after the first over first-to-last chunk (its batch's step rate)


# --- schemas -----------------------------------------------------------------------------------------


def synthetic_schemas(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """`n` distinct object schemas of the kinds real APIs use."""
    rng = random.Random(seed)
    words = ["id", "name", "title", "email", "count", "price", "status", "created", "tags", "owner", "score",
             "url", "city", "country", "code", "active", "level", "notes", "items", "version", "kind", "size"]

    def value(depth: int) -> dict[str, Any]:
        kind = rng.choice(["string", "bounded", "enum", "integer", "number", "boolean", "format", "array", "object"]
                          if depth < 2 else ["string", "bounded", "enum", "integer", "number", "boolean"])
        if kind == "string":
            return {"type": "string"}
        if kind == "bounded":
            return {"type": "string", "minLength": rng.randint(1, 3), "maxLength": rng.randint(8, 40)}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "small", "large", "open", "closed", "new", "old"],
                                       rng.randint(2, 5))}
        if kind == "integer":
            lo = rng.randint(-100, 100)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 100000)}
        if kind == "number":
            return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1e6])}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "format":
            return {"type": "string", "format": rng.choice(["date", "date-time", "email", "uuid", "uri", "ipv4"])}
        if kind == "array":
            return {"type": "array", "items": value(depth + 1), "maxItems": rng.randint(1, 5)}
        return obj(depth + 1, rng.randint(2, 6))

    def obj(depth: int, size: int) -> dict[str, Any]:
        keys = rng.sample(words, min(size, len(words)))
        props = {f"{k}_{rng.randint(0, 999)}" if rng.random() < 0.3 else k: value(depth) for k in keys}
        required = [k for k in props if rng.random() < 0.7]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    while len(out) < n:
        schema = obj(0, rng.randint(4, 24))
        text = json.dumps(schema, sort_keys=True)
        if text not in seen:
            seen.add(text)
            out.append((f"synthetic-{len(out)}", schema))
    return out


def folder_schemas(dirs: list[str], n: int, seed: int) -> list[tuple[str, Any]]:
    paths = sorted(p for d in dirs for p in glob.glob(os.path.join(d, "**", "*.json"), recursive=True))
    if not paths:
        raise SystemExit(f"no *.json files under {dirs}")
    rng = random.Random(seed)
    out: list[tuple[str, Any]] = []
    for path in rng.sample(paths, len(paths)):
        try:
            with open(path, encoding="utf-8") as f:
                schema = json.load(f)
        except (OSError, ValueError, RecursionError):
            continue
        out.append((os.path.relpath(path, os.path.commonpath(dirs) if len(dirs) > 1 else dirs[0]), schema))
        if len(out) == n:
            break
    return out


def distinct(schema: Any, tag: str) -> Any:
    """`schema` with an annotation nobody sent before: a cache miss on any server (annotations do
    not change the language)."""
    if isinstance(schema, dict):
        return {"$comment": f"bench_storm {tag}", **schema}
    return schema


# --- requests ------------------------------------------------------------------------------------------


def run_stream(client: httpx.Client, i: int, max_new: int, started: threading.Semaphore) -> StreamResult:
    res = StreamResult(i)
    body = {"text": STREAM_PROMPTS[i % len(STREAM_PROMPTS)], "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    signalled = False
    try:
        with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                return res
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    res.error = str(obj["error"])
                    break
                res.times.append(time.perf_counter())
                res.tokens.append(int(obj["meta_info"]["completion_tokens"]))
                if not signalled:
                    signalled = True
                    started.release()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not signalled:
            started.release()
    return res


def run_schema(client: httpx.Client, name: str, schema: Any, max_new: int) -> SchemaResult:
    res = SchemaResult(name)
    params: dict[str, Any] = {"max_new_tokens": max_new, "temperature": 0}
    if schema is None:  # --plain-storm: the same requests without a grammar (ignore_eos: the same length)
        params["ignore_eos"] = True
    else:
        params["json_schema"] = json.dumps(schema)
    # NOTE: the request id names the schema (unique per run), so the server's step trace names it too (admit_max_rid)
    body = {"text": "Here is a JSON document that follows the schema:\n", "stream": True, "sampling_params": params,
            "rid": f"storm-{name}-{time.time_ns()}"}
    start = time.perf_counter()
    last: dict[str, Any] | None = None
    first: tuple[float, int] | None = None  # (time, completion tokens) at the first chunk with a token
    try:
        with client.stream("POST", "/generate", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                text = r.read().decode(errors="replace")
                try:
                    res.message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    res.message = text[:300]
                res.outcome = "400" if r.status_code == 400 else "other"
                return res
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    res.message = str(obj["error"].get("message", obj["error"]))
                    res.outcome = "400" if obj["error"].get("code") == 400 else "other"
                    return res
                n = int(obj["meta_info"]["completion_tokens"])
                if n and first is None:
                    first = (time.perf_counter(), n)
                    res.ttft_s = first[0] - start
                elif first is not None and n > first[1]:
                    res.decode_tok_s = (n - first[1]) / (time.perf_counter() - first[0])
                last = obj
    except Exception as exc:  # noqa: BLE001
        res.message = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e_s = time.perf_counter() - start
    if last is None:
        res.message = "no output"
        return res
    meta = last["meta_info"]
    res.approximations = list(meta.get("grammar_approximations", []))
    reason = (meta.get("finish_reason") or {}).get("type")
    if schema is None:
        res.outcome = "plain"
        return res
    if reason == "length":
        res.outcome = "truncated"
        return res
    try:
        doc = json.loads(last["text"])
        jsonschema.validators.validator_for(schema)(schema).validate(doc)
        res.outcome = "valid"
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError, RecursionError) as exc:
        res.outcome, res.message = "invalid", f"{type(exc).__name__}: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - e.g. a $ref jsonschema cannot resolve
        res.outcome, res.message = "invalid", f"the validator failed: {type(exc).__name__}: {str(exc)[:200]}"
    if reason == "abort" and res.outcome != "valid":
        res.outcome, res.message = "other", str(meta.get("finish_reason"))
    return res


STAT_KEYS = ("forwards", "forward_tokens", "extend_forwards", "extend_time_s", "overlap_steps", "overlap_grammar_steps",
             "cuda_graph_replays", "jump_forward_steps", "jump_forward_tokens", "jump_forward_declined", "mask_prepare_s",
             "mask_apply_s", "mask_fill_s", "mask_rows", "mask_stale_rows", "generation_tokens", "compile_done",
             "compile_failed", "compile_workers_killed", "compile_receive_s", "compile_max_receive_s",
             "step_gap_max_s", "admission_deferred_rounds", "gc_pause_s", "gc_full_collections")


def server_gaps(client: httpx.Client, start: float, end: float) -> dict[str, Any]:
    """The server's gap records (`/get_step_trace`, a server started with `--step-trace N`) that
    ended in [start, end] (the server's perf_counter: the same clock on one machine): the longest
    with what filled them, the causes of those over 50 ms, and the mean gap with and without a
    prefill in it. Empty without a trace."""
    try:
        r = client.get("/get_step_trace")
        data = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    fields = data.get("fields", [])
    recs = [dict(zip(fields, row, strict=True)) for row in data.get("records", [])]
    recs = [rec for rec in recs if start <= rec["end"] <= end]
    if not recs:
        return {}
    causes: dict[str, int] = {}
    for rec in recs:
        if rec["gap_s"] > 0.05:
            causes[rec["cause"]] = causes.get(rec["cause"], 0) + 1
    plain = [rec["gap_s"] for rec in recs if not rec["extend_forwards"]]
    extend = [rec["gap_s"] for rec in recs if rec["extend_forwards"]]
    top = sorted(recs, key=lambda rec: -rec["gap_s"])[:6]
    return {"gaps": len(recs), "mean_gap_ms": 1e3 * statistics.fmean(rec["gap_s"] for rec in recs),
            "decode_gaps": len(plain), "decode_mean_ms": 1e3 * statistics.fmean(plain) if plain else float("nan"),
            "extend_gaps": len(extend), "extend_mean_ms": 1e3 * statistics.fmean(extend) if extend else float("nan"),
            "causes_over_50ms": causes,
            "top": [{"at_s": round(rec["end"] - start, 3),  # its end, seconds after the storm's arrival
                     **{k: (round(v * 1e3, 2) if k.endswith("_s") else v) for k, v in rec.items() if k != "end"}}
                    for rec in top]}


# levels, not counters: the SLO admission's current target and the line it fitted (read before the storm)
LEVEL_KEYS = ("admission_target_s", "admission_base_rows", "admission_decode_a_s", "admission_decode_b_s",
              "admission_credit_s")


def server_stats(client: httpx.Client, keys: tuple[str, ...] = STAT_KEYS) -> dict[str, float]:
    """The engine values of `keys` (those the server has) from /get_server_info."""
    try:
        sched = client.get("/get_server_info").json().get("scheduler", {})
    except (httpx.HTTPError, ValueError):
        return {}
    return {k: float(sched[k]) for k in keys if k in sched and sched[k] is not None}


def phase(base_url: str, streams: int, stream_tokens: int, schemas: list[tuple[str, Any]],
          schema_tokens: int) -> dict[str, Any]:
    started = threading.Semaphore(0)  # released once per stream, at its first chunk
    limits = httpx.Limits(max_connections=streams + len(schemas) + 8)
    with httpx.Client(base_url=base_url, timeout=1800, limits=limits) as client, \
            cf.ThreadPoolExecutor(streams + len(schemas)) as pool:
        futs = [pool.submit(run_stream, client, i, stream_tokens, started) for i in range(streams)]
        for _ in range(streams):  # every stream has sent its first chunk
            started.acquire(timeout=1800)
        before = server_stats(client)
        levels = server_stats(client, LEVEL_KEYS)
        t0 = time.perf_counter()
        sfuts = [pool.submit(run_schema, client, name, schema, schema_tokens) for name, schema in schemas]
        schema_results = [f.result() for f in sfuts]
        t1 = time.perf_counter()
        window_stats = server_stats(client)
        gaps = server_gaps(client, t0, t1)
        stream_results = [f.result() for f in futs]
        after = server_stats(client)
    delta = {k: round(window_stats[k] - before[k], 4) for k in window_stats if k in before}
    rest = {k: round(after[k] - window_stats[k], 4) for k in after if k in window_stats}
    return {"streams": stream_results, "schemas": schema_results, "window": (t0, t1),
            "server_window": delta, "server_after_window": rest, "server_gaps": gaps, "server_levels": levels}


# --- report ------------------------------------------------------------------------------------------

# a stream gap longer than this is a stall (a step that stopped the batch), not the batch's pace: the
# storm's speed is also reported without them, which splits a slower pace (a larger batch) from stalls
STALL_S = 0.045


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.fmean(xs) if xs else float("nan")


def summarize(name: str, res: dict[str, Any], storm: bool) -> dict[str, Any]:
    streams: list[StreamResult] = res["streams"]
    t0, t1 = res["window"]
    speeds = [s.decode_tok_s() for s in streams]
    row: dict[str, Any] = {
        "phase": name, "streams": len(streams), "errors": [s.error for s in streams if s.error],
        "per_user_tok_s_mean": _nanmean(speeds), "per_user_tok_s_min": min(speeds, default=float("nan")),
        "max_gap_ms": 1e3 * max((s.max_gap_s() for s in streams), default=float("nan")),
    }
    row["server_window"] = res.get("server_window", {})
    row["server_after_window"] = res.get("server_after_window", {})
    row["server_gaps"] = res.get("server_gaps", {})
    row["server_levels_before"] = res.get("server_levels", {})
    decode = [s.decode_tok_s for s in res["schemas"] if s.decode_tok_s == s.decode_tok_s]
    if decode:  # the storm requests' own per-user decode speed (after their first token)
        row["storm_req_decode_tok_s_median"] = statistics.median(decode)
    if storm:
        window = [s.tok_s_in(t0, t1) for s in streams]
        steady = [s.tok_s_in(t0, t1, STALL_S) for s in streams]
        row.update({"storm_window_s": t1 - t0, "window_tok_s_mean": _nanmean(window),
                    "window_tok_s_mean_without_stalls": _nanmean(steady),
                    "window_tok_s_min": min(window, default=float("nan")),
                    "window_max_gap_ms": 1e3 * max((s.max_gap_s(t0, t1) for s in streams), default=float("nan"))})
    return row


def print_report(calm: dict[str, Any], storm: dict[str, Any], schemas: list[SchemaResult]) -> None:
    cols = ["phase", "streams", "per_user_tok_s_mean", "per_user_tok_s_min", "max_gap_ms", "window_tok_s_mean",
            "window_tok_s_min", "window_max_gap_ms", "storm_window_s"]
    print("  ".join(f"{c:>20}" for c in cols))
    for row in (calm, storm):
        cells = []
        for c in cols:
            v = row.get(c, "")
            cells.append(f"{v:>20.1f}" if isinstance(v, float) else f"{v!s:>20}")
        print("  ".join(cells))
    for row in (calm, storm):
        for e in row["errors"]:
            print(f"  {row['phase']} stream error: {e}")
    ratio = storm.get("window_tok_s_mean", float("nan")) / calm["per_user_tok_s_mean"]
    print(f"\nper-user decode speed during the storm / calm: {ratio:.2f}; largest gap during the storm: "
          f"{storm.get('window_max_gap_ms', float('nan')):.0f} ms (calm: {calm['max_gap_ms']:.0f} ms); without "
          f"the gaps over {STALL_S * 1e3:.0f} ms: "
          f"{storm.get('window_tok_s_mean_without_stalls', float('nan')) / calm['per_user_tok_s_mean']:.2f}")
    counts: dict[str, int] = {}
    for s in schemas:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    ttft = sorted(s.ttft_s for s in schemas if s.ttft_s == s.ttft_s)
    q = (lambda p: ttft[int(p * (len(ttft) - 1))]) if ttft else (lambda p: float("nan"))
    print(f"schemas: {len(schemas)}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f"; time to first token p50 {q(0.5):.2f} s, p90 {q(0.9):.2f} s, max {q(1.0):.2f} s; "
          f"with approximation notes: {sum(bool(s.approximations) for s in schemas)}")
    for row in (calm, storm):
        if row.get("server_window"):
            print(f"  server counters, {row['phase']} window: {row['server_window']}")
    if storm.get("server_levels_before"):
        print(f"  SLO admission before the storm: {storm['server_levels_before']}")
    gaps = storm.get("server_gaps") or {}
    if gaps:
        print(f"  server gaps in the storm window: {gaps['gaps']}, mean {gaps['mean_gap_ms']:.2f} ms (decode "
              f"{gaps['decode_gaps']} at {gaps['decode_mean_ms']:.2f}, with a prefill {gaps['extend_gaps']} at "
              f"{gaps['extend_mean_ms']:.2f}); over 50 ms by cause: {gaps['causes_over_50ms']}")
        for rec in gaps["top"]:
            print(f"    {rec}")
    if "storm_req_decode_tok_s_median" in storm:
        print(f"  storm requests' own decode speed (median per user): {storm['storm_req_decode_tok_s_median']:.1f} tok/s")
    shown = 0
    for s in schemas:
        if s.outcome in ("400", "other", "invalid") and shown < 12:
            print(f"  {s.outcome:>9} {s.name}: {s.message[:160]}")
            shown += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one with --server-args)")
    ap.add_argument("--server-args", default="--context-length 4096", help="lmserver serve options when starting one")
    ap.add_argument("--streams", type=int, default=8, help="plain streaming requests")
    ap.add_argument("--stream-tokens", type=int, default=256, help="new tokens per stream")
    ap.add_argument("--schemas", type=int, default=96, help="distinct JSON Schema requests in the storm")
    ap.add_argument("--schema-tokens", type=int, default=256, help="max new tokens per schema request")
    ap.add_argument("--schema-dir", action="append", default=[], help="folder of *.json schemas (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain-storm", action="store_true",
                    help="a third phase: the storm's requests without their grammars (what a batch that large costs the "
                         "streams anyway)")
    ap.add_argument("--json", "--json-out", dest="json_out", default=None, help="write every number to this file")
    args = ap.parse_args()

    server = None
    url = args.url
    if url is None:
        from lmserver.testing import ServerProcess

        server = ServerProcess(shlex.split(args.server_args), core=None)
        print(f"starting lmserver serve {args.server_args} ...", flush=True)
        server.start(timeout_s=1800)
        url = server.base_url
    try:
        tag = f"{time.time_ns()}"
        picked = (folder_schemas(args.schema_dir, args.schemas, args.seed) if args.schema_dir
                  else synthetic_schemas(args.schemas, args.seed))
        schemas = [(name, distinct(schema, f"{tag}-{i}")) for i, (name, schema) in enumerate(picked)]
        with httpx.Client(base_url=url, timeout=600) as client:  # warm: the first forward, the first grammar
            client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}}).raise_for_status()
            client.post("/generate", json={"text": "Hi", "sampling_params": {
                "max_new_tokens": 4, "json_schema": json.dumps({"type": "object", "properties": {"w": {
                    "type": "string", "description": tag}}})}})
        calm_res = phase(url, args.streams, args.stream_tokens, [], args.schema_tokens)
        storm_res = phase(url, args.streams, args.stream_tokens, schemas, args.schema_tokens)
        calm, storm = summarize("calm", calm_res, False), summarize("storm", storm_res, True)
        print_report(calm, storm, storm_res["schemas"])
        plain = None
        if args.plain_storm:
            plain_res = phase(url, args.streams, args.stream_tokens, [(n, None) for n, _ in schemas], args.schema_tokens)
            plain = summarize("plain storm", plain_res, True)
            print(f"plain storm (no grammars): per-user {plain['per_user_tok_s_mean']:.1f} tok/s (window "
                  f"{plain['window_tok_s_mean']:.1f}, {plain['window_tok_s_mean'] / calm['per_user_tok_s_mean']:.2f} of "
                  f"calm, {plain['storm_window_s']:.2f} s), largest gap {plain['max_gap_ms']:.0f} ms; storm / plain "
                  f"storm: {storm['per_user_tok_s_mean'] / plain['per_user_tok_s_mean']:.2f}; the plain requests' own "
                  f"decode speed (median per user) {plain.get('storm_req_decode_tok_s_median', float('nan')):.1f} tok/s")
            print(f"  server counters, plain storm window: {plain['server_window']}")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"args": vars(args), "url": url, "calm": calm, "storm": storm, "plain_storm": plain,
                           "schemas": [asdict(s) for s in storm_res["schemas"]],
                           "streams": {"calm": [asdict(s) for s in calm_res["streams"]],
                                       "storm": [asdict(s) for s in storm_res["streams"]]},
                           "window": storm_res["window"]}, f, indent=1, default=str)
            print(f"wrote {args.json_out}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
