"""Real-vLLM fixtures: a plain reference server and 1P1D kvrelay stacks, shared per session.

Servers are expensive (~35-90 s to start on a 2-core host), so:
* the reference servers (plain vLLM, one per core: :class:`PlainServers`) start once and stay,
  idle, for the session; every module whose engines are bound as theirs asks them;
* each stack (per backend) starts once and serves every test that asks for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvrelay.bench.reference import Servers, server_count, servers, spread  # noqa: E402
from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.core import telemetry  # noqa: E402
from kvrelay.deploy import launch  # noqa: E402
from kvrelay.deploy.tiny_model import make_tiny_model  # noqa: E402

MODEL = "kvrelay-tiny"
MAX_TOKENS = 12
BLOCK = 128               # the tiny model's KV block, in tokens
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,;:!?0123456789\n"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str            # "completion" | "chat"
    stream: bool
    prompt_len: int      # characters = tokens for the tiny model's character tokenizer
    seed: int

    def text(self) -> str:
        rng = random.Random(self.seed)
        return "".join(rng.choice(ALPHABET) for _ in range(self.prompt_len))


# 14 cases: 10..1800 tokens, chunk-aligned and not, 1..8 chunks, chat and completion, stream and not.
CASES = [
    Case("c10", "completion", False, 10, 1), Case("c255", "completion", True, 255, 2),
    Case("c256", "completion", False, 256, 3), Case("c257", "completion", True, 257, 4),
    Case("c600", "completion", False, 600, 5), Case("c1024", "completion", True, 1024, 6),
    Case("c1100", "completion", False, 1100, 7), Case("c1800", "completion", True, 1800, 8),
    Case("h40", "chat", False, 40, 9), Case("h500", "chat", True, 500, 10),
    Case("h900", "chat", False, 900, 11), Case("h1300", "chat", True, 1300, 12),
    Case("h1700", "chat", False, 1700, 13), Case("c777", "completion", False, 777, 14),
]
PIPELINE_CASE = Case("pipe", "completion", False, 2200, 99)     # 9 chunks


@dataclass(frozen=True)
class SharedCase:
    """A request whose prompt starts with one of a few shared system prompts (prefix sharing)."""

    name: str
    kind: str            # "completion" | "chat"
    stream: bool
    system: int          # which shared system prompt (0..3)
    user_len: int

    def system_text(self) -> str:
        return Case(f"sys{self.system}", "chat", False, 300 + 60 * self.system, 500 + self.system).text()

    def user_text(self) -> str:
        return Case(self.name, "chat", False, self.user_len, 1000 + sum(map(ord, self.name))).text()


# Hardening chaos (a): 32 concurrent streams over 4 shared, uncached system prompts; prompts of
# 1..8 chunks (300..2030 tokens with the system prompt), chat and completion, stream and not.
CONCURRENT = [SharedCase(f"cc{i}", "chat" if i % 2 else "completion", i % 3 != 0, i % 4,
                         [20, 200, 450, 700, 950, 1200, 1450, 1700][i % 8]) for i in range(32)]


def run_shared(client: Any, case: SharedCase, request_id: str = "") -> str:
    headers = {"X-Request-Id": request_id} if request_id else None
    common: dict[str, Any] = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_headers=headers,
                                  stream=case.stream)
    if case.kind == "chat":
        msgs = [{"role": "system", "content": case.system_text()}, {"role": "user", "content": case.user_text()}]
        resp = client.chat.completions.create(messages=msgs, **common)
        if not case.stream:
            return str(resp.choices[0].message.content)
        return "".join(ch.delta.content or "" for ev in resp for ch in ev.choices)
    resp = client.completions.create(prompt=case.system_text() + case.user_text(), **common)
    if not case.stream:
        return str(resp.choices[0].text)
    return "".join(ch.text for ev in resp for ch in ev.choices)
TURN1 = Case("turn1", "chat", False, 1000, 41)


# The client-visible format with first_token=prefill is compared with one vLLM's, field by
# field (ids and timestamps aside); and requests that must take the decode path stay exact.
_FMT_PROMPT = Case("fmt", "completion", False, 300, 77).text()
_FMT_CHAT = [{"role": "user", "content": Case("fmtc", "chat", False, 280, 78).text()}]
FORMAT_REQS = {
    "fmt-c-stream": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 6, "stream": True,
                                         "stream_options": {"include_usage": True}}),
    "fmt-c-stream-plain": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 6, "stream": True}),
    "fmt-c": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 6}),
    "fmt-h-stream": ("/v1/chat/completions", {"messages": _FMT_CHAT, "max_tokens": 6, "stream": True,
                                              "stream_options": {"include_usage": True}}),
    "fmt-h-stream-plain": ("/v1/chat/completions", {"messages": _FMT_CHAT, "max_tokens": 6, "stream": True}),
    "fmt-h": ("/v1/chat/completions", {"messages": _FMT_CHAT, "max_completion_tokens": 6}),
    "fmt-c-one": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 1, "stream": True}),
    "fmt-err-context": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 4090, "stream": True}),
    # what vLLM's serving benchmark sends: feature-off values split like absent ones
    "fmt-c-bench": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 6, "stream": True, "ignore_eos": True,
                                        "repetition_penalty": 1.0, "logprobs": None,
                                        "stream_options": {"include_usage": True}}),
    # fallbacks (the decode path), compared by text
    "fb-stop": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 12, "stop": ["x", "M"]}),
    "fb-penalty": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 12, "presence_penalty": 1.5,
                                       "frequency_penalty": 0.5}),
    "fb-seed": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 11}),
    "fb-logprobs": ("/v1/completions", {"prompt": _FMT_PROMPT, "max_tokens": 12, "logprobs": 2}),
    "fb-chat-min": ("/v1/chat/completions", {"messages": _FMT_CHAT, "max_tokens": 12, "min_tokens": 4}),
}


def raw_post(url: str, path: str, body: dict) -> bytes:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps({"model": MODEL, "temperature": 0, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return bytes(r.read())
    except urllib.error.HTTPError as exc:       # an error answer is compared like any other
        return f"HTTP {exc.code} ".encode() + exc.read()


def turn2_messages(answer1: str) -> list[dict]:
    """Turn 2 of a conversation: turn 1's prompt, its answer, and a new user message."""
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": TURN1.text()},
            {"role": "assistant", "content": answer1},
            {"role": "user", "content": Case("turn2", "chat", False, 700, 42).text()}]


# Decode-side saves: turn 1 (~230 prompt tokens) answers with 100 tokens, so the first
# whole chunk ends inside the answer - only the decode node ever computed all of it.
DSAVE_ANSWER = 100


def dsave_messages(answer1: str | None = None, conv: int = 0) -> list[dict]:
    """Conversation ``conv`` (0: the decode-save test; 1, 2: the Redis outage test; 3: poisoning)."""
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": Case(f"dsave1.{conv}", "chat", False, 180, 43 + 10 * conv).text()}]
    if answer1 is None:
        return msgs
    return [*msgs, {"role": "assistant", "content": answer1},
            {"role": "user", "content": Case(f"dsave2.{conv}", "chat", False, 120, 44 + 10 * conv).text()}]


def run_chat(client: Any, messages: list[dict], max_tokens: int, request_id: str = "") -> str:
    headers = {"X-Request-Id": request_id} if request_id else None
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_headers=headers)
    return str(resp.choices[0].message.content)


def run_turn2(client: Any, answer1: str, request_id: str = "") -> str:
    return run_chat(client, turn2_messages(answer1), MAX_TOKENS, request_id)


def run_case(client: Any, case: Case, request_id: str = "") -> tuple[str, dict | None]:
    """Send one case through an OpenAI client; return (generated text, usage)."""
    headers = {"X-Request-Id": request_id} if request_id else None
    common: dict[str, Any] = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_headers=headers)
    if case.stream:
        common["stream_options"] = {"include_usage": True}
    if case.kind == "chat":
        msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": case.text()}]
        resp = client.chat.completions.create(messages=msgs, stream=case.stream, **common)
    else:
        resp = client.completions.create(prompt=case.text(), stream=case.stream, **common)
    if not case.stream:
        ch = resp.choices[0]
        return (ch.message.content if case.kind == "chat" else ch.text), resp.usage.model_dump()
    parts, usage = [], None
    for ev in resp:
        if ev.usage is not None:
            usage = ev.usage.model_dump()
        for ch in ev.choices:
            parts.append((ch.delta.content or "") if case.kind == "chat" else ch.text)
    return "".join(parts), usage


def openai_client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300, max_retries=0)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (no help/type lines)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def without_vllm_labels(series: dict[str, float]) -> dict[str, float]:
    """``kvrelay_x{engine="0",model_name="m",side="d"}`` -> ``kvrelay_x{side="d"}`` (summed over engines)."""
    out: dict[str, float] = {}
    for key, value in series.items():
        if key.startswith("kvrelay_") and "{" in key:
            name, _, rest = key.partition("{")
            labels = [p for p in re.findall(r'\w+="[^"]*"', rest) if not p.startswith(("engine=", "model_name="))]
            key = name + ("{" + ",".join(labels) + "}" if labels else "")
        out[key] = out.get(key, 0.0) + value
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far per thread (``comm``, tid) of every process in ``pid``'s process group."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) != pid:
                continue
            for tid in os.listdir(f"/proc/{entry}/task"):
                head, tail = Path(f"/proc/{entry}/task/{tid}/stat").read_text().rsplit(")", 1)
                fields = tail.split()
                out[f"{head.split('(', 1)[1]}[{tid}]"] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return out


def busiest_decode(stack: launch.Stack) -> str:
    """The live decode node with the most requests running (vLLM's own gauge)."""
    def running(spec: launch.NodeSpec) -> float:
        return sum(v for k, v in scrape(f"{stack.url(spec)}/metrics").items()
                   if k.startswith("vllm:num_requests_running"))
    live = [s for s in stack.specs if s.role is launch.Role.DECODE and s.name in stack.procs]
    return max(live, key=running).name


def read_events(path: Path) -> list[dict]:
    return telemetry.read_events(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# Every engine the tests start, references included, runs eagerly: torch.compile's warm-up is
# 10-20 s of each start on 2 cores, and a reference differs from a PD engine in nothing but
# that. tests/e2e/test_compiled.py keeps one stack and its reference compiled, as users run them.
EAGER = ("--enforce-eager",)


def _cfg(tiny_model: Path, tmp: Path, port0: int, **over: Any) -> kcfg.KVRelayConfig:
    data: dict[str, Any] = {
        "engine": {"model": str(tiny_model), "served_model_name": MODEL, "extra_args": list(EAGER)},
        "deploy": {"base_port": port0, "kv_base_port": port0 + 1000, "log_dir": str(tmp / "logs"),
                   "startup_timeout_s": 900},
        "router": {"port": port0 + 50, "health_interval_s": 0.5, "decode_first": False,   # each test names its path:
                   "first_token": "prefill"},           # the split path unless it asks for another
        "connector": {"events_path": str(tmp / "events.jsonl"), "metrics_port": port0 + 60,
                      "first_chunk_s": 20},
    }
    for key, value in over.items():
        if "__" not in key:                      # a top-level key (log_format)
            data[key] = value
            continue
        section, field = key.split("__")
        data.setdefault(section, {})[field] = value
    return kcfg.from_dict(data)


class PlainServers:
    """Plain vLLM servers (the references), bound as the single-rank engines of a stack of ``of``
    servers are (:mod:`kvrelay.bench.reference`), started on first use and kept for the session,
    paused (SIGSTOP) between uses: a start costs ~35 s of both cores, a paused server only
    memory. A stack of another size whose engines get the same cores (2 and 4 servers on a
    2-core host) shares them. A server that stopped answering is started again."""

    PORT = 18700

    def __init__(self, tiny_model: Path, tmp: Path) -> None:
        self.tiny_model, self.tmp = tiny_model, tmp
        self._open: dict[tuple[str, ...], tuple[contextlib.ExitStack, Servers]] = {}
        self._started = 0                # server sets started so far: each gets ports of its own

    @contextlib.contextmanager
    def use(self, of: int = 2) -> Iterator[list[str]]:
        """The servers' URLs, running for the ``with`` block and paused after it."""
        running = self._running(of)
        running.resume()
        try:
            if not self._alive(running.urls):
                self._open.pop(self._key(of))[0].close()
                running = self._running(of)
            yield running.urls
        finally:
            running.pause()

    @staticmethod
    def _key(of: int) -> tuple[str, ...]:
        return tuple(launch.rank_binding(k, of, 1) for k in range(server_count(of)))

    def _running(self, of: int) -> Servers:
        key = self._key(of)
        if key not in self._open:
            port = self.PORT + 10 * self._started
            self._started += 1
            es = contextlib.ExitStack()
            running = es.enter_context(servers(_cfg(self.tiny_model, self.tmp, port), port,
                                               self.tmp / f"plain-{port}", of=of))
            self._open[key] = (es, running)
        return self._open[key][1]

    @staticmethod
    def _alive(urls: list[str]) -> bool:
        try:
            for url in urls:
                with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
                    r.read()
        except OSError:
            return False
        return True

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1][0].close()


@pytest.fixture(scope="session")
def plain(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """The session's :class:`PlainServers`."""
    shared = PlainServers(tiny_model, tmp_path_factory.mktemp("plain-vllm"))
    try:
        yield shared
    finally:
        shared.close()


def answers_of(urls: list[str], cases: list[Case]) -> dict[str, str]:
    """Each case's greedy answer from plain vLLM at ``urls`` (one request at a time per server)."""
    texts = spread(urls, cases, lambda url, case: run_case(openai_client(url), case)[0])
    return {c.name: text for c, text in zip(cases, texts, strict=True)}


@pytest.fixture(scope="session")
def reference(plain: PlainServers) -> dict[str, str]:
    """Greedy outputs of plain vLLM for every case: a server per core, each bound as one engine
    of a 1P1D stack (CPU numerics change with the thread count)."""
    with plain.use(2) as urls:
        return _reference(urls)


def _reference(urls: list[str]) -> dict[str, str]:
    """Every case's answer, the conversations' second turns after their first."""
    conv = [dsave_messages(conv=c) for c in range(4)]
    cases: list[Any] = [*CASES, PIPELINE_CASE, TURN1, *CONCURRENT, *FORMAT_REQS, *range(4)]

    def first(url: str, item: Any) -> str:
        if isinstance(item, Case):
            return run_case(openai_client(url), item)[0]
        if isinstance(item, SharedCase):
            return run_shared(openai_client(url), item)
        if isinstance(item, int):                      # turn 1 of a decode-save conversation
            return run_chat(openai_client(url), conv[item], DSAVE_ANSWER)
        path, body = FORMAT_REQS[item]
        return raw_post(url, path, body).decode()

    names = [c if isinstance(c, str) else f"dsave1.{c}" if isinstance(c, int) else c.name for c in cases]
    ref = dict(zip(names, spread(urls, cases, first), strict=True))
    ref["dsave1"] = ref.pop("dsave1.0")

    def second(url: str, item: Any) -> str:
        if item == "turn2":
            return run_turn2(openai_client(url), ref["turn1"])
        answer1 = ref["dsave1" if item == 0 else f"dsave1.{item}"]
        return run_chat(openai_client(url), dsave_messages(answer1, item), MAX_TOKENS)

    later = spread(urls, ["turn2", *range(4)], second)
    ref["turn2"] = later[0]
    ref.update({"dsave2" if c == 0 else f"dsave2.{c}": text for c, text in enumerate(later[1:])})
    return ref


TP_REF_PORT = 18890       # not the differential harness's reference port (18790): both may run at once


def reference_at_tp(tiny_model: Path, tmp: Path, tp: int, cases: list[Case]) -> dict[str, str]:
    """Greedy answers of plain vLLM at TP ``tp`` (servers stopped afterwards), bound one core
    per rank as each rank of a TP engine in a 1P1D stack is (``launch.rank_binding``); one
    server per core share that has a core for each rank (:mod:`kvrelay.bench.reference`)."""
    with servers(_cfg(tiny_model, tmp, TP_REF_PORT), TP_REF_PORT, tmp, tp=tp) as running:
        return answers_of(running.urls, cases)


@dataclass
class StackHandle:
    stack: launch.Stack
    cfg: kcfg.KVRelayConfig
    events_path: Path

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.router.port}"

    def worker_metrics(self, role: launch.Role) -> dict[str, float]:
        spec = next(s for s in self.stack.specs if s.role is role)
        try:
            return scrape(f"http://127.0.0.1:{self.cfg.connector.metrics_port + spec.port - self.cfg.deploy.base_port}/")
        except OSError as exc:
            raise AssertionError(f"{spec.name}'s worker exporter: {exc}; {self.node_state(spec.name)}") from exc

    def node_state(self, node: str, lines: int = 40) -> str:
        """Whether ``node``'s process group leader still runs (its exit code if not) and the last
        ``lines`` lines of its log that are not routine: the context a failure in CI needs."""
        proc = self.stack.procs.get(node)
        state = "not running" if proc is None else "running" if proc.poll() is None else f"exited {proc.returncode}"
        path = self.stack.log_dir / f"{node}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        tail = [ln[:600] for ln in text if '"level": "INFO"' not in ln][-lines:]
        return f"{node} is {state}; its log ends:\n" + "\n".join(tail)

    def engine_metrics(self, role: launch.Role) -> dict[str, float]:
        """The engine's own /metrics, kvrelay's series with vLLM's labels (model_name, engine)
        taken off, so their keys read as on the worker's exporter."""
        spec = next(s for s in self.stack.specs if s.role is role)
        return without_vllm_labels(scrape(f"{self.stack.url(spec)}/metrics"))

    def events(self, rid: str) -> list[dict]:
        """Events of request ``rid``: its transfer's, and the per-request ones (store loads, saves)."""
        return [e for e in read_events(self.events_path) if rid in e.get("transfer", "") or rid in e.get("req", "")]

    def log_lines(self, node: str, needle: str) -> list[str]:
        """Lines of ``node``'s log (e.g. "prefill0") containing ``needle``: context for a failure."""
        path = self.stack.log_dir / f"{node}.log"
        return [ln for ln in path.read_text(errors="replace").splitlines() if needle in ln] if path.exists() else []

    def wait_events(self, rid: str, kinds: set[str], timeout: float = 30) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            evs = self.events(rid)
            if kinds <= {e["event"] for e in evs} or time.monotonic() > deadline:
                return evs
            time.sleep(0.1)


_ACTIVE: list[launch.Stack] = []
FIRST_TOKEN = {"tcp": "prefill", "nixl": "decode"}
# The shared stacks place decode-first on the engines' KV events; with nothing left for D alone
# (0 tokens) every request that can be split still takes a transfer, which the e2e tests assert.
DECODE_FIRST = {"router__decode_first": True, "router__disagg_min_tokens": 0, "router__disagg_min_tokens_idle": 0}



def assert_corrupted_chunks_recomputed(stack: StackHandle, reference: dict[str, str], case: Case) -> dict:
    """Serve ``case`` on a stack whose prefill node corrupts every other chunk
    (``connector.push_hook = tests.e2e.faults:corrupt_every_other``): the load must report
    checksum failures, recompute them, count them, and the answer must stay exact. Returns
    the decode node's ``load_done`` event."""
    before = stack.worker_metrics(launch.Role.DECODE).get("kvrelay_tokens_recomputed_total", 0)
    rid = f"t-{stack.cfg.transport.backend.value}-{case.name}-{os.urandom(3).hex()}"
    text, _ = run_case(openai_client(stack.router_url), case, rid)
    d = next(e for e in stack.wait_events(rid, {"load_done"}) if e["event"] == "load_done")
    assert d["failed"], d
    assert all("checksum" in why for why in d["failed"].values()), d
    assert d["recomputed_tokens"] > 0
    assert text == reference[case.name], "recompute fallback must still give the exact answer"
    after = stack.worker_metrics(launch.Role.DECODE)["kvrelay_tokens_recomputed_total"]
    assert after - before == d["recomputed_tokens"]
    return d

@dataclass
class _Retiring:
    ports: frozenset[int]
    reaper: threading.Thread


_RETIRING: list[_Retiring] = []


def _ports(cfg: kcfg.KVRelayConfig) -> frozenset[int]:
    """Every port a stack of ``cfg`` may bind, coarsely: its nodes, router, exporters and second
    routers sit within 100 of ``deploy.base_port``; its KV ports and publishers within 400 of
    ``deploy.kv_base_port``."""
    return frozenset(range(cfg.deploy.base_port, cfg.deploy.base_port + 100)) | frozenset(
        range(cfg.deploy.kv_base_port, cfg.deploy.kv_base_port + 400))


def retire(stack: launch.Stack) -> None:
    """Stop ``stack`` without waiting for it. Every group gets SIGINT now and is reaped on a thread:
    a vLLM server takes ~6 s to exit here, most of it interpreter teardown, which can overlap the
    next stack's start. A later :func:`start_stack` waits only for retiring stacks whose ports it
    needs, :func:`stop_active` for all of them."""
    if stack in _ACTIVE:
        _ACTIVE.remove(stack)
    procs = list(stack.procs.values())
    stack.procs.clear()
    launch.signal_groups(procs)
    reaper = threading.Thread(target=launch.reap_groups, args=(procs,), name="retire", daemon=True)
    reaper.start()
    _RETIRING.append(_Retiring(_ports(stack.cfg), reaper))


def _wait_retired(ports: frozenset[int] | None = None) -> None:
    """Join the retiring stacks (those that hold any of ``ports``; None: all)."""
    for r in list(_RETIRING):
        if ports is None or r.ports & ports:
            r.reaper.join()
            _RETIRING.remove(r)


def stop_active() -> None:
    """Stop the stack the last :func:`start_stack` started, if it still runs, and wait for every
    retiring one: the host is left with no stack of the harness's."""
    while _ACTIVE:
        _ACTIVE.pop().stop()
    _wait_retired()


@pytest.fixture(scope="session", autouse=True)
def _reap_retired_at_the_end() -> Iterator[None]:
    yield
    _wait_retired()


def start_stack(tiny_model: Path, tmp: Path, port0: int, **over: Any) -> StackHandle:
    """Start a stack; the previous one is retired first (tests are grouped by stack, and a
    2-core / 24 GiB host cannot hold several vLLM pairs at once)."""
    while _ACTIVE:
        retire(_ACTIVE[-1])
    cfg = _cfg(tiny_model, tmp, port0, **over)
    _wait_retired(_ports(cfg))
    stack = launch.Stack(cfg)
    _ACTIVE.append(stack)
    try:
        stack.start(progress=False)
    except BaseException:
        stack.stop()
        raise
    return StackHandle(stack, cfg, tmp / "events.jsonl")


@pytest.fixture(scope="session", params=["tcp", "nixl"])
def pd_stack(request: pytest.FixtureRequest, reference: dict[str, str], tiny_model: Path,
             tmp_path_factory: pytest.TempPathFactory):
    backend = request.param
    port0 = {"tcp": 18100, "nixl": 18300}[backend]
    # Both router.first_token settings run the whole e2e set: tcp with token 1 from the prefill
    # node (the default), nixl with every token from the decode node.
    handle = start_stack(tiny_model, tmp_path_factory.mktemp(f"stack-{backend}"), port0,
                         transport__backend=backend, router__first_token=FIRST_TOKEN[backend], **DECODE_FIRST)
    yield handle
    retire(handle.stack)
