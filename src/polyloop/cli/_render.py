"""Terminal views of runs: the progress line, the runs table and the trajectory blocks."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from rich import box
from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from polyloop._escaping import escape_block, escape_field
from polyloop.cli._facts import (
    Doubt,
    in_doubt,
    run_facts,
    run_tokens_text,
    state_text,
    step_facts,
    step_inherited_text,
)
from polyloop.cli._snapshots import step_snapshot_text
from polyloop.cli._view import RunSummary, RunView, reply_facts, review_facts, span_text
from polyloop.types import ActionStatus, DecisionKind, StepRecord

# How much of an observation the terminal shows; --json and --html show it whole.
OBSERVATION_CHARS = 600
REPLY_CHARS = 240
LINE_CHARS = 160

STATE_STYLES = {
    "finished": "green",
    "running": "cyan",
    "resumable": "yellow",
    "in doubt": "red",
    "awaiting approval": "magenta",
    "corrupt": "bold red",
}


def status_of(step: StepRecord) -> tuple[str, str]:
    """A step's outcome in words, with the style to show it in."""
    if step.action_status is ActionStatus.EXECUTED:
        if step.observation_synthesized:
            return "executed (the tool failed)", "yellow"
        return "executed", "green"
    if step.action_status is ActionStatus.NOT_EXECUTED:
        return "not executed", "yellow"
    if step.action_status is ActionStatus.ENV_FAULT:
        return "environment fault", "red"
    if step.error is not None:
        return "model failure", "red"
    if step.decision is DecisionKind.FINAL:
        return "final answer", "green"
    return "invalid reply", "yellow"


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def one_line(text: str, limit: int = LINE_CHARS) -> str:
    flat = " | ".join(part.strip() for part in text.splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def step_line(step: StepRecord, *, note: str | None = None) -> Text:
    """Two lines per step, as the demo prints them while the run goes on.

    The first names the step, its outcome and its action; the second what came back.
    """
    status, style = status_of(step)
    line = Text()
    line.append(f"  step {step.step:>2}  ", style="bold")
    line.append(f"{status:<13}", style=style)
    line.append(" ")
    line.append(escape_field(step.action_text or _no_action_text(step)))
    if note is not None:
        line.append(f"  ({note})", style="cyan")
    seen = step.observation if step.observation is not None else step.final_answer
    if seen is not None:
        line.append(f"\n           → {escape_field(one_line(seen))}", style="dim")
    return line


def _no_action_text(step: StepRecord) -> str:
    if step.error is not None:
        return "(model call failed)"
    if step.decision is DecisionKind.FINAL:
        return "(final answer)"
    return "(unusable reply)"


def runs_table(views: Iterable[RunSummary], *, now: datetime) -> Table:
    """One row per run: id, state, stop reason, steps, valid steps (a corrupt run: why),
    how long ago it started (at ``now``) and how long it took once it ended."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("run", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("stop reason", no_wrap=True)
    table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("valid", justify="right", no_wrap=True)
    table.add_column("age", justify="right", no_wrap=True)
    table.add_column("duration", justify="right", no_wrap=True)
    for view in views:
        # Escaped here already, not only on the way out, so the columns are measured
        # by what is printed.
        table.add_row(
            Text(escape_field(view.run_id)),
            Text(view.state_line, style=STATE_STYLES[view.state]),
            Text(escape_field(view.stop_reason or view.problem or "-")),
            str(view.step_count) if view.step_count is not None else "-",
            str(view.valid_steps) if view.valid_steps is not None else "-",
            span_text(view.age_s(now)),
            span_text(view.duration_s),
        )
    return table


def trajectory(view: RunView) -> RenderableType:
    """The run as blocks: a header, one block per step, and how it ended.

    An effect in doubt comes first, before anything that could read as a success.
    """
    parts: list[RenderableType] = [_header(view)]
    if (doubt := in_doubt(view)) is not None:
        parts.extend(_doubt_banner(doubt))
    parts.append(_fields([("state", state_text(view)), *run_facts(view)]))
    reviews = view.reviews()
    for step in view.steps:
        inherited = step_inherited_text(view, step)
        parts.append(
            Rule(_step_title(step, inherited=inherited is not None), align="left", style="dim")
        )
        fields = _step_fields(step) + review_facts(reviews.get(step.step, []))
        if inherited is not None:
            fields.append(("inherited", inherited))
        if (under := step_snapshot_text(view, step)) is not None:
            fields.append(("snapshot", under))
        parts.append(_fields(fields))
    parts.append(Rule(Text("end", style="bold"), align="left", style="dim"))
    parts.append(_fields(_end_fields(view)))
    return Group(*parts)


def _header(view: RunView) -> Text:
    header = Text()
    header.append("run ", style="bold")
    header.append(escape_field(view.run_id), style="bold")
    header.append("  ")
    header.append(view.state, style=STATE_STYLES[view.state])
    header.append(f"  ({view.records} records)", style="dim")
    return header


def _doubt_banner(doubt: Doubt) -> list[RenderableType]:
    banner = Text()
    banner.append(" IN DOUBT ", style="bold white on red")
    headline = escape_field(doubt.headline().removeprefix("IN DOUBT: "))
    banner.append(" " + headline, style="bold red")
    return [banner, _fields(doubt.fields()), Rule(style="red")]


def _step_title(step: StepRecord, *, inherited: bool = False) -> Text:
    status, style = status_of(step)
    title = Text()
    title.append(f"step {step.step}", style="bold")
    title.append(f" · {step.decision.value} · ")
    title.append(status, style=style)
    if inherited:
        title.append(" · inherited", style="blue")
    if step.resumed:
        title.append(" · resumed", style="cyan")
    return title


def _step_fields(step: StepRecord) -> list[tuple[str, str]]:
    fields: list[tuple[str, str]] = [("decision", step.decision.value)]
    if step.action_text is not None:
        fields.append(("action", step.action_text))
    fields.append(("status", status_of(step)[0]))
    if step.observation is not None:
        observation = shorten(step.observation.rstrip("\n"), OBSERVATION_CHARS)
        fields.append(("observation", observation))
    if step.truncated_chars:
        fields.append(("cut", f"{step.truncated_chars} characters cut by the tool registry"))
    if step.final_answer is not None:
        fields.append(("answer", step.final_answer))
    if step.error is not None:
        fields.append(("error", step.error))
    if step.model_output:
        fields.append(("reply", shorten(step.model_output, REPLY_CHARS)))
    fields.extend(reply_facts(step))
    fields.extend(step_facts(step))
    return fields


def _end_fields(view: RunView) -> list[tuple[str, str]]:
    fields = [("state", view.state)]
    if view.stop_reason is not None:
        fields.append(("stop reason", view.stop_reason))
    if view.cancelled_by is not None:
        fields.append(("cancelled by", view.cancelled_by))
    fields.append(("steps", f"{len(view.steps)} ({view.valid_steps} valid)"))
    if (tokens := run_tokens_text(view)) is not None:
        fields.append(("tokens", tokens))
    if view.final_answer is not None:
        fields.append(("final answer", view.final_answer))
    if view.detail is not None:
        fields.append(("detail", view.detail))
    fields.extend(review_facts(view.reviews().get(len(view.steps), [])))
    if (stands := view.where_it_stands()) is not None:
        fields.append(stands)
    return fields


def _fields(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold")
    for label, value in rows:
        # A value keeps its lines, each in the value column, where none passes for a label.
        grid.add_row(Text(f"  {label}"), Text(escape_block(value)))
    return grid
