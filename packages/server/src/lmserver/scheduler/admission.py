"""StepBudget: SLO-aware admission. New requests join the running batch only while the running
requests keep their decode speed. No torch.

Every request admitted while others decode costs them twice: one more row in every decode step
(a larger batch steps slower), and the prefill step that admits it (a mixed step with prompt
rows runs eagerly, several decode steps long). Admitting "as memory allows" (SGLang's and
vLLM's default; their knobs are a fixed max running requests or a token budget) lets a burst of
short requests slow every stream by the ratio of the big batch's step to the small one's. With
a target step time (`decode_step_target_ms`) the scheduler instead admits a waiting request
only when

1. the decode step it leads to stays within the target: a decode step's duration is modelled
   as a + b * rows, fitted by exponentially weighted least squares to the measured steps
   (`observe`); the batch never grows more than `probe_rows` beyond the largest one measured
   (no extrapolation from a slope that noise may have flattened), so each growth is measured
   before the next;
2. the prefill step that admits it is paid for: a budget (`credit`, seconds) gains
   `target - step` after every measured step (steps below the target fill it) and loses the
   overrun of each step above it (a prefill step); admission waits while the predicted
   overrun of the admitting step (its extra time over a decode step, fitted the same way
   against its number of prompt rows) exceeds the credit. The credit is capped at
   `credit_cap_steps` target steps, so over any W steps the running requests' mean gap stays
   within about target + cap / W;
3. the admitting step stays within `max_step_s` (the longest gap an admission may cause).

With no request decoding nothing is limited (the first requests prefill at full speed); with a
target below what the running batch alone costs, new requests wait until running ones finish
(every request ends: its output is bounded). The jump-forwards of grammar requests, which put a
running request back into prefill, ask the same budget (`extend_affordable`).

The target is absolute (`AdmissionConfig.target_s`, `--decode-step-target-ms`) or relative
(`AdmissionConfig.slowdown`, `--decode-step-slowdown`, the default on CUDA): each *protected*
request keeps its decode step within `slowdown` times the step it had when it started. A request
is protected when it is admitted in a round that leaves nothing waiting (it started in calm
conditions; `Req.slo_base_rows` is then the batch it started in, running and prefilling rows);
one admitted from a backlog (a burst: throughput traffic) is not. The target is then
`slowdown * (a + b * base_rows)`, `base_rows` the smallest start batch of the protected requests
still active (`protect`), on the same fitted line as the steps it limits. So

- a storm arriving next to calm streams joins only as far as the streams keep 1 / slowdown of
  their speed (their own rows fitted, not an absolute time: a model, a GPU or contexts that grow
  longer move both sides of the ratio alike);
- a burst into an idle server, or a sustained backlog, is not limited: its requests protect
  nothing, and once the protected requests end there is no target (offline batches and
  throughput benchmarks run as memory allows). What a burst costs is bounded by the remaining
  lifetime of the requests that were running calm when it came.

A fixed multiple of a running median of measured steps would ratchet: the steps the admitted
requests slow down become the next reference, and the target grows by the factor every window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AdmissionConfig", "LinearFit", "StepBudget"]


@dataclass(frozen=True)
class AdmissionConfig:
    """Exactly one of `target_s` (absolute) and `slowdown` (relative to the protected requests'
    start batch) is set."""

    target_s: float | None = None  # the running requests' decode step (gap between two tokens) to keep
    max_step_s: float = math.inf  # the longest step (gap) an admitting prefill step may take
    credit_cap_steps: float = 16.0  # the credit is capped at this many target steps
    probe_rows: int = 4  # rows the batch may grow beyond the largest measured while no slope is known
    forget: float = 0.98  # weight of past measurements per new one (about the last 50 count)
    slowdown: float | None = None  # relative target: this times the fitted step at the protected start batch

    def __post_init__(self) -> None:
        if (self.target_s is None) == (self.slowdown is None):
            raise ValueError("set exactly one of target_s (absolute) and slowdown (relative)")
        if self.target_s is not None and (not self.target_s > 0 or math.isinf(self.target_s)):
            raise ValueError(f"target_s must be a finite number > 0, got {self.target_s}")
        if self.slowdown is not None and (not self.slowdown > 1.0 or math.isinf(self.slowdown)):
            raise ValueError(f"slowdown must be a finite number > 1, got {self.slowdown}")
        if not self.max_step_s > 0:
            raise ValueError(f"max_step_s must be > 0, got {self.max_step_s}")
        if self.credit_cap_steps < 0 or self.probe_rows < 1 or not 0 < self.forget < 1:
            raise ValueError("need credit_cap_steps >= 0, probe_rows >= 1, 0 < forget < 1")


class LinearFit:
    """y = a + b * x by exponentially weighted least squares (each new point weighs 1, older
    ones `forget` times less per point). The slope is known once the weighted variance of x is
    at least `min_var` (two batch sizes measured recently); before that `predict` is the mean y."""

    def __init__(self, forget: float, min_var: float = 0.25) -> None:
        self.forget = forget
        self.min_var = min_var
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.max_x = -math.inf  # the largest x measured (not forgotten)

    def add(self, x: float, y: float) -> None:
        f = self.forget
        self.w = self.w * f + 1.0
        self.sx = self.sx * f + x
        self.sy = self.sy * f + y
        self.sxx = self.sxx * f + x * x
        self.sxy = self.sxy * f + x * y
        self.max_x = max(self.max_x, x)

    @property
    def empty(self) -> bool:
        return self.w == 0.0

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), b >= 0 (a step never gets faster with more rows); b = 0 while the slope is
        unknown; None without data."""
        if self.w == 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var < self.min_var:
            return my, 0.0
        b = max((self.sxy / self.w - mx * my) / var, 0.0)
        return my - b * mx, b

    @property
    def has_slope(self) -> bool:
        return self.w > 0.0 and self.sxx / self.w - (self.sx / self.w) ** 2 >= self.min_var

    def predict(self, x: float) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * x


class StepBudget:
    """The admission limit of one scheduler (see the module doc). Single-threaded."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.decode = LinearFit(config.forget)  # decode rows -> step seconds (steps without prefill rows)
        self.extra = LinearFit(config.forget)  # prompt rows -> a prefill step's seconds over the decode prediction
        self.credit = 0.0
        self.num_observed = 0
        self.num_deferred = 0  # rounds in which a waiting request could have been admitted but for this budget
        # relative target: the smallest start batch of the protected requests still active (None: none is)
        self.base_rows: int | None = None

    @property
    def relative(self) -> bool:
        return self.config.slowdown is not None

    def protect(self, base_rows: int | None) -> None:
        """Relative target: the smallest start batch (`Req.slo_base_rows`) of the active protected
        requests, None when none is (the scheduler's, each round). With nothing to protect there
        is no limit and the credit starts again from 0. Mutates self."""
        if base_rows is None and self.base_rows is not None:
            self.credit = 0.0
        self.base_rows = base_rows

    @property
    def target_s(self) -> float | None:
        """The decode step to keep now; None: no limit (relative, with no protected request or no
        step measured). Pure."""
        if self.config.target_s is not None:
            return self.config.target_s
        if self.base_rows is None:
            return None
        base = self.decode.predict(self.base_rows)
        assert self.config.slowdown is not None
        return None if base is None else self.config.slowdown * base

    @property
    def cap_s(self) -> float:
        target = self.target_s
        return 0.0 if target is None else self.config.credit_cap_steps * target

    def observe(self, decode_rows: int, prefill_rows: int, seconds: float) -> None:
        """A measured gap of the running requests: `decode_rows` of them got a token after
        `seconds`, in a step that also computed `prefill_rows` prompt rows (0: a decode step)."""
        if decode_rows <= 0 or not seconds > 0 or math.isinf(seconds):
            return
        if prefill_rows <= 0:
            self.decode.add(decode_rows, seconds)
        else:
            base = self.decode.predict(decode_rows)
            if base is not None:
                self.extra.add(prefill_rows, max(seconds - base, 0.0))
        target = self.target_s
        if target is not None:  # (relative, nothing protected: no credit to keep)
            self.credit = min(self.credit + target - seconds, self.config.credit_cap_steps * target)
        self.num_observed += 1

    def predict_decode(self, rows: int) -> float | None:
        """A decode step's seconds at `rows` rows (None: nothing measured). Pure."""
        return self.decode.predict(rows)

    def predict_extend(self, decode_rows: int, prefill_rows: int) -> float | None:
        """A prefill step's seconds with `decode_rows` decoding and `prefill_rows` prompt rows
        (None: no decode step measured; the extra is 0 until a prefill step was measured). Pure."""
        base = self.decode.predict(decode_rows)
        if base is None:
            return None
        extra = self.extra.predict(prefill_rows)
        return base + (extra if extra is not None else 0.0)

    def _row_limit(self, active: int, target: float) -> int | None:
        """The most rows (running and prefilling) whose decode step is predicted within `target`;
        None: not known (nothing measured). Pure."""
        c = self.decode.coefficients()
        if c is None:
            return None
        a, b = c
        largest = int(self.decode.max_x)
        probe = largest + self.config.probe_rows
        if not self.decode.has_slope or b <= 0.0:  # one batch size measured (or a flat fit): grow a little past it
            # NOTE: relative, the target is slowdown * a here, so the probe always grows
            return probe if a <= target else min(largest, active)
        return min(max(int(math.floor((target - a) / b + 1e-9)), 0), probe)

    def admit_limit(self, active: int, decoding: int) -> int | None:
        """How many waiting requests may be admitted now, with `active` requests holding rows
        (running and prefilling) of which `decoding` decode; None: no limit. Pure."""
        if decoding <= 0:
            return None
        target = self.target_s
        if target is None:  # relative: nothing protected, or no step measured yet
            return None
        rows = self._row_limit(active, target)
        n = None if rows is None else max(rows - active, 0)
        base = self.decode.predict(decoding)
        if n == 0 or base is None:
            return n
        c = self.extra.coefficients()
        if c is None:  # no prefill step measured yet: the first one waits for a non-negative credit
            return n if self.credit >= 0.0 else 0
        # the admitting step, base + e_a + e_b * k, within target + credit and within max_step_s
        e_a, e_b = c
        room = min(target + self.credit, self.config.max_step_s) - base - e_a
        if room < e_b or room < 0.0:
            return 0
        k = int(self.extra.max_x) + self.config.probe_rows  # as rows: at most probe_rows past the largest measured
        if e_b > 0.0:
            k = min(k, int(math.floor(room / e_b + 1e-9)))
        return k if n is None else min(n, k)

    def extend_affordable(self, decoding: int, prefill_rows: int) -> bool:
        """True when a prefill step of `prefill_rows` rows beside `decoding` decoding rows is paid
        for now (e.g. a jump-forward's re-prefill). Pure."""
        if decoding <= 0:
            return True
        step = self.predict_extend(decoding, prefill_rows)
        target = self.target_s
        if step is None or target is None:
            return True
        return step - target <= self.credit and step <= self.config.max_step_s

    def stats(self) -> dict[str, float]:
        a_b = self.decode.coefficients()
        target = self.target_s
        return {"admission_credit_s": self.credit, "admission_observed": self.num_observed,
                "admission_deferred_rounds": self.num_deferred,
                "admission_decode_a_s": a_b[0] if a_b else float("nan"),
                "admission_decode_b_s": a_b[1] if a_b else float("nan"),
                "admission_target_s": target if target is not None else float("nan"),
                "admission_base_rows": self.base_rows if self.base_rows is not None else -1}
