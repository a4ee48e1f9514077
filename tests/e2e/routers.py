"""More routers over a running stack's engines: a router is a small process (~2 s to start),
an engine pair ~40 s, so a test whose difference is the router's settings (API keys, timeouts,
first-token mode) puts its own router in front of a shared stack instead of starting a stack.

Each router gets the stack's own router settings with the test's overrides, logs into the
stack's log directory and is one of the stack's processes while it runs (so checks over the
stack's processes and logs cover it too).

The engines' prefix caches are shared too: prompts a test sends through its own router stay
cached on the decode node, and the stack's router (decode-first) would then serve those prompts
on D alone, with no transfer for the e2e tests to check. So such a test asks prompts of its
own (:func:`own_cases`: the e2e cases' shapes, other text) and its own reference answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import yaml

from kvrelay.core import config as kcfg
from kvrelay.deploy import launch
from tests.e2e.harness import CASES, Case, PlainServers, StackHandle, answers_of


def own_cases(tag: str, cases: list[Case] = CASES) -> list[Case]:
    """``cases``' shapes (kind, streaming, length) with prompts no other test sends, named ``tag-<name>``."""
    salt = sum(map(ord, tag)) * 1000
    return [dataclasses.replace(c, name=f"{tag}-{c.name}", seed=salt + c.seed) for c in cases]


def reference_for(plain: PlainServers, cases: list[Case]) -> dict[str, str]:
    """One vLLM's greedy answer to each of ``cases`` (the session's plain servers), by name."""
    with plain.use(2) as urls:
        return answers_of(urls, cases)


def spawn_router(stack: launch.Stack, name: str, port: int, **router: Any) -> tuple[subprocess.Popen, str]:
    """Start ``kvrelay router`` on ``port`` over ``stack``'s nodes with ``router`` overriding the
    stack router's settings, and wait until it answers; (process, URL). A second router follows
    no KV events (the engines' publishers are the stack router's): under ``decode_first`` it
    claims nothing it has not been told."""
    data = kcfg.to_dict(stack.router_config())
    data["router"].update(kv_events=[], **router, port=port)
    path = stack.log_dir / f"router-{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    log_path = stack.log_dir / f"router-{name}.log"
    with open(log_path, "w") as log:
        proc = launch.spawn_group([sys.executable, "-m", "kvrelay.cli", "router", "--config", str(path)],
                                  dict(os.environ), log)
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_healthy(url, proc, 60, str(log_path))
    except BaseException:
        launch.stop_group(proc)
        raise
    return proc, url


@contextlib.contextmanager
def second_router(handle: StackHandle, name: str, port: int, **router: Any) -> Iterator[StackHandle]:
    """``handle`` seen through a router of its own (:func:`spawn_router`): the same engines,
    events and logs; ``router_url`` and ``cfg.router`` are the new router's. Stopped on exit."""
    proc, _ = spawn_router(handle.stack, name, port, **router)
    key = f"router-{name}"
    handle.stack.procs[key] = proc
    try:
        data = kcfg.to_dict(handle.cfg)
        data["router"].update(router, port=port)
        yield dataclasses.replace(handle, cfg=kcfg.from_dict(data))
    finally:
        handle.stack.procs.pop(key, None)
        launch.stop_group(proc)
