"""Where the host time of a batch mask goes on CUDA, and what it adds to a step when it overlaps
a forward. A micro-benchmark of lmserver.engine.constrained.BatchMasker beside the engine benchmark.

Part 1 (each call alone, the device idle in between; median host microseconds): the pieces of
a mask step: `ndarray.fill(-1)` of the pinned buffer, the cfsm fill, an event's `query()` and
`synchronize()` once complete, the copy (`.to()` allocating vs `copy_` into a kept buffer), a new
event vs a reused one, the Triton apply launch, and whole steps: the single-phase apply before
the split (`old`) and `prepare` + `apply`.

Part 2 (steps against a stand-in forward: `torch.cuda._sleep` for `--forward-ms` on the device,
then logits): the step time (host, until the sampled ids are read back) of
- `unconstrained`: forward, argmax, read-back;
- `old`: forward, a list index of the rows (a copy from pageable memory: waits for the forward),
  the single-phase mask, argmax, read-back (the engine's order before the split);
- `two_phase`: forward, `prepare`, `apply`, argmax, read-back (the engine's order now);
with `old / unconstrained - 1` and `two_phase / unconstrained - 1`: what masks add to a step.

    python benchmarks/structured/bench_mask_host.py [--model-path DIR] [--rows 32] [--iters 300]
        [--forward-ms 1.3]

Grammars: the long-key JSON schema of bench_structured over the model's tokenizer, each row
walked a few random allowed tokens (different states), `--free-rows` of them unconstrained.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_structured import LONG_KEY_SCHEMA

import cfsm
from lmserver.engine.constrained import BatchMasker, GrammarBackend, GrammarKey, ReqGrammar
from lmserver.kernels.bitmask import apply_token_bitmask_inplace
from lmserver.models.loader import read_model_config


def _median_us(fn: Callable[[], Any], iters: int, sync: bool = True) -> float:
    times = []
    for _ in range(iters):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def _grammars(model_path: str, rows: int, free_rows: int, seed: int) -> tuple[list[ReqGrammar | None], int]:
    from transformers import AutoTokenizer

    mc = read_model_config(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    backend = GrammarBackend(tok, mc.vocab_size, mc.eos_token_ids)
    index = backend.compile(GrammarKey("json_schema", json.dumps(LONG_KEY_SCHEMA)))
    rng = random.Random(seed)
    out: list[ReqGrammar | None] = []
    for i in range(rows):
        if i % max(rows // max(free_rows, 1), 1) == 0 and sum(g is None for g in out) < free_rows:
            out.append(None)
            continue
        g = ReqGrammar(index, backend.encode, jump_forward=False)
        for _ in range(rng.randrange(0, 40)):
            allowed = [t for t in g.guide.allowed_token_ids().tolist() if t not in mc.eos_token_ids]
            if not allowed:
                break
            g.accept(rng.choice(allowed))
        out.append(g)
    backend.shutdown()
    return out, mc.vocab_size


class OldMasker:
    """The single-phase CUDA apply before the split (fill at sampling, a new pinned-to-device
    tensor and a new event per step), kept here as the baseline."""

    def __init__(self, vocab: int) -> None:
        self.words = (vocab + 31) // 32
        self.pinned: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def apply(self, logits: torch.Tensor, grammars: list[ReqGrammar | None]) -> torch.Tensor:
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if self.copied is not None:
            self.copied.synchronize()
        if self.pinned is None or self.pinned.shape[0] < len(grammars):
            self.pinned = torch.empty((len(grammars), self.words), dtype=torch.int32, pin_memory=True)
        pinned = self.pinned[: len(grammars)]
        host = pinned.numpy()
        host.fill(-1)
        cfsm.fill_next_token_bitmasks([grammars[i].guide for i in rows], host, rows)  # type: ignore[union-attr]
        mask = pinned.to(logits.device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        apply_token_bitmask_inplace(logits, mask)
        return logits


def part1(grammars: list[ReqGrammar | None], vocab: int, iters: int) -> dict[str, float]:
    dev = torch.device("cuda")
    n, words = len(grammars), (vocab + 31) // 32
    rows = [i for i, g in enumerate(grammars) if g is not None]
    guides = [g.guide for g in grammars if g is not None]
    pinned = torch.empty((n, words), dtype=torch.int32, pin_memory=True)
    host = pinned.numpy()
    dev_buf = torch.empty((n, words), dtype=torch.int32, device=dev)
    logits = torch.randn(n, vocab, device=dev)
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    old, new = OldMasker(vocab), BatchMasker(vocab)
    mask = torch.full((n, words), -1, dtype=torch.int32, device=dev)

    def two_phase() -> None:
        new.prepare(grammars, dev)
        new.apply(logits, grammars)

    res = {
        "ndarray.fill(-1)": _median_us(lambda: host.fill(-1), iters),
        "cfsm fill": _median_us(lambda: cfsm.fill_next_token_bitmasks(guides, host, rows), iters),
        "event.query() (done)": _median_us(ev.query, iters),
        "event.synchronize() (done)": _median_us(ev.synchronize, iters),
        "pinned.to(device) (allocates)": _median_us(lambda: pinned.to(dev, non_blocking=True), iters),
        "dev.copy_(pinned) (kept buffer)": _median_us(lambda: dev_buf.copy_(pinned, non_blocking=True), iters),
        "new Event + record": _median_us(lambda: torch.cuda.Event().record(), iters),
        "event.record (reused)": _median_us(ev.record, iters),
        "Triton apply launch": _median_us(lambda: apply_token_bitmask_inplace(logits, mask), iters),
        "old single-phase apply (all)": _median_us(lambda: old.apply(logits, grammars), iters),
        "prepare": _median_us(lambda: new.prepare(grammars, dev), iters),
        "prepare + apply": _median_us(two_phase, iters),
    }
    times = []
    for _ in range(iters):
        new.prepare(grammars, dev)
        torch.cuda.synchronize()
        start = time.perf_counter()
        new.apply(logits, grammars)
        times.append(time.perf_counter() - start)
    res["apply (prepared)"] = 1e6 * statistics.median(times)
    return res


def _sleep_cycles(ms: float) -> int:
    """Cycles of `torch.cuda._sleep` that take about `ms` on the device."""
    cycles = 1_000_000
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    per = (time.perf_counter() - start) / 5 / cycles
    return max(int(ms / 1e3 / per), 1)


def part2(grammars: list[ReqGrammar | None], vocab: int, iters: int, forward_ms: float) -> dict[str, float]:
    dev = torch.device("cuda")
    n = len(grammars)
    base = torch.randn(n, vocab, device=dev)
    cycles = _sleep_cycles(forward_ms)
    old, new = OldMasker(vocab), BatchMasker(vocab)
    sample_rows = list(range(n))

    def forward() -> torch.Tensor:
        torch.cuda._sleep(cycles)
        return base.clone()

    def unconstrained() -> None:
        forward().argmax(dim=-1).tolist()

    def old_step() -> None:
        logits = forward()
        raw = logits[sample_rows]  # the list index before the split: waits for the forward
        old.apply(raw, grammars).argmax(dim=-1).tolist()

    def two_phase() -> None:
        logits = forward()
        new.prepare(grammars, dev)
        new.apply(logits, grammars).argmax(dim=-1).tolist()

    res = {}
    for name, fn in (("unconstrained", unconstrained), ("old", old_step), ("two_phase", two_phase)):
        for _ in range(10):
            fn()
        res[name] = _median_us(fn, iters) / 1e3
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="a Hugging Face folder (its tokenizer; default: the embedded SmolLM2)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--free-rows", type=int, default=0, help="unconstrained rows in the batch")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--forward-ms", type=float, default=1.3, help="device time of the stand-in forward")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if args.model_path is None:
        from lmserver.models.default_model import default_model_path

        args.model_path = str(default_model_path())
    grammars, vocab = _grammars(args.model_path, args.rows, args.free_rows, seed=0)
    print(f"{args.rows} rows ({sum(g is None for g in grammars)} unconstrained), vocab {vocab}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("\npart 1: host microseconds per call (median, device idle)")
    print("| piece | us |\n|---|---|")
    for k, v in part1(grammars, vocab, args.iters).items():
        print(f"| {k} | {v:.1f} |")
    res = part2(grammars, vocab, args.iters, args.forward_ms)
    print(f"\npart 2: step ms (median) against a {args.forward_ms} ms stand-in forward")
    print("| step | ms | vs unconstrained |\n|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v:.3f} | {100 * (v / res['unconstrained'] - 1):+.1f}% |")


if __name__ == "__main__":
    main()
