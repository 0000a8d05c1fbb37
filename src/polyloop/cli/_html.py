"""A run's trajectory as one self-contained HTML page: inline CSS, no scripts, no links.

The web console shows the same sections (:func:`sections`) inside its own page.

Every piece of text from the log goes through :func:`html.escape`, so a model output
holding markup is shown, never interpreted; a lone surrogate, a control character or a
bidirectional override is shown as its escape, by the terminal's own functions: a value
of one line (the run id, the headline of an action in doubt) as ``polyloop show`` prints
it, a block as its fields are printed.
"""

from __future__ import annotations

import json
from html import escape

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
from polyloop.cli._render import status_of
from polyloop.cli._snapshots import snapshots, step_snapshot_text
from polyloop.cli._view import RunView, reply_facts, review_facts, state_detail
from polyloop.types import Review, StepRecord

CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 60rem;
       padding: 0 1rem; color: #1d1d1f; background: #fcfcfc; }
h1 { font-size: 1.4rem; word-break: break-all; }
section { border: 1px solid #d8d8dc; border-radius: 6px; margin: 1rem 0;
          padding: 0.5rem 1rem; background: #fff; }
h2 { font-size: 1.05rem; margin: 0.4rem 0; }
dl { display: grid; grid-template-columns: 9rem 1fr; gap: 0.3rem 1rem; margin: 0.5rem 0; }
dt { color: #6e6e73; }
dd { margin: 0; min-width: 0; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 0.9rem;
      background: #f4f4f6; padding: 0.4rem; border-radius: 4px; }
.good { color: #1a7f37; } .warn { color: #9a6700; } .bad { color: #cf222e; }
summary { cursor: pointer; color: #6e6e73; }
#in-doubt { border: 2px solid #cf222e; background: #fff1f0; }
#in-doubt h2 { color: #cf222e; font-size: 1.25rem; }
.tag { font-size: 0.8rem; padding: 0.05rem 0.4rem; border-radius: 3px;
       background: #ddf4ff; color: #0550ae; }
""".strip()

_STYLE_CLASSES = {"green": "good", "yellow": "warn", "red": "bad"}
_STATE_CLASSES = {
    "finished": "good",
    "running": "warn",
    "resumable": "warn",
    "in doubt": "bad",
    "awaiting approval": "warn",
}


def page(view: RunView) -> str:
    """The whole HTML document for ``view``."""
    # One line, escaped as the terminal's first line is: a newline would read as a space.
    title = f"polyloop run {escape_field(view.run_id)}"
    document = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n<style>\n{CSS}\n</style>\n</head>\n<body>\n"
        f"<h1>{escape(title)}</h1>\n{sections(view)}\n</body>\n</html>\n"
    )
    # Our markup holds no control or bidirectional character: any left came from the log,
    # and is shown as its escape (a lone surrogate too, since the page is UTF-8).
    return escape_block(document)


def sections(view: RunView) -> str:
    """The run's facts as HTML sections, every text from the log escaped: the body of
    :func:`page`, and what the web console shows of a run."""
    body = []
    if (doubt := in_doubt(view)) is not None:
        body.append(_doubt(doubt))  # first, before anything that could read as a success
    body.append(_summary(view))
    reviews = view.reviews()
    body.extend(
        _step(
            step,
            reviews.get(step.step, []),
            step_inherited_text(view, step),
            step_snapshot_text(view, step),
        )
        for step in view.steps
    )
    body.append(_end(view))
    body.append(_snapshot(view))
    return escape_block("\n".join(body))


def _doubt(doubt: Doubt) -> str:
    rows = [
        (label, _pre(text) if label == "arguments" else escape(text))
        for label, text in doubt.fields()
    ]
    return (
        f'<section id="in-doubt">\n<h2>IN DOUBT</h2>\n'
        f"<p><strong>{escape(escape_field(doubt.headline().removeprefix('IN DOUBT: ')))}"
        "</strong></p>\n"
        f"{_dl(rows)}\n</section>"
    )


def _summary(view: RunView) -> str:
    rows = [
        ("state", _state(view)),
        ("meaning", escape(state_text(view))),
        ("stop reason", escape(view.stop_reason or "-")),
        ("steps", escape(f"{len(view.steps)} ({view.valid_steps} valid)")),
        ("records", escape(str(view.records))),
    ]
    rows.extend((label, escape(text)) for label, text in run_facts(view))
    return f'<section id="summary">\n{_dl(rows)}\n</section>'


def _step(step: StepRecord, reviews: list[Review], inherited: str | None, under: str | None) -> str:
    status, style = status_of(step)
    heading = (
        f"step {step.step} · {escape(step.decision.value)} · {_span(status, _STYLE_CLASSES[style])}"
    )
    if inherited is not None:
        heading += ' <span class="tag">inherited</span>'
    if step.resumed:
        heading += ' <span class="tag">resumed</span>'
    rows = [("decision", escape(step.decision.value))]
    if step.action_text is not None:
        rows.append(("action", _pre(step.action_text)))
    rows.append(("status", escape(status)))
    if step.observation is not None:
        rows.append(("observation", _pre(step.observation)))
    if step.truncated_chars:
        rows.append(("cut", escape(f"{step.truncated_chars} characters")))
    if step.final_answer is not None:
        rows.append(("final answer", _pre(step.final_answer)))
    if step.error is not None:
        rows.append(("error", _pre(step.error)))
    rows.append(("model output", _details("reply", step.model_output)))
    if step.reasoning is not None:
        rows.append(("reasoning", _details("reasoning", step.reasoning)))
    rows.extend((label, escape(text)) for label, text in reply_facts(step))
    rows.extend((label, escape(text)) for label, text in step_facts(step))
    # The same words as the terminal's: who approved, rejected or settled, when, and
    # for a settlement whether the action ran.
    rows.extend((label, escape(text)) for label, text in review_facts(reviews))
    if inherited is not None:
        rows.append(("inherited", escape(inherited)))
    if under is not None:
        rows.append(("snapshot", escape(under)))
    if step.call_id is not None:
        rows.append(("call id", escape(step.call_id)))
    css_class = "step inherited" if inherited is not None else "step"
    return (
        f'<section class="{css_class}" id="step-{step.step}">\n'
        f"<h2>{heading}</h2>\n{_dl(rows)}\n</section>"
    )


def _end(view: RunView) -> str:
    rows = [("state", _state(view))]
    if view.stop_reason is not None:
        rows.append(("stop reason", escape(view.stop_reason)))
    if view.cancelled_by is not None:
        rows.append(("cancelled by", escape(view.cancelled_by)))
    if view.final_answer is not None:
        rows.append(("final answer", _pre(view.final_answer)))
    if (tokens := run_tokens_text(view)) is not None:
        rows.append(("tokens", escape(tokens)))
    if view.detail is not None:
        rows.append(("detail", _pre(view.detail)))
    rows.extend(
        (label, escape(text))
        for label, text in review_facts(view.reviews().get(len(view.steps), []))
    )
    if (stands := view.where_it_stands()) is not None:
        rows.append((stands[0], escape(stands[1])))
    return f'<section id="end">\n<h2>end</h2>\n{_dl(rows)}\n</section>'


def _state(view: RunView) -> str:
    """The state's word, coloured, and its detail as ``polyloop runs`` prints it."""
    detail = state_detail(view.status)
    shown = _span(view.state, _STATE_CLASSES[view.state])
    return shown if detail is None else f"{shown} {escape(f'({detail})')}"


def _snapshot(view: RunView) -> str:
    text = json.dumps(view.snapshot, indent=2, sort_keys=True, ensure_ascii=False)
    parts = [_details("what the run was started with", text)]
    held = snapshots(view)
    if len(held) > 1:
        now = json.dumps(held[-1], indent=2, sort_keys=True, ensure_ascii=False)
        parts.append(_details("what it goes on under, as amended", now))
    return f'<section id="snapshot">\n<h2>snapshot</h2>\n{"".join(parts)}\n</section>'


def _dl(rows: list[tuple[str, str]]) -> str:
    """A definition list; the values are HTML already escaped by the caller."""
    items = "\n".join(f"<dt>{escape(label)}</dt><dd>{value}</dd>" for label, value in rows)
    return f"<dl>\n{items}\n</dl>"


def _pre(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def _span(text: str, css_class: str) -> str:
    return f'<span class="{css_class}">{escape(text)}</span>'


def _details(summary: str, text: str) -> str:
    return f"<details><summary>{escape(summary)}</summary>{_pre(text)}</details>"
