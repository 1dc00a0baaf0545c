"""cfsm and its peers on the public JSON Schema suites: coverage and false accepts / rejects.

Parts (each runs when its data folder is given):

- coverage: JSONSchemaBench (`data/<subset>/*.json`, one schema per file). A schema is covered
  when it compiles within `--timeout` seconds on the SmolLM2 vocabulary. Every compile runs in a
  worker process (a pool of `--workers`) that is killed at the timeout (CPU seconds of that
  worker by default, so other load on the machine does not count; `--clock wall`). Failures are grouped by
  cause (error class; for cfsm's `UnsupportedSchemaError` its keyword, for
  `UnsupportedRegexError` its construct); cfsm errors that are not a `cfsm.CfsmError` are bugs,
  counted and listed apart with one example schema each.
- test-suite: JSON-Schema-Test-Suite (`tests/<draft>/*.json`, draft2020-12 keyword files by
  default, `optional/` left out). For each test group whose schema compiles, each instance is
  serialized compact (`json.dumps(x, separators=(",", ":"))`) and standard (`json.dumps(x)`),
  tokenized by the tokenizer and fed token by token, then EOS, through the engine's own accept
  call. Accepted but invalid: a false accept (rate over the invalid instances of compiled
  schemas); valid but rejected: a false reject (rate over the valid ones). Groups whose schema
  `$ref`s a remote document (not the metaschema) are skipped. cfsm's false accepts are split by
  whether the index reported approximations (`Index.approximations`).
- maskbench: JSONSchemaBench's real-world instances (`maskbench/data/*.json`: a schema and
  tests with validity), measured as test-suite.

Variants: every engine x whitespace (`compact`, `flexible`: cfsm `CfsmConfig(whitespace=...)`,
xgrammar `any_whitespace`, llguidance `whitespace_flexible`, outlines-core `[ \\t\\n\\r]*`), and
for cfsm every `--config` (`default`: `CfsmConfig()`, `spec`: `CfsmConfig.spec()`). Each result
records the git commit and whether cfsm's sources were dirty, at the start and at the end.

Data: plain checkouts of both suites.

    git clone https://github.com/guidance-ai/jsonschemabench
    git clone https://github.com/json-schema-org/JSON-Schema-Test-Suite
    python benchmarks/cfsm/bench_suites.py --jsonschemabench jsonschemabench \\
        --test-suite JSON-Schema-Test-Suite [--engines cfsm xgrammar llguidance outlines-core] \\
        [--config default spec] [--whitespace compact flexible] [--parts coverage test-suite maskbench] \\
        [--subsets Github_easy ...] [--limit N | --sample N --seed S] [--timeout 10] [--workers 2] \\
        [--json out.json]

Peers are optional: run from a virtual environment that has them (see bench_cfsm.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cfsm import load_smollm2  # noqa: E402
from engines import ENGINES, Bundle  # noqa: E402

import cfsm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SPACINGS = ("compact", "standard")


# ---------------------------------------------------------------------------------------------
# provenance


def provenance() -> dict[str, Any]:
    """The commit, and whether (and how) cfsm's sources differ from it."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                                  check=False).stdout
        except OSError:
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "packages/cfsm/src").splitlines()]
    diff = git("diff", "HEAD", "--", "packages/cfsm/src")
    package = Path(cfsm.__file__).resolve().parent
    files = hashlib.sha256()
    for f in sorted(package.glob("*.py")):
        files.update(f.name.encode() + b"\0" + f.read_bytes())
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "cfsm_dirty": bool(dirty),
            "cfsm_dirty_files": dirty, "cfsm_diff_sha": hashlib.sha256(diff.encode()).hexdigest()[:12] if dirty else "",
            # what this process imported: this checkout's cfsm, or a copy (PYTHONPATH) of some commit's
            "cfsm_imported_from_checkout": REPO in package.parents, "cfsm_files_sha": files.hexdigest()[:12],
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count()}


# ---------------------------------------------------------------------------------------------
# data


@dataclass
class Item:
    """One schema to compile, with the instances to walk (valid, compact text, standard text)."""

    part: str
    group: str  # subset or test file
    name: str
    schema: Any
    instances: list[tuple[bool, str, str, str]] = field(default_factory=list)  # (valid, compact, standard, description)
    skip: str = ""


def _texts(x: Any) -> tuple[str, str]:
    return json.dumps(x, separators=(",", ":")), json.dumps(x)


def jsb_items(root: Path, subsets: list[str] | None) -> list[Item]:
    items = []
    for folder in sorted(p for p in (root / "data").iterdir() if p.is_dir()):
        if subsets and folder.name not in subsets:
            continue
        for f in sorted(folder.glob("*.json")):
            try:
                schema = json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError):
                items.append(Item("coverage", folder.name, f.name, None, skip="not JSON"))
                continue
            items.append(Item("coverage", folder.name, f.name, schema))
    return items


def maskbench_items(root: Path, subsets: list[str] | None) -> list[Item]:
    items = []
    for f in sorted((root / "maskbench" / "data").glob("*.json")):
        group = f.name.split("---")[0] if "---" in f.name else re.sub(r"_\d+\.json$", "", f.name)
        if subsets and group not in subsets:
            continue
        try:
            d = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        tests = d.get("tests") or []
        if not tests:
            continue
        item = Item("maskbench", group, f.name, d["schema"])
        for t in tests:
            item.instances.append((bool(t["valid"]), *_texts(t["data"]), str(t.get("description", ""))[:80]))
        items.append(item)
    return items


_META = re.compile(r"^https?://json-schema\.org/(draft|schema)")


def remote_refs(schema: Any) -> list[str]:
    """The `$ref`s of `schema` that name a document other than itself (its `$id`s) or a metaschema."""
    ids: set[str] = set()
    refs: list[str] = []

    def walk(node: Any, base: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                base = urljoin(base, node["$id"])
                ids.add(urldefrag(base).url)
            for key in ("$ref", "$dynamicRef", "$recursiveRef"):
                if isinstance(node.get(key), str):
                    refs.append(urljoin(base, node[key]))
            for key, value in node.items():
                if key not in ("const", "enum", "examples", "default"):
                    walk(value, base)
        elif isinstance(node, list):
            for value in node:
                walk(value, base)

    walk(schema, "")
    out = []
    for ref in refs:
        doc = urldefrag(ref).url
        if doc and doc not in ids and not _META.match(doc):
            out.append(ref)
    return out


def test_suite_items(root: Path, drafts: list[str]) -> list[Item]:
    items = []
    for draft in drafts:
        for f in sorted((root / "tests" / draft).glob("*.json")):
            for i, group in enumerate(json.loads(f.read_text())):
                item = Item("test-suite", f"{draft}/{f.stem}", f"{i}: {group['description']}", group["schema"])
                for t in group["tests"]:
                    item.instances.append((bool(t["valid"]), *_texts(t["data"]), str(t["description"])[:80]))
                if remote_refs(group["schema"]):
                    item.skip = "remote $ref"
                items.append(item)
    return items


# ---------------------------------------------------------------------------------------------
# workers: one compile at a time each, killed at the timeout


@dataclass(frozen=True)
class Variant:
    engine: str
    config: str  # "default" / "spec" for cfsm, "-" for peers
    whitespace: str

    @property
    def label(self) -> str:
        cfg = "" if self.config == "-" else f" {self.config}"
        return f"{self.engine}{cfg} ({self.whitespace})"


def _make_engine(bundle: Bundle, v: Variant) -> Any:
    if v.engine == "cfsm":
        make = cfsm.CfsmConfig.spec if v.config == "spec" else cfsm.CfsmConfig
        return ENGINES["cfsm"](bundle, config=make(whitespace=v.whitespace))
    return ENGINES[v.engine](bundle, whitespace=v.whitespace)


def _node_at(schema: Any, pointer: str) -> Any:
    node = schema
    for part in pointer.lstrip("#").strip("/").split("/") if pointer.strip("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _cause(engine: str, exc: BaseException, schema: Any) -> tuple[str, bool]:
    """(cause, is_bug): a short, countable description of a compile failure."""
    name = type(exc).__name__
    if engine == "cfsm":
        if isinstance(exc, cfsm.UnsupportedSchemaError):
            key = exc.keyword
            for node in (_node_at(schema, exc.path), _node_at(schema, exc.path.rsplit("/", 1)[0])):
                value = node.get(exc.keyword) if isinstance(node, dict) else None
                if exc.keyword in ("format", "type") and isinstance(value, str) and len(value) < 40:
                    key = f"{exc.keyword}={value}"
                    break
            hint = str(exc).split(f" at {exc.path}", 1)[-1].lstrip(": ")
            return f"{name}[{key}]" + (f": {_short(hint)[:60]}" if hint else ""), False
        if isinstance(exc, cfsm.UnsupportedRegexError):
            return f"{name}[{exc.construct}]", False
        if isinstance(exc, cfsm.CfsmError):
            return name, False
        if isinstance(exc, MemoryError):
            return "MemoryError (worker memory limit)", False
        return f"BUG {name}: {_short(str(exc))}", True
    return f"{name}: {_short(str(exc))}", False


def _short(msg: str) -> str:
    msg = (msg.strip().splitlines() or [""])[0]
    msg = re.sub(r"\{.{8,}\}|\[.{60,}\]", "{…}", msg)  # a schema or instance quoted in the message
    msg = re.sub(r"\"[^\"]{25,200}\"|'[^']{25,200}'|`[^`]{25,200}`", "'…'", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:90]


def _worker(conn: Any, bundle: Bundle, memory_gb: float) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if memory_gb > 0:
        import resource

        limit = int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    engines: dict[Variant, Any] = {}
    encode_cache: dict[str, list[int]] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        variant, schema, instances = msg
        if variant not in engines:
            engines[variant] = _make_engine(bundle, variant)
        engine = engines[variant]
        conn.send(("start",))
        t0 = time.perf_counter()
        try:
            compiled = engine.compile("schema", schema)
        except BaseException as exc:  # noqa: BLE001 - every failure is a result
            cause, bug = _cause(variant.engine, exc, schema)
            tb = [f"{Path(fr.filename).name}:{fr.lineno} {fr.name}" for fr in traceback.extract_tb(exc.__traceback__)[-4:]]
            conn.send(("failed", {"cause": cause, "bug": bug, "message": str(exc)[:300], "traceback": tb,
                                  "compile_s": time.perf_counter() - t0}))
            continue
        compile_s = time.perf_counter() - t0
        approx = [str(a) for a in getattr(compiled, "approximations", ())]
        conn.send(("compiled", {"compile_s": compile_s, "approximations": approx}))
        if len(encode_cache) > 20000:
            encode_cache.clear()
        outcomes = []
        for _valid, *texts, _desc in instances:
            row = []
            for text in texts:
                ids = encode_cache.get(text)
                if ids is None:
                    ids = encode_cache[text] = bundle.tokenizer.encode(text, add_special_tokens=False)
                try:
                    row.append(bool(engine.walk(compiled, ids)))
                except Exception:  # noqa: BLE001 - an engine error on a text is a rejection
                    row.append(False)
            outcomes.append(row)
        conn.send(("walked", outcomes))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Pool:
    """`workers` processes forked from this one (the vocabulary already loaded and prepared);
    a worker past its deadline is killed and replaced."""

    def __init__(self, bundle: Bundle, workers: int, memory_gb: float) -> None:
        self.bundle = bundle
        self.memory_gb = memory_gb
        self.ctx = mp.get_context("fork")
        self.slots: list[dict[str, Any]] = [self._spawn() for _ in range(workers)]

    def _spawn(self) -> dict[str, Any]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child, self.bundle, self.memory_gb), daemon=True)
        proc.start()
        child.close()
        return {"proc": proc, "conn": parent, "task": None}

    def _replace(self, slot: dict[str, Any]) -> None:
        slot["proc"].kill()
        slot["proc"].join()
        slot["conn"].close()
        slot.update(self._spawn())

    def run(self, tasks: list[tuple[Any, Variant, Item]], timeout_s: float, walk_s: float,
            on_result: Any, clock: str = "cpu", wall_factor: float = 3.0) -> None:
        """Runs every task; calls `on_result(key, variant, item, result)` as each ends.

        `clock`: "wall" kills a compile `timeout_s` seconds after it started; "cpu" once the
        worker has used `timeout_s` seconds of CPU time on it (or after `wall_factor` times that
        on the wall clock: a separate cause), so a loaded machine does not turn slow compiles
        into timeouts.
        """
        todo = collections.deque(tasks)
        while todo or any(s["task"] for s in self.slots):
            for slot in self.slots:
                if slot["task"] is None and todo:
                    key, variant, item = todo.popleft()
                    slot["task"] = (key, variant, item)
                    slot["result"] = {}
                    slot["deadline"] = time.monotonic() + 600  # engine construction, once per variant
                    slot["phase"] = "setup"
                    slot["conn"].send((variant, item.schema, item.instances))
            busy = [s for s in self.slots if s["task"]]
            wait_s = max(0.0, min(s["deadline"] for s in busy) - time.monotonic())
            if clock == "cpu" and any(s["phase"] == "compile" for s in busy):
                wait_s = min(wait_s, 0.25)
            ready = mpc.wait([s["conn"] for s in busy], timeout=wait_s)
            now = time.monotonic()
            for slot in busy:
                key, variant, item = slot["task"]
                done: dict[str, Any] | None = None
                if slot["conn"] in ready:
                    try:
                        msg = slot["conn"].recv()
                    except (EOFError, OSError):
                        code = slot["proc"].exitcode
                        slot["proc"].join(1)
                        done = {**slot["result"], "status": "crash" if slot["phase"] != "walk" else "walk-crash",
                                "cause": f"worker died (exit code {slot['proc'].exitcode if code is None else code})"}
                        self._replace(slot)
                    else:
                        if msg[0] == "start":
                            slot["phase"] = "compile"
                            slot["deadline"] = now + (wall_factor * timeout_s if clock == "cpu" else timeout_s)
                            slot["cpu0"] = _cpu_s(slot["proc"].pid)
                        elif msg[0] == "failed":
                            done = {"status": "error", **msg[1]}
                        elif msg[0] == "compiled":
                            slot["result"] = {"status": "ok", **msg[1]}
                            slot["phase"] = "walk"
                            slot["deadline"] = now + walk_s + 0.05 * len(item.instances)
                        elif msg[0] == "walked":
                            done = {**slot["result"], "outcomes": msg[1]}
                elif now >= slot["deadline"] or (
                        clock == "cpu" and slot["phase"] == "compile"
                        and _cpu_s(slot["proc"].pid) - slot["cpu0"] >= timeout_s):
                    phase = slot["phase"]
                    if phase == "compile":
                        cpu = _cpu_s(slot["proc"].pid) - slot["cpu0"]
                        cause = (f"timeout (>{timeout_s:g} s)" if clock == "wall" or cpu >= timeout_s
                                 else f"timeout (wall cap {wall_factor * timeout_s:g} s, {cpu:.1f} CPU s: machine load)")
                        done = {"status": "timeout", "cause": cause}
                    elif phase == "walk":
                        done = {**slot["result"], "status": "walk-timeout"}
                    else:
                        done = {"status": "crash", "cause": "engine setup timed out"}
                    self._replace(slot)
                if done is not None:
                    slot["task"] = None
                    on_result(key, variant, item, done)

    def close(self) -> None:
        for slot in self.slots:
            with contextlib.suppress(OSError):
                slot["conn"].send(None)
            slot["proc"].join(2)
            if slot["proc"].is_alive():
                slot["proc"].kill()


# ---------------------------------------------------------------------------------------------
# tallies


def _pct(n: int, d: int) -> str:
    return f"{100.0 * n / d:.1f}%" if d else "-"


class Tally:
    """Per variant: coverage per group, failure causes, bugs; instance outcomes per spacing."""

    def __init__(self) -> None:
        self.groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # covered, total
        self.causes: collections.Counter[str] = collections.Counter()
        self.bugs: dict[str, dict[str, Any]] = {}
        self.compiled = self.not_compiled = self.skipped = self.walk_failed = 0
        self.with_approx = 0
        self.approx_keywords: collections.Counter[str] = collections.Counter()
        self.compile_s: list[float] = []
        # spacing -> counters
        self.inst: dict[str, collections.Counter[str]] = {s: collections.Counter() for s in SPACINGS}
        self.by_group: dict[str, dict[str, collections.Counter[str]]] = collections.defaultdict(
            lambda: {s: collections.Counter() for s in SPACINGS})
        self.errors: list[dict[str, Any]] = []  # misclassified instances (capped per kind)
        self.kept: collections.Counter[str] = collections.Counter()
        self.failed_groups: list[dict[str, str]] = []

    def add(self, item: Item, res: dict[str, Any], cap: int) -> None:
        if res["status"] == "skipped":
            self.skipped += 1
            return
        ok = res["status"] in ("ok", "walk-timeout", "walk-crash")
        self.groups[item.group][1] += 1
        if not ok:
            self.not_compiled += 1
            self.causes[res["cause"]] += 1
            if len(self.failed_groups) < 5 * cap:
                self.failed_groups.append({"group": item.group, "name": item.name, "cause": res["cause"],
                                           "message": res.get("message", "")[:200]})
            if res.get("bug"):
                bug = self.bugs.setdefault(res["cause"], {"count": 0, "example": f"{item.group}/{item.name}",
                                                          "message": res.get("message", ""),
                                                          "traceback": res.get("traceback", [])})
                bug["count"] += 1
            return
        self.groups[item.group][0] += 1
        self.compiled += 1
        self.compile_s.append(res.get("compile_s", 0.0))
        approx = res.get("approximations") or []
        if approx:
            self.with_approx += 1
            self.approx_keywords.update(a.split(" at ")[0] for a in approx)
        if res["status"] != "ok":
            self.walk_failed += 1
            return
        for (valid, *texts, desc), row in zip(item.instances, res.get("outcomes", []), strict=True):
            for spacing, text, accepted in zip(SPACINGS, texts, row, strict=True):
                kind = None
                c = self.inst[spacing]
                g = self.by_group[item.group][spacing]
                for counter in (c, g):
                    counter["valid" if valid else "invalid"] += 1
                if valid and not accepted:
                    kind = "false reject"
                    c["fr"] += 1
                    g["fr"] += 1
                elif accepted and not valid:
                    kind = "false accept"
                    c["fa"] += 1
                    g["fa"] += 1
                    c["fa_approx" if approx else "fa_exact"] += 1
                if not valid:
                    c["invalid_approx" if approx else "invalid_exact"] += 1
                if kind and self.kept[kind] < cap:
                    self.kept[kind] += 1
                    self.errors.append({"kind": kind, "spacing": spacing, "group": item.group, "name": item.name,
                                        "test": desc, "text": text[:300], "approximations": approx,
                                        "schema": json.dumps(item.schema)[:300]})

    def summary(self) -> dict[str, Any]:
        total = self.compiled + self.not_compiled
        out: dict[str, Any] = {
            "compiled": self.compiled, "not_compiled": self.not_compiled, "skipped": self.skipped,
            "total": total, "coverage": self.compiled / total if total else None,
            "groups": {g: {"covered": c, "total": t} for g, (c, t) in sorted(self.groups.items())},
            "causes": self.causes.most_common(), "bugs": self.bugs,
            "with_approximations": self.with_approx, "approximation_keywords": self.approx_keywords.most_common(),
            "walk_failed": self.walk_failed,
            "median_compile_s": sorted(self.compile_s)[len(self.compile_s) // 2] if self.compile_s else None,
        }
        inst = {}
        for s in SPACINGS:
            c = self.inst[s]
            inst[s] = {**dict(c), "fa_rate": c["fa"] / c["invalid"] if c["invalid"] else None,
                       "fr_rate": c["fr"] / c["valid"] if c["valid"] else None}
        out["instances"] = inst
        out["by_group"] = {g: {s: dict(c) for s, c in v.items()} for g, v in sorted(self.by_group.items())}
        out["misclassified"] = self.errors
        out["failed"] = self.failed_groups
        return out


# ---------------------------------------------------------------------------------------------
# tables


def print_coverage(part: str, tallies: dict[Variant, Tally], top: int) -> None:
    variants = list(tallies)
    groups = sorted({g for t in tallies.values() for g in t.groups})
    print(f"\n## {part}: compiled within the timeout\n")
    print("| subset | " + " | ".join(v.label for v in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for g in groups:
        cells = []
        for v in variants:
            c, t = tallies[v].groups.get(g, (0, 0))
            cells.append(f"{c}/{t} ({_pct(c, t)})")
        print(f"| {g} | " + " | ".join(cells) + " |")
    cells = [f"**{t.compiled}/{t.compiled + t.not_compiled} ({_pct(t.compiled, t.compiled + t.not_compiled)})**"
             for t in tallies.values()]
    print("| **total** | " + " | ".join(cells) + " |")
    for v, t in tallies.items():
        if not t.causes:
            continue
        print(f"\n### {part}, {v.label}: top {top} failure causes ({t.not_compiled} failures)\n")
        for cause, n in t.causes.most_common(top):
            print(f"- {n:5d}  {cause}")
        if t.with_approx:
            kws = ", ".join(f"{k} {n}" for k, n in t.approx_keywords.most_common(10))
            print(f"\n{t.with_approx} compiled schemas report approximations (notes per keyword: {kws})")
        if t.bugs:
            print(f"\n### {part}, {v.label}: errors that are not cfsm.CfsmError ({sum(b['count'] for b in t.bugs.values())})\n")
            for cause, b in sorted(t.bugs.items(), key=lambda kv: -kv[1]["count"]):
                print(f"- {b['count']:4d}  {cause}\n        e.g. {b['example']}: {b['message'][:160]!r}"
                      f"\n        at {' <- '.join(reversed(b['traceback']))}")


def print_instances(part: str, tallies: dict[Variant, Tally]) -> None:
    print(f"\n## {part}: false accepts / false rejects (instances of compiled schemas)\n")
    print("| variant | spacing | compiled | not compiled | skipped | valid | invalid | false accepts | "
          "FA w/ approx | FA w/o approx | false rejects |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v, t in tallies.items():
        for s in SPACINGS:
            c = t.inst[s]
            print(f"| {v.label} | {s} | {t.compiled} | {t.not_compiled} | {t.skipped} | {c['valid']} | {c['invalid']} | "
                  f"{c['fa']} ({_pct(c['fa'], c['invalid'])}) | "
                  f"{c['fa_approx']}/{c['invalid_approx']} | {c['fa_exact']}/{c['invalid_exact']} | "
                  f"{c['fr']} ({_pct(c['fr'], c['valid'])}) |")
    if any(t.walk_failed for t in tallies.values()):
        print("\nwalks that timed out or crashed (schemas left out of the rates): "
              + ", ".join(f"{v.label} {t.walk_failed}" for v, t in tallies.items()))


def print_worst_groups(part: str, tallies: dict[Variant, Tally], top: int) -> None:
    for v, t in tallies.items():
        rows = []
        for g, per in t.by_group.items():
            c = per["compact"]
            s = per["standard"]
            if c["fa"] or c["fr"] or s["fa"] or s["fr"]:
                rows.append((c["fa"] + c["fr"] + s["fa"] + s["fr"], g, c, s))
        if not rows:
            continue
        rows.sort(key=lambda r: -r[0])
        print(f"\n### {part}, {v.label}: groups with the most errors (FA/FR compact; FA/FR standard)\n")
        print("  " + "; ".join(f"{g} {c['fa']}/{c['fr']}; {s['fa']}/{s['fr']}" for _, g, c, s in rows[:top]))


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jsonschemabench", type=Path, default=None, help="a checkout of guidance-ai/jsonschemabench")
    ap.add_argument("--test-suite", type=Path, default=None, help="a checkout of JSON-Schema-Test-Suite")
    ap.add_argument("--parts", nargs="+", default=None, choices=["coverage", "test-suite", "maskbench"])
    ap.add_argument("--engines", nargs="+", default=["cfsm"], choices=list(ENGINES))
    ap.add_argument("--config", nargs="+", default=["default"], choices=["default", "spec"],
                    help="cfsm configs (peers have one)")
    ap.add_argument("--whitespace", nargs="+", default=["compact"], choices=["compact", "flexible"])
    ap.add_argument("--subsets", nargs="+", default=None, help="JSONSchemaBench subsets (and maskbench groups)")
    ap.add_argument("--drafts", nargs="+", default=["draft2020-12"])
    ap.add_argument("--limit", type=int, default=None, help="first N schemas per subset")
    ap.add_argument("--sample", type=int, default=None, help="N random schemas per part (with --seed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="compile timeout per schema, seconds")
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                    help="what the timeout counts: the worker's CPU time (with a wall-clock cap of 3x) or wall time")
    ap.add_argument("--wall-factor", type=float, default=3.0,
                    help="with --clock cpu: a compile is also stopped after this many times --timeout of wall time")
    ap.add_argument("--walk-timeout", type=float, default=120.0, help="instance walks per schema, seconds (+50 ms each)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--memory-gb", type=float, default=8.0, help="address-space limit per worker (0: none)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--max-examples", type=int, default=1000,
                    help="false accepts and false rejects kept (each) per variant in --json")
    ap.add_argument("--progress-every", type=int, default=200)
    ap.add_argument("--checkpoint-every", type=int, default=500, help="write --json every N schemas (0: at the end)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    parts = args.parts or ([*(["coverage", "maskbench"] if args.jsonschemabench else []),
                            *(["test-suite"] if args.test_suite else [])])
    if not parts:
        ap.error("give --jsonschemabench DIR and/or --test-suite DIR")
    items_by_part: dict[str, list[Item]] = {}
    for part in parts:
        if part in ("coverage", "maskbench") and not args.jsonschemabench:
            ap.error(f"{part} needs --jsonschemabench")
        if part == "test-suite" and not args.test_suite:
            ap.error("test-suite needs --test-suite")
        if part == "coverage":
            items = jsb_items(args.jsonschemabench, args.subsets)
        elif part == "maskbench":
            items = maskbench_items(args.jsonschemabench, args.subsets)
        else:
            items = test_suite_items(args.test_suite, args.drafts)
        if args.limit is not None:
            per: dict[str, int] = collections.Counter()
            kept = []
            for it in items:
                per[it.group] += 1
                if per[it.group] <= args.limit:
                    kept.append(it)
            items = kept
        if args.sample is not None and args.sample < len(items):
            items = sorted(random.Random(args.seed).sample(items, args.sample), key=lambda it: (it.group, it.name))
        items_by_part[part] = items

    variants = []
    for engine in args.engines:
        for ws in args.whitespace:
            for cfg in args.config if engine == "cfsm" else ["-"]:
                variants.append(Variant(engine, cfg, ws))

    start = provenance()
    print(f"# commit {start['commit']}, cfsm sources {'dirty ' + str(start['cfsm_dirty_files']) if start['cfsm_dirty'] else 'clean'}",
          file=sys.stderr)
    bundle = load_smollm2()
    bundle.vocab.prepare()
    # NOTE: fail fast when cfsm itself is broken (say, a checkout in the middle of an edit)
    cfsm.compile_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, bundle.vocab)
    for name in {v.engine for v in variants} - {"cfsm"}:
        try:
            _make_engine(bundle, Variant(name, "-", "compact"))
        except ImportError as exc:
            print(f"# {name}: not installed ({exc}); skipped", file=sys.stderr)
            variants = [v for v in variants if v.engine != name]

    tallies = {part: {v: Tally() for v in variants} for part in items_by_part}
    tasks = []
    for part, items in items_by_part.items():
        for v in variants:
            for it in items:
                if it.skip == "remote $ref":
                    tallies[part][v].add(it, {"status": "skipped"}, 0)
                elif it.skip:
                    tallies[part][v].add(it, {"status": "error", "cause": it.skip}, 0)
                else:
                    tasks.append(((part, v), v, it))
    done = [0]
    t0 = time.monotonic()

    def on_result(key: tuple[str, Variant], variant: Variant, item: Item, res: dict[str, Any]) -> None:
        tallies[key[0]][variant].add(item, res, args.max_examples)
        done[0] += 1
        if done[0] % args.progress_every == 0 or done[0] == len(tasks):
            el = time.monotonic() - t0
            eta = el / done[0] * (len(tasks) - done[0])
            print(f"# {done[0]}/{len(tasks)} schemas in {el:.0f} s (eta {eta:.0f} s); {key[0]} {variant.label} "
                  f"compiled {tallies[key[0]][variant].compiled}, failed {tallies[key[0]][variant].not_compiled}",
                  file=sys.stderr, flush=True)

    def write_json(end: dict[str, Any] | None, interrupted: bool) -> None:
        if not args.json:
            return
        out = {"provenance": {"start": start, "end": end}, "done": done[0], "tasks": len(tasks),
               "interrupted": interrupted,
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                        if k not in ("jsonschemabench", "test_suite", "json")},
               "results": {part: {v.label: t.summary() for v, t in by_variant.items()}
                           for part, by_variant in tallies.items()}}
        args.json.write_text(json.dumps(out, indent=1))

    def checkpoint(key: tuple[str, Variant], variant: Variant, item: Item, res: dict[str, Any]) -> None:
        on_result(key, variant, item, res)
        if args.checkpoint_every and done[0] % args.checkpoint_every == 0:
            write_json(None, True)

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    pool = Pool(bundle, args.workers, args.memory_gb)
    interrupted = False
    try:
        pool.run(tasks, args.timeout, args.walk_timeout, checkpoint, args.clock, args.wall_factor)
    except KeyboardInterrupt as exc:  # NOTE: what is done so far is still reported
        interrupted = True
        print(f"# interrupted ({exc}) after {done[0]}/{len(tasks)} schemas", file=sys.stderr)
    finally:
        pool.close()
    end = provenance()

    print(f"# commit {start['commit']} (cfsm dirty: {start['cfsm_dirty']}, diff {start['cfsm_diff_sha'] or '-'}); "
          f"at the end {end['commit']} (dirty: {end['cfsm_dirty']}, diff {end['cfsm_diff_sha'] or '-'}); "
          f"cfsm imported from {'this checkout' if start['cfsm_imported_from_checkout'] else 'a copy'} "
          f"(files {start['cfsm_files_sha']}); "
          f"SmolLM2 vocabulary, timeout {args.timeout:g} s ({args.clock} time), {args.workers} workers, {time.monotonic() - t0:.0f} s"
          + (f"; INTERRUPTED after {done[0]}/{len(tasks)} schemas" if interrupted else ""))
    for part, by_variant in tallies.items():
        print_coverage(part, by_variant, args.top)
        if part != "coverage":
            print_instances(part, by_variant)
            print_worst_groups(part, by_variant, args.top)
    write_json(end, interrupted)


if __name__ == "__main__":
    main()
