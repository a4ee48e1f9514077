"""Files kvrelay's processes share on one host, out of other local users' reach.

Some state passes between a node's processes through small files: a worker's gauge snapshot
(:mod:`kvrelay.core.gauge_snapshots`), the drain phase the supervisor writes and the engine
reads on every request (:mod:`kvrelay.core.drain`), vLLM's logging config. Another user on
the host must not be able to block, blind or steer a node through them. So:

- they live in one **runtime directory** (``connector.runtime_dir``; default
  :func:`default_runtime_dir`), created with mode 0700 and checked on use to be a real
  directory (no symlink), owned by this user and closed to group and others. Anything else
  is a :class:`~kvrelay.common.errors.ConfigError` naming the path: nobody else can plant a
  file in it.
- reading is guarded as well (:func:`read_small`, defence in depth, and for an operator's own
  ``connector.drain_file``): opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO or a device never
  blocks the reader, a symlink is not followed), checked to be a regular file owned by an
  allowed user, and capped in size. A file that fails a check reads as absent: nothing on a
  request path blocks on, or fails because of, the filesystem.
- writing is atomic (:func:`write_atomic`): a private temporary file beside the target, then
  ``rename``; readers see the old content or the new, never a part.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Collection
from pathlib import Path

from kvrelay.common.errors import ConfigError

READ_LIMIT = 64 * 1024              # the largest shared file kvrelay reads (a gauge snapshot is ~2 KiB)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"   # vLLM's variable: where it binds its processes' local sockets


def default_runtime_dir() -> Path:
    """``/dev/shm/kvrelay-<uid>`` (RAM-backed; the temporary directory where there is none)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else Path(tempfile.gettempdir())
    return base / f"kvrelay-{os.geteuid()}"


def runtime_dir_path(configured: str = "") -> Path:
    """The runtime directory's path (``configured``, or the default), neither created nor checked."""
    return Path(configured) if configured else default_runtime_dir()


def runtime_dir(configured: str = "") -> Path:
    """The runtime directory (``configured``, or the default), created if missing, and checked
    private: raises :class:`ConfigError` if it is a symlink, not a directory, someone else's,
    or open to group or others."""
    path = runtime_dir_path(configured)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=False)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"runtime directory {path}: {exc.strerror}") from exc
    why = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
           else f"is owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid()
           else f"has mode {stat.S_IMODE(st.st_mode):o}, open to other users" if st.st_mode & 0o077 else "")
    if why:
        raise ConfigError(f"runtime directory {path} {why}: kvrelay keeps node state there and needs it "
                          "private (a 0700 directory of the service user). Remove it, or set "
                          "connector.runtime_dir to another path")
    return path


def read_small(path: str | os.PathLike[str], limit: int = READ_LIMIT,
               owners: Collection[int] | None = None) -> bytes | None:
    """``path``'s bytes, or ``None`` when it is missing, not a regular file, a symlink, owned by
    a user outside ``owners`` (default: this user and root) or larger than ``limit``. Never
    blocks: a FIFO planted at ``path`` is refused, not waited on."""
    allowed = {os.geteuid(), 0} if owners is None else set(owners)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in allowed or st.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` at once (a private temporary file beside it, renamed)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
