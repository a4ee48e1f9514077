import logging
import os

import pytest

# Real-vLLM fixtures (the reference server, the PD stacks), shared by tests/e2e and tests/security.
pytest_plugins = ["tests.e2e.harness"]

# Keep UCX on loopback-capable transports in tests (no NIC is needed, none is assumed) and quiet.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
logging.getLogger("nixl").setLevel(logging.WARNING)
# One shared secret per test session (nodes refuse to start without one); child processes
# inherit it. Tests of the secret handling itself pass their own environment.
os.environ.setdefault("KVRELAY_SECRET", os.urandom(24).hex())


@pytest.fixture
def short_tmp():
    """A temporary directory with a short path: pytest's own are too long for the Unix sockets
    bound in it (a socket's path holds 107 bytes)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="kvr-") as d:
        yield Path(d)


def mount_small_fs(path, size: str):
    """A real tmpfs of ``size`` (e.g. "16k", "1m") mounted on ``path`` - a filesystem that
    really fills up. A context manager; the test is skipped where mounting needs root."""
    import contextlib
    import subprocess

    import pytest

    @contextlib.contextmanager
    def mounted():
        path.mkdir(exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if res.returncode:
            pytest.skip(f"cannot mount a small tmpfs (needs root): {res.stderr.decode().strip()}")
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)

    return mounted()


def pytest_addoption(parser):
    parser.addoption("--matrix", action="store_true",
                     help="also run the rest of the test matrices (tests marked `matrix`: the tensor-parallel "
                          "combinations beyond the three CI runs)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):  # noqa: ARG001 - pytest's hook signature
    """Every test on the shared PD stacks (``pd_stack``) first, then the tests that start stacks of
    their own. Only one vLLM stack runs at a time (``tests.e2e.harness.start_stack`` stops the
    previous one), so a test that starts its own stack between two ``pd_stack`` tests would stop
    the shared one under them; pytest's own ordering by fixture does not rule that out. A stable
    partition: the order within each part is pytest's."""
    if not config.getoption("--matrix"):
        more = pytest.mark.skip(reason="the rest of a test matrix: run with --matrix")
        for item in items:
            if "matrix" in item.keywords:
                item.add_marker(more)
    shared = [item for item in items if "pd_stack" in getattr(item, "fixturenames", ())]
    if shared:
        rest = [item for item in items if "pd_stack" not in getattr(item, "fixturenames", ())]
        items[:] = shared + rest
