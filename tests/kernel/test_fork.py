"""Forks of recorded runs (issue 32), on the memory store: what a fork takes over, what
it sends first, what it never runs again, and what it refuses."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from kit.fork import without_run_id
from polyloop import (
    Budget,
    CorruptLog,
    Injection,
    InvalidRequest,
    Message,
    ModelCall,
    ModelReply,
    Replay,
    RunAlreadyExists,
    RunLocked,
    RunLog,
    RunNotFound,
    RunStarted,
    StepRecord,
    StopReason,
    Usage,
    fork,
    recover,
    resume,
    run,
    start_or_resume,
)
from polyloop._recovery import read_plan
from polyloop.serialization import dumps, encode, loads
from polyloop.session._forking import inherited_digest
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash, without_timing

pytestmark = pytest.mark.anyio

SCRIPT = [
    tool_call("double", n=1),
    tool_call("double", n=2),
    tool_call("double", n=3),
    tool_call("double", n=4),
    tool_call("submit", answer="8"),
]


async def recorded(store: MemoryStore, ledger: Ledger, script: list[str] = SCRIPT) -> Any:
    model = ScriptedModelClient(script)
    result = await run(definition(store, model=model), request("src", make_tools(ledger)))
    assert result.stop_reason in (StopReason.SUBMITTED, StopReason.FINAL_ANSWER)
    return result, model


async def test_a_fork_of_the_same_request_sends_the_source_s_messages_and_runs_nothing_again() -> (
    None
):
    store, ledger = MemoryStore(), Ledger()
    source, source_model = await recorded(store, ledger)
    before = list(ledger.calls)
    model = ScriptedModelClient(SCRIPT)
    forked = await fork(
        definition(store, model=model),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=2,
    )
    assert forked.stop_reason is StopReason.SUBMITTED and not forked.resumed
    # Inherited: the source's steps as they were (the run id aside).
    assert [dataclasses.replace(step, run_id="src") for step in forked.steps[:2]] == list(
        source.steps[:2]
    )
    assert without_run_id(forked.steps) == without_run_id(source.steps)
    # Its first model call is the source's call at step 2, message for message.
    first = model.calls[0]
    assert first.call_index == 2 and first.result_id == "f:2:model"
    assert first.messages == source_model.calls[2].messages
    # The inherited steps' effects ran once, in the source, and never again.
    assert ledger.calls[: len(before)] == before
    assert [rid for _, rid in ledger.calls[len(before) :]] == [
        "f:2:action",
        "f:3:action",
        "f:4:action",
    ]
    assert forked.step_count == 5 and forked.valid_step_count == 5


async def test_the_fork_s_start_record_names_its_source_and_holds_its_copies() -> None:
    store, ledger = MemoryStore(), Ledger()
    source, _ = await recorded(store, ledger)
    await fork(
        definition(store, script=SCRIPT),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=3,
    )
    log = await store.read_log("f")
    started = log.records[0]
    assert isinstance(started, RunStarted)
    assert (started.forked_from, started.forked_at_step) == ("src", 3)
    assert started.inherited_sha256 == inherited_digest(source.steps[:3])
    assert [step.run_id for step in started.inherited_steps] == ["f", "f", "f"]
    assert [step.step for step in started.inherited_steps] == [0, 1, 2]
    assert loads(dumps(started)) == started
    plan = read_plan(log)
    assert [step.step for step in plan.steps] == [0, 1, 2, 3, 4]
    # The fork stands alone: its log is all it needs, with the source gone.
    alone = MemoryStore()
    for record in log.records:
        await _copy(alone, record)
    assert len(read_plan(await alone.read_log("f")).steps) == 5


async def _copy(store: MemoryStore, record: Any) -> None:
    # Records copied one by one into a store that never held the source.
    from polyloop.types import Intent, Result, RunEnded, StepRecord

    if isinstance(record, RunStarted):
        await store.claim_run(record.run_id)
        await store.start_run(record)
    elif isinstance(record, Intent):
        await store.write_intent(record)
    elif isinstance(record, Result):
        await store.write_result(record)
    elif isinstance(record, StepRecord):
        await store.write_step(record, None)
    elif isinstance(record, RunEnded):
        await store.end_run(record)


FORK_FIXTURE = (
    Path(__file__).parent.parent / "fixtures" / "records" / "v1" / "run_started_fork.json"
)


def fixture_steps(*outputs: str) -> tuple[StepRecord, ...]:
    """The inherited steps of the fork fixture, the first given each model output."""
    started = loads(FORK_FIXTURE.read_text(encoding="utf-8"))
    assert isinstance(started, RunStarted) and len(started.inherited_steps) == 2
    first, second = started.inherited_steps
    return (*(dataclasses.replace(first, model_output=text) for text in outputs), second)


def listed(steps: tuple[StepRecord, ...], *, ascii: bool) -> str:
    return json.dumps(
        [encode(step) for step in steps], ensure_ascii=ascii, sort_keys=True, separators=(",", ":")
    )


def test_the_digest_of_steps_utf8_can_encode_is_that_of_their_canonical_json() -> None:
    # The digest forks have always recorded: it must not change for them.
    steps = fixture_steps("Reading.", "caf\u00e9 \u2028 \u2615 \U0001f600")
    expected = hashlib.sha256(listed(steps, ascii=False).encode("utf-8")).hexdigest()
    assert inherited_digest(steps) == expected
    assert inherited_digest(steps[:1]) == (
        "a0584f8308b037fde6d869ef606a48a5e7ab4b885663641866a7f54f65c05e58"
    )
    assert inherited_digest(()) == hashlib.sha256(b"[]").hexdigest()


def test_a_step_holding_a_lone_surrogate_is_hashed_as_the_codec_writes_it() -> None:
    half, *others = fixture_steps("half an emoji: \ud83d", "caf\u00e9")
    # The record holding the surrogate in the codec's all-ASCII form; the others as always.
    line = dumps(half)
    assert line.isascii() and "\\ud83d" in line
    text = "[" + ",".join((line, listed(tuple(others), ascii=False)[1:-1])) + "]"
    assert inherited_digest((half, *others)) == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert inherited_digest((half, *others)) != inherited_digest(
        fixture_steps("half an emoji: ", "caf\u00e9")
    )


async def test_a_fork_onto_another_model_and_injection_differs_only_where_they_say() -> None:
    store, ledger = MemoryStore(), Ledger()
    _, source_model = await recorded(store, ledger)
    before = len(ledger.calls)
    other = ScriptedModelClient(SCRIPT, name="other")
    injected = Injection(entries={"system": ("Prefer small numbers.",)})
    await fork(
        definition(store, model=other),
        request("f", make_tools(ledger), injection=injected),
        source_run_id="src",
        at_step=2,
    )
    sent, was = other.calls[0].messages, source_model.calls[2].messages
    assert len(sent) == len(was) + 1
    extra = [message for message in sent if message not in was]
    assert extra == [Message.text(was[0].role, "Prefer small numbers.")]
    assert [message for message in sent if message not in extra] == list(was)
    assert [rid for _, rid in ledger.calls[before:]] == ["f:2:action", "f:3:action", "f:4:action"]


async def test_budgets_count_the_inherited_steps() -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger)
    budget = Budget(max_steps=4, max_valid_steps=20, max_context_chars=100_000)
    forked = await fork(
        definition(store, script=SCRIPT),
        request("f", make_tools(ledger), budget=budget),
        source_run_id="src",
        at_step=3,
    )
    assert forked.stop_reason is StopReason.STEP_LIMIT and forked.step_count == 4


async def test_a_fork_at_step_0_and_a_fork_of_a_fork() -> None:
    store, ledger = MemoryStore(), Ledger()
    source, _ = await recorded(store, ledger)
    zero = await fork(
        definition(store, script=SCRIPT),
        request("f0", make_tools(ledger)),
        source_run_id="src",
        at_step=0,
    )
    assert without_run_id(zero.steps) == without_run_id(source.steps)
    again = await fork(
        definition(store, script=SCRIPT),
        request("ff", make_tools(ledger)),
        source_run_id="f0",
        at_step=4,
    )
    assert without_run_id(again.steps) == without_run_id(source.steps)
    started = (await store.read_log("ff")).records[0]
    assert isinstance(started, RunStarted) and started.forked_from == "f0"


@pytest.mark.parametrize("writes", range(1, 12))
async def test_a_fork_crashed_after_any_write_resumes_to_the_uninterrupted_fork(
    writes: int,
) -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger)
    # Replay allowed, so that every crash point resumes (none leaves an effect in doubt).
    tools = make_tools(ledger, replay=Replay.ALLOWED)

    def forked(run_id: str) -> Any:
        return request(run_id, tools, model_replay=Replay.ALLOWED)

    whole = await fork(
        definition(store, script=SCRIPT), forked("whole"), source_run_id="src", at_step=2
    )
    source_calls = len([rid for _, rid in ledger.calls if rid.startswith("src:")])
    try:
        await fork(
            definition(FaultyStore(store, fail_after_writes=writes), script=SCRIPT),
            forked("f"),
            source_run_id="src",
            at_step=2,
        )
    except SimulatedCrash:
        await store.release_run("f")
    resumed = await resume(definition(store, script=SCRIPT), forked("f"))
    assert without_run_id(resumed.steps) == without_run_id(whole.steps)
    assert resumed.stop_reason is whole.stop_reason
    assert {rid for _, rid in ledger.calls if rid.startswith("f:")} == {
        "f:2:action",
        "f:3:action",
        "f:4:action",
    }
    assert len([rid for _, rid in ledger.calls if rid.startswith("src:")]) == source_calls
    started = without_timing((await store.read_log("f")).records[0])
    whole_started = without_timing((await store.read_log("whole")).records[0])
    assert isinstance(started, RunStarted) and isinstance(whole_started, RunStarted)
    assert started.inherited_sha256 == whole_started.inherited_sha256
    assert without_run_id(started.inherited_steps) == without_run_id(whole_started.inherited_steps)


async def test_an_unfinished_or_in_doubt_source_gives_only_its_completed_steps() -> None:
    store, ledger = MemoryStore(), Ledger()
    with pytest.raises(SimulatedCrash):
        # Crashed after the third step's action intent (replay never): in doubt at step 2.
        await run(
            definition(FaultyStore(store, fail_after_writes=12), script=SCRIPT),
            request("src", make_tools(ledger)),
        )
    await store.release_run("src")
    assert len(read_plan(await store.read_log("src")).steps) == 2
    with pytest.raises(InvalidRequest, match=r"step 3: run 'src' has 2 completed steps") as info:
        await fork(
            definition(store, script=SCRIPT),
            request("f", make_tools(ledger)),
            source_run_id="src",
            at_step=3,
        )
    assert info.value.run_id == "f"
    assert (await store.read_log("f")).records == ()
    forked = await fork(
        definition(store, script=SCRIPT),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=2,
    )
    assert forked.stop_reason is StopReason.SUBMITTED
    # The source is still in doubt and untouched: a fork never claims or writes it.
    source_after = await resume(
        definition(store, script=SCRIPT), request("src", make_tools(ledger))
    )
    assert source_after.stop_reason is StopReason.IN_DOUBT


async def test_what_a_fork_refuses() -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger)
    defined, tools = definition(store, script=SCRIPT), make_tools(ledger)
    with pytest.raises(RunNotFound, match="no record") as missing:
        await fork(defined, request("f", tools), source_run_id="nope", at_step=0)
    assert missing.value.run_id == "nope"
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(InvalidRequest, match="at_step must be a whole number"):
            await fork(defined, request("f", tools), source_run_id="src", at_step=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="source_run_id must be a non-empty string"):
        await fork(defined, request("f", tools), source_run_id="", at_step=0)
    with pytest.raises(InvalidRequest, match="its own run id"):
        await fork(defined, request("src", tools), source_run_id="src", at_step=0)
    with pytest.raises(InvalidRequest, match="step 6: run 'src' has 5 completed steps"):
        await fork(defined, request("f", tools), source_run_id="src", at_step=6)
    await fork(defined, request("f", tools), source_run_id="src", at_step=5)
    with pytest.raises(RunAlreadyExists):
        await fork(defined, request("f", tools), source_run_id="src", at_step=1)
    assert (await store.read_log("nope")).records == ()


async def test_a_fork_whose_last_inherited_step_ended_the_source_goes_on_after_it() -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger, [tool_call("double", n=1), answer("2")])
    model = ScriptedModelClient([tool_call("double", n=1), answer("2"), answer("still 2")])
    forked = await fork(
        definition(store, model=model),
        request("f", make_tools(ledger, replay=Replay.ALLOWED)),
        source_run_id="src",
        at_step=2,
    )
    assert forked.stop_reason is StopReason.FINAL_ANSWER
    assert forked.final_answer == "still 2" and forked.step_count == 3


async def test_a_fork_reads_a_source_another_writer_holds_and_writes_nothing_to_it() -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger)
    before = (await store.read_log("src")).records
    await store.claim_run("src")  # as a live worker driving the source would
    forked = await fork(
        definition(store, script=SCRIPT),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=2,
    )
    assert forked.stop_reason is StopReason.SUBMITTED
    # The claim is still the other writer's, and the source's log is as it was.
    with pytest.raises(RunLocked):
        await store.claim_run("src")
    assert (await store.read_log("src")).records == before


async def test_a_fork_s_snapshot_is_its_own_and_its_log_resumes_without_the_source() -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger)
    injected = Injection(entries={"system": ("Prefer small numbers.",)})
    forked = await fork(
        definition(store, model=ScriptedModelClient(SCRIPT, name="other")),
        request("f", make_tools(ledger), injection=injected),
        source_run_id="src",
        at_step=2,
    )
    snapshots = [(await store.read_log(run_id)).records[0] for run_id in ("src", "f")]
    source_snapshot, fork_snapshot = (
        started.snapshot for started in snapshots if isinstance(started, RunStarted)
    )
    differing = {key for key in fork_snapshot if fork_snapshot[key] != source_snapshot.get(key)}
    assert differing == {"model.name", "injection.sha256"}
    # In a store that never held the source, the fork's log alone gives back its result.
    alone = MemoryStore()
    for record in (await store.read_log("f")).records:
        await _copy(alone, record)
    again = await resume(
        definition(alone, model=ScriptedModelClient(SCRIPT, name="other")),
        request("f", make_tools(ledger), injection=injected),
    )
    assert without_run_id(again.steps) == without_run_id(forked.steps)
    assert again.stop_reason is StopReason.SUBMITTED and (await alone.read_log("src")).records == ()


async def test_a_fork_s_usage_and_token_budget_count_the_inherited_steps() -> None:
    def reported(call: ModelCall) -> ModelReply:
        content = SCRIPT[call.call_index]
        usage = Usage(input_tokens=10, output_tokens=5)
        return ModelReply(
            call_id=f"{call.run_id}/{call.call_index}", content=content, reasoning=None, usage=usage
        )

    store, ledger = MemoryStore(), Ledger()
    model = ScriptedModelClient(reported)
    await run(definition(store, model=model), request("src", make_tools(ledger)))
    budget = Budget(max_steps=20, max_valid_steps=20, max_context_chars=100_000, max_tokens=50)
    forked = await fork(
        definition(store, model=model),
        request("f", make_tools(ledger), budget=budget),
        source_run_id="src",
        at_step=3,
    )
    # Three inherited steps (45 tokens) and one of its own reach the budget of 50.
    assert forked.stop_reason is StopReason.TOKEN_LIMIT and forked.step_count == 4
    assert forked.usage == Usage(input_tokens=40, output_tokens=20)


async def test_a_start_record_whose_fork_fields_disagree_is_a_corrupt_log() -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger)
    await fork(
        definition(store, script=SCRIPT),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=2,
    )
    started = (await store.read_log("f")).records[0]
    assert isinstance(started, RunStarted) and started.inherited is not None
    first, second = started.inherited
    broken = [
        (
            "must name its source, its step and its digest",
            dataclasses.replace(started, inherited_sha256=None),
        ),
        (
            "a fork at step 2 whose start record holds 1 inherited steps",
            dataclasses.replace(started, inherited=(first,)),
        ),
        (
            "inherited step 0 is step 1 of run 'f'",
            dataclasses.replace(started, inherited=(second, first)),
        ),
        (
            "inherited step 1 is step 1 of run 'src'",
            dataclasses.replace(
                started, inherited=(first, dataclasses.replace(second, run_id="src"))
            ),
        ),
        (
            "a start record holding an inherited snapshot but no inherited steps",
            dataclasses.replace(started, inherited=None, forked_at_step=0),
        ),
    ]
    # What the fork inherited ran under the source's snapshot at step 2 (never amended).
    source_started = (await store.read_log("src")).records[0]
    assert isinstance(source_started, RunStarted)
    assert started.inherited_snapshot == source_started.snapshot
    for reason, record in broken:
        with pytest.raises(CorruptLog, match=re.escape(reason)):
            read_plan(RunLog(run_id="f", records=(record,)))


async def test_a_source_waiting_for_approval_gives_its_completed_steps() -> None:
    from kit.review import approval_script, review_tools

    store, ledger = MemoryStore(), Ledger()
    paused = await run(
        definition(store, script=approval_script()), request("src", review_tools(ledger))
    )
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL and paused.step_count == 1
    with pytest.raises(InvalidRequest, match=r"step 2: run 'src' has 1 completed steps"):
        await fork(
            definition(store, script=approval_script()),
            request("f", review_tools(ledger)),
            source_run_id="src",
            at_step=2,
        )
    # Forked after step 0 onto tools that ask no approval: the fork deploys on its own.
    forked = await fork(
        definition(store, script=approval_script()),
        request("f", review_tools(ledger, needs_approval=False)),
        source_run_id="src",
        at_step=1,
    )
    assert forked.stop_reason is StopReason.FINAL_ANSWER
    assert [name for name, rid in ledger.calls if rid.startswith("f:")] == ["deploy"]
    assert (
        await resume(
            definition(store, script=approval_script()), request("src", review_tools(ledger))
        )
    ).stop_reason is StopReason.AWAITING_APPROVAL


async def test_start_or_resume_and_recover_continue_a_crashed_fork() -> None:
    store, ledger = MemoryStore(), Ledger()
    await recorded(store, ledger)
    tools = make_tools(ledger, replay=Replay.ALLOWED)
    for run_id in ("a", "b"):
        with pytest.raises(SimulatedCrash):
            await fork(
                definition(FaultyStore(store, fail_after_writes=3), script=SCRIPT),
                request(run_id, tools, model_replay=Replay.ALLOWED),
                source_run_id="src",
                at_step=2,
            )
        await store.release_run(run_id)
    again = await start_or_resume(
        definition(store, script=SCRIPT), request("a", tools, model_replay=Replay.ALLOWED)
    )
    assert again.resumed and again.stop_reason is StopReason.SUBMITTED
    recovered = await recover(
        definition(store, script=SCRIPT),
        store,
        lambda run_id: request(run_id, tools, model_replay=Replay.ALLOWED),
        max_concurrent=2,
    )
    assert [(r.run_id, r.result and r.result.stop_reason) for r in recovered] == [
        ("b", StopReason.SUBMITTED)
    ]
    for run_id in ("a", "b"):
        started = (await store.read_log(run_id)).records[0]
        assert isinstance(started, RunStarted) and started.forked_from == "src"


class StartNeverLands(MemoryStore):
    """A memory store whose start writes never finish once ``hold`` is set."""

    hold = False

    async def start_run(self, record: RunStarted) -> None:
        if self.hold:
            await anyio.sleep_forever()
        await super().start_run(record)


async def test_a_fork_cancelled_before_its_start_record_landed_leaves_nothing() -> None:
    store, ledger = StartNeverLands(), Ledger()
    await recorded(store, ledger)
    store.hold = True
    with anyio.move_on_after(0.05) as scope:
        await fork(
            definition(store, script=SCRIPT),
            request("f", make_tools(ledger)),
            source_run_id="src",
            at_step=2,
        )
    assert scope.cancelled_caught
    assert (await store.read_log("f")).records == ()
    assert not [rid for _, rid in ledger.calls if rid.startswith("f:")]
    with pytest.raises(RunNotFound):
        await resume(definition(store, script=SCRIPT), request("f", make_tools(ledger)))
