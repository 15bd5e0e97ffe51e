"""tritonserver's own crash backtrace, named: the frames in its binary matched against the binary's ELF symbol table.

On SIGSEGV tritonserver prints `backtrace()` frames, `N# 0xADDR in PATH`. Frames in shared libraries carry names
(`pthread_mutex_lock`, `TRITONBACKEND_Response...`); frames in the tritonserver binary itself don't: its functions
aren't exported, only listed in its symbol table (`.symtab`, not stripped in the bundled 2.51). The binary is
position-independent, so an address is its load base plus the function's offset; the base is found from frame 0,
which is always inside tritonserver's ErrorSignalHandler (its own handler calls backtrace), as the page-aligned
value that puts that address inside that function.
"""

from __future__ import annotations

import bisect
import functools
import re
import struct
from pathlib import Path

FRAME = re.compile(r"^\s*(\d+)# 0x([0-9A-Fa-f]+) in (\S+)\s*$", re.M)
HANDLER = "ErrorSignalHandler"  # triton::server::(anonymous namespace)::ErrorSignalHandler(int), src/main.cc's
PAGE = 0x1000
SHT_SYMTAB, STT_FUNC = 2, 2


@functools.lru_cache(maxsize=4)
def functions(binary: str) -> tuple[tuple[int, ...], tuple[tuple[int, int, str], ...]]:
    """(starts, (start, size, mangled name) per function), sorted, from the ELF64 binary's .symtab; empty where it
    has none or can't be read."""
    try:
        data = Path(binary).read_bytes()
        if data[:4] != b"\x7fELF" or data[4] != 2:
            return (), ()
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    except (OSError, struct.error):
        return (), ()
    found = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != SHT_SYMTAB or not entsize:
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name, info, _, _, value, length = struct.unpack_from("<IBBHQQ", data, at)
            if info & 0xF == STT_FUNC and value and length:
                end = data.index(b"\0", strtab + name)
                found.append((value, length, data[strtab + name:end].decode(errors="replace")))
    found.sort()
    return tuple(f[0] for f in found), tuple(found)


def _at(starts, table, offset: int) -> str | None:
    i = bisect.bisect_right(starts, offset) - 1
    if i >= 0 and table[i][0] <= offset < table[i][0] + table[i][1]:
        return table[i][2]
    return None


def named_frames(crash: str) -> list[str]:
    """The mangled names of the backtrace's frames in the tritonserver binary, in order ([] where the binary, its
    symbols or frame 0 in its signal handler aren't there to go by)."""
    frames = [(int(n), int(a, 16), path) for n, a, path in FRAME.findall(crash)]
    own = [f for f in frames if Path(f[2]).name == "tritonserver"]
    if not own or own[0][0] != 0:
        return []
    starts, table = functions(own[0][2])
    handlers = [t for t in table if HANDLER in t[2]]
    for start, size, _ in handlers:
        base = (own[0][1] - start) // PAGE * PAGE
        if start <= own[0][1] - base < start + size:
            return [name for _, address, _ in own if (name := _at(starts, table, address - base))]
    return []


def demangled(name: str) -> str:
    """An Itanium nested name as C++ spells it (`_ZN6triton6server4grpc23ModelStreamInferHandler7ProcessEb` ->
    `triton::server::grpc::ModelStreamInferHandler::Process`), its parameters left out; anything else as it is."""
    if not name.startswith("_ZN"):
        return name
    i, parts = 3, []
    while i < len(name) and name[i] in "KVr":  # const, volatile, restrict
        i += 1
    while i < len(name) and name[i].isdigit():
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        size = int(name[i:j])
        parts.append(name[j:j + size])
        i = j + size
    return "::".join(parts) if parts and name[i:i + 1] == "E" else name


def crash_site(log: str) -> str | None:
    """Where the last crash in a server's log happened: the signal, and the first function past the signal handler
    that the binary's symbols name (`SIGSEGV in triton::server::grpc::ModelStreamInferHandler::Process`); None
    where the log shows no crash."""
    marker = re.findall(r"Signal \((\d+)\) received\.", log)
    if not marker:
        return None
    import signal

    try:
        name = signal.Signals(int(marker[-1])).name
    except ValueError:
        name = f"signal {marker[-1]}"
    own = named_frames(log[log.rfind("Signal ("):])
    return f"{name} in {demangled(own[1])}" if len(own) > 1 else name
