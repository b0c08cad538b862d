"""Host-to-device copies of a step's small inputs (token ids, positions, slots, counts) that do
not make the host wait for the device, and the step's one device-to-host copy, which makes
the host wait only when it reads the values.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the
stream, so the host waits for everything queued before it (the previous step's commit, say)
and the device idles while the host prepares the rest of the step. From pinned memory the
copy is queued behind that work instead, and the host goes on; PyTorch's pinned-memory
allocator keeps the buffer until the copy has run. Off CUDA it is a plain tensor.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from functools import cache

import torch


def to_device(values: Sequence, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list, nested lists) as a tensor on `device`, without a stream sync on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        host = int64_tensor(values) if dtype is torch.int64 else None
        return torch.tensor(values, dtype=dtype, device=device) if host is None else host.to(device)
    return to_pinned(values, dtype).to(device, non_blocking=True)


def to_pinned(values: Sequence, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` as a host tensor that a non-blocking copy to the GPU can read from (pinned
    where CUDA is present)."""
    host = int64_tensor(values) if dtype is torch.int64 else None
    if host is None:
        return torch.tensor(values, dtype=dtype, pin_memory=_pinned())
    return host.pin_memory() if _pinned() else host


def int64_tensor(values: Sequence) -> torch.Tensor | None:
    """A list of ints, or a list of equally long lists of ints, as an int64 host tensor
    through an `array` (`torch.tensor` reads a Python list element by element, and a step's
    inputs are a list of about 200 ints: 25 us against 7.5 on the 2-core CPU, and
    torch.tensor's 25 us on an H100's host too); None for
    anything else (empty, ragged, not ints), which `torch.tensor` takes as it always did."""
    if type(values) is not list or not values:
        return None
    first = values[0]
    if type(first) is list:
        width = len(first)
        if not width or any(type(row) is not list or len(row) != width for row in values):
            return None
        flat = [v for row in values for v in row]
    elif type(first) is int:
        flat, width = values, 0
    else:
        return None
    try:
        packed = array.array("q", flat)
    except (TypeError, OverflowError):  # a float, a tensor, a number past int64: torch.tensor's
        return None
    host = torch.frombuffer(packed, dtype=torch.int64)
    return host.view(len(values), width) if width else host


@cache
def _pinned() -> bool:
    """Whether host buffers are pinned: CUDA is present. Asked once: each
    `torch.cuda.is_available()` reads the environment again (tens of us a step)."""
    return torch.cuda.is_available()


class HostCopy:
    """A device tensor's values on their way to the host: the copy is queued behind the work
    before it, and the host waits for it only in `tolist`, so work queued in between (a
    captured commit) runs while the host reads the values. Off CUDA it is a plain tensor."""

    def __init__(
        self, values: torch.Tensor, host: torch.Tensor | None = None, event: torch.cuda.Event | None = None
    ) -> None:
        """`host`, `event`: a pinned buffer of the values' shape and an event to use (HostReader's)
        rather than new ones."""
        self.event = None
        if values.device.type != "cuda":
            self.host = values
            return
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True) if host is None else host
        self.host.copy_(values, non_blocking=True)
        self.event = torch.cuda.Event() if event is None else event
        # on the current stream, named by its device (a record without one looks it up)
        self.event.record(torch.cuda.current_stream(values.device.index))

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class HostReader:
    """Makes the HostCopy of each step's results, each read (`tolist`) before the next is made:
    its pinned buffer, one per shape, and its event are kept for the next copy instead of
    allocated a step (a pinned allocation and a new event are tens of us of host time). A copy
    not read (its step raised) is overwritten by the next, which lands after it on the stream."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._event: torch.cuda.Event | None = None

    def copy(self, values: torch.Tensor) -> HostCopy:
        if values.device.type != "cuda":
            return HostCopy(values)
        key = (values.shape, values.dtype)
        host = self._buffers.get(key)
        if host is None:
            host = self._buffers[key] = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        return HostCopy(values, host, self._event)


class DeviceTokens:
    """Token ids chosen on the device ([k]), on their way to the host: the copy is queued at
    once and read (`value`) once a later read of the step has waited for the device anyway,
    so that choosing them makes the host wait for nothing. Meanwhile a forward that needs
    them as inputs takes them from `device` (`place_tokens`)."""

    def __init__(self, device_tokens: torch.Tensor) -> None:
        self.device = device_tokens
        self.copy = HostCopy(device_tokens)
        self._values: list[int] | None = None

    def value(self, index: int) -> int:
        if self._values is None:
            self._values = self.copy.tolist()
        return self._values[index]


def place_tokens(ids: torch.Tensor, pending: list[tuple[int, DeviceTokens, int]]) -> None:
    """Write tokens still on the device into `ids` [b]: each (row, tokens, index) puts
    `tokens.device[index]` at `ids[row]`, one copy per DeviceTokens (no host wait)."""
    groups: dict[int, tuple[DeviceTokens, list[int], list[int]]] = {}
    for row, tokens, index in pending:
        group = groups.setdefault(id(tokens), (tokens, [], []))
        group[1].append(row)
        group[2].append(index)
    for tokens, rows, indices in groups.values():
        at, taken = to_device([rows, indices], ids.device)
        ids.index_copy_(0, at, tokens.device.index_select(0, taken))
