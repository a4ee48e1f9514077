"""The ``kvrelay`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from kvrelay import __version__
from kvrelay.common.errors import KVRelayError
from kvrelay.common.secrets import load_secret
from kvrelay.core import config as kcfg


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    cfg = kcfg.config_from_args(args)
    if args.markdown:
        from kvrelay.deploy.config_doc import write_markdown

        print(f"kvrelay: wrote {write_markdown(args.markdown)}", file=sys.stderr)
        return 0
    if args.check:
        from kvrelay.deploy.config_check import problems

        found = problems(cfg)
        for p in found:
            print(f"kvrelay: {p}", file=sys.stderr)
        print(f"kvrelay: {len(found)} problem(s)" if found else "kvrelay: config OK", file=sys.stderr)
        return 2 if found else 0
    print(yaml.safe_dump(kcfg.to_dict(cfg), sort_keys=False), end="")
    return 0


def _cmd_bench_transfer(args: argparse.Namespace) -> int:
    from kvrelay.bench import transfer

    return transfer.main(args)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from kvrelay.deploy.tiny_model import make_tiny_model

    print(make_tiny_model(args.dir, "wide" if args.wide else "narrow", args.attention))
    return 0


def _cmd_make_tiny_lora(args: argparse.Namespace) -> int:
    from kvrelay.deploy.tiny_lora import make_tiny_lora

    print(make_tiny_lora(args.dir, args.seed, args.rank, "wide" if args.wide else "narrow"))
    return 0


def _cmd_compat(args: argparse.Namespace) -> int:
    from kvrelay.deploy import compat

    if args.markdown:
        print(f"kvrelay: wrote {compat.write_markdown(args.markdown)}", file=sys.stderr)
        return 0
    print(compat.markdown(), end="")
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from kvrelay.core.logs import setup
    from kvrelay.router.app import run
    from kvrelay.router.preflight import require

    cfg = kcfg.config_from_args(args)
    setup(cfg.log_format)
    require(cfg)                              # nodes listed, the secret, keys, TLS: one line saying what is wrong
    run(cfg)
    return 0


def _serve_env(cfg: kcfg.KVRelayConfig, spec: Any, visible: list[str], devices: str | None) -> dict[str, str]:
    """The environment ``kvrelay serve`` gives node ``spec``'s vLLM; ConfigError if it cannot."""
    from kvrelay.deploy import launch

    env = launch.server_env(cfg, 0, 1, spec.tp, cpu=not visible)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if spec.role is not launch.Role.SINGLE:   # vLLM's own sockets in the node's directory (deploy/node_files.py)
        from kvrelay.deploy.node_files import RPC_BASE_ENV, ipc_dir

        env.setdefault(RPC_BASE_ENV, str(ipc_dir(cfg, spec)))
    return env


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from kvrelay.core.logs import LogFormat, setup, vllm_logging_config
    from kvrelay.deploy import launch

    cfg = kcfg.config_from_args(args)
    role = launch.Role(args.role)
    kv_port = cfg.transport.control_port or cfg.deploy.kv_base_port + args.index * cfg.engine.decode_tp
    port = args.port or cfg.deploy.base_port + args.index
    tp = cfg.engine.prefill_tp if role is launch.Role.PREFILL else cfg.engine.decode_tp   # single: decode's
    spec = launch.NodeSpec(role, args.index, port, kv_port if role is launch.Role.DECODE else 0, tp)
    if role is not launch.Role.SINGLE:
        load_secret(cfg.transport)            # refuse to start without one, saying how to set it
        from kvrelay.deploy.config_check import engine_problems

        if found := engine_problems(cfg):     # what `kvrelay config --check` reports, before vLLM starts
            for p in found:
                print(f"kvrelay: {p}", file=sys.stderr)
            return 2
    from kvrelay.common.errors import ConfigError
    from kvrelay.deploy.devices import Node, node_devices, visible_gpus

    visible = visible_gpus()
    try:
        devices = node_devices(cfg, Node(spec.name, role.value, args.index, tp), visible)
        env = _serve_env(cfg, spec, visible, devices)
    except ConfigError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2
    cmd = launch.server_command(cfg, spec)
    if args.dry_run:                          # what it would run: the variables it sets, then the command
        from kvrelay.deploy.devices import node_numa

        print(f"kvrelay: {spec.name}: {node_numa(cfg, devices, env)}", file=sys.stderr)
        sets = {k: v for k, v in env.items() if os.environ.get(k) != v or k == "CUDA_VISIBLE_DEVICES"}
        print(launch.shell_line(cmd, sets))
        return 0
    if cfg.tracing.endpoint:                 # vLLM's spans name the node's role (core/tracing.py)
        env.setdefault("OTEL_SERVICE_NAME", f"vllm-{role.value}")
    if cfg.log_format is LogFormat.JSON:     # vLLM's lines and the connectors' as JSON (core/logs.py)
        env["VLLM_LOGGING_CONFIG_PATH"] = vllm_logging_config(launch.vllm_logging_path(cfg, spec))
    if role is launch.Role.SINGLE:
        os.execvpe(cmd[0], cmd, env)
    from kvrelay.deploy.node_files import scratch
    from kvrelay.deploy.supervisor import DrainPlan, supervise

    setup(cfg.log_format)
    host = "127.0.0.1" if cfg.deploy.host in ("0.0.0.0", "::") else cfg.deploy.host
    e = cfg.engine
    plan = DrainPlan(launch.drain_path(cfg, spec), e.drain_timeout_s, e.drain_quiet_s)
    return supervise(cmd, env, f"http://{host}:{port}/metrics", plan, scratch(cfg, spec, env))


def _cmd_secret(args: argparse.Namespace) -> int:
    from kvrelay.common.secrets import write_secret_file

    path = write_secret_file(args.file)
    print(f"kvrelay: wrote a new shared secret to {path} (mode 0600); point transport.secret_file at it "
          "on every node and the router", file=sys.stderr)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    import signal
    import threading
    import time

    from kvrelay.deploy import launch
    from kvrelay.deploy.config_check import problems

    cfg = kcfg.config_from_args(args)
    if found := problems(cfg):                # what `kvrelay config --check` reports, before anything starts
        for p in found:
            print(f"kvrelay: {p}", file=sys.stderr)
        return 2
    stack = launch.Stack(cfg)
    print(f"kvrelay: starting {cfg.deploy.prefill} prefill + {cfg.deploy.decode} decode vLLM servers "
          f"({launch.served_name(cfg)}, transport {cfg.transport.backend.value}); logs in {stack.log_dir}/",
          file=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stack.start()
        url = f"http://{cfg.router.host}:{cfg.router.port}"
        print(f"kvrelay: ready. OpenAI API at {url}/v1 (model {launch.served_name(cfg)!r}); Ctrl-C stops.",
              file=sys.stderr)
        if args.request:
            print(f"prompt:     {args.request}")
            print(f"completion: {launch.demo_request(url, launch.served_name(cfg), args.request)!r}")
            time.sleep(0.5)
            print(launch.route_summary(url, stack.cfg.connector.events_path))
        if args.exit_after_request:
            return 0
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("kvrelay: stopping ...", file=sys.stderr)
        stack.stop()
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped flag (subcommands inherit the class)."""

    def error(self, message: str) -> NoReturn:
        import difflib

        if message.startswith("unrecognized arguments:"):
            known = _option_strings(self)
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                if flag.startswith("--") and (close := difflib.get_close_matches(flag, known, n=1, cutoff=0.75)):
                    message += f" (did you mean {close[0]}?)"
                    break
        super().error(message)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of ``parser`` and of its subcommands."""
    out: list[str] = []
    for action in parser._actions:
        out += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _option_strings(sub)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvrelay", description="Disaggregated prefill/decode serving for vLLM: "
                                "KV chunks pushed from prefill to decode nodes over NIXL, UCX, TCP or shm.")
    p.add_argument("--version", action="version", version=f"kvrelay {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    c = sub.add_parser("config", help="print the effective configuration (defaults < YAML < flags)",
                       description="Prints the effective configuration (defaults < YAML < flags) as YAML.")
    c.add_argument("--check", action="store_true",
                   help="run every check the router and kvrelay up run before they start, print each problem, "
                   "exit 2 if any")
    c.add_argument("--markdown", metavar="FILE", help="write every key's reference (type, default, meaning) "
                   "as Markdown to FILE (docs/guide/configuration.md) and exit")
    kcfg.add_config_args(c)
    c.set_defaults(func=_cmd_config)

    u = sub.add_parser("up", help="bring up a local PD stack: N prefill + M decode vLLM servers + router",
                       description="Starts deploy.prefill prefill and deploy.decode decode vLLM servers "
                       "(the built-in tiny model unless MODEL or engine.model is set) and the router on "
                       "router.port; Ctrl-C stops everything. Every flag below is also a YAML key; vLLM "
                       "arguments after -- go to every engine (engine.extra_args).")
    u.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model every engine serves (engine.model): "
                   "a Hugging Face id or a local path")
    u.add_argument("--request", metavar="PROMPT", help="once up, send this prompt through the router and print "
                   "the completion")
    u.add_argument("--exit-after-request", action="store_true", help="stop the stack after --request")
    kcfg.add_config_args(u)
    u.usage = "kvrelay up [MODEL] [options] [-- VLLM_ARGS...]"
    u.set_defaults(func=_cmd_up)

    r = sub.add_parser("router", help="run the OpenAI-compatible PD router (pools from router.* keys)")
    kcfg.add_config_args(r)
    r.set_defaults(func=_cmd_router)

    s = sub.add_parser("serve", help="start one vLLM server with a kvrelay connector (pool launchers use this)",
                       description="Starts one vLLM server. Prefill and decode nodes run under a supervisor: "
                       "SIGTERM drains the node (not ready at once, no new work, in-flight requests, loads and "
                       "pushes finish; engine.drain_quiet_s, engine.drain_timeout_s), then vLLM stops.")
    s.add_argument("--role", choices=["prefill", "decode", "single"], required=True)
    s.add_argument("--index", type=int, default=0, help="node index: default ports are base + index")
    s.add_argument("--port", type=int, default=0, help="HTTP port (default deploy.base_port + index)")
    s.add_argument("--dry-run", action="store_true", help="print the vLLM command instead of running it")
    kcfg.add_config_args(s)
    s.set_defaults(func=_cmd_serve)

    _add_ops_commands(sub)

    sec = sub.add_parser("secret", help="write a new shared secret to FILE (mode 0600) for transport.secret_file",
                         description="Every node and the router of one deployment share a secret: it "
                         "authenticates the transfer handshake, the router's signed kv_transfer_params and "
                         "shared store records. Nodes read it from KVRELAY_SECRET or transport.secret_file.")
    sec.add_argument("file")
    sec.set_defaults(func=_cmd_secret)

    _add_model_commands(sub)
    _add_tool_commands(sub)
    _add_bench_commands(sub.add_parser("bench", help="benchmarks"))
    return p


def _add_model_commands(sub: argparse._SubParsersAction) -> None:
    """make-tiny-model, make-tiny-lora: the built-in checkpoints the stack and its tests run on."""
    m = sub.add_parser("make-tiny-model", help="write the built-in tiny Llama checkpoint + tokenizer to DIR")
    m.add_argument("dir")
    m.add_argument("--wide", action="store_true",
                   help="the compute-heavy variant: same KV layout, 1024-wide residual, 4096-wide MLP (benchmarks)")
    m.add_argument("--attention", choices=("full", "sliding", "alternating"), default="full",
                   help="full (default); sliding: every layer sees the last 256 tokens (Mistral-style); "
                        "alternating: sliding and full layers in turn (Gemma-2/3-style hybrid KV groups)")
    m.set_defaults(func=_cmd_make_tiny_model)
    lo = sub.add_parser("make-tiny-lora", help="write a deterministic LoRA adapter (PEFT format) for the tiny model to DIR")
    lo.add_argument("dir")
    lo.add_argument("--seed", type=int, default=1, help="which adapter (each seed gives other weights; default 1)")
    lo.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8; serve with --max-lora-rank >= it)")
    lo.add_argument("--wide", action="store_true", help="for the wide tiny model")
    lo.set_defaults(func=_cmd_make_tiny_lora)


def _add_ops_commands(sub: argparse._SubParsersAction) -> None:
    """probe, deploy k8s, dashboard: what operators run around a deployment."""
    from kvrelay.deploy import dashboard, k8s, probe

    db = sub.add_parser("dashboard", help="render the Grafana dashboard's panels as a PNG from a live Prometheus",
                        description=(dashboard.__doc__ or "").split("\n\n")[1])
    dashboard.add_args(db)
    db.set_defaults(func=dashboard.main)

    pr = sub.add_parser("probe", help="exit 0 if a node is healthy: its engine's /health and (decode) its transfer "
                        "endpoint", description=(probe.__doc__ or "").split("\n\n")[1])
    probe.add_args(pr)
    pr.set_defaults(func=probe.main)
    dep = sub.add_parser("deploy", help="render deployment manifests from the config tree")
    dsub = dep.add_subparsers(dest="target", metavar="TARGET", required=True)
    k = dsub.add_parser("k8s", help="Kubernetes manifests (pools, router, Redis, Secret, ConfigMap, PDBs, PodMonitor)",
                        description=(k8s.__doc__ or "").split("\n\n", 1)[1].replace("``", "`"),
                        formatter_class=argparse.RawDescriptionHelpFormatter)      # the whole object list
    k8s.add_args(k)
    k.set_defaults(func=k8s.main)


def _add_tool_commands(sub: argparse._SubParsersAction) -> None:
    from kvrelay.bench import calibrate
    from kvrelay.deploy import warmup

    cal = sub.add_parser("calibrate", help="measure router.disagg_min_tokens: where P + push beats D alone here",
                         description=(calibrate.__doc__ or "").split("\n\n")[1])
    calibrate.add_args(cal)
    kcfg.add_config_args(cal)
    cal.set_defaults(func=calibrate.main)

    c = sub.add_parser("compat", help="the compatibility matrix: engine configurations served exactly, left to the "
                       "engine, or refused at start (with the tests behind each row)")
    c.add_argument("--markdown", metavar="PATH", default="", help="write it as Markdown to PATH instead of printing it")
    c.set_defaults(func=_cmd_compat)

    w = sub.add_parser("warmup", help="run hot prompts through prefill nodes so their chunks land in the store",
                       description=(warmup.__doc__ or "").split("\n\n")[1])
    warmup.add_args(w)
    w.set_defaults(func=warmup.main)


def _typed_help(p: argparse.ArgumentParser) -> None:
    """Every bench flag shows what it takes (``N``, ``SECONDS``, ``LIST``, ...) and its default,
    as the config flags do; flags that name their own metavar keep it."""
    for a in p._actions:
        if not a.option_strings or a.nargs == 0 or a.help == argparse.SUPPRESS or a.dest.startswith("cfg:"):
            continue
        if a.metavar is None:
            a.metavar = _metavar_of(a)
        if a.default not in (None, "", [], False) and "default" not in (a.help or ""):
            a.help = f"{a.help or ''} (default: {a.default})".strip()


def _metavar_of(a: argparse.Action) -> str:
    if "port" in a.dest:
        return "PORT"
    if a.dest in ("out", "out_dir"):
        return "DIR"
    if a.type is int:
        return "N"
    if a.type is float:
        return "MS" if a.dest.endswith("_ms") else "SECONDS" if a.dest.endswith(("_s", "duration")) else "X"
    return "LIST" if isinstance(a.default, str) and "," in a.default or "comma list" in (a.help or "") else "TEXT"


def _add_bench_commands(b: argparse.ArgumentParser) -> None:
    bsub = b.add_subparsers(dest="bench", metavar="BENCH", required=True)
    _bench_parsers(bsub)
    for parser in bsub.choices.values():
        _typed_help(parser)


def _bench_parsers(bsub: Any) -> None:
    from kvrelay.bench.transfer import add_args

    t = bsub.add_parser("transfer", help="chunk transfer latency/bandwidth per backend vs same-run ceilings",
                        description="Sweeps backends x chunk sizes x windows between two processes and "
                        "prints a table, writes JSON and a PNG plot.")
    add_args(t)
    t.set_defaults(func=_cmd_bench_transfer)
    from kvrelay.bench import e2e

    e = bsub.add_parser("e2e", help="TTFT/ITL: kvrelay PD vs single vLLM vs vLLM NixlConnector (stock and fair)",
                        description=(e2e.__doc__ or "").split("\n\n")[0])
    e2e.add_args(e)
    e.set_defaults(func=e2e.main)
    from kvrelay.bench import breakdown

    bd = bsub.add_parser("breakdown", help="where kvrelay's first token spends its time over one vLLM's, step by step",
                         description=(breakdown.__doc__ or "").split("\n\n")[0])
    breakdown.add_args(bd)
    bd.set_defaults(func=breakdown.main)
    from kvrelay.bench import proxy

    r = bsub.add_parser("router", help="router overhead: added latency and streamed req/s vs direct and a toy proxy",
                        description=(proxy.__doc__ or "").split("\n\n")[0])
    proxy.add_args(r)
    r.set_defaults(func=proxy.main)
    from kvrelay.bench import serve

    sv = bsub.add_parser("serve", help="goodput under load (Poisson rates, vLLM's serving client): PD vs one vLLM",
                         description=(serve.__doc__ or "").split("\n\n")[0])
    serve.add_args(sv)
    sv.set_defaults(func=serve.main)
    from kvrelay.bench import multiturn

    mt = bsub.add_parser("multiturn", help="multi-turn chat TTFT with the prefill store on vs off",
                         description=(multiturn.__doc__ or "").split("\n\n")[1])
    multiturn.add_args(mt)
    mt.set_defaults(func=multiturn.main)
    from kvrelay.bench import soak

    sk = bsub.add_parser("soak", help="an hour of mixed traffic under scheduled faults: exactness, hangs, leaks and "
                         "a recovery matrix", description=(soak.__doc__ or "").split("\n\n")[0])
    soak.add_args(sk)
    sk.set_defaults(func=soak.main)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    tail: list[str] = []
    if "--" in argv:                          # kvrelay up MODEL -- --enable-lora ...: vLLM's own arguments
        at = argv.index("--")
        argv, tail = argv[:at], argv[at + 1:]
    args = build_parser().parse_args(argv)
    args.vllm_args = tail
    try:
        return int(args.func(args))
    except KVRelayError as exc:               # ConfigError and every other error kvrelay raises on purpose
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
