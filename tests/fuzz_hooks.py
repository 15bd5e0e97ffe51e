"""Schemathesis hooks for the fuzzing test (tests/test_openai_api.py): loaded by `st run` through
$SCHEMATHESIS_HOOKS. After a generated request, a normal one must still get its usual answer, which the test
puts in $FUZZ_EXPECTED_TEXT: a server that stopped answering, or answered differently, fails the run.

Harm that lasts is still there at the next check, so a refused request (a 4xx: most of the coverage phase's
negative cases) is followed by one every REFUSED_EVERY-th time; a request the engine ran, every time. The normal
request after each of about 1,200 cases was two thirds of the test's time on a busy CI worker."""

from __future__ import annotations

import itertools
import json
import os
import urllib.request
from urllib.parse import urlsplit

import schemathesis


# An answer's length, where a request leaves it to the server (chat's default: the rest of the 1024-token context)
# or asks for one the context holds: the ~320 answers the positive cases get were most of the rest of the test's
# time, and a longer answer tests nothing more about the API's shapes. Lengths past the context go as drawn (the
# request check refuses them).
ANSWER_CAP, CONTEXT = 16, 1024
LENGTHS = ("max_tokens", "max_completion_tokens")
REFUSED_EVERY = 6
_refused = itertools.count()  # next() on it is atomic: `st run --workers 2` checks from two threads


@schemathesis.check
def serves_on(ctx, response, case):
    if 400 <= response.status_code < 500 and next(_refused) % REFUSED_EVERY:
        return
    url = urlsplit(response.request.url)
    body = json.dumps({"model": os.environ["FUZZ_MODEL"], "prompt": os.environ["FUZZ_PROMPT"], "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{url.scheme}://{url.netloc}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = json.loads(answer.read())["choices"][0]["text"]
    if text != os.environ["FUZZ_EXPECTED_TEXT"]:
        raise AssertionError(f"after this request a normal one answered {text!r}, not "
                             f"{os.environ['FUZZ_EXPECTED_TEXT']!r}")


@schemathesis.hook
def before_call(context, case, kwargs):
    """A generation request's answer length to at most ANSWER_CAP, as the comment above says."""
    if not isinstance(case.body, dict) or case.method.upper() != "POST":
        return
    if not any(field in case.body for field in LENGTHS):
        case.body["max_tokens"] = ANSWER_CAP
    for field in LENGTHS:
        value = case.body.get(field)
        if type(value) is int and ANSWER_CAP < value <= CONTEXT:
            case.body[field] = ANSWER_CAP
