"""Tool calling: OpenAI's `tools` and `tool_choice`, rendered through the chat template,
constrained by a grammar where a call is required, and parsed out of the answer.

- `tool_choice` is `none`, `auto` (the default with tools), `required`, or a named
  function (`{"type": "function", "function": {"name": ...}}`).
- Named: the answer is constrained to that function's parameters schema; it is the
  call's arguments. Required: the answer is constrained to a JSON array of calls
  `[{"name": ..., "arguments": {...}}]`, one item when `parallel_tool_calls` is false,
  each item's arguments constrained by its function's schema. Auto: the model answers
  freely; calls are parsed from its own format (`<tool_call>{...}</tool_call>` as Qwen's
  and Hermes' templates ask for, or a bare JSON call as Llama 3's does).
- Templates that take `tools` get them; for the others (SmolLM2's) the tools and the
  call format go into the system message, and earlier calls are written into their
  assistant turns, so that the model sees the conversation it is continuing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from infire.errors import InvalidRequestError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean for its generation and its answer."""

    tools: list[dict]  # the functions: {"name", "description", "parameters"}
    mode: str  # auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True

    def grammar(self) -> dict | None:
        """The structured_output that constrains a required or named call (None: auto)."""
        if self.mode == "named":
            return {"json": _function(self.tools, self.name)["parameters"]}
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for f in self.tools]  # fmt: skip
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": array}

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """The answer's content (None when it is only calls) and its tool calls."""
        if self.mode == "named":
            return None, [_call(self.name, text)]
        if self.mode == "required":
            return None, [_call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
        return parse_calls(text, {f["name"] for f in self.tools})


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan, or None when it uses no tools; 400s name the problem."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    if not tools:
        return None
    functions = [_checked(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct names", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return ToolPlan(functions, choice, parallel=parallel is not False)
    name = ((choice or {}).get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not name:
        raise InvalidRequestError('tool_choice must be none, auto, required or {"type": '
                                  '"function", "function": {"name": ...}}', param="tool_choice")  # fmt: skip
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                  param="tool_choice")  # fmt: skip
    return ToolPlan(functions, "named", name=name, parallel=parallel is not False)


def _checked(tool: Any, index: int) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}',
                                  param="tools")  # fmt: skip
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where} has no function", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"{where}.function.name is required: 1-64 letters, digits, "
                                  "_ or -", param="tools")  # fmt: skip
    parameters = function.get("parameters")
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"{where}.function.parameters is required: a JSON Schema of "
                                  f"an object ({name})", param="tools")  # fmt: skip
    return {"name": name, "description": str(function.get("description") or ""),
            "parameters": parameters}  # fmt: skip


def _function(tools: list[dict], name: str | None) -> dict:
    return next(f for f in tools if f["name"] == name)


def _call(name: str | None, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """Calls in a free answer: `<tool_call>` blocks, else the whole answer as one JSON call
    or a list of them (`{"name", "arguments" | "parameters"}`); only known names count."""
    found = [_as_call(block, names) for block in _TAGGED.findall(text)]
    if found and all(found):
        content = _TAGGED.sub("", text).strip()
        return content or None, found  # type: ignore[return-value]
    try:
        value = json.loads(text.strip())
    except ValueError:
        return text, []
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(item, names) for item in items]
    if items and all(calls):
        return None, calls  # type: ignore[return-value]
    return text, []


def _as_call(value: Any, names: set[str]) -> dict | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return _call(value["name"], json.dumps(arguments))


def chat_messages(messages: list[Any], tools: ToolPlan | None, template: str | None) -> list[dict]:
    """The conversation as the chat template takes it: text content, earlier calls and
    tool results; the tools in the system message when the template has no `tools`."""
    takes_tools = bool(template and "tools" in template)
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        extra = message.model_extra or {}
        calls = extra.get("tool_calls") or []
        if message.role == "assistant" and calls:
            if takes_tools:
                item["tool_calls"] = [_template_call(c) for c in calls]
            else:
                written = [{"name": c["function"]["name"],
                            "arguments": _arguments(c["function"].get("arguments"))} for c in calls]  # fmt: skip
                item["content"] = (item["content"] + "\n" if item["content"] else "") + json.dumps(
                    written
                )
        if message.role == "tool":
            item["tool_call_id"] = extra.get("tool_call_id")
            if not takes_tools:
                item["content"] = (
                    f"Result of the call {extra.get('tool_call_id') or ''}: {item['content']}"
                )
        out.append(item)
    if tools is not None and not takes_tools:
        out = _with_tool_prompt(out, tools)
    return out


def template_kwargs(tools: ToolPlan | None, template: str | None) -> dict:
    """Extra variables for a template that renders tools itself (HF's convention)."""
    if tools is None or not (template and "tools" in template):
        return {}
    return {"tools": [{"type": "function", "function": f} for f in tools.tools]}


def _template_call(call: dict) -> dict:
    function = call.get("function") or {}
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function.get("name"), "arguments": _arguments(function.get("arguments"))}}  # fmt: skip


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _with_tool_prompt(messages: list[dict], tools: ToolPlan) -> list[dict]:
    listing = "\n".join(json.dumps(f) for f in tools.tools)
    prompt = ("You can call these functions:\n" + listing + "\nTo call functions, answer "
              'only with a JSON list of calls: [{"name": ..., "arguments": {...}}].')  # fmt: skip
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


_OPEN_TAG = "<tool_call>"


class CallStream:
    """A streamed answer with tools, as OpenAI's chunks: `feed` each text delta and send
    the deltas it returns (`{"content": ...}` or `{"tool_calls": [...]}`), then `finish`.

    - Named: the head (index, id, type, name) first, then each fragment as arguments.
    - Required: the calls' JSON array is scanned as it grows. Each call's head goes out
      once its name is complete, then its arguments fragment by fragment.
    - Auto: text streams as content while it can only be content. An answer that opens
      like a call (`[`, `{` or `<tool_call>`), and the rest of one in which a
      `<tool_call>` appears, is held and parsed when it ends (calls, else content).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything generated
        self.sent = 0  # auto: the characters sent as content
        self.held = False  # auto: the rest is held to the end
        self.scanner = _CallScanner() if plan.mode == "required" else None
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"

    def start(self) -> list[dict]:
        if self.plan.mode != "named":
            return []
        return [{"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                 "function": {"name": self.plan.name, "arguments": ""}}]}]  # fmt: skip

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if not text:
            return []
        if self.plan.mode == "named":
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if self.scanner is not None:
            return [{"tool_calls": [part]} for part in self.scanner.feed(text)]
        return self._content()

    def finish(self, reason: str | None) -> tuple[list[dict], str]:
        """The last deltas and the finish_reason."""
        if self.plan.mode != "auto":
            return [], "length" if reason == "length" else "tool_calls"
        rest = self.text[self.sent :]
        content, calls = (rest, []) if reason == "length" else self.plan.calls(rest)
        if calls:
            deltas = []
            for i, call in enumerate(calls):
                name, arguments = call["function"]["name"], call["function"]["arguments"]
                deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})  # fmt: skip
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": arguments}}]})
            return ([{"content": content}] if content else []) + deltas, "tool_calls"
        final = "length" if reason == "length" else "stop"
        return ([{"content": rest}] if rest else []), final

    def _content(self) -> list[dict]:
        if self.held:
            return []
        start = len(self.text) - len(self.text.lstrip())
        head = self.text[start:]
        if not head or (self.sent == 0 and _OPEN_TAG.startswith(head)):
            return []  # nothing yet, or what may be the start of a tag
        if self.sent == 0 and head[0] in "[{<" and (head[0] != "<" or head.startswith(_OPEN_TAG)):
            self.held = True  # opens like a call
            return []
        tag = self.text.find(_OPEN_TAG, self.sent)
        if tag >= 0:
            self.held = True
            end = tag
        else:  # hold back a tail that may be the start of a tag
            end = len(self.text)
            for k in range(min(len(_OPEN_TAG) - 1, len(self.text) - self.sent), 0, -1):
                if _OPEN_TAG.startswith(self.text[-k:]):
                    end = len(self.text) - k
                    break
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return [{"content": out}] if out else []


class _CallScanner:
    """Scans a growing JSON array of calls, `[{"name": ..., "arguments": {...}}, ...]`,
    (the shape a required call's grammar allows) and returns each call's delta as soon as
    it is known: the head when the name is complete, then the arguments' text."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers
        self.in_string = self.escape = False
        self.index = -1
        self._new_item()

    def _new_item(self) -> None:
        self.key: str | None = None
        self.raw = ""  # the item-level string being read
        self.after_colon = False
        self.named = False
        self.in_arguments = False  # inside the arguments' value
        self.pending = ""  # arguments seen before the name

    def feed(self, text: str) -> list[dict]:
        parts: list[dict] = []
        chunk = ""
        for c in text:
            if self.in_arguments:
                chunk += c
                self._track(c)
                if len(self.stack) == 2 and not self.in_string:  # the value is closed
                    parts += self._arguments(chunk)
                    self.in_arguments, chunk = False, ""
                continue
            at_item = self.stack == ["[", "{"]
            was_string = self.in_string
            self._track(c)
            if not at_item:
                if self.stack == ["[", "{"]:  # a call opens
                    self.index += 1
                    self._new_item()
                continue
            if was_string and self.in_string:
                self.raw += c
            elif was_string:  # a string at the item's level ends: a key or the name
                value = json.loads(f'"{self.raw}"')
                if not self.after_colon:
                    self.key = value
                elif self.key == "name" and not self.named:
                    parts += self._head(value)
            elif self.in_string:
                self.raw = ""
            elif c == ":":
                self.after_colon = True
            elif c == ",":
                self.key, self.after_colon = None, False
            elif c in "{[" and self.key == "arguments" and self.after_colon:
                self.in_arguments, chunk = True, c
        parts += self._arguments(chunk)
        return parts

    def _track(self, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.stack.append(c)
        elif c in "}]" and self.stack:
            self.stack.pop()

    def _head(self, name: str) -> list[dict]:
        self.named = True
        head = {"index": self.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip
        pending, self.pending = self.pending, ""
        return [head] + self._arguments(pending)

    def _arguments(self, text: str) -> list[dict]:
        if not text:
            return []
        if not self.named:
            self.pending += text
            return []
        return [{"index": self.index, "function": {"arguments": text}}]
