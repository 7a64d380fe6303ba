"""Byte views of caller memory (torch tensors, numpy arrays, buffers) without copying.

The disk tier must not import torch just to accept tensors (a crash-test child or a tool that
only reads the catalog should start fast), so tensors are recognised by duck typing: anything
with ``data_ptr`` is treated as a torch tensor, and torch is looked up only when the first
tensor arrives (it is necessarily loaded by then).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

ALIGN = 4096  # O_DIRECT alignment for addresses, offsets and lengths


_uint8: Any = None  # torch.uint8, looked up when the first tensor arrives


def _tensor_view(tensor: Any) -> tuple[memoryview, int]:
    global _uint8
    if _uint8 is None:
        import torch  # already imported by whoever made the tensor

        _uint8 = torch.uint8
    if not tensor.is_cpu:
        raise ValueError(f"expected a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got strides {tuple(tensor.stride())}")
    if tensor.dtype is not _uint8:
        tensor = tensor.detach().reshape(-1).view(_uint8)
    view = memoryview(tensor.numpy())  # holds the tensor alive as long as the view lives
    return (view if view.ndim == 1 else view.cast("B")), tensor.data_ptr()


def address_of(view: memoryview) -> int:
    """The address of the first byte of a writable, non-empty, contiguous byte view."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def byte_view(obj: Any, *, writable: bool) -> tuple[memoryview, int]:
    """Return a flat byte memoryview over ``obj``'s memory and the address of its first byte.

    The address is -1 for a read-only non-tensor buffer (it is then never used in place).

    Raises:
        ValueError: ``obj`` is a non-CPU or non-contiguous tensor, a non-contiguous buffer, or
            read-only where ``writable`` is asked.
        TypeError: ``obj`` supports neither the tensor interface nor the buffer protocol.
    """
    if hasattr(obj, "data_ptr"):
        view, address = _tensor_view(obj)
    else:
        view = memoryview(obj)
        if not view.c_contiguous:
            raise ValueError("expected a contiguous buffer")
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        address = address_of(view) if not view.readonly and view.nbytes else -1
    if writable and view.readonly:
        raise ValueError("expected writable memory, got a read-only buffer")
    return view, address


def io_views(
    objs: Sequence[Any], payload_bytes: int, slot_bytes: int, *, writable: bool, zero_copy: bool
) -> tuple[list[memoryview], list[bool]]:
    """Byte views of a batch of payloads (or outs), and which may move a whole slot in place.

    A view may move in place when ``zero_copy`` is allowed (O_DIRECT mode) and it starts on a
    4096-byte boundary and spans at least ``slot_bytes``: O_DIRECT needs both.

    Raises:
        ValueError: a buffer is shorter than ``payload_bytes`` (or see ``byte_view``).
    """
    views: list[memoryview] = []
    in_place: list[bool] = []
    for obj in objs:
        view, address = byte_view(obj, writable=writable)
        if view.nbytes < payload_bytes:
            what = "out" if writable else "payload"
            raise ValueError(f"{what} of {view.nbytes} bytes is shorter than payload_bytes={payload_bytes}")
        views.append(view)
        in_place.append(zero_copy and view.nbytes >= slot_bytes and address % ALIGN == 0)
    return views, in_place
