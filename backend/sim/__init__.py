"""The Chestnut twin: a fault-injectable digital twin of the dock at the USB boundary.

- :mod:`.twin` -- the dock's state (USB, bridge XDATA/SRAM/LTSSM, PCIe, GPU) as one thread-safe object
- :mod:`.pcie`, :mod:`.memory`, :mod:`.descriptors` -- config spaces and routing, sparse VRAM, USB descriptors
- :mod:`.engine` -- the GPU engine running the command packets of ``backend/protocol.py``; :mod:`.compute` --
  its compile and run, in a child process so the daemon keeps answering USB
- :mod:`.faults` -- fault kinds, activation (once / repeat / probability / window / phase), the inferred phase
- :mod:`.daemon`, :mod:`.wire`, :mod:`.client` -- ``chestnut twin serve``, its socket framing, ``TwinClient``
- :mod:`.usb3` -- tinygrad 0.14 ``USB3`` over the twin; :mod:`.pyusb_backend` -- a pyusb backend
- :mod:`.libusb_face` -- real libusb (and tinygrad's own ``USB3``) against the twin: umockdev's usbdevfs node
- :mod:`.cli` -- ``chestnut twin serve|fault|clear|status|devices|kinds|plug|unplug|power-cycle|libusb``
"""
