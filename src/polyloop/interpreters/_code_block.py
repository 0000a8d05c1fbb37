"""The code-block action language: the model acts by writing one fenced block of code."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polyloop._fences import FencedBlock, clip, scan_fences
from polyloop.ports import (
    Action,
    Decision,
    FinalAnswer,
    InvalidDecision,
    ModelReply,
    reject_incomplete,
)
from polyloop.types import InvalidRequest, JSONValue


@dataclass(frozen=True, slots=True, kw_only=True)
class CodeBlockInterpreter:
    """Reads a decision written as one fenced code block, for agents that act in code.

    The action language:

    * The reply holds exactly one fenced block tagged ``language`` (or one of
      ``aliases``; the tag's case does not matter), and the block ends the reply. Its
      text is an :class:`~polyloop.Action` with the payload ``{"code": TEXT}``, TEXT
      being the lines between the fences, each ending in a newline; the action's
      executor runs it.
    * Text before the block is allowed (the model may say what it is about to do).
      Text after the closing fence is refused: whatever follows the code would be a
      guess at its output, which comes back in the next message instead.
    * With ``final_marker`` set (say ``"FINAL:"``), a reply whose text starts with the
      marker is a :class:`~polyloop.FinalAnswer`, the rest of the reply being the
      answer; a block in such a reply is part of the answer and does not run. With
      ``final_marker=None`` (the default) there is no answering reply: the run ends
      when the environment reports ``done``, when a budget runs out, or in any other
      way the executor arranges.
    * Each fault has its own :class:`~polyloop.InvalidDecision` feedback, which names it
      and restates the format: no block, more than one block, a block that is never
      closed, a block without a tag or with another tag, an empty block, text after the
      block, and a final-answer marker with no answer after it.

    A reply that did not end normally (cut off, filtered, refused) is never read: see
    :func:`polyloop.reject_incomplete`.
    """

    language: str = "python"
    aliases: tuple[str, ...] = ()
    final_marker: str | None = None

    def __post_init__(self) -> None:
        for tag in (self.language, *self.aliases):
            if not isinstance(tag, str) or not tag or tag != tag.strip() or " " in tag:
                raise InvalidRequest(f"a language tag must be one word, got {tag!r}")
            if "`" in tag:
                raise InvalidRequest(f"a language tag cannot hold a backtick, got {tag!r}")
        if not isinstance(self.aliases, tuple):
            raise InvalidRequest(f"aliases must be a tuple of tags, got {self.aliases!r}")
        if self.final_marker is not None and (
            not isinstance(self.final_marker, str) or not self.final_marker.strip()
        ):
            raise InvalidRequest(
                f"final_marker must be None or a non-blank string, got {self.final_marker!r}"
            )

    def parameters(self) -> Mapping[str, JSONValue]:
        """The kind and version of the language, and this interpreter's settings."""
        return {
            "kind": "code-block",
            "version": 1,
            "language": self.language,
            "aliases": list(self.aliases),
            "final_marker": self.final_marker,
        }

    def interpret(self, reply: ModelReply) -> Decision:
        """The action, answer or correction that ``reply`` amounts to."""
        if (rejected := reject_incomplete(reply)) is not None:
            return rejected  # cut off, filtered or refused: never acted on
        text = reply.content
        if self.final_marker is not None and text.lstrip().startswith(self.final_marker):
            answer = text.lstrip()[len(self.final_marker) :].strip()
            if not answer:
                return self._invalid(
                    f"Your reply starts with {self.final_marker} but gives no answer after it.",
                    text,
                )
            return FinalAnswer(answer=answer, history_text=text)
        block = self._block(text)
        if isinstance(block, str):
            return self._invalid(block, text)
        return Action(
            payload={"code": block.body}, action_text=block.body.strip(), history_text=text
        )

    def _block(self, text: str) -> FencedBlock | str:
        """The reply's one code block, or what keeps the reply from being an action."""
        scan = scan_fences(text)
        fence = f"```{self.language}"
        if scan.unclosed is not None:
            return (
                f"Your code block opened on line {scan.unclosed.opening_line} is never "
                "closed: end it with a line of three backticks."
            )
        if not scan.blocks:
            return "Your reply holds no code block."
        if len(scan.blocks) > 1:
            lines = ", ".join(str(block.opening_line) for block in scan.blocks)
            return (
                f"Your reply holds {len(scan.blocks)} code blocks (opened on lines {lines}); "
                "send one block with all the code to run now."
            )
        [block] = scan.blocks
        if block.tag.lower() not in self._tags():
            if not block.tag:
                return f"Your code block has no language tag: open it with {fence}."
            return (
                f"Your code block is tagged {clip(block.tag)!r}, but the code must be "
                f"{self.language}: open the block with {fence}."
            )
        if not block.body.strip():
            return "Your code block is empty: there is no code to run."
        if scan.after.strip():
            return (
                f"Your reply goes on after the code block closes on line {block.closing_line}: "
                "end the reply with the block. The code's output comes back in the next "
                "message."
            )
        return block

    def _tags(self) -> frozenset[str]:
        return frozenset(tag.lower() for tag in (self.language, *self.aliases))

    def _invalid(self, problem: str, text: str) -> InvalidDecision:
        fence = f"```{self.language}"
        how = (
            f"Reply with exactly one {fence} block holding the code to run, at the end of "
            "your reply (text before the block is fine)."
        )
        if self.final_marker is not None:
            how += f" To answer instead, start your reply with {self.final_marker} and the answer."
        else:
            how += " No reply ends the task: the environment says when it is done."
        return InvalidDecision(feedback=f"{problem} {how}", history_text=text)
