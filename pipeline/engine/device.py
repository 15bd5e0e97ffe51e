"""Where the portable engine runs: a device choice (auto | cpu | cuda | cuda:N) checked against what torch sees,
and the KV pool a GPU's free memory holds.

A --device is read once, into a `DeviceChoice` (its spelling checked and normalized: the CLI's option type, or an
options object's own field), and chosen once per process, into a `Device` (`DeviceChoice.choose`: the one place a
choice becomes a device). Both are strings, so they go into engine.json, a config.pbtxt or an environment variable
as they are; what takes a `Device` uses it as it is, so nothing asks torch twice. The commands print the line the
choice returns, once, so a run always says where it ran and why. The module imports torch only inside the
functions that ask it, so the Triton configs can check a choice's spelling without torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import ConfigError

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N"
# The share of the GPU memory left free after the weights load that the KV pool may take, as TensorRT-LLM's
# KvCacheConfig.free_gpu_memory_fraction (default 0.9, and `pipeline compile --free-gpu-memory-fraction` on its
# route): the rest is left for activations, the allocator's slack and whatever else shares the GPU.
DEFAULT_GPU_MEMORY_FRACTION = 0.9

_CUDA = re.compile(r"cuda(?::(\d+))?")


class DeviceChoice(str):
    """A --device as asked for, spelled one way: "auto", "cpu" or "cuda:N" (a bare "cuda" is cuda:0, the device
    torch's "cuda" means until a program picks another), and `asked`, as the user spelled it, for messages. Made
    from a DeviceChoice, it is that one: nothing is read twice. Raises ConfigError for a name that is none of
    these."""

    asked: str

    def __new__(cls, choice: str = "auto") -> DeviceChoice:
        if isinstance(choice, DeviceChoice):
            return choice
        name = str(choice).strip().lower()
        if name not in ("auto", "cpu"):
            match = _CUDA.fullmatch(name)
            if match is None:
                raise ConfigError(f"unknown device {choice!r}; use auto, cpu, cuda or cuda:N (N: a GPU's index, 0 "
                                  f"first)")
            name = f"cuda:{int(match.group(1) or 0)}"
        read = super().__new__(cls, name)
        read.asked = str(choice)
        return read

    def __getnewargs__(self) -> tuple[str]:
        return (self.asked,)

    @property
    def auto(self) -> bool:
        return self == "auto"

    def choose(self) -> tuple[Device, str]:
        """(the device, the one line saying what was picked and why); asks torch only where the choice needs it."""
        return pick_device(self, ()) if self == "cpu" else pick_device(self, *visible_gpus())


class Device(DeviceChoice):
    """A device chosen for this process ("cpu" or "cuda:N") by `DeviceChoice.choose`, with the line that says why.
    As a choice it chooses itself: what takes one uses it as it is, and nothing asks torch again."""

    line: str

    def __new__(cls, name: str, line: str = "") -> Device:
        device = str.__new__(cls, name)
        device.asked, device.line = name, line
        return device

    def __getnewargs__(self) -> tuple[str, str]:  # pickled (a build's stages, a spawned process) with its line
        return str(self), self.line

    def choose(self) -> tuple[Device, str]:
        return self, self.line


AUTO = DeviceChoice("auto")


class DeviceField:
    """An options dataclass's `device` field: what it is given is read there, once, into a DeviceChoice (default
    auto), so a library caller's "CUDA" is checked where it enters as the CLI's is. A data descriptor, which
    dataclasses call for the field's default and from __init__, frozen ones too."""

    def __set_name__(self, owner, name: str) -> None:
        self._slot = f"_{name}_choice"

    def __get__(self, obj, owner=None) -> DeviceChoice:
        return AUTO if obj is None else getattr(obj, self._slot)

    def __set__(self, obj, value: str) -> None:
        object.__setattr__(obj, self._slot, DeviceChoice(value))


def is_cuda(device: str) -> bool:
    return str(device).strip().lower().startswith("cuda")


def pick_device(choice: str, gpus: tuple[str, ...], cpu_build: bool = False) -> tuple[Device, str]:
    """(device, the line that says why) for a choice, given the names of the GPUs torch sees (cuda:0 first) and
    whether this torch is a CPU-only build. Pure: `DeviceChoice.choose` asks torch."""
    device = DeviceChoice(choice)
    seen = f"torch sees {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}" if gpus else "torch sees no GPU"
    if isinstance(device, Device):
        return device.choose()
    if device == "cpu":
        return _chosen("cpu", "device: cpu (asked for)")
    if device.auto:
        if not gpus:
            return _chosen("cpu", f"device: cpu (auto: {seen}{'; this torch is a CPU-only build' if cpu_build else ''})")
        return _chosen("cuda:0", f"device: cuda:0 ({gpus[0]}, auto: {seen})")
    index = int(device.split(":")[1])
    if not gpus:
        why = ("this torch is a CPU-only build: install a CUDA build of torch on a machine with an NVIDIA GPU"
               if cpu_build else "no CUDA device is visible: check nvidia-smi and CUDA_VISIBLE_DEVICES")
        raise ConfigError(f"device {device.asked!r} asks for a GPU but {seen} ({why}); use --device cpu or auto")
    if index >= len(gpus):
        raise ConfigError(f"device {device.asked!r} is past the GPUs here: {seen} (cuda:0 to cuda:{len(gpus) - 1}); "
                          f"use --device cuda:0 to cuda:{len(gpus) - 1}, or auto")
    return _chosen(device, f"device: {device} ({gpus[index]}, asked for; {seen})")


def _chosen(name: str, line: str) -> tuple[Device, str]:
    return Device(name, line), line


def visible_gpus() -> tuple[tuple[str, ...], bool]:
    """(the names of the GPUs torch sees, cuda:0 first; whether this torch is a CPU-only build)."""
    if _cpu_only_build():  # no GPU to see: `pipeline serve`'s supervisor need not import torch (2 s, 230 MB) to say so
        return (), True
    import torch

    cpu_build = torch.version.cuda is None
    if not torch.cuda.is_available():
        return (), cpu_build
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())), cpu_build


def _cpu_only_build(version_file: Path | None = None) -> bool:
    """Whether the installed torch is built for neither CUDA nor ROCm, read from its generated torch/version.py
    (`cuda = None`, `hip = None`) without importing it; False where the file can't be read so (then torch is asked)."""
    import ast
    import importlib.util

    try:
        version_file = version_file or Path(importlib.util.find_spec("torch").origin).with_name("version.py")
        tree = ast.parse(version_file.read_text())
    except (AttributeError, ImportError, OSError, SyntaxError, TypeError, ValueError):
        return False
    built = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    built[target.id] = node.value.value
    return "cuda" in built and "hip" in built and built["cuda"] is None and built["hip"] is None


def choose_device(choice: str) -> tuple[Device, str]:
    """(device: "cpu" or "cuda:N", the one line saying what was picked and why) for auto|cpu|cuda|cuda:N; raises
    ConfigError for a GPU torch doesn't see, or a malformed name."""
    return DeviceChoice(choice).choose()


def resolve_device(device: str) -> Device:
    """The device a choice picks here: "cpu" or "cuda:N" ("auto": cuda:0 where torch sees a GPU, else cpu); a
    `Device` is itself."""
    return choose_device(device)[0]


def check_fraction(fraction: float, name: str = "gpu_memory_fraction") -> None:
    if not 0 < fraction <= 1:
        raise ConfigError(f"{name} must be in (0, 1] (got {fraction}); it is the share of the GPU memory free after "
                          f"the weights load that the KV cache may take (default {DEFAULT_GPU_MEMORY_FRACTION})")


def kv_pool_blocks(free_bytes: int, bytes_per_block: int, *, block_size: int, max_batch_size: int, max_seq_len: int,
                   fraction: float = DEFAULT_GPU_MEMORY_FRACTION) -> int:
    """The target's KV pool on a GPU, in blocks: `fraction` of the memory free once the weights are loaded
    (torch.cuda.mem_get_info), but never more than max_batch_size requests of max_seq_len tokens need: past that
    the blocks would only ever hold prefix-cache entries, and the GPU may be shared. Pure.

    Raises ConfigError when not even one request of max_seq_len fits."""
    check_fraction(fraction)
    if bytes_per_block < 1 or block_size < 1:
        raise ConfigError(f"a KV block must have bytes and tokens (got {bytes_per_block} bytes, {block_size} tokens)")
    per_request = -(-max_seq_len // block_size)
    fit = int(max(free_bytes, 0) * fraction) // bytes_per_block
    if fit < per_request:
        raise ConfigError(
            f"the KV cache gets {fraction:g} of the {max(free_bytes, 0) / 2**30:.2f} GiB of GPU memory free after the "
            f"weights: {fit} blocks of {bytes_per_block} bytes, and one request of max_seq_len {max_seq_len} needs "
            f"{per_request}; lower max_seq_len, raise the fraction, or free GPU memory (or use --device cpu)")
    return min(fit, max_batch_size * per_request)
