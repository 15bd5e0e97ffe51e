"""Tool calls on the OpenAI API, for any chat template: the tools described in a system turn, a call answered as
one JSON object {"name": ..., "arguments": {...}}, and tool results as turns the template can render.

Chat templates that know tools (Llama 3.1's, Qwen2.5's, Hermes') each want their own markup, parsed by a parser per
family (vLLM's --tool-call-parser); SmolLM2's, the embedded default's, knows none. This module is the fallback that
works with every template, and the one the server uses for all of them for now:

- tool_choice "required" or a named tool: the answer is held to a JSON schema (a guide, pipeline.engine.guide):
  anyOf, per allowed tool, {"name": its name, "arguments": its parameters' schema}. The call is then always well
  formed and names a tool that exists.
- tool_choice "auto" (the default with tools): the answer is free; one that is exactly such an object naming a
  listed tool is returned as a call, anything else as content.
- tool_choice "none", or no tools: the tools aren't described and no call is returned.
- History: an assistant turn with tool_calls is rendered as the call objects it made, a `tool` turn as a user turn
  "Result of NAME: CONTENT", so the next answer can use it.
"""

from __future__ import annotations

import json
import secrets

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


def parse_call(text: str, tools: list[dict]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) where the answer is exactly one call of a listed tool, else None."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and isinstance(call["arguments"], dict)):
        return None
    if call["name"] not in {t["name"] for t in tools}:
        return None
    return call["name"], json.dumps(call["arguments"])


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


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
