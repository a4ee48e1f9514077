import pytest

from kvrelay.common.config_fields import parse_size
from kvrelay.common.errors import ConfigError, KVRelayError
from kvrelay.core import config
from kvrelay.store.config import EvictionPolicy
from kvrelay.transport.config import TransportKind


def test_defaults_match_the_design():
    cfg = config.load()
    assert cfg.chunk_tokens == 256
    assert cfg.transport.backend is TransportKind.NIXL
    assert cfg.store.deferred_bytes == 8 << 20
    assert cfg.store.prefetch_ahead == 2
    assert cfg.store.eviction_policy is EvictionPolicy.LRU
    assert issubclass(ConfigError, KVRelayError)


def test_yaml_then_flags_override(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("chunk_tokens: 512\ntransport:\n  backend: tcp\n  pool_bytes: 64MiB\n")
    cfg = config.load(f, ["transport.pool_bytes=1GiB", "store.eviction_policy=lfu"])
    assert cfg.chunk_tokens == 512 and cfg.transport.backend is TransportKind.TCP
    assert cfg.transport.pool_bytes == 1 << 30
    assert cfg.store.eviction_policy is EvictionPolicy.LFU


@pytest.mark.parametrize("override, key", [
    ("transport.pool_byte=1", "pool_byte"),
    ("transport.backend=rdma", "transport.backend"),
    ("chunk_tokens=0", "chunk_tokens"),
    ("store.eviction_policy=mru", "store.eviction_policy"),
    ("transport.pool_bytes=lots", "pool_bytes"),
    ("timeouts.lease_s=-1", "timeouts.lease_s"),
    ("nonsense=1", "nonsense"),
    ("transport.numa_node=0", "numa_node"),
    ("timeouts.heartbeat_s=2", "heartbeat_s"),          # >= half of peer_s (3): cross-checked
    ("timeouts.lease_s=5", "lease_s"),                  # < chunk_s (10)             # removed: it was validated but never read
])
def test_bad_keys_and_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        config.load(overrides=[override])
    assert key.split(".")[-1] in str(err.value)


def test_cli_flags_cover_every_leaf():
    import argparse

    p = argparse.ArgumentParser()
    config.add_config_args(p)
    args = p.parse_args(["--transport.backend", "shm", "--chunk_tokens", "128"])
    cfg = config.config_from_args(args)
    assert cfg.transport.backend is TransportKind.SHM and cfg.chunk_tokens == 128
    flags = {a.dest for a in p._actions}
    assert {f"cfg:{k}" for k, _ in config.leaf_fields()} <= flags


@pytest.mark.parametrize("text, value", [("1MiB", 1 << 20), ("2GB", 2 * 10**9), ("4096", 4096), (7, 7)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_every_config_key_has_help_and_appears_in_up_help():
    from kvrelay.cli import build_parser

    keys = {k for k, _ in config.leaf_fields()}
    assert keys == set(config.FIELD_HELP), keys ^ set(config.FIELD_HELP)
    parser = build_parser()
    up = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "up")[1]
    text = up.format_help()
    for key in keys:
        assert f"--{key.replace('_', '-')}" in text           # the kebab spelling vLLM uses (the YAML one works too)
    assert "--request" in text and "Ctrl-C" in text


def test_a_decode_node_binding_every_address_must_say_which_one_to_announce():
    import msgspec

    from kvrelay.transport.backends import make_receiver_backend
    from kvrelay.transport.backends.sockets import SocketInfo
    from kvrelay.transport.config import TransportConfig

    with pytest.raises(ConfigError, match="advertise_host"):
        make_receiver_backend(TransportConfig(backend=TransportKind.TCP, host="0.0.0.0"))
    rx = make_receiver_backend(TransportConfig(backend=TransportKind.TCP, host="0.0.0.0", advertise_host="10.77.0.12"))
    try:
        info = msgspec.msgpack.decode(rx.info(), type=SocketInfo)
        assert (info.family, info.address) == ("inet", "10.77.0.12") and info.port > 0
    finally:
        rx.close()
    assert TransportConfig(host="10.0.0.5").advertised_host() == "10.0.0.5"


def test_numbers_given_where_the_field_is_text_are_taken_as_text():
    # `--connector.helper_cpus 3` and a numeric vLLM argument in a list used to fail with
    # "Expected `str`, got `int`": YAML reads 3 as a number; the field wants the text.
    from kvrelay.core import config as kcfg

    cfg = kcfg.load(overrides=["connector.helper_cpus=3", "engine.prefill_args=[--max-num-seqs, 8]",
                               "engine.served_model_name=true"])
    assert cfg.connector.helper_cpus == "3" and cfg.engine.prefill_args == ["--max-num-seqs", "8"]
    assert cfg.engine.served_model_name == "true"
    assert kcfg.load(overrides=["router.port=9000"]).router.port == 9000      # numbers stay numbers
    with pytest.raises(kcfg.ConfigError, match="router.port"):
        kcfg.load(overrides=["router.port=abc"])                                # and text is no number


def test_signed_params_outlive_the_longest_request():
    """params_ttl_s below request_timeout_s would let a request queued that long lose its transfer."""
    cfg = config.from_dict({})
    assert cfg.router.params_ttl_s >= cfg.router.request_timeout_s
    with pytest.raises(ConfigError, match="params_ttl_s"):
        config.from_dict({"router": {"params_ttl_s": 300, "request_timeout_s": 600}})


def test_the_command_line_takes_what_a_vllm_user_types():
    """Kebab-case flags as vLLM spells them, lists without YAML, enum errors that list the values,
    and pool entries checked when the config loads (not when the router first uses them)."""
    import argparse

    p = argparse.ArgumentParser()
    config.add_config_args(p)
    args = p.parse_args(["--chunk-tokens", "128", "--router.first-token", "decode",
                         "--router.prefill", "http://a:8100,http://b:8100",
                         "--engine.decode_args", "--max-num-seqs 8 --enforce-eager"])
    cfg = config.config_from_args(args)
    assert cfg.chunk_tokens == 128 and cfg.router.first_token.value == "decode"
    assert cfg.router.prefill == ["http://a:8100", "http://b:8100"]
    assert cfg.engine.decode_args == ["--max-num-seqs", "8", "--enforce-eager"]
    with pytest.raises(ConfigError, match="valid values: nixl, tcp, shm, ucx"):
        config.load(overrides=["transport.backend=foo"])
    for entry in ("foo", "http://d:8101", "tcp://d:9100"):
        with pytest.raises(ConfigError, match="router.decode: .* is not a node"):
            config.load(overrides=[f"router.decode=[{entry!r}]"])
    with pytest.raises(ConfigError, match="router.prefill"):
        config.load(overrides=["router.prefill=[a:8100]"])
    ok = config.load(overrides=["router.decode=['http://d:8101=tcp://d:9100', 'dns+http://kv-d:8100=tcp://kv-d:9100']"])
    assert len(ok.router.decode) == 2
