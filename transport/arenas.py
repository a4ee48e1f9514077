"""The memory behind a receive pool: shared or private host pages, or device memory.

:class:`SharedArena` (``/dev/shm``) is for the same-host ``shm`` backend, which writes into it
from another process; :class:`PrivateArena` for the rest (NIXL/UCX register it once; their CMA
writes into private pages are faster); :class:`DeviceArena` for a pool in GPU memory. Host
arenas are populated (every page faulted in, writable) and, where CUDA is present, pinned
with ``cudaHostRegister`` by :class:`~kvrelay.transport.pool.ReceivePool`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from multiprocessing import shared_memory

from kvrelay.common.errors import TransportError

log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)     # Linux 5.14+; Python 3.11 lacks the name


class Arena:
    """Page-aligned host memory behind the pool. Subclasses: shared (``shm``) or private."""

    buf: memoryview
    name: str = ""
    pinned: bool = False
    mem = "DRAM"                  # what NIXL registers it as
    device_index = 0

    @property
    def address(self) -> int:
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.buf))

    def populate(self) -> bool:
        """Fault every page of the arena in, writable, now (blocks; idempotent).

        False, with a warning, where the kernel cannot (before 5.14) or the memory is not
        there (a full ``/dev/shm``): the pool still works and faults its pages lazily. Never
        touches the bytes, so it cannot raise SIGBUS on a short tmpfs."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        t0 = time.monotonic()
        rc = libc.madvise(ctypes.c_void_p(self.address), ctypes.c_size_t(self.buf.nbytes), MADV_POPULATE_WRITE)
        if rc != 0:
            err = ctypes.get_errno()
            log.warning("receive pool not populated (%s): its pages fault in on first use",
                        os.strerror(err))
            return False
        log.info("receive pool: %d MiB faulted in at start-up in %.2f s", self.buf.nbytes >> 20,
                 time.monotonic() - t0)
        return True

    def pin_if_cuda(self) -> bool:
        """Page-lock the arena for CUDA when a GPU is present (idempotent). No-op otherwise."""
        if self.pinned:
            return True
        try:
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_available():
            return False
        rc = torch.cuda.cudart().cudaHostRegister(self.address, self.buf.nbytes, 0)
        self.pinned = int(rc) == 0
        if not self.pinned:
            _clear_cuda_error()     # else the next kernel launch in this process reports it
            log.warning("cudaHostRegister failed (%s); receive pool is pageable", rc)
        return self.pinned

    def _unpin(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False

    def close(self) -> None:
        raise NotImplementedError


def _clear_cuda_error() -> None:
    """Reset the runtime's last-error after a failed host registration (torch checks it after
    every launch). Best effort: needs NVIDIA's cuda-python, else the error stays to be seen."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return
    runtime.cudaGetLastError()


class PrivateArena(Arena):
    """Anonymous private memory: for backends whose peers never map the pool (nixl, tcp, ucx).

    Measured here: NIXL/UCX CMA writes into private pages run ~20 % faster than into
    tmpfs-backed shared pages, and faster again with transparent huge pages
    (``MADV_HUGEPAGE``; the kernel walks one 2 MiB page instead of 512 small ones).
    """

    def __init__(self, nbytes: int) -> None:
        self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):    # fewer page walks for CMA/RDMA
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self._unpin()
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            log.warning("private arena still has exported views; unmapped at exit")


class SharedArena(Arena):
    """A page-aligned shared-memory segment other processes can attach by name.

    The creator uses :mod:`multiprocessing.shared_memory` (which unlinks the segment
    if the process dies). Attaching maps ``/dev/shm/<name>`` directly, so the
    attaching process never registers the segment with its resource tracker - in
    Python 3.11 that registration would unlink the receiver's pool at exit.
    """

    def __init__(self, nbytes: int, *, name: str | None = None, create: bool = True) -> None:
        self.owner = create
        self.shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if create:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            assert self.shm.buf is not None
            self.buf: memoryview = self.shm.buf
            self.name: str = self.shm.name
            return
        if not name:
            raise TransportError("attaching a shared arena needs its name")
        try:
            fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        except OSError as exc:
            raise TransportError(f"cannot attach shared memory {name!r}: {exc}") from exc
        try:
            # MAP_POPULATE: map the receiver's (populated) pages now, not on the first write to each
            self._mmap = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.name = name

    def close(self) -> None:
        self._unpin()
        self.buf.release()
        try:
            if self.shm is not None:
                self.shm.close()
            if self._mmap is not None:
                self._mmap.close()
        except BufferError:     # a view is still exported (e.g. a registered array): unmapped at exit
            log.warning("shared segment %s still has exported views; unlinking anyway", self.name)
        if self.owner and self.shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


class DeviceArena:
    """Device memory behind the pool (``transport.pool_device: gpu``): one uint8 tensor on the
    decode engine's KV-cache device, registered with NIXL as VRAM so prefill nodes write chunks
    straight into it and the install is a device-to-device scatter. Its slots' headers live in
    host memory beside it (:meth:`kvrelay.transport.pool.ReceivePool.header_view`): NIXL delivers
    each header in its write's notification, and the receiver reads it on the host.

    ``device`` may be ``cpu``: a tensor arena in host memory, the same code paths without a GPU
    (what the tests of this host exercise)."""

    name = ""
    pinned = False

    def __init__(self, nbytes: int, device: str) -> None:
        import torch

        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self.mem = "VRAM" if self.tensor.device.type == "cuda" else "DRAM"
        self.device_index = self.tensor.device.index or 0

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    def close(self) -> None:
        del self.tensor
