"""Build pipeline/draft/data/prompts.jsonl: the built-in prompts `pipeline draft train` self-distils a head on.

Two kinds of record:
- written for this project (no "source" field): kept as they are;
- "source": "stdlib": drawn from CPython's standard library (PSF license, see the NOTICE next to the data):
  - code completions in the style of HumanEval: a public function's signature and the first paragraph of
    its docstring, the body left to the target (methods inside their class line);
  - chat requests about a module or one of its functions, from a few templates.

Why: the head learns from the target's answers to these prompts, and with 230 prompts a 60-minute run met its cap
of 8 answers a prompt and trained 16 epochs on them (training accuracy 0.84, held-out 0.59): more distinct
prompts, not more rounds of the same ones, is what it lacked.

None is a function scripts/bench_cpu.py benchmarks (its names are left out). Records are shuffled with a fixed
seed, so any prefix (a short run's first answer round) mixes both kinds, and every 10th is held out
(pipeline/draft/data.py). Run once with a fixed CPython; the output is committed, not rebuilt in CI.

    python scripts/build_draft_prompts.py       # rewrites pipeline/draft/data/prompts.jsonl
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import random
import re
import sys
import textwrap
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import PROMPTS as BENCH_PROMPTS  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "pipeline" / "draft" / "data" / "prompts.jsonl"
SEED = 0
COMPLETIONS = 560
MODULE_CHATS = 120
FUNCTION_CHATS = 180
DOC_LINES = 6  # of a docstring's first paragraph, at most
# Pure-Python stdlib modules with documented public functions. The modules of the calibration text
# (scripts/build_calib_data.py), which the head already trains on as plain text, are left out.
MODULES = (
    "ast", "asyncio.tasks", "base64", "binascii", "bz2", "cgi", "cmd", "codecs", "collections", "colorsys",
    "compileall", "configparser", "datetime", "decimal", "dis", "email.utils", "filecmp", "fileinput",
    "ftplib", "getopt", "gettext", "glob", "gzip", "hashlib", "hmac", "html", "html.parser", "http.cookies",
    "imaplib", "inspect", "io", "itertools", "keyword", "linecache", "locale", "logging", "lzma", "mailbox",
    "mimetypes", "netrc", "ntpath", "numbers", "optparse", "os", "pathlib", "pickle", "pickletools", "pkgutil",
    "platform", "plistlib", "poplib", "posixpath", "py_compile", "pydoc", "quopri", "random", "re", "secrets",
    "selectors", "shelve", "shutil", "site", "smtplib", "socket", "socketserver", "sqlite3", "ssl", "stat",
    "subprocess", "sysconfig", "tabnanny", "tarfile", "tempfile", "threading", "timeit", "token", "tokenize",
    "trace", "traceback", "tracemalloc", "types", "typing", "unittest.case", "urllib.parse", "urllib.request",
    "uuid", "warnings", "wave", "weakref", "webbrowser", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
    "zipimport", "zoneinfo",
)
MODULE_TEMPLATES = (
    "Explain what Python's {mod} module is for ({summary}), with a short example.",
    "When would I use the {mod} module in Python? {summary_cap}. Give two use cases.",
    "Write a short tutorial on Python's {mod} module: {summary}.",
)
FUNCTION_TEMPLATES = (
    "Explain what {qual}() does in Python, with an example: {summary}",
    "Write a short Python script that uses {qual}(), with a docstring and an example.",
    "What are common mistakes when using {qual}() in Python? It does this: {summary}",
)


def bench_names() -> set[str]:
    return {re.match(r"def (\w+)", p).group(1) for p in BENCH_PROMPTS}


def first_paragraph(doc: str) -> str | None:
    para = doc.strip().split("\n\n")[0].strip()
    lines = para.splitlines()
    if len(para) < 20 or len(lines) > DOC_LINES or not para.isascii() or '"""' in para or "\\" in para:
        return None
    return para


def completion(fn, name: str, owner: str | None) -> str | None:
    """'def name(sig):\\n    \"\"\"doc\"\"\"\\n', inside 'class Owner:' for a method; None where unusable."""
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    doc = first_paragraph(inspect.getdoc(fn) or "")
    if doc is None or "<" in sig or len(sig) > 120:
        return None
    body = f'def {name}{sig}:\n{textwrap.indent(chr(34) * 3 + doc + chr(34) * 3, "    ")}\n'
    return f"class {owner}:\n{textwrap.indent(body, '    ')}" if owner else body


def public_functions(mod) -> list[tuple[str, str | None, object]]:
    """(name, owner class or None, function) for functions and methods defined in mod itself."""
    out = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            out.append((name, None, obj))
        elif inspect.isclass(obj):
            for mname, m in sorted(vars(obj).items()):
                if not mname.startswith("_") and inspect.isfunction(m):
                    out.append((mname, name, m))
    return out


def stdlib_prompts(rng: random.Random) -> list[str]:
    skip = bench_names()
    completions, module_chats, function_chats = [], [], []
    for modname in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                continue
        summary = first_paragraph(inspect.getdoc(mod) or "")
        if summary and len(summary.splitlines()) == 1:
            s = summary.rstrip(".")
            module_chats += [t.format(mod=modname, summary=s[0].lower() + s[1:], summary_cap=s)
                             for t in MODULE_TEMPLATES]
        for name, owner, fn in public_functions(mod):
            if name in skip:
                continue
            text = completion(fn, name, owner)
            if text:
                completions.append(text)
            doc = first_paragraph(inspect.getdoc(fn) or "")
            if doc and len(doc.splitlines()) == 1 and owner is None:
                qual = f"{modname}.{name}"
                function_chats += [t.format(qual=qual, summary=doc) for t in FUNCTION_TEMPLATES]
    pick = lambda items, n: rng.sample(items, min(n, len(items)))  # noqa: E731
    return pick(completions, COMPLETIONS) + pick(module_chats, MODULE_CHATS) + pick(function_chats, FUNCTION_CHATS)


def main() -> None:
    rng = random.Random(SEED)
    rows = [json.loads(line) for line in OUT.read_text(encoding="utf-8").splitlines() if line.strip()]
    written = sorted((r for r in rows if "source" not in r), key=lambda r: r["prompt"])  # a rerun: same order
    drawn = [{"prompt": p, "source": "stdlib"} for p in dict.fromkeys(stdlib_prompts(rng))
             if p not in {r["prompt"] for r in written}]
    records = written + drawn
    rng.shuffle(records)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tmp.replace(OUT)
    print(f"{OUT}: {len(written)} written + {len(drawn)} from the stdlib of CPython {platform.python_version()}, "
          f"{OUT.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
