"""Mixtral-style MoE: the Llama decoder with a top-k routed expert MLP.

Loads both checkpoint layouts: per-expert `block_sparse_moe.experts.E.w1/w2/w3` and the fused
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj` of newer transformers.
"""

from __future__ import annotations

import re

from torch import nn

from lmserver.layers.moe import MoE
from lmserver.models.config import ModelConfig
from lmserver.models.llama import LlamaForCausalLM

_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_ROUTER = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_FUSED = re.compile(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_mlp(config: ModelConfig) -> nn.Module:
        return MoE(config.hidden_size, config.intermediate_size, config.num_experts, config.num_experts_per_tok)

    def map_weight(self, name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        inter = self.config.intermediate_size
        if m := _EXPERT.match(name):
            prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
            if which == "w2":
                return f"{prefix}.mlp.w2", (expert,)
            rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
            return f"{prefix}.mlp.w13", (expert, rows)
        if m := _ROUTER.match(name):
            return f"{m.group(1)}.mlp.gate.weight", ()
        if m := _FUSED.match(name):
            return f"{m.group(1)}.mlp.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", ()
        return super().map_weight(name)
