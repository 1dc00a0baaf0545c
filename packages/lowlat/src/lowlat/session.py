"""A lowlat session: start-up in a checked order, then per-step dispatch, graph recording, reports.

Start-up order (each stage once, in this order; ``capture`` may repeat)::

    configure -> loaded -> check_model -> agree -> build -> memory_measured -> kv_sized
              -> install -> warmup -> capture

Plugins are chosen once (``configure`` + ``check_model``): an ``Unsupported`` plugin stays off for
the session's lifetime. Per step, ``select`` picks the plugin's forward or the original one from
the agreed coverage and counts every ``NotCovered`` reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from lowlat.agree import Agreement, Group, agree
from lowlat.build import BuildContext, Built
from lowlat.config import LowlatConfig
from lowlat.errors import LowlatError, StartupOrderError, Unsupported
from lowlat.graphs import ORIGINAL, PLUGIN, GraphEntry, PathRecorder
from lowlat.guards import spec_failures
from lowlat.layer import ForwardMeta, KVCache, LayerShape, LayerWeights
from lowlat.moe import MoELayerWeights, MoEShape
from lowlat.registry import Registry
from lowlat.spec import NotCovered, PluginSpec, ServerSetup, Step, StepKind
from lowlat.tp import Reducer


class Stage(enum.IntEnum):
    """Start-up stages, in the order a runner must call them."""

    CONFIGURE = 0
    LOADED = 1
    CHECK_MODEL = 2
    AGREE = 3
    BUILD = 4
    MEMORY_MEASURED = 5
    KV_SIZED = 6
    INSTALL = 7
    WARMUP = 8
    CAPTURE = 9


@dataclass(frozen=True)
class Verdict:
    """What the session decided about one registered plugin."""

    plugin: str
    version: str
    status: str  # "selected" | "candidate" | "unsupported" | "excluded"
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    """A snapshot of a session's decisions and counters (plain data)."""

    mode: str
    stage: str | None
    setup: ServerSetup | None
    verdicts: tuple[Verdict, ...]
    selected: str | None
    agreement: Agreement | None
    workspace_bytes: int
    graphs: tuple[GraphEntry, ...]
    plugin_steps: int
    fallbacks: tuple[tuple[str, int], ...]  # (reason, count), most frequent first
    plugin_steps_by_kind: tuple[tuple[str, int], ...] = ()  # (step kind, steps on the plugin), by kind


_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("lowlat_session", default=None)


class Session:
    """One model runner's use of lowlat. Single-threaded; one per process (per TP rank)."""

    def __init__(self, config: LowlatConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.setup: ServerSetup | None = None
        self.verdicts: dict[str, Verdict] = {}
        self.selected: PluginSpec | None = None
        self.agreement: Agreement | None = None
        self.built: Built | None = None
        self.recorder = PathRecorder()
        self._stage: Stage | None = None
        self._plugin_steps = 0
        self._plugin_steps_by_kind: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()
        self._off_reason: str | None = None
        self._group: Group | None = None
        self._deferred: Unsupported | None = None

    # -- start-up ---------------------------------------------------------------------------

    def _advance(self, stage: Stage) -> None:
        expected = Stage.CONFIGURE if self._stage is None else Stage(min(self._stage + 1, Stage.CAPTURE))
        if stage == Stage.CAPTURE and self._stage == Stage.CAPTURE:
            return
        if stage != expected:
            done = "nothing" if self._stage is None else self._stage.name.lower()
            raise StartupOrderError(
                f"lowlat start-up stage {stage.name.lower()} called after {done}; expected {expected.name.lower()} "
                f"(order: {' -> '.join(s.name.lower() for s in Stage)})"
            )
        self._stage = stage

    def configure(self, setup: ServerSetup) -> tuple[Verdict, ...]:
        """Check every registered plugin against ``setup`` (before weights load). Mutates the session.

        In ``require`` mode raises ``Unsupported`` (with every plugin's reasons) when no plugin fits.
        """
        self._advance(Stage.CONFIGURE)
        self.setup = setup
        for spec in self.registry.specs():
            if self.config.mode == "off":
                verdict = Verdict(spec.name, spec.version, "excluded", ("lowlat mode is off",))
            elif spec.name in self.config.disabled or (self.config.plugins and spec.name not in self.config.plugins):
                verdict = Verdict(spec.name, spec.version, "excluded", ("excluded by LowlatConfig.plugins/disabled",))
            else:
                reasons = spec_failures(spec, setup)
                verdict = Verdict(spec.name, spec.version, "unsupported" if reasons else "candidate", reasons)
            self.verdicts[spec.name] = verdict
        self._require_some_candidate()
        return tuple(self.verdicts.values())

    def loaded(self) -> None:
        """Mark the model's weights as loaded."""
        self._advance(Stage.LOADED)

    def check_model(self, model: Any, runner_reasons: Sequence[str] = ()) -> PluginSpec | None:
        """Run each candidate's ``check_model`` on the loaded model, then select the best candidate.

        ``runner_reasons``: why the model runner cannot express this model in lowlat's layer layout
        (for example attention biases); non-empty refuses every candidate with those reasons.
        Mutates the verdicts and ``selected``; returns the selected spec (None: original forward).
        """
        self._advance(Stage.CHECK_MODEL)
        for spec in self.registry.specs():
            verdict = self.verdicts[spec.name]
            if verdict.status != "candidate" or (spec.check_model is None and not runner_reasons):
                continue
            reasons = tuple(runner_reasons) or tuple(spec.check_model(model))  # type: ignore[misc]
            if reasons:
                self.verdicts[spec.name] = Verdict(spec.name, spec.version, "unsupported", reasons)
        self._require_some_candidate()
        for spec in self.registry.specs():  # highest priority first
            if self.verdicts[spec.name].status == "candidate":
                self.selected = spec
                self.verdicts[spec.name] = Verdict(spec.name, spec.version, "selected")
                break
        return self.selected

    def agree(self, group: Group | None = None) -> Agreement:
        """Agree with the other TP ranks (MIN of verdicts, all-gather of coverage); collective.

        In ``require`` mode every rank raises the same ``Unsupported`` (with every rank's reasons)
        when the plugin is off on any rank; under TP (``setup.tp_size > 1``) ``configure`` and
        ``check_model`` defer their ``require`` failure to here, so no rank leaves the group
        before the collective (the others would wait for it forever).
        """
        self._advance(Stage.AGREE)
        self._group = group
        spec = self.selected
        self.agreement = agree(
            spec.name if spec else None,
            spec.version if spec else None,
            spec.coverage if spec else None,
            group,
            () if spec else self._rank_reasons(),
        )
        if self.agreement.enabled:
            return self.agreement
        reasons = self.agreement.reasons or (self._deferred.reasons if self._deferred else ())
        if self.config.mode == "require":
            if spec is not None:
                self.verdicts[spec.name] = Verdict(spec.name, spec.version, "unsupported", reasons)
                self.selected = None
            raise Unsupported(self.config.plugins[0] if self.config.plugins else "any", reasons)
        if spec is not None:
            self._turn_off(spec, reasons)
        return self.agreement

    @property
    def deferred(self) -> Unsupported | None:
        """The ``require``-mode failure found before ``agree`` under TP (raised there), else None."""
        return self._deferred

    def build(
        self,
        shape: LayerShape,
        weights: Sequence[LayerWeights] | Sequence[MoELayerWeights],
        device: torch.device | str,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        moe: MoEShape | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        reducer: Reducer | None = None,
    ) -> Built | None:
        """Build the selected plugin (prepare weights, allocate workspaces); before KV sizing.

        A mixture-of-experts model passes ``moe`` and ``MoELayerWeights`` per layer. Under TP
        the weights are this rank's shards and ``all_reduce`` sums a tensor over the ranks in
        place, or ``reducer`` (a ``lowlat.tp.Reducer``) does (see ``BuildContext``).

        A build that raises ``Unsupported`` turns the plugin off (``require`` mode re-raises).
        Under TP (``agree`` got a group) the ranks exchange their build outcomes (a collective):
        a build that fails on any rank turns the plugin off on every rank.
        """
        self._advance(Stage.BUILD)
        spec = self.selected
        if spec is None or self.agreement is None or not self.agreement.enabled:
            return None
        assert self.setup is not None and self.agreement.coverage is not None
        ctx = BuildContext(
            shape=shape,
            weights=() if moe is not None else tuple(cast("Sequence[LayerWeights]", weights)),
            device=torch.device(device),
            dtype=dtype,
            kv_dtype=kv_dtype or dtype,
            coverage=self.agreement.coverage,
            config=self.config,
            setup=self.setup,
            max_context=self.setup.max_context,
            moe=moe,
            moe_weights=tuple(cast("Sequence[MoELayerWeights]", weights)) if moe is not None else (),
            tp_rank=self._group.rank if self._group is not None else 0,
            all_reduce=all_reduce,
            reducer=reducer,
        )
        built: Built | None = None
        failure: tuple[str, ...] = ()
        try:
            built = spec.build(ctx)
        except Unsupported as exc:
            failure = exc.reasons or ("build raised Unsupported",)
        if built is not None and not isinstance(built, Built):
            raise LowlatError(f"plugin {spec.name!r} build returned {type(built).__name__}, which is not a lowlat.Built")
        if self._group is not None and self._group.world_size > 1:
            outcomes = self._group.all_gather_object(failure)
            failure = tuple(f"rank {r} build: {why}" for r, reasons in enumerate(outcomes) for why in reasons)
        if failure:
            self._turn_off(spec, failure)  # drops this rank's build too: every rank runs the original
            return None
        self.built = built
        return built

    def memory_measured(self) -> int:
        """Mark memory as measured; returns the plugin's workspace bytes (already allocated).

        Under TP (``agree`` got a group) this is the largest workspace of any rank (a collective),
        so every rank takes the same amount off its KV budget and the ranks size identical caches.
        """
        self._advance(Stage.MEMORY_MEASURED)
        local = self.built.workspace_bytes if self.built is not None else 0
        if self._group is not None and self._group.world_size > 1:
            return max(int(b) for b in self._group.all_gather_object(local))
        return local

    def kv_sized(self, num_slots: int) -> None:
        """Mark the KV cache as sized (``num_slots`` tokens)."""
        self._advance(Stage.KV_SIZED)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")

    def install(self) -> None:
        """Mark the dispatcher as installed in the model; ``select`` works from here on."""
        self._advance(Stage.INSTALL)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run the built plugin's warm-up for each batch size it covers."""
        self._advance(Stage.WARMUP)
        if self.built is not None:
            self.built.warmup([b for b in batch_sizes if self._why_not(Step.decode(b)) is None])

    # -- per step ---------------------------------------------------------------------------

    def select(self, step: Step) -> str:
        """``"plugin"`` or ``"original"`` for ``step``; counts the step and any fallback reason."""
        if self._stage is None or self._stage < Stage.INSTALL:
            raise StartupOrderError("select() needs the dispatcher installed (call install() first)")
        why = self._why_not(step)
        if why is None:
            self._plugin_steps += 1
            self._plugin_steps_by_kind[step.kind.value] += 1
            return PLUGIN
        self._fallbacks[why.reason] += 1
        return ORIGINAL

    def capture(self, step: Step, graph: tuple[StepKind, int] | None = None) -> str:
        """Pick and record the path a CUDA graph for ``step`` freezes (after warm-up; repeatable).

        ``graph``: the (kind, batch size) the graph is recorded under, when it is not the step's own
        (a verify graph of as many rows as a decode graph: ``(StepKind.VERIFY, rows)``)."""
        self._advance(Stage.CAPTURE)
        why = self._why_not(step)
        path = PLUGIN if why is None else ORIGINAL
        kind, size = graph if graph is not None else (step.kind, step.batch_size)
        self.recorder.record(kind, size, path, None if why is None else why.reason)
        return path

    def replay(self, step: Step, graph: tuple[StepKind, int] | None = None) -> str:
        """Check that the graph for ``step`` froze the path ``select`` picks now; counts the step.

        ``graph``: the (kind, batch size) of the captured graph the step replays, when it is not
        the step's own (a verify step replayed in the decode graph of as many rows)."""
        path = self.select(step)
        kind, size = graph if graph is not None else (step.kind, step.batch_size)
        self.recorder.check(kind, size, path)
        return path

    def path_for(self, step: Step) -> str:
        """The path ``select`` would pick for ``step``, counting nothing. Pure."""
        return PLUGIN if self._why_not(step) is None else ORIGINAL

    def verify_launch_differs(self) -> bool:
        """Whether the built plugin launches verify steps otherwise than decode steps of as many rows (``Built``'s
        optional ``verify_launch_differs``): a graph captured for decode rows does not replay its verify launch. Pure."""
        return bool(getattr(self.built, "verify_launch_differs", False))

    def frozen_path(self, kind: StepKind, batch_size: int) -> str | None:
        """The path the graph captured for (kind, batch_size) froze, or None when none was. Pure."""
        entry = self.recorder.entry(kind, batch_size)
        return entry.path if entry is not None else None

    def forward_layer(
        self,
        path: str,
        layer: int,
        x: torch.Tensor,
        kv: KVCache,
        meta: ForwardMeta,
        original: Callable[[int, torch.Tensor, KVCache, ForwardMeta], torch.Tensor],
    ) -> torch.Tensor:
        """Run layer ``layer`` on the path ``select``/``replay`` returned for this step."""
        if path == PLUGIN:
            assert self.built is not None, "path 'plugin' without a built plugin"
            return self.built.forward(layer, x, kv, meta)
        return original(layer, x, kv, meta)

    # -- reporting --------------------------------------------------------------------------

    def report(self) -> Report:
        """A plain-data snapshot of decisions and counters. Pure."""
        return Report(
            mode=self.config.mode,
            stage=None if self._stage is None else self._stage.name.lower(),
            setup=self.setup,
            verdicts=tuple(self.verdicts.values()),
            selected=self.selected.name if self.selected else None,
            agreement=self.agreement,
            workspace_bytes=self.built.workspace_bytes if self.built is not None else 0,
            graphs=self.recorder.entries(),
            plugin_steps=self._plugin_steps,
            plugin_steps_by_kind=tuple(sorted(self._plugin_steps_by_kind.items())),
            fallbacks=tuple(self._fallbacks.most_common()),
        )

    def explain(self) -> str:
        """A human-readable account of why each path was or was not taken. Pure."""
        from lowlat.explain import format_report

        return format_report(self.report())

    @contextlib.contextmanager
    def activate(self) -> Iterator[Session]:
        """Make this session the one ``lowlat.explain()`` / ``lowlat.report()`` describe (context-scoped)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    # -- internals --------------------------------------------------------------------------

    def _why_not(self, step: Step) -> NotCovered | None:
        if self.built is None or self.selected is None or self.agreement is None or self.agreement.coverage is None:
            return NotCovered("-", self._off_reason or "no plugin selected")
        name = self.selected.name
        why = self.agreement.coverage.why_not(step)
        if why is not None:
            return NotCovered(name, why)
        if not self.built.covers(step):
            return NotCovered(name, f"declined by built plugin for {step.kind.value} batch {step.batch_size}")
        return None

    def _turn_off(self, spec: PluginSpec, reasons: tuple[str, ...]) -> None:
        self.verdicts[spec.name] = Verdict(spec.name, spec.version, "unsupported", reasons)
        self.selected = None
        self._off_reason = f"{spec.name} turned off: " + "; ".join(reasons)
        if self.config.mode == "require":
            raise Unsupported(spec.name, reasons)

    def _rank_reasons(self) -> tuple[str, ...]:
        """Why this rank has no plugin: every refused plugin's reasons (in ``require`` mode with
        named plugins, only theirs: the others are excluded by that choice). Pure."""
        named = set(self.config.plugins) if self.config.mode == "require" and self.config.plugins else None
        reasons = tuple(f"{v.plugin}: {r}" for v in self.verdicts.values()
                        if named is None or v.plugin in named for r in v.reasons)
        if reasons:
            return reasons
        if named:
            registered = ", ".join(sorted(self.verdicts)) or "none"
            return (f"{', '.join(sorted(named))}: not registered (registered: {registered})",)
        return ("no plugin registered",)

    def _require_some_candidate(self) -> None:
        if any(v.status in ("candidate", "selected") for v in self.verdicts.values()):
            return
        if self.config.mode != "require":
            self._off_reason = "no supported plugin: " + "; ".join(
                f"{v.plugin}: {', '.join(v.reasons)}" for v in self.verdicts.values()
            ) if self.verdicts else "no plugin registered"
            return
        exc = Unsupported(self.config.plugins[0] if self.config.plugins else "any", self._rank_reasons())
        if self.setup is not None and self.setup.tp_size > 1:
            self._deferred = exc  # raised by agree() on every rank at once
            self._off_reason = "; ".join(exc.reasons)
            return
        raise exc


def active_session() -> Session:
    """The session made active by ``Session.activate``; raises ``LowlatError`` when none is."""
    session = _ACTIVE.get()
    if session is None:
        raise LowlatError("no active lowlat session: use `with session.activate():` or call session.explain()")
    return session
