"""Tool calls on the OpenAI API, for every chat template: a template that knows tools renders them, the calls and
their results itself, and its family's markup is parsed; one that doesn't (SmolLM2's, the embedded default's) gets
the fallback below.

Template families (`template_family`, read from the template's own text, as vLLM's --tool-call-parser names them):
- hermes: Hermes 2 Pro, Qwen2.5, Qwen3: calls answered as <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
  any number of them, text around them being content.
- llama3_json: Llama 3.1-3.3: a call answered as the whole answer, {"name": ..., "parameters": {...}}.
- json: a template that takes tools in another markup: calls parsed as the fallback's.
For these the conversation goes to the template as Hugging Face's chat format has it: `tools`, an assistant turn's
`tool_calls` (arguments as objects), `tool` turns with their call's name and id.

The fallback, for templates without tools: the tools described in a system turn, a call answered as one JSON object
{"name": ..., "arguments": {...}}, an assistant turn's calls as that JSON, a `tool` turn as a user turn "Result of
NAME: CONTENT".

Either way:
- tool_choice "required" or a named tool: the answer is held to a JSON schema (a guide, pipeline.engine.guide):
  anyOf, per allowed tool, {"name": its name, "arguments": its parameters' schema}, as vLLM holds forced calls to a
  schema whatever the family. The call is then always well formed and names a tool that exists.
- tool_choice "auto" (the default with tools): the answer is free; the calls in it naming listed tools, in the
  family's markup or the fallback's, are returned as calls, the rest as content.
- tool_choice "none", or no tools: no tools are offered and no call is returned.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from pipeline.engine.guide import GuideSpec

SYSTEM_PROMPT = ('You can call these functions. To call one, answer with only {"name": <its name>, "arguments": '
                 "<a JSON object>}. Otherwise answer as usual.\nFunctions:\n")


def describe(tools: list[dict]) -> str:
    """The system turn's text that lists the tools (OpenAI's function objects), one compact JSON line each: the
    prompt pays for every character."""
    lines = [json.dumps({k: v for k, v in (("name", t["name"]), ("description", t.get("description")),
                                          ("parameters", t.get("parameters"))) if v}, separators=(",", ":"))
             for t in tools]
    return SYSTEM_PROMPT + "\n".join(lines)


def call_schema(tools: list[dict]) -> dict:
    """A call to one of `tools`, as a JSON schema: its name, and arguments its parameters allow."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["name"]},
                               "arguments": t.get("parameters") or {"type": "object"}}} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def guide_for(tools: list[dict], choice: str | None) -> GuideSpec | None:
    """The guide a tool_choice asks for: required (any tool), a named tool (its own), none for auto and none."""
    if choice in (None, "auto", "none"):
        return None
    allowed = tools if choice == "required" else [t for t in tools if t["name"] == choice]
    return GuideSpec("json_schema", json.dumps(call_schema(allowed)))


def template_family(template: str | None) -> str | None:
    """The tool markup a chat template's text shows (module docstring), or None for a template without tools."""
    if not template or not re.search(r"\btools\b", template):
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "json"


def _call(obj, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) from one call object, {"name", "arguments"} (or Llama's "parameters"), naming
    one of `names`; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    keys = set(obj) - {"name"}
    if len(keys) != 1 or not ({"arguments", "parameters"} >= keys):
        return None
    args = obj[keys.pop()]
    return (obj["name"], json.dumps(args)) if isinstance(args, dict) else None


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Parsed:
    calls: list[tuple[str, str]]  # (name, arguments as JSON text), in the answer's order
    content: str | None  # the text beside them; None when there is none


def parse_calls(text: str, tools: list[dict], family: str | None) -> Parsed | None:
    """The calls of listed tools an answer makes, in its family's markup or the fallback's; None when it makes
    none (the answer is content)."""
    names = {t["name"] for t in tools}
    if family == "hermes" and (blocks := HERMES_CALL.findall(text)):
        calls = [_call(_json(b), names) for b in blocks]
        if all(calls):
            rest = HERMES_CALL.sub("", text).strip()
            return Parsed(calls, rest or None)
        return None
    answer = text.strip().removeprefix("<|python_tag|>")
    call = _call(_json(answer), names)
    return Parsed([call], None) if call else None


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def native(messages: list[dict], tools: list[dict]) -> tuple[list[dict], list[dict]]:
    """The conversation and tools as a template that knows tools takes them (Hugging Face's chat format): calls with
    their arguments as objects, `tool` turns with the name of the call they answer."""
    out, names = [], {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            names.update({c["id"]: c["name"] for c in m["tool_calls"]})
            out.append({"role": "assistant", "content": m.get("content") or "", "tool_calls": [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}}
                for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": m.get("tool_call_id"),
                        "name": names.get(m.get("tool_call_id"), ""), "content": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out, [{"type": "function", "function": t} for t in tools]


def render(messages: list[dict], tools: list[dict], describe_tools: bool) -> list[dict]:
    """The conversation as any chat template takes it: the tools in the system turn (a new one, or the first one's
    text after it), assistant calls as their JSON, tool results as user turns."""
    out, names = [], {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [json.dumps({"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")})
                     for c in m["tool_calls"]]
            names.update({c["id"]: c["name"] for c in m["tool_calls"]})
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), *calls]))})
        elif m["role"] == "tool":
            name = names.get(m.get("tool_call_id"), "the call")
            out.append({"role": "user", "content": f"Result of {name}: {m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if describe_tools and tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + describe(tools)}
        else:
            out.insert(0, {"role": "system", "content": describe(tools)})
    return out
