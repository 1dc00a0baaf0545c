"""EagleProposer: an EAGLE head drafting from the target's features
(`--speculative-algorithm eagle --speculative-draft-model-path FOLDER`, lmserver.models.eagle).

After every target forward the engine hands over the final-norm hidden states of the tokens
whose KV the target kept (`observe`: prefill chunks, decode rows, the accepted rows of a verify
step). A proposal first catches up: one extend forward of the head over the positions observed
since the last one (the feature of position p with the token of position p + 1), whose last
row's logits give the first draft; then k - 1 decode steps, each feeding the head its own
predicted feature with the draft token before (replaying the head's decode CUDA graphs where
captured, the features through a static buffer). The KV of those steps is dropped at once
(their features were the head's guesses); the catch-up KV stays. Drafts are greedy, so the target's
acceptance rules stay exact for sampled requests too.

The head's KV covers the tokens whose features it saw, in order: a prompt prefix served from the
radix cache (no forward, no features) is not in it, and the head's positions count the tokens it
has (RoPE positions shift by the skipped prefix). That only lowers acceptance, never changes an
output token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmserver.models.config import ModelConfig
from lmserver.models.eagle import (
    Eagle3Head,
    EagleHead,
    checkpoint_names,
    default_aux_layers,
    is_eagle3_config,
    iter_checkpoint,
)
from lmserver.models.llama import WeightLoadingError
from lmserver.models.loader import ModelLoadError, read_model_config
from lmserver.runner.cuda_graph import draft_graph_runner
from lmserver.runner.draft_model import DraftModel, DraftModelError, DraftReq
from lmserver.runner.sampler import greedy_argmax
from lmserver.scheduler import ScheduleDecision

__all__ = ["EagleProposer", "SharedTargetModules", "build_head", "eagle3_aux_layers", "eagle_head_bytes"]


def _head_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise DraftModelError(f"EAGLE head: {model_path} has no config.json")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def eagle3_aux_layers(model_path: str, target_layers: int) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head reads (its config's `eagle_config.eagle_aux_hidden_state_layer_ids`,
    else `default_aux_layers`), or None for an EAGLE-1/2 head. An EAGLE-3 head names an `*Eagle3*`
    architecture or has a `draft_vocab_size`."""
    raw = _head_config(model_path)
    if not is_eagle3_config(raw):
        return None
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in ids) if ids else default_aux_layers(target_layers)
    if not all(0 <= i < target_layers for i in layers):
        raise DraftModelError(f"EAGLE-3 head: aux layers {layers} outside the target's {target_layers} layers")
    return layers


def build_head(model_path: str, target: torch.nn.Module, target_config: ModelConfig, max_positions: int,
               names: set[str]) -> tuple[EagleHead | Eagle3Head, ModelConfig]:
    """The EAGLE head of `model_path` (EAGLE-1/2 or EAGLE-3, by its config.json) over `target`'s shared modules, on
    the default device, its weights not loaded, and its config; `names`: its checkpoint's tensor names (whether it has
    an embedding of its own, an fc bias). DraftModelError for a head this target cannot use."""
    raw = _head_config(model_path)
    aux = eagle3_aux_layers(model_path, target_config.num_hidden_layers)
    try:  # NOTE: an EAGLE-3 config names its own architecture; its fields are a Llama layer's
        config = ModelConfig.from_hf(dict(raw, architectures=["LlamaForCausalLM"])) if aux \
            else read_model_config(model_path)
    except (ModelLoadError, ValueError) as exc:
        raise DraftModelError(f"EAGLE head: {exc}") from exc
    for field in ("vocab_size", "hidden_size"):
        if getattr(config, field) != getattr(target_config, field):
            raise DraftModelError(f"the EAGLE head at {model_path} has {field} {getattr(config, field)}, the target "
                                  f"{getattr(target_config, field)}: a head must be trained for this target")
    own_embedding = any(n.removeprefix("model.") == "embed_tokens.weight" for n in names)
    if aux:
        return Eagle3Head(config, target, max_positions, int(raw.get("draft_vocab_size", config.vocab_size)), len(aux),
                          own_embedding=own_embedding), config
    return EagleHead(config, target, max_positions, fc_bias="fc.bias" in names, own_embedding=own_embedding), config


class SharedTargetModules(torch.nn.Module):
    """The target modules an EAGLE head reads (`model.embed_tokens`, `lm_head`), in a target's layout.

    `of(target)` holds a loaded target's own modules: with tensor parallelism, kept before sharding replaces them by
    vocabulary shards (whose forwards need every rank: the head runs on rank 0 alone, over these full modules).
    `blank(config)` makes new ones, to build a head on the meta device."""

    def __init__(self, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = embed_tokens
        self.lm_head = lm_head

    @classmethod
    def of(cls, target: torch.nn.Module) -> SharedTargetModules:
        return cls(target.model.embed_tokens, target.lm_head)  # type: ignore[union-attr, arg-type]

    @classmethod
    def blank(cls, config: ModelConfig) -> SharedTargetModules:
        return cls(torch.nn.Embedding(config.vocab_size, config.hidden_size),
                   torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False))


def eagle_head_bytes(model_path: str, target_config: ModelConfig, dtype: torch.dtype, max_positions: int,
                     load_format: str = "auto", tp_size: int = 1) -> int:
    """Bytes the EAGLE head of `model_path` adds to the target's: its own parameters and buffers in `dtype` (built on
    the meta device: no memory, no weights read), not the embedding and LM head it shares with the target; with
    `tp_size` > 1 also those shared modules whole (rank 0 keeps them beside its vocabulary shards: builder.py). A
    `pytorch_model.bin` head (its names need the whole file read) counts an embedding and an fc bias of its own, the
    safe side. Raises DraftModelError as `build_head`."""
    if load_format != "auto":
        names: set[str] = set()
    elif any(Path(model_path).glob("*.safetensors")):
        names = checkpoint_names(model_path)  # the files' headers only
    else:
        names = {"embed_tokens.weight", "fc.bias"}
    with torch.device("meta"):
        head, _ = build_head(model_path, SharedTargetModules.blank(target_config), target_config, max_positions, names)
        head = head.to(dtype)
    counted = {id(p): p for _, p in head.head_parameters()} | {id(b): b for b in head.buffers()}
    if tp_size > 1:
        counted |= {id(p): p for m in head.target_modules() for p in m.parameters()}
    return sum(t.numel() * t.element_size() for t in counted.values())


class EagleProposer(DraftModel):
    def __init__(self, model_path: str, *, target: torch.nn.Module, target_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, context_length: int, max_requests: int, num_slots: int,
                 attention_backend: str, load_format: str = "auto", seed: int = 0, graph_max_bs: int = 0,
                 chain_steps: int = 0) -> None:
        with torch.device(device):
            names = checkpoint_names(model_path) if load_format == "auto" else set()
            head, config = build_head(model_path, target, target_config, context_length, names)
            head = head.to(dtype)
        if load_format == "dummy":
            gen = torch.Generator(device=device).manual_seed(seed)
            with torch.no_grad():
                for name, param in head.head_parameters():
                    if "norm" in name:
                        param.fill_(1.0)
                    elif param.dim() == 0 or param.dtype == torch.int64:
                        continue
                    else:
                        param.copy_(torch.randn(param.shape, generator=gen, device=device) * 0.02)
        else:
            try:
                head.load_weights(iter_checkpoint(model_path))
            except WeightLoadingError as exc:
                raise DraftModelError(f"EAGLE head at {model_path}: {exc}") from exc
        self.head = head
        self._init_cache(head, config, dtype=dtype, device=device, context_length=context_length,
                         max_requests=max_requests, num_slots=num_slots, attention_backend=attention_backend)
        self.runner.keep_hidden = True
        if graph_max_bs > 0:  # the head's decode steps replay captured graphs (features through feature_buffer)
            head.feature_buffer = torch.zeros(graph_max_bs, config.hidden_size, dtype=dtype, device=device)
            self.runner.cuda_graph = draft_graph_runner(self.runner, graph_max_bs)
        self._chain = self._capture_chain(chain_steps, self._carry_features)
        # per request: target positions observed and not yet in the head's KV, with their features
        self._pending: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        self._next_pos: dict[str, int] = {}

    def observe(self, rid: str, start: int, features: torch.Tensor) -> None:
        """The target kept the KV of positions start .. start + len(features) - 1 of `rid`, whose
        final-norm hidden states are `features` (copied: the caller's buffer is reused). A start
        before the last observed end (the target recomputed tokens: a retraction, a jump-forward)
        restarts the request's head state."""
        if start < self._next_pos.get(rid, 0):
            self.forget(rid)
        positions, rows = self._pending.setdefault(rid, ([], []))
        positions.extend(range(start, start + features.shape[0]))
        rows.append(features.detach().clone())
        self._next_pos[rid] = start + features.shape[0]

    def propose(self, contexts: dict[str, Sequence[int]], k: dict[str, int]) -> dict[str, list[int]]:
        """Greedy drafts, `k[rid]` tokens after each request's `contexts[rid]`; requests with no
        observed features, or no room in the head's cache, get none. Mutates the head's cache."""
        active: dict[str, DraftReq] = {}
        free = len(self._free_slots)  # NOTE: what the requests taken so far leave
        for rid, tokens in contexts.items():
            positions = self._pending.get(rid, ([], []))[0]
            if not positions or positions[-1] + 1 >= len(tokens):
                continue
            req = self._reqs.get(rid)
            if req is None:
                if not self._free_rows:
                    continue
                req = self._reqs[rid] = DraftReq(self._free_rows.pop())
            if len(positions) + k[rid] - 1 > free or len(req.tokens) + len(positions) + k[rid] > self.context_length:
                continue
            free -= len(positions) + k[rid] - 1
            active[rid] = req
        if not active:
            return {}
        items, feats = [], []
        for rid, req in active.items():
            positions, rows = self._pending.pop(rid)
            items.append(self._item(rid, req, [int(contexts[rid][p + 1]) for p in positions]))
            feats.append(torch.cat(rows))
        keep = {rid: len(req.tokens) for rid, req in active.items()}  # the catch-up KV stays
        self.head.features = torch.cat(feats)
        logits = self.runner.forward(ScheduleDecision("extend", items))
        assert self.runner.last_hidden is not None
        ends = torch.tensor([len(item.token_ids) for item in items], device=logits.device).cumsum(0) - 1
        guess = self.runner.last_hidden.index_select(0, ends)  # (requests, hidden): each one's predicted feature
        drafts = {rid: [int(t)] for rid, t in zip(active, greedy_argmax(logits).tolist(), strict=True)}
        if self._chain_runs(active, k, 1):  # the k - 1 steps in one replay, each step's features carried in the graph
            assert self.head.feature_buffer is not None
            self.head.feature_buffer[: len(active)].copy_(guess)
            self.head.features = None
            self._chain_drafts(active, drafts, {rid: d[-1] for rid, d in drafts.items()})
        else:
            self._step_drafts(active, drafts, k, guess)
        self.head.features = None
        for rid, req in active.items():
            self._drop_kv(req, keep[rid])
        return drafts

    def _step_drafts(self, active: dict[str, DraftReq], drafts: dict[str, list[int]], k: dict[str, int],
                     guess: torch.Tensor) -> None:
        """The decode steps after the first draft one at a time (`guess`: each active request's predicted feature,
        in order); appends each request's further drafts."""
        rows_of = {rid: i for i, rid in enumerate(active)}
        for step in range(1, max(k[rid] for rid in active)):
            rids = [rid for rid in active if k[rid] > step]
            index = torch.tensor([rows_of[rid] for rid in rids], device=guess.device)
            decision = ScheduleDecision("decode", [self._item(rid, active[rid], [drafts[rid][-1]]) for rid in rids])
            self._set_features(guess.index_select(0, index), decision)
            logits = self.runner.forward(decision)
            assert self.runner.last_hidden is not None
            guess = guess.index_copy(0, index, self.runner.last_hidden)
            for rid, token in zip(rids, greedy_argmax(logits).tolist(), strict=True):
                drafts[rid].append(int(token))

    def _carry_features(self, bs: int) -> None:
        """Inside a chain graph, between steps: the step's predicted features are the next step's inputs."""
        graphs, buffer = self.runner.cuda_graph, self.head.feature_buffer
        assert graphs is not None and graphs.hidden_out is not None and buffer is not None
        buffer[:bs].copy_(graphs.hidden_out[:bs])

    def _set_features(self, features: torch.Tensor, decision: ScheduleDecision) -> None:
        """The features of a head step: into the graphs' static buffer when the step replays one."""
        graphs = self.runner.cuda_graph
        buffer = self.head.feature_buffer
        if graphs is not None and buffer is not None and graphs.can_run(decision):
            buffer[: features.shape[0]].copy_(features)
            self.head.features = None
        else:
            self.head.features = features

    def accepted(self, rid: str, context: Sequence[int]) -> None:
        """Nothing to drop: a proposal keeps only the KV of observed (target-verified) tokens."""

    def forget(self, rid: str) -> None:
        super().forget(rid)
        self._pending.pop(rid, None)
        self._next_pos.pop(rid, None)
