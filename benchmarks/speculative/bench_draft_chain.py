"""A draft's k - 1 decode steps in one chain graph against one graph replay per step (issue 34; CUDA GPU).

One offline `Engine` per draft source (dummy weights, CUDA graphs, greedy, EOS ignored, acceptance simulated at
`--accept-length` of `--draft-tokens` drafts, so the step count is the same in every variant): `draft_model`, a
Llama-3.2-1B-shaped draft model (16 layers, hidden 2048, the target's vocabulary), and `eagle`, a one-layer EAGLE
head of the target's width (it drafts through the target's LM head). Both folders are written here (config.json
only: the weights are random). In each engine the variants run in turn, A-B-A: `chain` (the server's default: a
proposal's decode steps replay one `DraftChainGraphs` graph: an EAGLE head's k - 1 after its catch-up forward, a
draft model's k with the one token to catch up on as the first step when each request has one), `steps` (the
proposer's chain removed: a catch-up forward, then one decode graph replay and one host round trip per step),
`chain` again. Per variant and concurrency: per-user
decode tokens/s (every user's request at once, `--output-len` new tokens each) and the median wall time of one
proposal (`propose`, CUDA-synchronized), over the same prompts.

    python benchmarks/speculative/bench_draft_chain.py --model-path MODEL_DIR [--concurrency 1 4] [--json OUT]
    python benchmarks/speculative/bench_draft_chain.py --cpu-smoke   # tiny shapes on the CPU (eager graphs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DRAFT_1B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16")


def write_drafts(target_dir: Path, out: Path, tiny: bool) -> dict[str, Path]:
    """The draft model's and the EAGLE head's folders (config.json) for the target at `target_dir`."""
    target = json.loads((target_dir / "config.json").read_text())
    draft = dict(DRAFT_1B, vocab_size=target["vocab_size"], max_position_embeddings=target["max_position_embeddings"])
    if tiny:
        draft.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    head = dict(target, num_hidden_layers=1)
    folders = {"draft_model": out / "draft", "eagle": out / "eagle"}
    for name, config in (("draft_model", draft), ("eagle", head)):
        folders[name].mkdir(parents=True, exist_ok=True)
        (folders[name] / "config.json").write_text(json.dumps(config, indent=1))
    return folders


def timed_proposals(draft: Any, times: list[float], cuda: bool) -> Any:
    """`draft.propose` wrapped to append each call's wall seconds (CUDA-synchronized) to `times`."""
    propose = draft.propose

    def wrapper(*a: Any, **kw: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = propose(*a, **kw)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        return out

    return wrapper


def check_chain(draft: Any, chain: Any, prompts: dict[int, list[list[int]]], k: int) -> str:
    """The drafts of proposals per concurrency with the chain and with one replay per step (the same requests,
    forgotten in between): equal token for token ("PASS"), else the first difference ("FAIL ..."). An EAGLE head
    drafts from observed target features (random ones here, the same for both variants): its chain runs after the
    catch-up forward of the first proposal. A draft model's chain starts with the one token to catch up on: a
    second proposal after the target kept 2 drafts and added its own token."""
    g = torch.Generator().manual_seed(1)
    eagle = type(draft).__name__ != "DraftModel"
    for c, ctxs in prompts.items():
        contexts = {f"check{i}": ctx for i, ctx in enumerate(ctxs)}
        feats = {rid: torch.randn(len(ctx) - 1, draft.runner.model.config.hidden_size, generator=g)
                 for rid, ctx in contexts.items()} if eagle else {}
        got = []
        for use in (chain, None):
            draft._chain = use
            for rid, f in feats.items():
                draft.observe(rid, 0, f.to(draft.runner.device, next(draft.runner.model.parameters()).dtype))
            ks = dict.fromkeys(contexts, k)
            first = draft.propose(contexts, ks)
            rounds = [first]
            if not eagle:
                vocab = draft.runner.model.config.vocab_size
                later = {rid: [*ctx, *first[rid][:2], (first[rid][2] + 1) % vocab] for rid, ctx in contexts.items()}
                for rid, ctx in later.items():
                    draft.accepted(rid, ctx)
                rounds.append(draft.propose(later, ks))
            got.append(rounds)
            for rid in contexts:
                draft.forget(rid)
        draft._chain = chain
        if got[0] != got[1] or not all(got[0]):
            return f"FAIL at c={c}: chain {got[0]} vs steps {got[1]}"
    return "PASS"


def run_engine(algorithm: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    from lmserver.engine.offline import Engine

    cuda = not args.cpu_smoke
    eng = Engine(model_path=args.model_path, load_format="dummy", dtype="bfloat16" if cuda else "float32",
                 device="cuda" if cuda else "cpu", context_length=args.input_len + args.output_len + 64,
                 speculative_algorithm=algorithm, speculative_draft_model_path=str(folder),
                 speculative_num_draft_tokens=args.draft_tokens, speculative_simulate_accept_length=args.accept_length,
                 # NOTE: max_running_requests caps the graphs' sizes: left at its default, so that verify steps of
                 # every concurrency (drafts + 1 rows per request) replay the target's decode graphs
                 cuda_graph_max_bs=max(args.concurrency) * (args.draft_tokens + 1), lowlat_plugins="off")
    out: dict[str, Any] = {"algorithm": algorithm, "variants": []}
    with eng:
        spec = eng.core.spec
        assert spec is not None and spec.draft_model is not None
        draft = spec.draft_model
        chain = draft._chain
        assert chain is not None, "no chain graphs were captured (CUDA graphs off?)"
        g = torch.Generator().manual_seed(0)
        prompts = {c: [torch.randint(100, args.vocab, (args.input_len,), generator=g).tolist() for _ in range(c)]
                   for c in args.concurrency}
        out["check"] = check_chain(draft, chain, prompts, args.draft_tokens)
        print(f"  {algorithm:11s} check: {out['check']}", flush=True)
        times: list[float] = []
        draft.propose = timed_proposals(draft, times, cuda)
        params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        eng.generate(input_ids=prompts[args.concurrency[0]][:1], sampling_params=dict(params, max_new_tokens=16))
        for variant in ("chain", "steps", "chain"):
            draft._chain = chain if variant == "chain" else None
            row: dict[str, Any] = {"variant": variant}
            for c in args.concurrency:
                times.clear()
                t = time.perf_counter()
                eng.generate(input_ids=prompts[c], sampling_params=params)
                wall = time.perf_counter() - t
                row[f"c{c}_tok_s"] = round(args.output_len / wall, 1)
                row[f"c{c}_propose_ms"] = round(statistics.median(times) * 1e3, 3) if times else float("nan")
            row["chain_replays"] = chain.num_replays
            out["variants"].append(row)
            print(f"  {algorithm:11s} {variant:6s} " + "  ".join(
                f"c={c}: {row[f'c{c}_tok_s']:8.1f} tok/s per user, propose {row[f'c{c}_propose_ms']:7.3f} ms"
                for c in args.concurrency), flush=True)
        out["stats"] = {k: v for k, v in eng.get_stats().items() if k.startswith("spec_")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="the target's folder (config.json, tokenizer)")
    ap.add_argument("--algorithms", nargs="+", default=["draft_model", "eagle"], choices=["draft_model", "eagle"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    ap.add_argument("--draft-tokens", type=int, default=5)
    ap.add_argument("--accept-length", type=float, default=3.5)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny target and drafts on the CPU (eager graphs)")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.cpu_smoke:  # NOTE: the CPU runs the graph path through EagerGraph (the test hook)
            from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV

            os.environ[EAGER_GRAPHS_ENV] = "1"
            target = dict(DRAFT_1B, vocab_size=512, max_position_embeddings=1024, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, tie_word_embeddings=False)
            args.model_path = str(Path(tmp) / "target")
            Path(args.model_path).mkdir()
            (Path(args.model_path) / "config.json").write_text(json.dumps(target))
            from lmserver.testing.word_tokenizer import save_word_level_tokenizer

            save_word_level_tokenizer(args.model_path, 512)
            args.vocab, args.input_len, args.output_len, args.concurrency = 500, 32, 16, [1, 2]
        if not args.model_path:
            ap.error("--model-path is required (or --cpu-smoke)")
        folders = write_drafts(Path(args.model_path), Path(tmp), args.cpu_smoke)
        results = [run_engine(alg, folders[alg], args) for alg in args.algorithms]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
