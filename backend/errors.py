"""Typed errors at the backend boundary, one class per health layer.

tinygrad 0.14 raises plain ``RuntimeError``/``AssertionError`` (it defines no exception classes of its own:
``runtime/support/usb.py``, ``runtime/support/hcq.py``, ``runtime/ops_amd.py``); pyusb raises
``usb.core.USBError``. Everything that leaves ``chestnut.backend`` is one of the classes below and
keeps the original message in ``.detail`` (and the original exception as ``__cause__``).

Layers (``docs/health.md``): ``usb`` -> ``pcie`` -> ``gpu`` -> ``output``;
model and configuration problems are not dock faults and have their own classes.
"""

from __future__ import annotations

from enum import StrEnum


class Layer(StrEnum):
    """A health layer; the values match ``LayerHealth.Layer`` in ``msgs/chestnut.capnp``."""

    USB = "usb"
    PCIE = "pcie"
    GPU = "gpu"
    OUTPUT = "output"


class ChestnutError(Exception):
    """Base of every error the backend raises.

    ``reason`` is a short machine-friendly tag (e.g. ``"disconnect"``, ``"fence_stall"``) that
    health counters and logs use; ``detail`` is the original, human-readable message.
    """

    layer: Layer | None = None

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class UsbLayerError(ChestnutError):
    """The USB layer failed: no dock, wrong VID/PID or product string, transfer error/timeout."""

    layer = Layer.USB


class PcieLayerError(ChestnutError):
    """The PCIe layer failed: LTSSM not 0x78, bad TLP completion, TLP retries exhausted."""

    layer = Layer.PCIE


class GpuLayerError(ChestnutError):
    """The GPU layer failed: unsupported architecture, fence not advancing within the wait timeout, hang."""

    layer = Layer.GPU


class OutputLayerError(ChestnutError):
    """The model output is unusable: non-finite, wrong shape/dtype, out of range, stale, disagreeing."""

    layer = Layer.OUTPUT


class ModelError(ChestnutError):
    """The model itself is unusable: missing file, unparsable ONNX, wrong input name/shape, bad fingerprint."""


class ConfigError(ChestnutError):
    """The configuration is unusable: missing GPU firmware cache, bad setting, unknown dock kind."""


LAYER_ERRORS: dict[Layer, type[ChestnutError]] = {
    Layer.USB: UsbLayerError,
    Layer.PCIE: PcieLayerError,
    Layer.GPU: GpuLayerError,
    Layer.OUTPUT: OutputLayerError,
}
