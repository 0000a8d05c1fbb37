"""The contract every :class:`~polyloop.ports.ActionExecutor` keeps, as reusable pytest classes.

Subclass :class:`ActionExecutorContract` in a test module and provide three fixtures:
``executor``, the executor under test; ``good_action``, an
:class:`~polyloop.ports.Action` it performs (``EXECUTED``); and ``refused_action``, one
it refuses without performing (``NOT_EXECUTED``: an unknown tool, arguments its schema
rejects). Every test then runs against your executor, under each ``anyio_backend`` your
test session parametrizes::

    class TestMyExecutor(ActionExecutorContract):
        @pytest.fixture
        def executor(self):
            return MyEnvironment().executor()

        @pytest.fixture
        def good_action(self):
            return Action(payload={"name": "echo", "arguments": {"text": "hi"}},
                          action_text="echo(hi)", history_text="echo hi")

        @pytest.fixture
        def refused_action(self):
            return Action(payload={"name": "no-such-tool", "arguments": {}},
                          action_text="no-such-tool()", history_text="no-such-tool")

Three fixtures are optional, and have defaults here (``None``, which skips the test
that needs them):

* ``faulting_action``: an action whose environment is broken, which the executor
  reports as ``ENV_FAULT`` rather than raising;
* ``slow_executor``: an executor of the same kind that performs ``good_action`` until
  it is cancelled, so the suite can cancel an execution in flight;
* ``seen_result_ids``: a function returning, in order, the result ids your executor
  handed to what performed the actions (your tool's handler, your environment), so the
  suite can check ``result_id`` reaches it unchanged.

An executor that is also a :class:`~polyloop.ports.ReconcilingExecutor` is asked
about ``good_action`` and ``refused_action`` too: ``reconciles`` must answer a bool,
and ``reconcile``, where it is asked, ``Reconciled`` or ``None``.

The suite's result ids have the form the library gives them, ``"<run_id>:<step>:action"``.
The tests need pytest and anyio's pytest plugin (installed with anyio).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from polyloop.ports import Action, ActionExecutor, ActionOutcome, ReconcilingExecutor
from polyloop.testing._contract_checks import (
    assert_cancelled_before_start,
    assert_cancelled_in_flight,
)
from polyloop.types import ActionStatus, Reconciled, Replay

__all__ = ("ActionExecutorContract", "assert_well_formed_outcome")

SeenResultIds = Callable[[], list[str]]


def assert_well_formed_outcome(outcome: object) -> ActionOutcome:
    """``outcome`` is an :class:`ActionOutcome` whose every field has its declared type."""
    assert isinstance(outcome, ActionOutcome), f"execute() returned {type(outcome).__name__}"
    assert isinstance(outcome.status, ActionStatus), "status must be an ActionStatus"
    assert isinstance(outcome.observation, str), "observation must be a string"
    assert isinstance(outcome.synthesized, bool), "synthesized must be a bool"
    assert isinstance(outcome.done, bool), "done must be a bool"
    cut = outcome.truncated_chars
    assert isinstance(cut, int) and not isinstance(cut, bool) and cut >= 0, (
        f"truncated_chars must be an integer >= 0, not {cut!r}"
    )
    return outcome


@pytest.mark.anyio
class ActionExecutorContract:
    """Tests every action executor passes.

    Provide ``executor``, ``good_action`` and ``refused_action`` fixtures.
    """

    @pytest.fixture
    def faulting_action(self) -> Action | None:
        return None

    @pytest.fixture
    def slow_executor(self) -> ActionExecutor | None:
        return None

    @pytest.fixture
    def seen_result_ids(self) -> SeenResultIds | None:
        return None

    async def test_satisfies_the_seam(self, executor: ActionExecutor) -> None:
        assert isinstance(executor, ActionExecutor)

    async def test_a_good_action_is_executed(
        self, executor: ActionExecutor, good_action: Action
    ) -> None:
        outcome = assert_well_formed_outcome(
            await executor.execute(good_action, result_id="contract:0:action")
        )
        assert outcome.status is ActionStatus.EXECUTED, outcome

    async def test_a_refused_action_is_a_status_not_an_exception(
        self, executor: ActionExecutor, refused_action: Action
    ) -> None:
        outcome = assert_well_formed_outcome(
            await executor.execute(refused_action, result_id="contract:0:action")
        )
        assert outcome.status is ActionStatus.NOT_EXECUTED, outcome

    async def test_a_broken_environment_is_a_status_not_an_exception(
        self, executor: ActionExecutor, faulting_action: Action | None
    ) -> None:
        if faulting_action is None:
            pytest.skip("no faulting_action: the executor has no fault to report")
        outcome = assert_well_formed_outcome(
            await executor.execute(faulting_action, result_id="contract:0:action")
        )
        assert outcome.status is ActionStatus.ENV_FAULT, outcome

    async def test_the_result_id_is_passed_through(
        self,
        executor: ActionExecutor,
        good_action: Action,
        seen_result_ids: SeenResultIds | None,
    ) -> None:
        # A replay after a crash passes the same id again; both executions take it.
        for result_id in ("contract:3:action", "contract:3:action", "other-run:0:action"):
            assert_well_formed_outcome(await executor.execute(good_action, result_id=result_id))
        if seen_result_ids is not None:
            assert seen_result_ids()[-3:] == [
                "contract:3:action",
                "contract:3:action",
                "other-run:0:action",
            ]

    async def test_every_action_has_a_replay_policy(
        self,
        executor: ActionExecutor,
        good_action: Action,
        refused_action: Action,
        faulting_action: Action | None,
    ) -> None:
        for action in (good_action, refused_action, faulting_action):
            if action is not None:
                policy = executor.replay(action)
                assert isinstance(policy, Replay), f"replay() returned {policy!r}"
                assert executor.replay(action) is policy, "replay() must not change its mind"

    async def test_an_execution_in_a_cancelled_scope_lets_the_cancellation_out(
        self, executor: ActionExecutor, good_action: Action
    ) -> None:
        await assert_cancelled_before_start(
            lambda: executor.execute(good_action, result_id="contract:0:action")
        )

    async def test_cancelling_an_execution_in_flight_propagates(
        self, slow_executor: ActionExecutor | None, good_action: Action
    ) -> None:
        if slow_executor is None:
            pytest.skip("no slow_executor: an execution in flight cannot be cancelled")
        await assert_cancelled_in_flight(
            lambda: slow_executor.execute(good_action, result_id="contract:0:action")
        )

    async def test_a_reconciling_executor_answers_what_it_may_be_asked(
        self, executor: ActionExecutor, good_action: Action, refused_action: Action
    ) -> None:
        if not isinstance(executor, ReconcilingExecutor):
            pytest.skip("not a ReconcilingExecutor: it has no probe to ask")
        for action in (good_action, refused_action):
            asked = executor.reconciles(action)
            assert isinstance(asked, bool), f"reconciles() returned {asked!r}"
            assert executor.reconciles(action) is asked, "reconciles() must not change its mind"
            if asked:
                answer = await executor.reconcile(action, result_id="contract:0:action")
                assert answer is None or (
                    isinstance(answer, Reconciled)
                    and isinstance(answer.ran, bool)
                    and isinstance(answer.observation, str)
                ), f"reconcile() returned {answer!r:.80}, not Reconciled or None"
