"""What a run's page in the console adds to ``polyloop show``: the step timeline and
the edited arguments beside the proposed ones, from real runs (and, for exact bar
positions, a real log whose times are set by hand)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from kit.agent import Ledger, answer, definition, request, tool_call
from kit.console import resume
from kit.review import approval_script, review_tools
from polyloop import approve, run
from polyloop.cli._console._run_page import MIN_BAR, WIDTH, edits, timeline
from polyloop.cli._view import RunView
from polyloop.ports import ManagedStore
from polyloop.session import run_status
from polyloop.stores import MemoryStore
from polyloop.types import StepRecord

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)


@pytest.fixture
async def store() -> AsyncIterator[ManagedStore]:
    async with MemoryStore() as opened:
        yield opened


async def view_of(store: ManagedStore, run_id: str) -> RunView:
    return RunView(status=await run_status(store, run_id), log=await store.read_log(run_id))


def timed(
    view: RunView, times: dict[int, tuple[float, float, float | None, float | None]]
) -> RunView:
    """``view`` with its steps' times set: step -> (ends at, seconds, model, tool), in
    seconds from :data:`T0`, the run's start."""
    records = []
    for record in view.log.records:
        if isinstance(record, StepRecord) and record.step in times:
            end, seconds, model, tool = times[record.step]
            record = dataclasses.replace(
                record,
                at=T0 + timedelta(seconds=end),
                duration_s=seconds,
                model_duration_s=model,
                action_duration_s=tool,
            )
        records.append(record)
    log = dataclasses.replace(view.log, records=tuple(records))
    status = dataclasses.replace(view.status, started_at=T0, ended_at=T0 + timedelta(seconds=10))
    return RunView(status=status, log=log)


async def test_each_step_is_a_bar_placed_where_it_began_with_its_model_and_tool_time(
    store: ManagedStore,
) -> None:
    script = [tool_call("double", n=1), tool_call("double", n=2), answer("4")]
    await run(definition(store, script=script), request("r", review_tools(Ledger())))
    view = timed(
        await view_of(store, "r"),
        {0: (2.0, 2.0, 1.5, 0.5), 1: (6.0, 3.0, 1.0, 2.0), 2: (10.0, 1.0, None, None)},
    )
    bars = timeline(view)
    assert [bar.step for bar in bars] == [0, 1, 2]
    # On a scale of 10 s: step 1 began at 3 s and ran 3 s, 1 s of it the model's.
    assert (bars[1].start, bars[1].width) == pytest.approx((300.0, 300.0))
    assert (bars[1].model_width, bars[1].tool_width) == pytest.approx((100.0, 200.0))
    assert bars[1].tool_start == pytest.approx(400.0)
    assert (bars[0].start, bars[0].model_width, bars[0].tool_width) == pytest.approx(
        (0.0, 150.0, 50.0)
    )
    assert (bars[2].start, bars[2].width) == pytest.approx((900.0, 100.0))
    assert bars[1].text == "3.000 s (model 1.000 s, tool 2.000 s)"


async def test_a_step_too_short_to_see_still_gets_a_sliver_and_one_without_time_words(
    store: ManagedStore,
) -> None:
    script = [tool_call("double", n=1), answer("2")]
    await run(definition(store, script=script), request("r", review_tools(Ledger())))
    view = timed(await view_of(store, "r"), {0: (1.0, 0.0001, 0.0001, None)})
    untimed = dataclasses.replace(
        view,
        log=dataclasses.replace(
            view.log,
            records=tuple(
                dataclasses.replace(r, at=None, duration_s=None)
                if isinstance(r, StepRecord) and r.step == 1
                else r
                for r in view.log.records
            ),
        ),
    )
    short, without = timeline(untimed)
    assert short.placed and short.width == MIN_BAR and short.start <= WIDTH
    assert not without.placed and without.text == "no time recorded"


async def test_a_real_run_s_bars_stay_inside_the_timeline(store: ManagedStore) -> None:
    script = [tool_call("double", n=1), tool_call("double", n=2), answer("4")]
    await run(definition(store, script=script), request("r", review_tools(Ledger())))
    bars = timeline(await view_of(store, "r"))
    assert len(bars) == 3 and all(bar.placed for bar in bars)
    starts = [bar.start or 0.0 for bar in bars]
    assert starts == sorted(starts)
    for bar in bars:
        assert 0.0 <= (bar.start or 0.0) <= WIDTH
        assert bar.model_width + bar.tool_width <= bar.width + 1e-6


async def test_an_approval_with_edited_arguments_keeps_both_side_by_side(
    store: ManagedStore,
) -> None:
    await run(definition(store, script=approval_script()), request("r", review_tools(Ledger())))
    await approve(store, "r", by="alice", arguments={"env": "staging"}, result_id=None)
    waiting = edits(await view_of(store, "r"))  # approved, not run yet
    await resume(store, "r", approval_script())
    [edit] = edits(await view_of(store, "r"))
    assert waiting == (edit,)
    assert (edit.step, edit.tool, edit.by, edit.changed) == (1, "deploy", "alice", ("env",))
    assert json.loads(edit.proposed) == {"env": "prod"}
    assert json.loads(edit.approved) == {"env": "staging"}


async def test_an_approval_as_proposed_is_no_edit(store: ManagedStore) -> None:
    await run(definition(store, script=approval_script()), request("r", review_tools(Ledger())))
    await approve(store, "r", by="bob", arguments=None, result_id=None)
    await resume(store, "r", approval_script())
    assert edits(await view_of(store, "r")) == ()
