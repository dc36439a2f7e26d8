"""Configuration: errors name the key, DP endpoints follow vLLM's rule, examples load, README is true."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from index.kvindex import IndexConfig
from index.subscriber import SubscriberConfig
from router.cluster.config import ClusterConfig
from router.config import (
    BackendConfig,
    ConfigError,
    HealthConfig,
    KubernetesConfig,
    MembershipConfig,
    RouterConfig,
    ServerConfig,
    decode_backend,
    load_config,
    parse_config,
    rank_endpoint,
    with_overrides,
)
from router.decision.policy import PolicyConfig
from router.fleet.breaker import BreakerConfig
from router.fleet.runtime import sources_of
from router.observe.checks import ChecksConfig
from router.pd.config import PDConfig

ROOT = Path(__file__).resolve().parents[2]
BACKEND = {"name": "a", "url": "http://127.0.0.1:8000", "kv_events": "tcp://127.0.0.1:5557"}


def cfg(**top: Any) -> dict[str, Any]:
    return {"backends": [dict(BACKEND)], **top}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "backends"),
        (cfg(block_size="16"), "block_size"),
        (cfg(block_size=0), "block_size"),
        ({"backends": [dict(BACKEND, dp_size="two")]}, "backends[0].dp_size"),
        ({"backends": [dict(BACKEND, url="10.0.0.5:8000")]}, "backends[0].url"),
        ({"backends": [dict(BACKEND), dict(BACKEND)]}, "backends[1].name"),
        ({"backends": [dict(BACKEND, kv_events="10.0.0.5:5557")]}, "backends[0].kv_events"),
        ({"backends": [dict(BACKEND, kv_events="tcp://h")]}, "backends[0].kv_events"),
        # the engine's own bind address pasted in: accepted, it ended the subscriber thread
        ({"backends": [dict(BACKEND, kv_events="tcp://*:5557")]}, "backends[0].kv_events"),
        ({"backends": [dict(BACKEND, kv_replay="tcp://*:5558")]}, "backends[0].kv_replay"),
        ({"backends": [dict(BACKEND, colour="red")]}, "backends[0].colour"),
        (cfg(policy={"name": "fastest"}), "policy.name"),
        (cfg(policy={"load_weigth": 1}), "policy.load_weigth"),
        (cfg(server={"port": 70000}), "server.port"),
        (cfg(server={"workers": 64}), "server.workers"),  # (worker 63 could not use the load board)
        (cfg(tokenizer="/does/not/exist"), "tokenizer"),
        (cfg(unknown_key=1), "unknown_key"),
        (cfg(pd={"connector": "mooncake"}), "pd.connector"),
        (cfg(pd={"min_uncached_tokens": -1}), "pd"),
        (cfg(pd={"prefill_policy": "fastest"}), "pd.prefill_policy"),
        (cfg(pd={"prefill_timeout_s": 0}), "pd.prefill_timeout_s"),
        (cfg(policy={"min_match_ratio": float("nan")}), "policy.min_match_ratio"),
        (cfg(policy={"min_match_ratio": 1.5}), "policy.min_match_ratio"),
        (cfg(policy={"load_weight": -1.0}), "policy.load_weight"),
        (cfg(policy={"cpu_credit": float("inf")}), "policy.cpu_credit"),
        (cfg(policy={"temperature": float("nan")}), "policy.temperature"),
        (cfg(index={"subscriber": {"io_threads": 0}}), "index.subscriber.io_threads"),
    ],
)
def test_config_errors_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(message), str(err.value)


def test_kvrouter_serve_reports_every_field_error_and_the_choices(tmp_path: Path) -> None:
    """A file with several mistakes reported only the first (fix, restart, the next one, ...), and an
    invalid choice in the file listed no choices while the same mistake through KVROUTER_POLICY
    did. Every field error msgspec finds is on its own line; a choice lists the valid ones."""
    path = tmp_path / "fleet.toml"
    path.write_text(
        '[policy]\nname = "fastest"\nload_weigth = 1\n[server]\nport = "8000"\n'
        '[[backends]]\nname = "a"\nurl = "http://127.0.0.1:1"\nrole = "prefil"\ndp_size = "two"\n'
        '[[backends]]\nname = "b"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "kvrouter: config error: backends[0].role: Invalid enum value 'prefil'; must be one of both, decode, "
        "prefill",
        "kvrouter: config error: backends[0].dp_size: Expected `int`, got `str`",
        "kvrouter: config error: backends[1].url: required",
        "kvrouter: config error: policy.name: Invalid enum value 'fastest'; must be one of kv, least_loaded, "
        "random, round_robin",
        "kvrouter: config error: policy.load_weigth: unknown key",
        "kvrouter: config error: server.port: Expected `int`, got `str`",
    ], proc.stderr
    with pytest.raises(ConfigError) as err:  # (the admin API's PUT body: one field, named)
        decode_backend(b'{"url": "http://127.0.0.1:1", "role": "prefil"}', "c")
    assert (str(err.value), err.value.field) == (
        "role: Invalid enum value 'prefil'; must be one of both, decode, prefill",
        "role",
    )


def test_a_file_with_mistakes_in_several_tables_hears_of_them_all() -> None:
    """Values of the right type but out of range were reported one at a time, the first table's only;
    each table's first problem is now on its own line, the error's field the first's."""
    data = tomllib.loads(
        "[policy]\nload_weight = -1.0\n[server]\nworkers = 99\n[flow]\nenabled = true\nmax_active = -3\n"
    )
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).splitlines() == [
        "backends: at least one [[backends]] entry is required (or membership.kubernetes.enabled, "
        "or admin_keys to add backends at run time)",
        "policy.load_weight: must be a finite number >= 0",
        "server.workers: must be between 1 and 63",
        "flow.max_active and flow.max_pending_prefill_tokens: must be >= 0 (0: not used)",
    ]
    assert err.value.field is None  # (the first's: "backends" names no single field)
    one = {**data, "policy": {}, "server": {}, "flow": {}}
    with pytest.raises(ConfigError) as err:  # one problem: that error itself, as before
        parse_config(one)
    assert str(err.value).startswith("backends: at least one") and "\n" not in str(err.value)


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("backends = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_a_wildcard_event_address_is_fine_when_the_router_binds() -> None:
    parse_config({"backends": [dict(BACKEND, kv_events="tcp://*:5557", kv_bind=True)]})


def test_dp_ranks_use_port_plus_rank() -> None:
    assert rank_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert rank_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert rank_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    c = parse_config(
        {"backends": [dict(BACKEND, dp_size=2, kv_replay="tcp://127.0.0.1:5600")], "kv_topic": "kv-events"}
    )
    sources = sources_of(c.backends[0], c.kv_topic)
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in sources] == [
        (0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600", "kv-events"),
        (1, "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601", "kv-events"),
    ]


def test_overrides() -> None:
    c = with_overrides(parse_config(cfg()), host="0.0.0.0", port=9000, policy="round_robin", api_keys="x,y")
    assert (c.server.host, c.server.port, c.policy.name, c.api_keys) == (
        "0.0.0.0",
        9000,
        "round_robin",
        ["x", "y"],
    )
    with pytest.raises(ConfigError):
        with_overrides(c, port=0)


@pytest.mark.parametrize("path", ["deploy/fleet.example.toml", "deploy/compose/fleet.mock.toml"])
def test_example_configs_load(path: str) -> None:
    c = load_config(ROOT / path)
    assert c.backends


def test_the_example_config_shows_the_code_defaults() -> None:
    """deploy/fleet.example.toml says every value it shows outside [[backends]] is the default unless
    a comment says otherwise; it showed load_weight = 1.0 while the default is 0.25."""
    text = (ROOT / "deploy/fleet.example.toml").read_text()
    marked: set[str] = set()  # keys whose own comment gives another default ("# default 127.0.0.1; ...")
    section: str | None = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("[["):
            section = None  # (a backend's values are examples)
        elif m := re.fullmatch(r"\[([\w.]+)\]", s):
            section = m.group(1) + "."
        elif section is not None and (m := re.match(r"(\w+)\s*=[^#]*#\s*default\b", s)):
            marked.add(section + m.group(1))
    shown = tomllib.loads(text)
    del shown["backends"]
    checked: list[str] = []

    def compare(values: dict[str, Any], defaults: dict[str, Any], prefix: str) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                compare(value, defaults[key], f"{prefix}{key}.")
            elif prefix + key not in marked:
                checked.append(prefix + key)
                assert value == defaults[key], f"{prefix}{key} = {value!r}: the default is {defaults[key]!r}"

    compare(shown, msgspec.to_builtins(RouterConfig()), "")
    assert marked == {"server.host"}, marked
    assert {"block_size", "policy.load_weight", "health.interval_s", "index.max_residencies"} <= set(checked)


STRUCTS: list[tuple[str, type[msgspec.Struct]]] = [
    ("", RouterConfig),
    ("server.", ServerConfig),
    ("health.", HealthConfig),
    ("policy.", PolicyConfig),
    ("index.", IndexConfig),
    ("index.subscriber.", SubscriberConfig),
    ("backends[].", BackendConfig),
    ("membership.", MembershipConfig),
    ("health.breaker.", BreakerConfig),
    ("checks.", ChecksConfig),
    ("membership.kubernetes.", KubernetesConfig),
    ("cluster.", ClusterConfig),
    ("pd.", PDConfig),
]


def test_readme_configuration_table_mirrors_the_defaults() -> None:
    """Every config field has a row in docs/configuration.md with its default, so the table cannot
    drift (the page is generated: tests/router/test_config_doc.py; this reads it as a reader would)."""
    readme = (ROOT / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `([\w.\[\]]+)` \| [^|]* \| `?([^|`]*)`? \|", readme, re.MULTILINE))
    for prefix, struct in STRUCTS:
        for f in msgspec.structs.fields(struct):
            key = prefix + f.name
            if isinstance(f.default, msgspec.Struct) or f.name in ("backends", "subscriber"):
                continue
            assert key in rows, f"docs/configuration.md has no row for `{key}`"
            if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT:
                expected = "required"
            elif f.default_factory is not msgspec.NODEFAULT:
                expected = repr(f.default_factory()).replace("'", '"')
            else:
                expected = (
                    "none"
                    if f.default is None
                    else str(f.default).lower()
                    if isinstance(f.default, bool)
                    else (f'"{f.default}"' if isinstance(f.default, str) else repr(f.default))
                )
            assert rows[key].strip() == expected, (
                f"docs/configuration.md says `{key}` = {rows[key]!r}, the code says {expected!r}"
            )
