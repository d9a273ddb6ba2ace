"""From a decoded frame to the ``Batch`` a trainer gets: numpy views, or torch tensors on a device.

Runs on the client's reader thread, so a batch is on its device before the
trainer asks for it. CUDA copies go through pinned memory on a CUDA stream
of the reader's own, and the batch carries an event: when the trainer takes
the batch (``next()``, on its own thread), its current stream waits for that
event and the tensors are recorded on that stream, so the trainer may compute
on any stream, and the copies of later batches overlap its work.

Imports torch only when a device is given.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ladle.proto import codec

from .batch import Batch

__all__ = ["check_device", "converter"]


def check_device(device: Any, pin: bool | None) -> Any:
    """The device batches go to, resolved in the constructor; refuses what would fail on the reader thread.

    ``"cuda"`` without an index is the caller's current CUDA device, read
    here: the reader thread that copies the batches has a current device of
    its own (device 0), not the one ``torch.cuda.set_device(local_rank)``
    chose for the trainer's thread.
    """
    if device is None:
        if pin:
            raise ValueError("pin_memory=True needs a torch device (device='cuda:0', ...)")
        return None
    try:
        import torch
    except ImportError:
        raise ValueError(f"device={device!r} needs torch, which is not installed") from None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device: {exc}") from None
    accelerated = target.type == "cuda" or bool(pin)
    if accelerated and not torch.cuda.is_available():
        what = f"device={device!r}" if target.type == "cuda" else "pin_memory=True"
        raise ValueError(f"{what} needs CUDA, and torch sees no CUDA device here")
    if target.type == "meta":
        raise ValueError("device='meta' holds no data: the batches would arrive as shapes only")
    if target.type == "cuda":
        index = torch.cuda.current_device() if target.index is None else target.index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"device={device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    if target.type != "cpu":  # mps, xpu, ...: each fails in its own way when absent
        try:
            torch.empty(1, device=target)
        except (RuntimeError, AssertionError, ValueError) as exc:
            raise ValueError(f"device={device!r} cannot be used here: {exc}") from None
    return target


def converter(device: Any, pin: bool | None) -> Callable[[codec.DecodedBatch], Batch]:
    """What turns a decoded frame into a ``Batch`` (on the reader thread), for a device ``check_device`` gave.

    A function of the device settings alone, not a method: the reader
    threads hold it, and a client they held would never be collected (nor
    its threads end) when a trainer drops it without ``close()``.
    """
    move: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]] | None = None
    if device is not None:
        move = _CudaCopies(device, pin) if device.type == "cuda" else _Tensors(device, pin)

    def to_batch(d: codec.DecodedBatch) -> Batch:
        arrays: dict[str, Any] = {
            "input_ids": d.input_ids,
            "loss_mask": d.loss_mask,
            "lengths": d.lengths,
            "sample_ids": d.sample_ids,
        }
        ready = None
        if move is not None:
            arrays, ready = move(arrays)
        lengths, width = arrays["lengths"], int(d.input_ids.shape[1])

        def mask() -> Any:  # made when the trainer first reads batch.attention_mask
            if device is not None and device.type == "cuda":
                return _torch_mask(lengths, width)
            array = d.attention_mask(np.int8)
            if device is None:
                array.flags.writeable = False  # as read-only as the other arrays: it is cached
                return array
            return _tensors({"mask": array}, device, bool(pin))["mask"]

        arrays.update(
            epoch=d.epoch,
            step=d.step,
            rank=d.rank,
            bucket=d.bucket,
            real_tokens=d.real_tokens,
            padded_tokens=d.padded_tokens,
            extra={},
            _mask=mask,
            _ready=ready,
        )
        return Batch._make(arrays)

    return to_batch


def _torch_mask(lengths: Any, width: int) -> Any:
    """int8 ``[rows, width]``, 1 on each row's first ``lengths[i]`` positions, made where ``lengths`` is.

    On a GPU it is a few small kernels on the trainer's current stream:
    nothing crosses from the host.
    """
    import torch

    positions = torch.arange(width, dtype=lengths.dtype, device=lengths.device)
    return (positions[None, :] < lengths[:, None]).view(torch.int8)


def _tensors(arrays: dict[str, Any], device: Any, pin: bool) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        # the views are read-only (they share the received message); tensors made from
        # them must not be written to, which torch cannot express
        warnings.simplefilter("ignore", UserWarning)
        for name, array in arrays.items():
            tensor = torch.from_numpy(array)
            if pin:
                tensor = tensor.pin_memory()
            if device.type != "cpu":
                tensor = tensor.to(device, non_blocking=pin)
            out[name] = tensor
    return out


class _Tensors:
    """Tensors on the CPU (sharing the received frame, or pinned copies), or on a device other than CUDA."""

    def __init__(self, device: Any, pin: bool | None) -> None:
        self.device = device
        self.pin = bool(pin)

    def __call__(self, arrays: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        return _tensors(arrays, self.device, self.pin), None


class _CudaCopies:
    """Each batch copied to a CUDA device on a stream of its own; the trainer's stream waits at ``next()``.

    The copies run on the reader thread, through pinned memory unless
    ``pin_memory=False`` (then each copy waits for itself). The batch's
    ``_ready`` makes the stream current on the trainer's thread wait for the
    copies (an event, no host wait) and records the tensors on that stream,
    so the caching allocator does not hand their memory to the next copies
    while the trainer's kernels still read it.
    """

    def __init__(self, device: Any, pin: bool | None) -> None:
        self.device = device
        self.pin = True if pin is None else bool(pin)
        self.stream: Any = None  # made on the reader thread, at its first batch

    def __call__(self, arrays: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        import torch

        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            out = _tensors(arrays, self.device, self.pin)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self.stream)
        tensors = tuple(out.values())
        device = self.device

        def ready() -> None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(copied)
            for tensor in tensors:
                tensor.record_stream(stream)

        return out, ready
