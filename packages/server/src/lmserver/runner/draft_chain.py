"""A draft model's k - 1 decode steps in one captured graph: all of a proposal's chained drafts in one replay.

A proposal (`runner.draft_model.DraftModel`, `runner.eagle.EagleProposer`) gets its first draft from a catch-up
extend forward, then runs k - 1 decode steps, each feeding the previous step's greedy token (an EAGLE head also
its predicted feature). Step by step, each of those is a host round trip: inputs copied in, a graph replayed, the
argmax read back before the next step can be written. `DraftChainGraphs` captures, per batch size of the draft's
`DecodeGraphRunner`, the `steps` decode forwards back to back in one graph: step j + 1 reads step j's argmax on the
device (`write_decode_inputs`' chained ids), `carry` (EAGLE: the predicted features into the head's static buffer)
runs between steps, and every step's argmax lands in one (steps, bs) output. A proposal then costs one input copy,
one replay and one read for all its chained drafts: the draft-proposal launch of issue 34.

Every step's KV slot and position is known before the replay (the drafts' positions follow each other), so the
host writes all steps' padded inputs (`pad_decode`) at once; only the token ids of steps after the first are left
to the graph. The tokens a step writes to `req_to_token` and the KV pool are those the step-by-step loop writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lmserver.runner.cuda_graph import (
    DecodeGraphRunner,
    EagerGraph,
    Graph,
    TorchCudaGraph,
    pad_decode,
)
from lmserver.runner.host_tensors import to_device
from lmserver.scheduler.scheduler import ForwardItem

__all__ = ["DraftChainGraphs"]


class DraftChainGraphs:
    """`steps` chained decode steps of a draft runner per captured size of `graphs` (sizes >= 1, steps >= 1).

    `carry(bs)`, when given, runs inside the graph after every step but the last (it may read `graphs.hidden_out`).
    Owns its static inputs (`ints`: (steps, 5, max_bs)) and output (`ids`: (steps, max_bs)); replays mutate the
    runner's KV pool and request table and `graphs`' static buffers, as that many `graphs.forward` calls would."""

    def __init__(self, graphs: DecodeGraphRunner, steps: int, carry: Callable[[int], None] | None = None) -> None:
        if steps < 1:
            raise ValueError(f"a draft chain needs at least one step, got {steps}")
        runner = graphs.runner
        if runner.lowlat is not None or runner.prefix_planner is not None:
            raise ValueError("a draft chain runs the plain decode graph body: no lowlat plugin, no cascade attention")
        self.graphs, self.steps, self.carry = graphs, steps, carry
        device, max_bs = graphs.device, graphs.max_bs
        self.ints = graphs.ints.unsqueeze(0).repeat(steps, 1, 1)  # (steps, 5, max_bs): padding rows as the runner's
        self.ids = torch.zeros(steps, max_bs, dtype=torch.int64, device=device)  # each step's argmax
        cuda = device.type == "cuda"
        self._staging = torch.zeros(steps, 5, max_bs, dtype=torch.int64, pin_memory=cuda)
        self._staging.copy_(self.ints)  # columns past a run's padded size keep the padding rows
        self._staged = torch.cuda.Event() if cuda else None  # the staging buffer's last copy
        self.chains: dict[int, Graph] = {}
        self.num_replays = 0

    def _chain_fn(self, bs: int) -> Callable[[], torch.Tensor]:
        step = self.graphs.step_fn(bs)
        graphs, carry = self.graphs, self.carry

        def fn() -> torch.Tensor:
            for j in range(self.steps):
                graphs.ints.copy_(self.ints[j])
                step()
                self.ids[j].copy_(graphs.greedy_ids)
                if carry is not None and j + 1 < self.steps:
                    carry(bs)
            return self.ids

        return fn

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms up and captures a chain for every size of `graphs`, largest first; mutates self and padding slot 0
        (the static inputs hold padding rows only until the first `run`)."""
        cuda = self.graphs.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        for bs in reversed(self.graphs.sizes):
            fn = self._chain_fn(bs)
            for _ in range(2):  # NOTE: compiles kernels and allocates scratch outside the capture
                fn()
            if cuda:
                torch.cuda.synchronize(self.graphs.device)
            graph: Graph = TorchCudaGraph(pool) if cuda else EagerGraph()
            graph.capture(fn)
            self.chains[bs] = graph
        if cuda:
            torch.cuda.synchronize(self.graphs.device)

    def can_run(self, bs: int, steps: int) -> bool:
        """Whether a chain of `steps` decode steps of `bs` requests has a captured graph. Pure."""
        return steps == self.steps and 0 < bs <= self.graphs.max_bs and bool(self.chains)

    @torch.inference_mode()
    def run(self, step_items: Sequence[Sequence[ForwardItem]]) -> torch.Tensor:
        """Replays the chain over `step_items[j]`, the decode items of step j (the same requests in the same order
        each step, one new token each; the token ids of steps after the first are ignored: row i reads step j - 1's
        argmax of row i). Returns the (steps, bs) int64 argmax of every step, a view the next replay overwrites.
        Mutates req_to_token, the KV pool and the static buffers."""
        if len(step_items) != self.steps:
            raise ValueError(f"a chain of {self.steps} steps got {len(step_items)}")
        bs = len(step_items[0])
        if not self.can_run(bs, len(step_items)) or any(len(items) != bs for items in step_items):
            raise ValueError(f"no chain graph serves {len(step_items)} steps of {[len(i) for i in step_items]} rows")
        padded = self.graphs.padded_size(bs)
        if self._staged is not None:  # NOTE: the previous run's copy; done long before (its drafts were read)
            self._staged.synchronize()
        for j, items in enumerate(step_items):
            step = pad_decode(items, padded, self.graphs.pad_row)
            if step.table[2]:  # NOTE: rare (a table row behind its KV); entries before any step's new slot
                table = to_device(step.table, torch.int64, self.graphs.device)
                self.graphs.runner.req_to_token[table[0], table[1]] = table[2].to(torch.int32)
            if j:
                step.ints[0][:bs] = range(-1, -bs - 1, -1)  # row i reads the previous step's argmax of row i
            self._staging[j].numpy()[:, :padded] = step.ints  # straight into the pinned buffer (cuda_graph's note)
        self.ints.copy_(self._staging, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        self.chains[padded].replay()
        self.num_replays += 1
        return self.ids[:, :bs]
