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
