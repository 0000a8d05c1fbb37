"""Code as action: the model writes Python, a subprocess runs it, the environment decides.

What it shows
    * the ready-made :class:`~polyloop.interpreters.CodeBlockInterpreter`: a reply's one
      fenced ``python`` block is the action, with the payload ``{"code": ...}``; a reply
      without one (or with two, or with text after the block) is an invalid decision,
      and the feedback tells the model what was wrong. It has no final-answer marker
      here, so the model has no way to declare the task finished;
    * an :class:`~polyloop.ActionExecutor` of your own, not derived from a tool
      registry: it runs the code with ``anyio.run_process([sys.executable, "-c", code])``
      in the task's working directory, under ``anyio.fail_after(time_limit)``, and feeds
      the combined output back as the observation;
    * the done signal coming from the environment, never from the model: the task is
      solved when ``answer.txt`` in the working directory holds the right total, which
      the executor checks after every run of the code. A model that merely *says* it
      is done has made an invalid decision, and the run goes on.

How the executor reports each case (``ActionOutcome``):

=====================================  ===============  ===========  ====================
case                                   status           synthesized  observation
=====================================  ===============  ===========  ====================
the code ran (any exit status)         ``EXECUTED``     no           its stdout and stderr
the code ran past the time limit       ``EXECUTED``     yes          ``TimeoutError: ...``
the payload holds no code              ``NOT_EXECUTED`` yes          the reason
the interpreter could not be started   ``ENV_FAULT``    yes          the ``OSError``
=====================================  ===============  ===========  ====================

A snippet that runs too long is the snippet's fault, like a tool that raises: the model
sees a ``TimeoutError`` observation it can react to, and the step counts as a valid
one, so a model cannot loop on slow code for free. Failing to start Python at all is
the environment's fault, and ends the run with ``ENV_FAILURE``. Code may have side
effects outside the working directory, so the executor's replay policy is ``NEVER``:
after a crash between announcing the code and recording its output, ``resume`` stops
``IN_DOUBT`` instead of running it twice.

The model is scripted (deterministic, offline). It looks at the data, writes a loop
that outlives the time limit, writes code with a bug, claims to be finished without
code, and finally writes the answer file.

How to run it::

    python examples/code_as_action.py [--time-limit SECONDS] [--backend trio]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio

from polyloop import (
    Action,
    ActionOutcome,
    ActionStatus,
    Budget,
    Definition,
    Injection,
    Message,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    RunResult,
    ToolRegistry,
    ToolStyle,
    run,
)
from polyloop.interpreters import CodeBlockInterpreter
from polyloop.stores import MemoryStore
from polyloop.testing import ScriptedModelClient

SALES_CSV = "region,units\nnorth,120\nnorth,80\nsouth,45\nsouth,55\nsouth,100\n"
EXPECTED_TOTAL = "400"
ANSWER_FILE = "answer.txt"
MAX_OBSERVATION_CHARS = 2_000


class SubprocessPythonExecutor:
    """Runs each action's code in a fresh Python process inside ``workdir``.

    ``done`` is the environment's own verdict: ``answer.txt`` holds the expected total.
    """

    def __init__(self, workdir: Path, *, time_limit: float, python: str = sys.executable) -> None:
        self.workdir = workdir
        self.time_limit = time_limit
        self.python = python

    def replay(self, action: Action) -> Replay:
        return Replay.NEVER  # code may have effects beyond the working directory

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        """Run the code; see the module documentation for what each case returns.

        Cancellation: propagates; leaving the ``run_process`` call kills the child.
        """
        payload = action.payload
        code = payload.get("code") if isinstance(payload, dict) else None
        if not isinstance(code, str):
            return ActionOutcome(
                status=ActionStatus.NOT_EXECUTED,
                synthesized=True,
                observation="the action holds no code",
                done=False,
            )
        try:
            with anyio.fail_after(self.time_limit):
                finished = await anyio.run_process(
                    [self.python, "-c", code],
                    cwd=self.workdir,
                    check=False,
                    stdin=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
        except TimeoutError:
            # The child was killed when the deadline cancelled run_process.
            return self._outcome(
                f"TimeoutError: the code ran for more than {self.time_limit:g} s and was stopped",
                synthesized=True,
            )
        except OSError as exc:
            return ActionOutcome(
                status=ActionStatus.ENV_FAULT,
                synthesized=True,
                done=False,
                observation=f"could not start Python: {exc}",
            )
        output = finished.stdout.decode("utf-8", "replace") or "(no output)\n"
        if finished.returncode != 0:
            output = f"[exit status {finished.returncode}]\n{output}"
        return self._outcome(output, synthesized=False)

    def _outcome(self, text: str, *, synthesized: bool) -> ActionOutcome:
        # Long output keeps its end, where a traceback says what went wrong.
        cut = max(0, len(text) - MAX_OBSERVATION_CHARS)
        return ActionOutcome(
            status=ActionStatus.EXECUTED,
            observation=text[cut:],
            synthesized=synthesized,
            done=self.solved(),
            truncated_chars=cut,
        )

    def solved(self) -> bool:
        """The environment's done signal, checked after every run of the code."""
        answer = self.workdir / ANSWER_FILE
        return answer.is_file() and answer.read_text().strip() == EXPECTED_TOTAL


def _code(text: str, code: str) -> str:
    return f"{text}\n```python\n{code}```"


# What the model answers, call by call.
SCRIPT = [
    _code("Let me look at the data first.", "print(open('sales.csv').read())\n"),
    _code(
        "I'll wait for the nightly export to land before summing.",
        "import os, time\nwhile not os.path.exists('export.done'):\n    time.sleep(0.05)\n",
    ),
    _code(
        "No export then. Summing the amounts.",
        "import csv\nrows = csv.DictReader(open('sales.csv'))\n"
        "print(sum(int(row['amount']) for row in rows))\n",
    ),
    "The total is 400, so I am done.",
    _code(
        "The column is 'units'. Writing the answer file.",
        "import csv\nrows = csv.DictReader(open('sales.csv'))\n"
        "total = sum(int(row['units']) for row in rows)\n"
        "open('answer.txt', 'w').write(str(total))\nprint('wrote', total)\n",
    ),
]


def build(workdir: Path, time_limit: float) -> tuple[Definition, Request]:
    definition = Definition(
        model=ScriptedModelClient(SCRIPT, name="code-as-action"),
        # No final_marker: the task is over when the environment says so, never the model.
        interpreter=CodeBlockInterpreter(language="python", aliases=("py",)),
        store=MemoryStore(),  # no recovery needed here; see sqlite_script.py for that
        events=NullSink(),
        texts=ObservationTexts(
            not_executed="Refused: {reason}", env_fault="Environment failure: {detail}"
        ),
    )
    no_tools = ToolRegistry([], max_observation_chars=MAX_OBSERVATION_CHARS)
    request = Request(
        run_id="code-as-action",
        budget=Budget(max_steps=8, max_valid_steps=6, max_context_chars=50_000),
        executor=SubprocessPythonExecutor(workdir, time_limit=time_limit),
        tools=no_tools,  # the action space is code, not a tool list
        run_context=(
            Message.text(
                Role.SYSTEM,
                "You act by writing Python. Each fenced ```python block you send is run for you.",
            ),
        ),
        goal_context=(
            Message.text(
                Role.USER,
                "sales.csv is in the working directory. "
                "Write the total of its units to answer.txt.",
            ),
        ),
        injection=Injection(entries={}),
        binding={},
        model_replay=Replay.ALLOWED,
        observation_template="Output:\n{observation}",
        tool_style=ToolStyle.MARKDOWN,
        cancel_grace_s=2.0,
    )
    return definition, request


def show(result: RunResult) -> None:
    for step in result.steps:
        if step.action_status is None:
            status = step.decision.value
        else:
            status = step.action_status.value + (
                ", synthesized" if step.observation_synthesized else ""
            )
        said = step.model_output.splitlines()[0]
        lines = (step.observation or "").strip().splitlines()
        shown = " | ".join(lines)
        if len(shown) > 90 and len(lines) > 1:
            shown = f"... {lines[-1]}"  # a traceback's last line says what went wrong
        print(f"  step {step.step} [{status}] done={step.done}: {said}")
        print(f"      -> {shown}")
    print(
        f"stop reason: {result.stop_reason.value} after {result.step_count} steps "
        f"({result.valid_step_count} valid)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--time-limit",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long one snippet may run",
    )
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        (workdir / "sales.csv").write_text(SALES_CSV)
        result = anyio.run(run, *build(workdir, args.time_limit), backend=args.backend)
        show(result)
        print(f"{ANSWER_FILE} holds: {(workdir / ANSWER_FILE).read_text()}")


if __name__ == "__main__":
    main()
