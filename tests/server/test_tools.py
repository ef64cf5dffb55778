"""tools.CallStream: OpenAI's streamed tool-call layout, whatever the pieces the text
arrives in (no model: the text is given)."""

from __future__ import annotations

import json
import random

import pytest

from infire.server.tools import CallStream, ToolPlan

TOOLS = [{"name": n, "description": "", "parameters": {"type": "object"}} for n in ("a", "b")]


def _run(plan: ToolPlan, text: str, seed: int, reason: str = "stop") -> tuple[list, str, str]:
    """Feed `text` in random pieces; the deltas, the content and the finish_reason."""
    rng, stream, deltas, i = random.Random(seed), CallStream(plan), [], 0
    deltas += stream.start()
    while i < len(text):
        step = rng.randint(1, 6)
        deltas += stream.feed(text[i : i + step])
        i += step
    last, final = stream.finish(reason)
    deltas += last
    return deltas, "".join(d.get("content", "") for d in deltas), final


def _calls(deltas: list[dict]) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            if "id" in part:  # the head: id, type and name, before any argument
                assert part["id"].startswith("call_") and part["type"] == "function"
                assert call["arguments"] == "" and part["function"]["arguments"] == ""
                call["name"] = part["function"]["name"]
            call["arguments"] += part["function"]["arguments"]
    return [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("seed", range(20))
def test_required_calls_stream_by_name_then_arguments(seed: int) -> None:
    text = ('[{"name": "a", "arguments": {"x": "}\\\\\\"{[", "y": [1, {"z": 2}]}},'
            ' {"arguments": {"q": 1}, "name": "b"}]')  # fmt: skip
    deltas, content, final = _run(ToolPlan(TOOLS, "required"), text, seed)
    assert _calls(deltas) == [("a", {"x": '}\\"{[', "y": [1, {"z": 2}]}), ("b", {"q": 1})]
    assert content == "" and final == "tool_calls"
    fragments = [d for d in deltas if "id" not in d["tool_calls"][0]]
    assert len(fragments) > 2  # arguments stream in pieces, not at the end


def test_named_call_and_length() -> None:
    deltas, _, final = _run(ToolPlan(TOOLS, "named", name="b"), '{"k": [1, 2]}', 0)
    assert _calls(deltas) == [("b", {"k": [1, 2]})] and final == "tool_calls"
    assert _run(ToolPlan(TOOLS, "named", name="b"), '{"k": [1', 0, "length")[2] == "length"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("  plain text, no call", "  plain text, no call", []),
        ("Hi <tool and more", "Hi <tool and more", []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
        ('<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call>', "", [("b", {"k": 1})]),
        ('[{"name": "a", "arguments": {}}]', "", [("a", {})]),
        ('Let me look. <tool_call>{"name": "a", "arguments": {"x": 2}}</tool_call>',
         "Let me look. ", [("a", {"x": 2})]),
    ],
)  # fmt: skip
def test_auto_streams_content_and_holds_calls(seed: int, text: str, content: str, calls: list):
    deltas, got, final = _run(ToolPlan(TOOLS, "auto"), text, seed)
    assert got == content and _calls(deltas) == calls
    assert final == ("tool_calls" if calls else "stop")


def test_auto_streams_text_before_it_ends() -> None:
    stream = CallStream(ToolPlan(TOOLS, "auto"))
    assert stream.feed("The answer") == [{"content": "The answer"}]
    assert stream.feed(" is <tool") == [{"content": " is "}]  # "<tool" may open a call
    assert stream.feed("box>") == [{"content": "<toolbox>"}]
