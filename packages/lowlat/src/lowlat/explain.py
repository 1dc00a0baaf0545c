"""Text rendering of a session ``Report``: the answer to "why did (or didn't) lowlat run?"."""

from __future__ import annotations

from lowlat.session import Report, active_session


def format_report(report: Report) -> str:
    """Render ``report`` as lines of text. Pure."""
    lines = [f"lowlat: mode={report.mode} stage={report.stage or '-'} selected={report.selected or 'none'}"]
    if report.setup is not None:
        s = report.setup
        cap = f"{s.capability[0]}.{s.capability[1]}" if s.capability else "-"
        lines.append(
            f"  setup: arch={s.arch} vendor={s.vendor} cc={cap} amd_arch={s.amd_arch or '-'} dtype={s.dtype} "
            f"kv={s.kv_dtype} tp={s.tp_size} max_context={s.max_context} features={sorted(s.features)}"
        )
    for v in report.verdicts:
        lines.append(f"  plugin {v.plugin} {v.version}: {v.status}")
        lines.extend(f"    - {r}" for r in v.reasons)
    if report.agreement is not None:
        a = report.agreement
        cov = a.coverage.to_table() if a.coverage is not None else None
        lines.append(f"  agreement over {a.world_size} rank(s): enabled={a.enabled} coverage={cov}")
        lines.extend(f"    - {r}" for r in a.reasons)
    lines.append(f"  workspace: {report.workspace_bytes / 2**20:.1f} MiB")
    if report.graphs:
        lines.append("  graphs (kind, batch -> path, replays):")
        for g in report.graphs:
            why = f" ({g.reason})" if g.reason else ""
            lines.append(f"    {g.kind.value:7s} bs={g.batch_size:<4d} -> {g.path}{why}, replays={g.replays}")
    kinds = ", ".join(f"{kind} {n}" for kind, n in report.plugin_steps_by_kind)
    lines.append(f"  steps on plugin: {report.plugin_steps}" + (f" ({kinds})" if kinds else ""))
    if report.fallbacks:
        lines.append("  fallbacks to the original forward:")
        lines.extend(f"    {count:8d}  {reason}" for reason, count in report.fallbacks)
    return "\n".join(lines)


def explain() -> str:
    """Explain the active session (see ``Session.activate``)."""
    return active_session().explain()


def report() -> Report:
    """The active session's ``Report``."""
    return active_session().report()
