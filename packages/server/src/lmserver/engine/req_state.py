"""`ReqState`: the engine-side state of one request (the scheduler holds its KV side in `sreq`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserver.engine.detokenizer import IncrementalDetokenizer, OutputText
from lmserver.io_struct import GenerateReq, TokenLogprob
from lmserver.runner.sampler import SamplingInfo
from lmserver.scheduler import Req


@dataclass
class ReqState:
    """Engine-side state of one request (the scheduler holds the KV side in `sreq`)."""

    req: GenerateReq
    sreq: Req
    detok: IncrementalDetokenizer
    out: OutputText
    info: SamplingInfo
    sent_tokens: int = 0
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_top: list[list[TokenLogprob] | None] = field(default_factory=list)
    input_sent: bool = False
    out_logprobs: list[TokenLogprob] = field(default_factory=list)
    out_top: list[list[TokenLogprob] | None] = field(default_factory=list)
    finished: bool = False
    grammar: Any = None  # lmserver.engine.constrained.ReqGrammar of a constrained request (once compiled)
    rollback_tokens: int = 0  # sent token ids taken back by jump-forward, reported with the next output
