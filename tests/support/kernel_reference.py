"""The profiler's own figures per kernel class, for checking `kernel_sampler.attribute`.

Built from torch's `FunctionEvent` tree (its parents, self times and the kernels it links
to each op), not from the raw events `attribute` reads: per (lane, phase) step scope and
class, microseconds. On CPU each op's self CPU time under a step scope; on CUDA each
kernel, memcpy and memset of an op under a step scope (device memcpys and memsets first,
then the outermost ancestor-or-self op that names a class, then the kernel's own name)."""
from __future__ import annotations

import torch

from ac_observe.engine import kernel_sampler as ks


def _chain(event) -> list[str]:
    """The event's name and its ancestors', innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def classes_from_function_events(prof, device_kernels: bool) -> dict:
    out: dict = {}
    for event in prof.function_events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.is_async:
            continue
        chain = _chain(event)
        keys = [ks._SCOPE_KEYS[name] for name in chain if name in ks._SCOPE_KEYS]
        if not keys:
            continue
        named = [c for c in map(ks.classify, reversed(chain)) if c]
        per_key = out.setdefault(keys[0], {})
        if not device_kernels:
            if not event.is_user_annotation:
                cls = named[0] if named else "other"
                per_key[cls] = per_key.get(cls, 0.0) + event.self_cpu_time_total
            continue
        for kernel in event.kernels:
            if kernel.name.startswith("ac::"):
                continue  # the device-side span of one of our scopes, not work
            own = ks.classify(kernel.name)
            cls = "memcpy" if kernel.name.startswith(("Memcpy", "Memset")) \
                else (named[0] if named else own or "other")
            per_key[cls] = per_key.get(cls, 0.0) + kernel.duration
    return {key: classes for key, classes in out.items() if classes}


def inclusive_us(prof, name: str, self_too: bool = True) -> float:
    """The profiler's own total CPU time of every event of that name (minus its own self
    time for a scope, whose self time is the interpreter between ops)."""
    return sum(e.cpu_time_total - (0 if self_too else e.self_cpu_time_total)
               for e in prof.function_events if e.name == name)
