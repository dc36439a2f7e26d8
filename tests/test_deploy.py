"""Static checks of deploy/ and the built-in dashboard page.

They catch the mistakes that otherwise only show up on a cluster: a config file that does not parse, a Grafana
panel querying a metric the router does not export, compose and fleet configs that disagree on hosts, ports or
block size, a container that runs as root, a dashboard page that pulls something from the internet.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PAGE = ROOT / "router" / "static" / "dashboard.html"
GRAFANA = DEPLOY / "grafana" / "kvrouter-dashboard.json"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "k8s"

# The router's Prometheus contract: name -> (type, labels); a live scrape keeps to it exactly
# (test_router_e2e.py::test_metrics_scrape_is_valid_prometheus_text_and_keeps_the_contract).
EXPORTED_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "kvrouter_requests_total": ("counter", frozenset({"backend", "model", "status"})),
    "kvrouter_kv_report_mode_removed_total": ("counter", frozenset()),
    "kvrouter_client_fields_removed_total": ("counter", frozenset({"field"})),
    "kvrouter_decisions_by_objective_total": ("counter", frozenset({"objective"})),
    "kvrouter_request_errors_total": ("counter", frozenset({"backend", "kind"})),
    "kvrouter_route_decision_seconds": ("histogram", frozenset()),
    "kvrouter_route_decisions_total": ("counter", frozenset({"backend", "dp_rank", "outcome"})),
    "kvrouter_matched_prefix_ratio": ("histogram", frozenset()),
    "kvrouter_prompt_tokens_total": ("counter", frozenset({"backend"})),
    "kvrouter_matched_tokens_total": ("counter", frozenset({"backend", "medium"})),
    "kvrouter_index_blocks": ("gauge", frozenset({"source", "medium"})),
    "kvrouter_kv_batches_total": ("counter", frozenset({"source"})),
    "kvrouter_kv_events_total": ("counter", frozenset({"source", "type"})),
    "kvrouter_kv_decode_errors_total": ("counter", frozenset({"source"})),
    "kvrouter_kv_gaps_total": ("counter", frozenset({"source"})),
    "kvrouter_kv_replays_total": ("counter", frozenset({"source"})),
    "kvrouter_kv_restarts_total": ("counter", frozenset({"source"})),
    "kvrouter_kv_unknown_parents_total": ("counter", frozenset({"source"})),
    "kvrouter_kv_lost_batches_total": ("counter", frozenset({"source"})),
    "kvrouter_kv_event_lag_seconds": ("histogram", frozenset()),
    "kvrouter_kv_source_connected": ("gauge", frozenset({"source"})),
    "kvrouter_kv_last_event_age_seconds": ("gauge", frozenset({"source"})),
    "kvrouter_inflight_requests": ("gauge", frozenset({"backend", "dp_rank"})),
    "kvrouter_backend_healthy": ("gauge", frozenset({"backend"})),
    "kvrouter_upstream_latency_seconds": ("histogram", frozenset({"backend"})),
    "kvrouter_ttft_seconds": ("histogram", frozenset({"backend"})),
    "kvrouter_index_evictions_total": ("counter", frozenset()),
    "kvrouter_event_sockets": ("gauge", frozenset()),
    "kvrouter_event_socket_limit": ("gauge", frozenset()),
    "kvrouter_event_sources_failing": ("gauge", frozenset()),
    "kvrouter_event_source_open_errors_total": ("counter", frozenset()),
    "kvrouter_tokenizer_cache_tokens_total": ("counter", frozenset({"result"})),
    "kvrouter_tokenizer_cache_bytes": ("gauge", frozenset()),
    "kvrouter_tokenizer_cache_disabled": ("gauge", frozenset()),
    # membership, breakers and retries, config reloads (router/fleet)
    "kvrouter_backends": ("gauge", frozenset({"state"})),
    "kvrouter_membership_changes_total": ("counter", frozenset({"change", "origin"})),
    "kvrouter_backend_ejections_total": ("counter", frozenset({"backend"})),
    "kvrouter_backend_ejected": ("gauge", frozenset({"backend"})),
    "kvrouter_retries_total": ("counter", frozenset({"result"})),
    "kvrouter_upstream_violations_total": ("counter", frozenset({"reason"})),
    "kvrouter_config_reloads_total": ("counter", frozenset({"result"})),
    # prediction checks (router/observe/checks.py)
    "kvrouter_prediction_checks_total": ("counter", frozenset({"backend", "result"})),
    "kvrouter_prediction_error_tokens": ("histogram", frozenset()),
    "kvrouter_prompt_tokens_mismatch_total": ("counter", frozenset({"backend"})),
    "kvrouter_prediction_diagnosis": ("gauge", frozenset({"backend"})),
    # P/D disaggregation (router/pd/metrics.py)
    "kvrouter_pd_requests_total": ("counter", frozenset({"mode"})),
    "kvrouter_pd_skips_total": ("counter", frozenset({"reason"})),
    "kvrouter_pd_fallbacks_total": ("counter", frozenset({"backend", "reason"})),
    "kvrouter_pd_legs_total": ("counter", frozenset({"leg", "backend", "status"})),
    "kvrouter_pd_leg_first_byte_seconds": ("histogram", frozenset({"leg"})),
    "kvrouter_pd_prompt_tokens_total": ("counter", frozenset({"leg"})),
    "kvrouter_pd_matched_tokens_total": ("counter", frozenset({"leg"})),
    "kvrouter_gc_pause_seconds": ("histogram", frozenset({"generation"})),
    "kvrouter_gc_frozen_objects": ("gauge", frozenset()),
}
# Exported only by routers with a [cluster] table (redis_url, session_header); test_cluster.py scrapes them.
CLUSTER_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "kvrouter_cluster_connected": ("gauge", frozenset()),
    "kvrouter_cluster_peers": ("gauge", frozenset()),
    "kvrouter_cluster_peer_max_age_seconds": ("gauge", frozenset()),
    "kvrouter_cluster_messages_total": ("counter", frozenset({"direction"})),
    "kvrouter_cluster_bytes_total": ("counter", frozenset({"direction"})),
    "kvrouter_cluster_predicted_keys_total": ("counter", frozenset({"direction"})),
    "kvrouter_cluster_pins_total": ("counter", frozenset({"direction"})),
    "kvrouter_cluster_failures_total": ("counter", frozenset({"kind"})),
    "kvrouter_cluster_dropped_total": ("counter", frozenset({"what"})),
    "kvrouter_cluster_peers_expired_total": ("counter", frozenset()),
    "kvrouter_cluster_missed_messages_total": ("counter", frozenset()),
    "kvrouter_cluster_lag_seconds": ("histogram", frozenset()),
    "kvrouter_cluster_assumed_decisions_total": ("counter", frozenset()),
    "kvrouter_cluster_held_decisions_total": ("counter", frozenset({"unit"})),
    "kvrouter_session_affinity_total": ("counter", frozenset({"result"})),
    "kvrouter_session_pins": ("gauge", frozenset()),
}
# Exported by kvrouter's own HTTP server (what `kvrouter serve` runs), not under another ASGI server.
SERVER_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "kvrouter_client_connections": ("gauge", frozenset()),
    "kvrouter_max_client_connections": ("gauge", frozenset()),
    "kvrouter_client_limit_hits_total": ("counter", frozenset({"limit"})),
    "kvrouter_open_fds": ("gauge", frozenset()),
    "kvrouter_fd_limit": ("gauge", frozenset()),
}
ALL_METRICS = {**EXPORTED_METRICS, **CLUSTER_METRICS, **SERVER_METRICS}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus attaches at scrape time, usable in any query.
TARGET_LABELS = frozenset({"job", "instance"})

# The fleet TOML is validated in full by router.config; these checks cover what deploy/ must keep consistent.
FLEET_POLICY_NAMES = frozenset({"kv", "round_robin", "least_loaded", "random"})

PAGE_IDS = (
    "status-banner",
    "fleet-hit-ratio",
    "fleet-hit-ratio-recent",
    "requests-total",
    "errors-total",
    "decisions-rate",
    "inflight-total",
    "blocks-total",
    "healthy-backends",
    "sources-ok",
    "policy",
    "uptime",
    "backends",
    "sources",
    "decisions",
    "blocks",
    "chart-fleet-hit",
    "chart-backend-hit",
    "chart-decisions",
    "replicas-body",
    "replicas-summary",
)

REQUIRED_DEPLOY_FILES = (
    "Dockerfile",
    "README.md",
    "fleet.example.toml",
    "compose/docker-compose.yaml",
    "compose/docker-compose.mock.yaml",
    "compose/fleet.toml",
    "compose/fleet.mock.toml",
    "compose/prometheus.yml",
    "compose/grafana-provisioning/datasources/prometheus.yaml",
    "compose/grafana-provisioning/dashboards/kvrouter.yaml",
    "grafana/kvrouter-dashboard.json",
    "k8s/kustomization.yaml",
    "k8s/kvrouter.yaml",
    "k8s/redis.yaml",
    "k8s/vllm.yaml",
    "k8s/static/kustomization.yaml",
    "k8s/static/fleet-static.yaml",
    "k8s/static/no-discovery.yaml",
)

PYYAML_MISSING = "PyYAML is not installed: add `pyyaml` to the [test] extras to check the YAML under deploy/"


# ---- helpers -------------------------------------------------------------------------------------


def _yaml() -> Any:
    return pytest.importorskip("yaml", reason=PYYAML_MISSING)


def _files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.name.endswith(suffixes))


def _yaml_docs(path: Path) -> list[Any]:
    return [d for d in _yaml().safe_load_all(path.read_text()) if d is not None]


def _k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _yaml_docs(path):
            if isinstance(doc, dict) and "kind" in doc and doc.get("kind") != "Kustomization":
                objs[(doc["kind"], doc["metadata"]["name"])] = doc
    return objs


def _grafana_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _grafana_panels(p.get("panels", []))


def _grafana_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    dash = json.loads(GRAFANA.read_text())
    out: list[tuple[str, str]] = []
    for p in _grafana_panels(dash["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    return out


def _check_fleet(cfg: dict[str, Any], where: str) -> None:
    assert isinstance(cfg["block_size"], int) and cfg["block_size"] > 0, where
    assert cfg.get("server", {}).get("host") == "0.0.0.0", f"{where}: listen on all interfaces in a container"
    assert cfg.get("policy", {}).get("name", "kv") in FLEET_POLICY_NAMES, where
    assert isinstance(cfg.get("api_keys", []), list), where
    backends = cfg["backends"]
    assert backends, f"{where}: no backends"
    names = [b["name"] for b in backends]
    assert len(names) == len(set(names)), f"{where}: duplicate backend names"
    for b in backends:
        assert re.match(r"^https?://[^/]+", b["url"]), f"{where}: {b['name']} url"
        dp = b.get("dp_size", 1)
        assert isinstance(dp, int) and dp >= 1
        if b["kv_events"] == "auto":  # the engine lists its streams (GET /kv_event_sources)
            assert "kv_replay" not in b, f"{where}: {b['name']}: kv_replay comes from the listing"
            continue
        ev = re.fullmatch(r"tcp://([^:]+):(\d+)", b["kv_events"])
        assert ev, f"{where}: {b['name']} kv_events must be tcp://host:port"
        if "kv_replay" in b:
            rp = re.fullmatch(r"tcp://([^:]+):(\d+)", b["kv_replay"])
            assert rp, f"{where}: {b['name']} kv_replay must be tcp://host:port"
            # vLLM offsets both endpoints by the DP rank, so the two port ranges must not overlap.
            events = set(range(int(ev[2]), int(ev[2]) + dp))
            replay = set(range(int(rp[2]), int(rp[2]) + dp))
            assert not events & replay, (
                f"{where}: {b['name']}: event ports {events} overlap replay ports {replay}"
            )


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    out = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _page_script() -> str:
    scripts: list[str] = re.findall(r"<script>(.*?)</script>", PAGE.read_text(), flags=re.S)
    assert len(scripts) == 1, "the page has exactly one inline script"
    return scripts[0]


# ---- layout and parsing --------------------------------------------------------------------------


def test_deploy_tree_is_complete() -> None:
    missing = [f for f in REQUIRED_DEPLOY_FILES if not (DEPLOY / f).is_file()]
    assert not missing


def test_json_files_parse() -> None:
    files = _files(".json")
    assert files
    for path in files:
        json.loads(path.read_text())


def test_toml_files_parse_and_follow_the_fleet_contract() -> None:
    files = _files(".toml")
    assert files
    for path in files:
        cfg = tomllib.loads(path.read_text())
        if "backends" in cfg:
            _check_fleet(cfg, str(path.relative_to(ROOT)))


def test_yaml_files_parse() -> None:
    files = _files(".yaml", ".yml")
    assert files
    for path in files:
        assert _yaml_docs(path), f"{path} is empty"


# ---- Grafana -------------------------------------------------------------------------------------


def test_grafana_queries_only_exported_metrics() -> None:
    queries = _grafana_queries()
    assert queries
    for where, expr in queries:
        names = re.findall(r"\bkvrouter_[a-zA-Z0-9_]+\b", expr)
        assert names, f"{where}: queries no kvrouter metric: {expr}"
        for name in names:
            if name in ALL_METRICS:
                kind = ALL_METRICS[name][0]
                assert kind != "histogram", f"{where}: query histogram {name} via _bucket/_sum/_count"
                continue
            base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
            assert base in ALL_METRICS, f"{where}: {name} is not an exported metric"
            assert ALL_METRICS[base][0] == "histogram", f"{where}: {name}: {base} is not a histogram"


def test_grafana_queries_use_existing_labels() -> None:
    for where, expr in _grafana_queries():
        allowed = set(TARGET_LABELS)
        for name in re.findall(r"\bkvrouter_[a-zA-Z0-9_]+\b", expr):
            base = name
            for s in HISTOGRAM_SUFFIXES:
                if name.endswith(s) and name[: -len(s)] in ALL_METRICS:
                    base = name[: -len(s)]
                    allowed.add("le")
            allowed |= ALL_METRICS.get(base, ("", frozenset()))[1]
        used: set[str] = set()
        for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
            used |= {lbl.strip() for lbl in group.split(",") if lbl.strip()}
        for matchers in re.findall(r"\{([^}]*)\}", expr):
            used |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
        if expr.startswith("label_values("):
            used.add(expr.rstrip(")").rsplit(",", 1)[1].strip())
        assert used <= allowed, f"{where}: labels {used - allowed} do not exist on the metrics it queries"


def test_grafana_dashboard_is_well_formed() -> None:
    dash = json.loads(GRAFANA.read_text())
    assert dash["uid"] == "kvrouter"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    panels = list(_grafana_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs)), p["title"]


def test_grafana_covers_the_operator_views() -> None:
    exprs = "\n".join(e for _, e in _grafana_queries())
    for needed in (
        "kvrouter_matched_tokens_total",
        "kvrouter_prompt_tokens_total",
        "kvrouter_route_decisions_total",
        "kvrouter_route_decision_seconds_bucket",
        "kvrouter_ttft_seconds_bucket",
        "kvrouter_inflight_requests",
        "kvrouter_index_blocks",
        "kvrouter_kv_gaps_total",
        "kvrouter_kv_replays_total",
        "kvrouter_kv_restarts_total",
        "kvrouter_kv_decode_errors_total",
        "kvrouter_kv_last_event_age_seconds",
        "kvrouter_kv_event_lag_seconds_bucket",
    ):
        assert needed in exprs, f"the Grafana dashboard has no panel on {needed}"
    assert "by (outcome)" in exprs and "by (backend" in exprs


def test_grafana_promql_parses(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    rules = []
    for i, (_, expr) in enumerate(_grafana_queries()):
        if expr.startswith("label_values("):
            continue
        for var, value in (
            ("$__rate_interval", "5m"),
            ("$__range", "1h"),
            ("$backend", ".*"),
            ("$source", ".*"),
        ):
            expr = expr.replace(var, value)
        rules.append({"record": f"kvrouter_check_{i}", "expr": expr})
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"groups": [{"name": "grafana", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- container image -----------------------------------------------------------------------------


def test_the_image_has_what_the_kubernetes_manifest_turns_on() -> None:
    """The manifest enables pod discovery, which needs the `kubernetes` extra (lightkube): the image
    installed the package without it, so every router pod stopped at start with a config error."""
    manifest = (DEPLOY / "k8s" / "kvrouter.yaml").read_text()
    assert "[membership.kubernetes]" in manifest and "enabled = true" in manifest
    runs = " ".join(rest for w, rest in _dockerfile_instructions() if w == "RUN")
    assert "pip install '.[kubernetes,epp]'" in runs, runs
    gateway = (DEPLOY / "gateway" / "epp.yaml").read_text()  # (and [epp] needs the epp extra)
    assert "[epp]" in gateway and "enabled = true" in gateway


def test_the_image_has_the_mock_engines_the_mock_compose_stack_runs() -> None:
    """The GPU-less compose stack runs `kvrouter mock-engine` from the router's image, and the
    simulated fleet is a distribution of its own (kvrouter-sim, sim/pyproject.toml): without it in
    the image that stack's engines would stop at once on an unknown command."""
    compose = (DEPLOY / "compose" / "docker-compose.mock.yaml").read_text()
    assert "mock-engine" in compose and "image: kvrouter:dev" in compose
    runs = " ".join(rest for w, rest in _dockerfile_instructions() if w == "RUN")
    assert "pip install '.[kubernetes,epp]' ./sim" in runs, runs


def test_the_engine_manifests_report_cached_tokens() -> None:
    """Without --enable-prompt-tokens-details the router's prediction checks see no usage at all."""
    for path in (DEPLOY / "k8s" / "vllm.yaml", DEPLOY / "compose" / "docker-compose.yaml"):
        assert "--enable-prompt-tokens-details" in path.read_text(), path


def test_dockerfile_runs_unprivileged_with_a_healthcheck() -> None:
    instr = _dockerfile_instructions()
    words = [w for w, _ in instr]
    assert instr[0][0] in ("ARG", "FROM")
    assert any("python:3.11-slim" in rest for w, rest in instr if w in ("ARG", "FROM"))
    users = [rest for w, rest in instr if w == "USER"]
    assert users, "the image must drop root"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert words.index("USER") < words.index("ENTRYPOINT")
    health = [rest for w, rest in instr if w == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in (DEPLOY / "Dockerfile").read_text()
    assert "urllib" in health[0] and "curl" not in health[0]
    assert any(w == "EXPOSE" and "8000" in rest.split() for w, rest in instr)
    entry = json.loads(next(rest for w, rest in instr if w == "ENTRYPOINT"))
    cmd = json.loads(next(rest for w, rest in instr if w == "CMD"))
    assert entry + cmd == ["kvrouter", "serve", "--config", "/etc/kvrouter/fleet.toml"]


def test_dockerfile_copies_paths_that_exist() -> None:
    for word, rest in _dockerfile_instructions():
        if word == "COPY" and "--from" not in rest:
            sources = rest.split()[:-1]
            for src in sources:
                if src == "README.md" and not (ROOT / src).exists():
                    continue  # referenced by pyproject.toml; the main README is written separately
                assert (ROOT / src).exists(), f"COPY {src}: not in the build context (repository root)"


# ---- dashboard page ------------------------------------------------------------------------------


def test_dashboard_page_is_self_contained() -> None:
    html = PAGE.read_text()
    assert not re.findall(r"https?://", html), "the page must not reference external URLs"
    assert not re.search(r"""(?:src|href)\s*=\s*["']?//""", html), "no protocol-relative URLs"
    assert not re.search(r"<script[^>]*\bsrc\s*=", html), "scripts are inline"
    assert not re.search(r"<link[^>]*rel=[\"']?stylesheet", html), "styles are inline"
    assert "@import" not in html
    assert 'rel="icon" href="data:' in html, "an inline favicon avoids a 404 console error"


def test_dashboard_page_has_stable_ids() -> None:
    html = PAGE.read_text()
    for element_id in PAGE_IDS:
        assert html.count(f'id="{element_id}"') == 1, element_id


def test_dashboard_page_sends_the_api_key_as_bearer() -> None:
    script = _page_script()
    assert 'params.get("key")' in script
    assert '"Bearer " + API_KEY' in script


def test_dashboard_script_is_valid_javascript(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not installed")
    path = tmp_path / "dashboard.js"
    path.write_text(_page_script())
    proc = subprocess.run([node, "--check", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---- compose -------------------------------------------------------------------------------------


def _compose(name: str) -> dict[str, Any]:
    docs = _yaml_docs(COMPOSE / name)
    assert len(docs) == 1
    doc: dict[str, Any] = docs[0]
    return doc


def _kv_events_config(args: list[str]) -> dict[str, Any]:
    i = args.index("--kv-events-config")
    cfg: dict[str, Any] = json.loads(args[i + 1])
    return cfg


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name:
            return args[i + 1]
    return None


@pytest.mark.parametrize(
    ("compose_file", "fleet_file", "engine_image"),
    [
        ("docker-compose.yaml", "fleet.toml", "vllm/vllm-openai"),
        ("docker-compose.mock.yaml", "fleet.mock.toml", "kvrouter"),
    ],
)
def test_compose_stack_is_consistent(compose_file: str, fleet_file: str, engine_image: str) -> None:
    compose = _compose(compose_file)
    services = compose["services"]
    fleet = tomllib.loads((COMPOSE / fleet_file).read_text())
    assert {"kvrouter", "prometheus", "grafana"} <= set(services)

    mounts = services["kvrouter"]["volumes"]
    assert f"./{fleet_file}:/etc/kvrouter/fleet.toml:ro" in mounts

    for backend in fleet["backends"]:
        host = re.match(r"https?://([^:/]+)", backend["url"])
        assert host, backend["url"]
        engine = services[host[1]]
        assert engine["image"].startswith(engine_image)
        args = [str(a) for a in engine["command"]]
        if engine_image.startswith("vllm"):
            cfg = _kv_events_config(args)
            assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
            assert cfg["endpoint"] == "tcp://*:5557" and cfg["replay_endpoint"] == "tcp://*:5558"
            assert cfg["topic"] == "kv-events"
            assert "--enable-prefix-caching" in args
            devices = engine["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"]
        else:
            assert args[0] == "mock-engine"
            assert _flag(args, "--host") == "0.0.0.0" and _flag(args, "--port") == "8000"
            assert _flag(args, "--kv-port") == "5557" and _flag(args, "--replay-port") == "5558"
            assert _flag(args, "--engines") == "1"
        assert backend["kv_events"] == f"tcp://{host[1]}:5557"
        assert backend["kv_replay"] == f"tcp://{host[1]}:5558"
        assert int(_flag(args, "--block-size") or 0) == fleet["block_size"]

    # every bind mount from the repository exists (user-provided paths come from ${VARIABLES})
    for service in services.values():
        for vol in service.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")) and "${" not in vol:
                assert (COMPOSE / src).exists(), f"{compose_file}: mount {src} does not exist"


def test_prometheus_scrapes_the_compose_services() -> None:
    prom = _yaml_docs(COMPOSE / "prometheus.yml")[0]
    targets = {
        t.split(":")[0]
        for job in prom["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    for compose_file in ("docker-compose.yaml", "docker-compose.mock.yaml"):
        services = set(_compose(compose_file)["services"])
        assert "kvrouter" in targets
        assert targets <= services, (
            f"{compose_file}: prometheus targets {targets - services} are not services"
        )


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    ds = _yaml_docs(COMPOSE / "grafana-provisioning" / "datasources" / "prometheus.yaml")[0]
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = _yaml_docs(COMPOSE / "grafana-provisioning" / "dashboards" / "kvrouter.yaml")[0]
    path = prov["providers"][0]["options"]["path"]
    grafana = _compose("docker-compose.yaml")["services"]["grafana"]
    assert any(v.endswith(f":{path}/kvrouter-dashboard.json:ro") for v in grafana["volumes"])


# ---- Kubernetes ----------------------------------------------------------------------------------


def test_k8s_kvrouter_deployment() -> None:
    objs = _k8s_objects()
    dep = objs[("Deployment", "kvrouter")]
    pod = dep["spec"]["template"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[mounts["/etc/kvrouter"]]["configMap"]["name"] == "kvrouter-config"
    svc = objs[("Service", "kvrouter")]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_k8s_discovers_the_statefulset_pods_with_just_enough_rbac() -> None:
    from router.config import parse_config
    from router.fleet.sources.kubernetes import pod_backend

    objs = _k8s_objects()
    data = tomllib.loads(objs[("ConfigMap", "kvrouter-config")]["data"]["fleet.toml"])
    data.pop("tokenizer")  # fetched into the pod at start-up; not on this machine
    cfg = parse_config(data)
    k8s = cfg.membership.kubernetes
    assert k8s.enabled and not cfg.backends
    sts = objs[("StatefulSet", "vllm")]
    template = sts["spec"]["template"]
    # the selector picks the engine pods (and only them: the router's own pods carry another name)
    wanted = dict(part.split("=") for part in k8s.label_selector.split(","))
    assert wanted.items() <= template["metadata"]["labels"].items()
    router_labels = objs[("Deployment", "kvrouter")]["spec"]["template"]["metadata"]["labels"]
    assert not wanted.items() <= router_labels.items()
    # what discovery would make of such a pod: the engine's own ports, its topic, its block size
    (engine,) = template["spec"]["containers"]
    pod = {
        "metadata": {"name": "vllm-0", "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
        "status": {"phase": "Running", "podIP": "10.0.0.5"},
    }
    b = pod_backend(pod, k8s, cfg.kv_topic)
    args = [str(a) for a in engine["args"]]
    events = _kv_events_config(args)
    assert (b.url, b.kv_events, b.kv_replay) == (
        "http://10.0.0.5:8000",
        f"tcp://10.0.0.5:{events['endpoint'].rsplit(':', 1)[1]}",
        f"tcp://10.0.0.5:{events['replay_endpoint'].rsplit(':', 1)[1]}",
    )
    assert b.kv_topic == events["topic"] and int(_flag(args, "--block-size") or 0) == cfg.block_size
    # RBAC: the Deployment's service account may get/list/watch pods in its namespace, nothing more
    dep = objs[("Deployment", "kvrouter")]
    account = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in objs
    binding = objs[("RoleBinding", "kvrouter-discovery")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = objs[("Role", binding["roleRef"]["name"])]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def test_the_gateway_picker_follows_its_inference_pool_with_just_enough_rbac() -> None:
    """The picker reads its fleet from the InferencePool: the pool it names must be the one the
    HTTPRoute sends to, select the engine pods on their OpenAI port, and the picker's account may
    read pools and pods (get, list, watch), nothing more."""
    from router.config import parse_config

    gateway = DEPLOY / "gateway"
    objs = {(d["kind"], d["metadata"]["name"]): d for d in _yaml_docs(gateway / "epp.yaml")}
    docs = _yaml_docs(gateway / "inferencepool.yaml")
    pools = {d["metadata"]["name"]: d for d in docs if d["kind"] == "InferencePool"}
    cfg = parse_config(tomllib.loads(objs[("ConfigMap", "kvrouter-epp-config")]["data"]["fleet.toml"]))
    k8s = cfg.membership.kubernetes
    assert k8s.enabled and k8s.inference_pool and not k8s.label_selector and not cfg.backends
    pool = pools[k8s.inference_pool]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (route,) = [d for d in docs if d["kind"] == "HTTPRoute"]
    refs = [r for rule in route["spec"]["rules"] for r in rule["backendRefs"]]
    assert {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    } in refs
    assert pool["spec"]["endpointPickerRef"]["name"] == "kvrouter-epp"
    # the pool selects the engine pods (deploy/k8s/vllm.yaml) on their OpenAI server's port
    template = _k8s_objects()[("StatefulSet", "vllm")]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (engine,) = template["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert pool["spec"]["targetPorts"][0]["number"] == named["http"]
    assert {"kv-events", "kv-replay"} <= named.keys()  # what the picker's KV event ports name
    # RBAC: the Deployment's account reads pods and InferencePools in its namespace
    account = objs[("Deployment", "kvrouter-epp")]["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in objs
    (binding,) = [o for k, o in objs.items() if k[0] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = objs[("Role", binding["roleRef"]["name"])]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
    ]


def test_k8s_static_variant_lists_the_statefulset_pods() -> None:
    objs = _k8s_objects()
    static = K8S / "static"
    kustomization = _yaml_docs(static / "kustomization.yaml")[0]
    assert kustomization["resources"] == [".."]
    namespace = kustomization["namespace"]
    assert namespace == _yaml_docs(K8S / "kustomization.yaml")[0]["namespace"]
    patched = {p["path"] for p in kustomization["patches"]}
    assert all((static / p).is_file() for p in patched)
    deleted = {
        (d["kind"], d["metadata"]["name"])
        for d in _yaml_docs(static / "no-discovery.yaml")
        if d.get("$patch") == "delete"
    }
    assert deleted == {k for k in objs if k[0] in ("ServiceAccount", "Role", "RoleBinding")}
    sts = objs[("StatefulSet", "vllm")]
    headless = objs[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in headless["spec"]["ports"]} >= {8000, 5557, 5558}

    (cm,) = _yaml_docs(static / "fleet-static.yaml")
    fleet = tomllib.loads(cm["data"]["fleet.toml"])
    _check_fleet(fleet, "k8s static ConfigMap kvrouter-config")
    expected = [
        f"vllm-{i}.{headless['metadata']['name']}.{namespace}.svc" for i in range(sts["spec"]["replicas"])
    ]
    hosts = []
    for b in fleet["backends"]:
        m = re.match(r"https?://([^:/]+)", b["url"])
        assert m, b["url"]
        hosts.append(m[1])
        assert b["kv_events"] == f"tcp://{m[1]}:5557"
    assert hosts == expected

    (engine,) = sts["spec"]["template"]["spec"]["containers"]
    args = [str(a) for a in engine["args"]]
    cfg = _kv_events_config(args)
    assert cfg["endpoint"] == "tcp://*:5557" and cfg["replay_endpoint"] == "tcp://*:5558"
    assert int(_flag(args, "--block-size") or 0) == fleet["block_size"]
    assert {p["containerPort"] for p in engine["ports"]} >= {8000, 5557, 5558}


def test_k8s_manifests_match_the_api_schema() -> None:
    validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (optional)"
    )
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _yaml_docs(path):
            if doc.get("kind") != "Kustomization":
                validate.validate(doc, "1.30.0", strict=True)


# ---- router replicas -----------------------------------------------------------------------------


def test_k8s_runs_replicas_that_share_a_store() -> None:
    objs = _k8s_objects()
    dep = objs[("Deployment", "kvrouter")]
    assert dep["spec"]["replicas"] >= 2, "the router runs as two or more replicas"
    labels = dep["spec"]["selector"]["matchLabels"]
    pdb = objs[("PodDisruptionBudget", "kvrouter")]
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    assert 1 <= pdb["spec"]["minAvailable"] < dep["spec"]["replicas"], "drains must be able to proceed"
    spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread[0]["labelSelector"]["matchLabels"] == labels
    fleet = tomllib.loads(objs[("ConfigMap", "kvrouter-config")]["data"]["fleet.toml"])
    url = fleet["cluster"]["redis_url"]
    m = re.fullmatch(r"redis://([^:/]+):(\d+)/(\d+)", url)
    assert m, url
    svc = objs[("Service", m[1])]
    store = objs[("Deployment", m[1])]
    assert svc["spec"]["selector"] == store["spec"]["selector"]["matchLabels"]
    (port,) = svc["spec"]["ports"]
    assert port["port"] == int(m[2])
    (container,) = store["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith(("valkey/valkey:", "redis:"))
    assert {p["name"] for p in container["ports"]} >= {port["targetPort"]}
    assert store["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    kustomization = _yaml_docs(K8S / "kustomization.yaml")[0]
    assert "redis.yaml" in kustomization["resources"]
    # every [cluster] key the manifest sets is one the router knows (a typo would stop every replica)
    from router.cluster.config import ClusterConfig

    known = {f.name for f in msgspec.structs.fields(ClusterConfig)}
    assert set(fleet["cluster"]) <= known


@pytest.mark.parametrize(
    ("compose_file", "fleet_file"),
    [("docker-compose.yaml", "fleet.toml"), ("docker-compose.mock.yaml", "fleet.mock.toml")],
)
def test_compose_runs_two_routers_and_a_store(compose_file: str, fleet_file: str) -> None:
    services = _compose(compose_file)["services"]
    first, second = services["kvrouter"], services["kvrouter-2"]
    assert first["volumes"] == second["volumes"], "both replicas read the same fleet config"
    assert first["command"] == second["command"] and first["image"] == second["image"]
    host_ports = {p.rsplit(":", 2)[-2] for r in (first, second) for p in r["ports"]}
    assert len(host_ports) == 2, "the two routers publish different host ports"
    fleet = tomllib.loads((COMPOSE / fleet_file).read_text())
    m = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", fleet["cluster"]["redis_url"])
    assert m and m[1] in services, fleet["cluster"]["redis_url"]
    store = services[m[1]]
    assert store["image"].startswith(("valkey/valkey:", "redis:"))
    assert m[2] in [str(p) for p in store["expose"]]
    for router in (first, second):
        assert m[1] in router["depends_on"]
    prom = _yaml_docs(COMPOSE / "prometheus.yml")[0]
    targets = {
        t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    }
    assert {"kvrouter:8000", "kvrouter-2:8000"} <= targets
