"""Guided decoding: a request's output held to a JSON schema, any JSON, a regex or an EBNF grammar (llguidance).

A guide is a per-request matcher over the tokenizer's vocabulary. Before a token is chosen, every token the
grammar can't take next gets logit -inf; after it is chosen, the matcher consumes it. With speculation:

- A verify row j is masked by the grammar's state after the drafts before it: the matcher consumes d_1..d_j to
  make row j's mask, then rolls them back; it then consumes only what was accepted (the rollback of rejected
  drafts is that nothing else was consumed).
- Greedy rows and deterministic drafts (n-gram, greedy draft models) are cut at their first draft the grammar
  refuses, before the target sees them: the masked argmax could never equal it, so the cut changes no token and
  saves the verify's work on the rest.
- A drafter (a draft model, an EAGLE-3 head) drafts under the same grammar: each draft step's logits are masked
  by the state after the drafts before it (push, then pop once drafting ends), so its drafts are ones the target
  can accept; the target as its own draft still accepts every draft under a guide. Its q is then masked too.
- A sampled row's drafts from a distribution q are not cut: rejection sampling is exact only over what q drew.
  A refused draft meets p(d) = 0 under the masked target, so it is rejected with certainty and the residual
  max(p - q, 0) is sampled, which keeps the output distributed as the masked target's p. (Cutting there and
  sampling p instead would tilt it by q's mass on refused tokens.) Rows past a refused draft are never read.

Greedy output with a guide and speculation is then token for token the guided output without speculation, and a
sampled one follows the masked target's distribution (tests/test_guide.py, tests/test_speculative.py). Guide types
and their names are tensorrtllm_backend's (`guided_decoding_guide_type`: json, json_schema, regex, ebnf_grammar);
an EBNF grammar is GBNF, as xgrammar and llama.cpp read it, converted by llguidance's own gbnf_to_lark.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.errors import RequestError

if TYPE_CHECKING:
    import torch
# numpy, torch and llguidance are imported where used: GuideSpec is read at the serving edge (preprocessing,
# the clients), which never masks a logit.

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
# A guide's text is the request's to choose, and a grammar's size is what it costs to compile and hold: bounded.
MAX_GUIDE_BYTES = 64 * 1024
# Any JSON value an API means by "JSON output": an object or an array (xgrammar's builtin JSON grammar's root).
ANY_JSON = {"type": ["object", "array"]}
# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): no free whitespace between tokens. With it, a model can
# pad an answer with newlines until max_tokens (seen with random models, and reported of real ones under guides);
# a schema's own "x-guidance" options still win.
# looping_ref's fixed point takes up to one pass over the refs per ref: it runs on the engine's scheduler thread, so
# a schema with more distinct refs than this (rare: OpenAPI-sized documents) isn't checked for loops.
MAX_CHECKED_REFS = 256
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GuideSpec:
    """What a request's output must match: type (GUIDE_TYPES) and its text (a schema, a regex, a grammar; none
    for json)."""

    type: str
    guide: str = ""

    def __post_init__(self):
        if self.type not in GUIDE_TYPES:
            raise RequestError(f"guided_decoding_guide_type {self.type!r} is not one of {', '.join(GUIDE_TYPES)}")
        if self.type != "json" and not self.guide:
            raise RequestError(f"a {self.type} guide needs its text in guided_decoding_guide")
        if len(self.guide.encode()) > MAX_GUIDE_BYTES:
            raise RequestError(f"the guide is {len(self.guide.encode())} bytes; the most is {MAX_GUIDE_BYTES}")


def grammar_text(spec: GuideSpec) -> str:
    """The spec as an llguidance grammar (not yet checked: Guide's matcher says what is wrong with it)."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if spec.type == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON, defaults=JSON_OPTIONS)
    if spec.type == "json_schema":
        try:
            schema = json.loads(spec.guide)
        except ValueError as e:
            raise RequestError(f"the json_schema guide is not JSON ({e}); send a JSON Schema object") from None
        if not isinstance(schema, dict):
            raise RequestError("the json_schema guide must be a JSON object (a JSON Schema)")
        if (loop := looping_ref(schema)) is not None:
            raise RequestError(f"the json_schema guide matches no JSON value: every value it allows goes through "
                               f"$ref {loop[:80]!r} again and never ends; give that definition a way out "
                               "(an optional property, an anyOf branch without the $ref)")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.type == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.guide)
    try:
        lark = gbnf_to_lark(spec.guide)
    except Exception as e:  # noqa: BLE001  the converter raises on GBNF it can't read; say so in one line
        raise RequestError(f"the ebnf_grammar guide is not GBNF: {_first_line(e)}") from None
    if (endless := endless_rules(lark)) is not None:
        names = ", ".join("root" if name == "start" else name for name in endless[:4])
        raise RequestError(f"the ebnf_grammar guide matches no text: its rules {names[:80]} only ever recurse, and "
                           "root needs them; give one an alternative without the recursion")
    return llguidance.LLMatcher.grammar_from_lark(lark)


# Lark as gbnf_to_lark writes it: strings, regexes, names, repetitions ({n}, {n,}, {n,m}, ~ n..m), operators.
_LARK_TOKEN = re.compile(r'\s+|//[^\n]*|"(?:[^"\\]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*'
                         r'|[A-Za-z_]\w*|\d+|\.\.|[():|*+?\[\]~{},]')
_LARK_RULE = re.compile(r"^[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?\s*:(.*)$")


def endless_rules(lark: str) -> list[str] | None:
    """The rules no finite string derives from, when the start rule is one of them (`root ::= "x" root`), else None.
    llguidance compiles such a grammar and lets the model write "x" until max_tokens: an answer that never matches
    its guide.

    A least fixed point, as looping_ref's: a rule produces a string once one of its alternatives is made of strings,
    regexes, optional or starred parts and rules already found to; what is left can't. Terminals (upper-case names)
    and regexes count as producing (llguidance's own check finds a regex that matches nothing). Lark this doesn't
    read (llguidance's extensions past gbnf_to_lark's output) returns None: llguidance alone judges it."""
    rules: dict[str, list[str]] = {}
    current = None
    for line in lark.splitlines():
        if not line.strip() or line.lstrip().startswith(("//", "%")):
            continue
        if (m := _LARK_RULE.match(line)) is not None:
            current = m.group(1)
            rules.setdefault(current, []).append(m.group(2))
        elif current is not None and line[:1].isspace():
            rules[current].append(line)
        else:
            return None
    try:
        parsed = {name: _lark_alternatives(_lark_tokens(" ".join(body))) for name, body in rules.items()}
    except (ValueError, IndexError):  # Lark past what gbnf_to_lark writes
        return None
    found = _least_fixed_point(parsed, lambda alternatives, found: _produces(alternatives, found, parsed),
                               {name for name in parsed if name[:1].isupper()})
    if "start" not in parsed or "start" in found:
        return None
    return [name for name in parsed if name not in found]


def _lark_tokens(text: str) -> list[str]:
    tokens, at = [], 0
    while at < len(text):
        m = _LARK_TOKEN.match(text, at)
        if m is None:
            raise ValueError(text[at:at + 20])
        if not m.group().isspace() and not m.group().startswith("//"):
            tokens.append(m.group())
        at = m.end()
    return tokens


def _lark_alternatives(tokens: list[str]):
    """Lark expansions as nested lists: alternatives, each a sequence of (atom, least repeats); an atom is a name,
    "" (a string or regex), or a nested alternatives list."""
    pos = 0

    def alternatives(closing: str | None):
        nonlocal pos
        out, seq = [], []
        while pos < len(tokens) and tokens[pos] != closing:
            tok = tokens[pos]
            pos += 1
            if tok == "|":
                out.append(seq)
                seq = []
                continue
            if tok in ("(", "["):
                atom = alternatives(")" if tok == "(" else "]")
                if pos >= len(tokens):
                    raise ValueError("unclosed group")
                pos += 1
                least = 0 if tok == "[" else 1
            elif tok[0] in "\"/" or tok[0].isalpha() or tok[0] == "_":
                atom, least = ("" if tok[0] in "\"/" else tok), 1
            else:
                raise ValueError(tok)
            least = quantifier(least)
            seq.append((atom, least))
        out.append(seq)
        return out

    def quantifier(least: int) -> int:
        nonlocal pos
        if pos < len(tokens) and tokens[pos] in ("*", "?"):
            pos += 1
            return 0
        if pos < len(tokens) and tokens[pos] == "+":
            pos += 1
            return least
        if pos < len(tokens) and tokens[pos] == "{":  # {n}, {n,}, {n,m}
            end = tokens.index("}", pos)
            n = tokens[pos + 1]
            pos = end + 1
            return least if n.isdigit() and int(n) > 0 else 0
        if pos < len(tokens) and tokens[pos] == "~":  # ~ n or ~ n..m
            n = tokens[pos + 1]
            pos += 2
            if pos < len(tokens) and tokens[pos] == "..":
                pos += 2
            return least if n.isdigit() and int(n) > 0 else 0
        return least

    parsed = alternatives(None)
    if pos != len(tokens):
        raise ValueError("stray closing bracket")
    return parsed


def _produces(alternatives, found: set[str], rules: dict) -> bool:
    def atom_ok(atom) -> bool:
        if isinstance(atom, list):
            return _produces(atom, found, rules)
        return atom == "" or atom in found or atom not in rules  # an unknown name: llguidance refuses it itself
    return any(all(least == 0 or atom_ok(atom) for atom, least in seq) for seq in alternatives)


def looping_ref(schema: dict) -> str | None:
    """A local $ref through which every value the schema allows must pass again, so that no finite value matches
    (`{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}`), or None. llguidance compiles such a schema
    and then allows nothing but the end token: a 200 with an empty answer that doesn't match its guide.

    A least fixed point over the refs: a ref is satisfiable once its target is, counting as satisfiable only the
    refs already found so; what is left at the end can't be. Only what every value must contain is followed
    (required properties, allOf, at least one anyOf/oneOf branch, minItems' items); any other keyword counts
    as satisfiable, so this never refuses a schema that has a value, and llguidance judges the rest."""
    refs = _refs(schema)
    if len(refs) > MAX_CHECKED_REFS:  # each pass may settle one ref: past this, llguidance alone judges it
        return None
    targets = {ref: _pointer(schema, ref) for ref in refs}
    found = _least_fixed_point(targets, _satisfiable)
    if _satisfiable(schema, found):
        return None
    return next((ref for ref in targets if ref not in found), "#")


def _least_fixed_point(items: dict, holds, found: set[str] | None = None) -> set[str]:
    """The names of `items` that hold, found by passes until one adds none: holds(item, found) may count only the
    names found so far (a $ref is satisfiable once its target is; a rule produces once an alternative does)."""
    found = set(found or ())
    changed = True
    while changed:
        changed = False
        for name, item in items.items():
            if name not in found and holds(item, found):
                found.add(name)
                changed = True
    return found


def _refs(node) -> set[str]:
    """Every local $ref in a schema (a pointer into the document itself)."""
    out, stack = set(), [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out.add(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


def _pointer(schema: dict, ref: str):
    """The subschema a local $ref names (JSON Pointer, RFC 6901), or True where it names nothing: llguidance
    refuses a dangling ref itself."""
    node = schema
    for part in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


def _satisfiable(node, found: set[str], depth: int = 0) -> bool:
    """Whether some finite value matches `node`, taking the refs in `found` as satisfiable and the others not."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict) or depth > 256:  # the body parser refuses deeper nesting anyway
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in found:
        return False

    def sat(child) -> bool:
        return _satisfiable(child, found, depth + 1)

    if isinstance(node.get("allOf"), list) and not all(sat(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(sat(s) for s in node[key]):
            return False
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in node.get("required") or []:
        if isinstance(name, str) and name in properties and not sat(properties[name]):
            return False
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items > 0:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        if not all(sat(s) for s in prefix[:min_items]):
            return False
        if min_items > len(prefix) and "items" in node and not sat(node["items"]):
            return False
    return True


def _first_line(e: Exception | str) -> str:
    """llguidance's message in one line: its first, and the `error:` line a parse error puts under its echo."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    cause = next((line for line in lines[1:] if line.startswith("error:")), None)
    return (lines[0] + (f" ({cause})" if cause else ""))[:300]


def tokenizer_for(hf_tokenizer, eos_token_ids: tuple[int, ...] = ()):
    """The llguidance tokenizer for a Hugging Face fast tokenizer (about a second: make it once per engine). The
    end tokens a completed grammar allows are the model's eos ids, else the tokenizer's own."""
    import llguidance.hf

    eos = list(eos_token_ids) or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos)


class Guide:
    """One request's matcher: the tokens allowed next, drafts checked and cut, verify rows' masks."""

    def __init__(self, spec: GuideSpec, tokenizer, vocab_size: int):
        import llguidance

        self.spec, self.vocab_size = spec, vocab_size
        self.known = tokenizer.vocab_size  # a model's vocabulary may run past its tokenizer's (padded embeddings)
        self.matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"the {spec.type} guide doesn't compile: {_first_line(self.matcher.get_error())}")
        # Stopped before any token and not accepting: the grammar matches no text at all (a regex with an empty
        # class, `a+[^\\s\\S]`); llguidance then allows only the end token, an empty answer that doesn't match.
        # (llguidance finds out when it computes the first mask, which the first step would compute anyway.)
        self.matcher.compute_bitmask()
        if self.matcher.is_stopped() and not self.matcher.is_accepting():
            raise RequestError(f"the {spec.type} guide matches no text (nothing it allows can be completed); check it")

    def refused(self) -> torch.Tensor | None:
        """[vocab_size] bool, True for each token the grammar can't take next (a model vocabulary wider than the
        tokenizer's has its extra ids refused), or None where it takes none (a stopped or broken state).
        Unpacked from llguidance's bitmask inverted, with no copy: this runs for every guided token."""
        import numpy as np
        import torch

        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if not words.any():
            return None
        bits = np.unpackbits(~words, bitorder="little")  # 1 = refused; the bitmask's padding bits come out 1
        if bits.shape[0] >= self.vocab_size:
            return torch.from_numpy(bits[: self.vocab_size].view(np.bool_))
        out = torch.ones(self.vocab_size, dtype=torch.bool)
        out[: bits.shape[0]] = torch.from_numpy(bits.view(np.bool_))
        return out

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar takes next."""
        import torch

        refused = self.refused()
        return torch.zeros(self.vocab_size, dtype=torch.bool) if refused is None else ~refused

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of drafts, in order, the grammar takes from its current state. An id past the tokenizer's
        vocabulary (a draft model may propose one) is refused here: llguidance would enter its error state."""
        drafts = drafts[: next((n for n, t in enumerate(drafts) if not 0 <= t < self.known), len(drafts))]
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def row_refusals(self, drafts: list[int], stop_ids: frozenset[int] = frozenset()) -> torch.Tensor:
        """[len(drafts) + 1, vocab_size]: row j refuses what the grammar refuses after drafts[:j]. Rows past the
        first refused draft refuse nothing: nothing reads them (that draft is rejected, so no later row is used);
        so do rows past a stop token, which ends the answer if accepted (and which llguidance's rollback doesn't
        undo: it is never consumed here). A row the grammar leaves no token is an error for its request."""
        import torch

        n = self.valid_prefix(drafts)
        n = next((j for j in range(n) if drafts[j] in stop_ids), n)
        rows = [self._must_refused()]
        for j in range(n):
            if not self.matcher.consume_token(drafts[j]):
                raise RuntimeError(f"the guide took draft {drafts[j]} in validate_tokens but not in consume_token")
            rows.append(self._must_refused())
        if n:
            self.matcher.rollback(n)
        rows += [torch.zeros(self.vocab_size, dtype=torch.bool)] * (len(drafts) - n)
        return torch.stack(rows)

    def _must_refused(self) -> torch.Tensor:
        refused = self.refused()
        if refused is None:  # its softmax would be NaN and its argmax meaningless
            raise RuntimeError("the guide allows no token here (the grammar is stuck); check the guide")
        return refused

    def draft_refusals(self, width: int, index: torch.Tensor | None = None) -> torch.Tensor | None:
        """What a drafter refuses of its [width] logits at the grammar's current state (index: each of its ids'
        target id, for a head with a vocabulary of its own), or None where the grammar leaves it no token (a
        stopped or broken state: that row then drafts unguided, and its drafts are checked before the verify as
        any others)."""
        refused = self.refused()
        if refused is None:
            return None
        refused = refused[index] if index is not None else refused[:width]
        return None if bool(refused.all()) else refused

    def push(self, token: int, stop_ids: frozenset[int] = frozenset()) -> bool:
        """A drafter's token, taken for the drafts after it (popped once drafting ends); False where the grammar
        refuses it or it is a stop token (drafts past one are never used), and nothing is taken."""
        if token in stop_ids or not 0 <= token < self.known or self.matcher.validate_tokens([token]) != 1:
            return False
        return self.matcher.consume_token(token)

    def pop(self, n: int) -> None:
        """Drop the last n pushed drafts: the grammar is back where the request's output left it."""
        if n:
            self.matcher.rollback(n)

    def advance(self, tokens: list[int], stop_ids: frozenset[int] = frozenset()) -> None:
        """The grammar takes the emitted tokens (each one chosen under its mask), up to a stop token: that ends
        the answer, and a completed grammar's matcher takes nothing more."""
        end = next((n for n, t in enumerate(tokens) if t in stop_ids), len(tokens))
        if tokens[:end] and not self.matcher.consume_tokens(tokens[:end]):
            raise RuntimeError(f"the guide refused emitted tokens {tokens}: {_first_line(self.matcher.get_error())}")
        if end < len(tokens) and self.matcher.is_stopped() and not self.matcher.is_accepting():
            # llguidance allows the end token where the grammar accepts, and where it stopped, stuck with no way
            # forward (a rule that only loops, deep in a grammar): that answer wouldn't match its guide. (A stop
            # token of the request's own, which the grammar takes as text, ends the answer where it is.)
            raise RequestError(f"the {self.spec.type} guide can't be completed from here: nothing it allows after "
                               "this answer's start ends; check the guide")


def apply_refusals(logits: torch.Tensor, refused: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with every refused token at -inf (a new tensor)."""
    return logits.masked_fill(refused.to(logits.device), float("-inf"))
