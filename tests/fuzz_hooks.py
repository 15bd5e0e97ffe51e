"""Schemathesis hooks for the fuzzing test (tests/test_openai_api.py): loaded by `st run` through
$SCHEMATHESIS_HOOKS. After every generated request, a normal one must still get its usual answer, which the
test puts in $FUZZ_EXPECTED_TEXT: a server that stopped answering, or answered differently, fails the run."""

from __future__ import annotations

import json
import os
import urllib.request
from urllib.parse import urlsplit

import schemathesis


@schemathesis.check
def serves_on(ctx, response, case):
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
