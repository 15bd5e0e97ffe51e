"""The prompt sets `pipeline bench` sweeps: built-in ones, or the user's own file.

- code: edits of code given in the prompt. The answer copies much of its prompt, which is where n-gram
  lookup and draft models pay most.
- chat: free questions whose answers copy little: the hard case for drafts.
- long: long answers (512 new tokens), where a short-output rule never applies.
Files: JSONL ({"prompt": ...} per line) or one prompt per line, as `pipeline generate --prompts-file`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

MERGE_INTERVALS = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
_CLASS = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]
'''
_SCRIPT = '''import sys

def count_words(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                counts[word] = counts.get(word, 0) + 1
    return counts

if __name__ == "__main__":
    for word, n in sorted(count_words(sys.argv[1]).items()):
        print(word, n)
'''

BUILTIN: dict[str, tuple[tuple[str, ...], int]] = {  # name -> (prompts, max new tokens)
    "code": ((
        f"Rewrite this code with comments:\n\n{MERGE_INTERVALS}",
        f"Add type hints to this function and return the full code:\n\n{MERGE_INTERVALS}",
        f"Rename the variables in this function to longer, clearer names:\n\n{MERGE_INTERVALS}",
        f"Add docstrings to every method of this class and return the full code:\n\n{_CLASS}",
        f"Make pop and peek raise IndexError with a clear message on an empty stack; return the whole class:\n\n{_CLASS}",
        f"Rewrite this script to use collections.Counter; return the full script:\n\n{_SCRIPT}",
        f"Add error handling for a missing file to this script and return all of it:\n\n{_SCRIPT}",
        f"Convert this function to use a while loop instead of a for loop; return the code:\n\n{MERGE_INTERVALS}",
    ), 128),
    "chat": ((
        "Explain the difference between a list and a tuple in Python, with examples.",
        "Describe how a hash map handles collisions, in a few paragraphs.",
        "What are three good habits for writing readable code?",
        "Give me a short plan for learning the basics of linear algebra in a month.",
        "Why is the sky blue? Answer for a curious ten-year-old.",
        "Compare TCP and UDP, and say when you would pick each.",
        "Write a short, friendly email inviting a colleague to a code review.",
        "What should I check before deploying a web service to production?",
    ), 128),
    "long": ((
        "Write a detailed tutorial on Python decorators, with several complete examples.",
        "Write a long story about a robot who learns to paint, in several chapters.",
        "Explain in depth how a relational database executes a query, from parsing to results.",
        "Write a complete command-line todo application in Python, with tests, and explain each part.",
    ), 512),
}


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[str, ...]
    max_tokens: int


def prompt_set(name: str, max_tokens: int | None = None) -> PromptSet:
    """A built-in set by name, or a prompts file (its name is the file's stem; 128 new tokens unless given)."""
    if name in BUILTIN:
        prompts, default_tokens = BUILTIN[name]
        return PromptSet(name, prompts, max_tokens or default_tokens)
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"prompt set {name!r} is neither built in ({', '.join(BUILTIN)}) nor a file; pass one of "
                          f"those or a JSONL/text file of prompts")
    from pipeline.generate import read_prompts_file

    return PromptSet(path.stem, tuple(read_prompts_file(path)), max_tokens or 128)
