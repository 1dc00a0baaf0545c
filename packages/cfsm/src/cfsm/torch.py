"""torch logits processors: apply an int32 token bitmask to logits in place (CPU and CUDA).

Install with ``pip install "cfsm[torch]"``. Bit ``i % 32`` of word ``i // 32`` allows token i.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('cfsm.torch needs torch: pip install "cfsm[torch]"') from exc

from cfsm.grammar import GrammarIndex
from cfsm.guide import Guide
from cfsm.masks.index import Index

_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)

__all__ = ["apply_token_bitmask_", "apply_token_bitmask_reference_", "TokenIdsLogitsProcessor"]


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if bitmask.dtype != torch.int32:
        raise TypeError(f"Invalid bitmask dtype: expected torch.int32, got {bitmask.dtype}")
    if logits.dim() not in (1, 2) or bitmask.dim() != logits.dim():
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must both be 1-D or 2-D")
    if logits.dim() == 2 and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"batch mismatch: logits {tuple(logits.shape)} vs bitmask {tuple(bitmask.shape)}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")


def apply_token_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor,
                                   indices: Sequence[int] | None = None) -> None:
    """Reference semantics (slow): for each row r (or r in `indices`) and token i < V::

        if i >= 32 * W or not (bitmask[r, i // 32] >> (i % 32)) & 1: logits[r, i] = -inf

    Mutates `logits`.
    """
    _check(logits, bitmask)
    lg = logits.unsqueeze(0) if logits.dim() == 1 else logits
    bm = (bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask).cpu().tolist()
    rows = range(lg.shape[0]) if indices is None else indices
    for r in rows:
        words = bm[r]
        for i in range(lg.shape[1]):
            w = i // 32
            if w >= len(words) or not (words[w] >> (i % 32)) & 1:
                lg[r, i] = float("-inf")


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         indices: Sequence[int] | None = None) -> None:
    """Vectorized `apply_token_bitmask_reference_` (same semantics; CPU or CUDA). Mutates `logits`."""
    _check(logits, bitmask)
    lg = logits.unsqueeze(0) if logits.dim() == 1 else logits  # (B, V)
    bm = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask  # (B, W)
    if indices is not None:
        idx = torch.as_tensor(list(indices), device=lg.device, dtype=torch.long)
        sub = lg.index_select(0, idx)
        apply_token_bitmask_(sub, bm.index_select(0, idx))
        lg.index_copy_(0, idx, sub)
        return
    vocab = lg.shape[1]
    width = min(vocab, bm.shape[1] * 32)
    if bm.device.type == "cpu" and sys.byteorder == "little":
        # NOTE: on a little-endian host the bytes of word w hold tokens 32w.. in ascending bit order,
        # so numpy's C unpack gives the allowed table directly; filling through numpy is ~3x masked_fill_.
        bits = np.unpackbits(bm.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")[:, :width]
        target = lg[:, :width]
        if target.device.type == "cpu" and target.dtype in _NUMPY_FLOATS and not target.requires_grad:
            np.copyto(target.numpy(), -np.inf, where=bits == 0)  # writes through the view into `logits`
        else:
            target.masked_fill_(torch.from_numpy(bits).to(lg.device) == 0, float("-inf"))
    else:
        shifts = torch.arange(32, device=bm.device, dtype=torch.int32)
        allowed = ((bm.unsqueeze(-1) >> shifts) & 1).reshape(bm.shape[0], -1)[:, :width]  # (B, width)
        lg[:, :width].masked_fill_(allowed == 0, float("-inf"))
    if width < vocab:
        lg[:, width:] = float("-inf")


class TokenIdsLogitsProcessor:
    """A plain ``(token_ids, logits) -> logits`` callable for engines with that hook (one request).

    `token_ids` are the tokens generated so far (prompt excluded); new ones are fed to the
    guide before masking. Mutates `logits` in place and returns it.
    """

    def __init__(self, index: Index | GrammarIndex) -> None:
        self.guide = Guide(index)
        self._mask = np.zeros((1, index.vocab.mask_words), dtype=np.int32)

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        seen = self.guide.num_tokens
        if len(token_ids) < seen:
            self.guide.rollback(seen - len(token_ids))
        else:
            self.guide.advance_many(list(token_ids[seen:]))
        self.guide.fill_mask(self._mask, 0)
        mask = torch.from_numpy(self._mask).to(logits.device)
        apply_token_bitmask_(logits, mask if logits.dim() == 2 else mask[0])
        return logits
