"""An event sink that turns a run's events into OpenTelemetry spans.

:class:`OpenTelemetrySink` follows the OpenTelemetry semantic conventions for generative
AI: one ``invoke_agent`` span per run attempt, and for every step a ``chat`` span for
its model call and, when the step ran an action, an ``execute_tool`` span. The sink is a
:class:`~polyloop.ports.TracingSink`: a step span starts when its call starts and is the
current span while the call runs, so the spans the model client or a tool starts nest
under it. It ends when the call returns, and gets the attributes of the step's record
when that arrives. A call the run did not make (a reply read back from the log, an
action a person settled) gets its span from the record alone.

A resumed attempt also rebuilds, from the log its ``RUN_RESUMED`` event carries, the
spans of every step the earlier attempts logged, marked ``polyloop.rebuilt``: no attempt
can know what an earlier one exported before its process died.

Every attempt of one run lands in one trace, in any process: the run id determines a
trace id and a span id, and without a current span in the caller's context an
attempt's span is the child of that (never exported) parent. A resumed attempt links
to it, and so does any attempt whose parent is the caller's current span.

Importing this module imports ``opentelemetry`` (the ``polyloop[otel]`` extra, the API
only); nothing else in the library does. The application chooses the SDK, the span
processors and the exporters.

The sink is written in private modules, one job each: ``_sink`` keeps the spans that
are open, ``_steps`` builds a step's spans from its records, ``_spans`` the parts every
span is made of, ``_logged`` walks a log. This module is their one public home.
"""

from polyloop._shared import needs_extra

with needs_extra("polyloop.otel", "otel"):
    from polyloop.otel._sink import OpenTelemetrySink

__all__ = ("OpenTelemetrySink",)


def _claim_public_home() -> None:
    # Defined in a private module to keep each job in its own file; its public home is
    # here, and reprs, pickles and docs should say so.
    OpenTelemetrySink.__module__ = __name__


_claim_public_home()
