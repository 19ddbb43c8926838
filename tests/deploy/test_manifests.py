"""compose.yaml, the Dockerfile and deploy/k8s run the same commands as `sluice up`: every command in them
is a real `sluice` command whose flags parse with that service's settings, the addresses the gateway is
given are DNS names that resolve to every replica of each stage at the stages' ports, probes and health
checks ask the ports the code listens on, and Prometheus scrapes every replica. The Kubernetes overlays
are rendered with `kubectl kustomize` where it is installed, else with tests/deploy/kustomize.py."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.grpc_server import ServiceHealth
from services.common.metrics import exposed_names
from services.common.settings import load_settings
from sluice import cli, plan
from sluice.launcher import parse_args as parse_up_args
from sluice.model import tiny
from sluice.plan import LIGHT_NICE, child_env, default_engine_threads, plan_children, policy_line
from tests.deploy import kustomize

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SETTINGS = {
    "tokenizer": ("services.tokenizer.settings", "TokenizerSettings"),
    "engine": ("services.engine.settings", "EngineSettings"),
    "detokenizer": ("services.detokenizer.settings", "DetokenizerSettings"),
    "gateway": ("gateway.settings", "GatewaySettings"),
}
STAGES = ("tokenizer", "engine", "detokenizer")
ROUTING_POLICIES = ("round_robin", "least_load", "prefix_affinity")
OVERLAYS = ("cpu", "gpu")
WAITING_GAUGE = "sluice_requests_waiting"


def settings_for(name: str, flags: list[str], environ: dict[str, str] | None = None) -> Any:
    module_name, class_name = SETTINGS[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return load_settings(cls, flags, environ=environ or {})


def default_port(name: str, field: str = "port") -> int:
    """The port the service listens on when no flag or variable sets it."""
    module_name, class_name = SETTINGS[name]
    return getattr(getattr(importlib.import_module(module_name), class_name)(), field)


def serve_command(argv: list[str]) -> tuple[str, list[str]]:
    """The service and flags of `sluice serve NAME FLAGS`, checked against the `sluice` parser."""
    assert argv[:2] == ["sluice", "serve"], argv
    parsed, rest = cli._parser().parse_known_args(argv[1:])
    assert parsed.name == argv[2]
    return argv[2], rest


def check_sluice_command(argv: list[str]) -> argparse.Namespace:
    """Parses a `sluice health|model ...` command line as `sluice` would; fails on a bad command."""
    assert argv[0] == "sluice", argv
    parsed, rest = cli._parser().parse_known_args(argv[1:])
    if parsed.command == "model":
        tiny._parser().parse_args(rest)
    else:
        assert rest == [], argv
    return parsed


def sluice_commands_in_shell(script: str) -> list[list[str]]:
    """Every `sluice ...` command line inside a shell script (split at ||, && and ;)."""
    commands = []
    for part in re.split(r"\|\||&&|;|\{|\}", script):
        words = shlex.split(part)
        if words and words[0] == "sluice":
            commands.append(words)
    return commands


def interpolate(value: Any) -> str:
    """A compose value with `${VAR:-default}` replaced by its default (no variable set)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def compose_environ(service: dict[str, Any]) -> dict[str, str]:
    return {k: interpolate(v) for k, v in service.get("environment", {}).items()}


def compose_settings(name: str) -> tuple[str, Any, dict[str, str]]:
    service = compose()["services"][name]
    kind, flags = serve_command(service["command"])
    environ = compose_environ(service)
    return kind, settings_for(kind, flags, environ), environ


# ---- the image -----------------------------------------------------------------------------------


def test_dockerfile_installs_dependencies_before_the_source() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    text = "\n".join(lines)
    assert "ARG TORCH_VARIANT=cuda" in lines
    # cpu: a wheel in docker/wheels/ when there is one, else the PyTorch CPU index
    assert re.search(r"then pip install .*--find-links /tmp/wheels \"torch==\$TORCH_VERSION\"", text)
    assert re.search(
        r"else pip install .*--index-url \"\$TORCH_CPU_INDEX\" \\\n.*\"torch==\$TORCH_VERSION\"", text
    )
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines and "FROM ${BASE_IMAGE}" in lines
    assert "ARG TORCH_VERSION=2.13.0" in lines
    pinned = {
        line.split("==")[0]: line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().split()
    }
    assert pinned["torch"] == "2.13.0"

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    deps = first(r"pip install .*-c constraints.txt -r /tmp/requirements.txt")
    assert first(r"\['project'\]\['dependencies'\]") < deps
    assert first(r"^COPY pyproject.toml constraints.txt") < deps
    for package in ("services", "gateway", "sluice", "protos"):
        assert first(rf"^COPY {package} ") > deps, package
    assert first(r"pip install --no-cache-dir --no-deps \.$") > first(r"^COPY sluice ")
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "tests", "**/__pycache__", ".env"):
        assert path in ignored, path


# ---- compose ------------------------------------------------------------------------------------


def test_compose_services_parse_and_wire_up() -> None:
    services = compose()["services"]
    assert set(STAGES) | {"engine-cpu", "gateway", "model"} <= set(services)
    ports = {}
    for name in (*STAGES, "engine-cpu"):
        kind, settings, _ = compose_settings(name)
        assert kind == name.removesuffix("-cpu")
        assert settings.host == "0.0.0.0"
        assert settings.port == default_port(kind)
        ports[kind] = settings.port
        health = services[name]["healthcheck"]["test"]
        assert health[0] == "CMD"
        assert check_sluice_command(health[1:]).address == f"127.0.0.1:{settings.port}"
    kind, gateway, environ = compose_settings("gateway")
    assert kind == "gateway" and gateway.host == "0.0.0.0"
    assert (gateway.port, gateway.grpc_port) == (
        default_port("gateway"),
        default_port("gateway", "grpc_port"),
    )
    depends_on = services["gateway"]["depends_on"]
    for stage in STAGES:
        assert getattr(gateway, stage) == (f"dns:///{stage}:{ports[stage]}",)
    # No dependency on an engine service (which one runs depends on the profile, and docker-compose 1.29
    # refuses `required: false`): the gateway's health is /readyz, which needs a serving engine.
    assert set(depends_on) == {"model", "tokenizer", "detokenizer"}
    for stage in ("tokenizer", "detokenizer"):
        assert depends_on[stage] == {"condition": "service_healthy"}
    assert all("required" not in dependency for dependency in depends_on.values())
    assert environ["SLUICE_ROUTING"] in ROUTING_POLICIES
    if hasattr(gateway, "routing"):
        assert gateway.routing == environ["SLUICE_ROUTING"]
    readyz = " ".join(services["gateway"]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{gateway.port}/readyz" in readyz
    published = [interpolate(port) for port in services["gateway"]["ports"]]
    assert f"{gateway.port}:{gateway.port}" in published
    assert f"{gateway.grpc_port}:{gateway.grpc_port}" in published
    for command in sluice_commands_in_shell(services["model"]["command"][2]):
        check_sluice_command(command)


def test_compose_scales_every_stage_through_dns() -> None:
    """`docker compose up --scale engine=2` needs no edits: no scaled service has a fixed container name
    or a host port, and the CPU engine answers to the same DNS name as the GPU one."""
    services = compose()["services"]
    for name in (*STAGES, "engine-cpu"):
        assert "container_name" not in services[name], name
        assert "ports" not in services[name], name
        assert "models:/models" in services[name]["volumes"]
        grace = float(compose_settings(name)[1].grace_s)
        assert float(services[name]["stop_grace_period"].removesuffix("s")) > grace, name
    assert services["engine"]["profiles"] == ["gpu"]
    assert services["engine-cpu"]["profiles"] == ["cpu"]
    assert services["engine-cpu"]["networks"]["default"]["aliases"] == ["engine"]
    assert "deploy" not in services["engine-cpu"]
    devices = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert compose_settings("engine")[1].device == "cuda"
    assert compose_settings("engine-cpu")[1].device == "cpu"
    assert "COMPOSE_PROFILES=gpu,observability" in (ROOT / ".env").read_text().splitlines()
    assert "models" in compose()["volumes"]


def test_compose_config_is_valid() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose is not installed")
    for profile in ("gpu", "cpu"):
        result = subprocess.run(
            [docker, "compose", "--profile", profile, "config", "--quiet"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr


def test_prometheus_discovers_every_replica_by_dns() -> None:
    services = compose()["services"]
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    expected = {stage: compose_settings(stage)[1].metrics_port for stage in STAGES}
    expected["gateway"] = compose_settings("gateway")[1].port
    for name, port in expected.items():
        job = jobs[f"sluice-{name}"]
        assert port > 0, name
        assert "static_configs" not in job, name  # a static target is one series for all replicas
        assert job["dns_sd_configs"] == [
            {"names": [name], "type": "A", "port": port, "refresh_interval": "10s"}
        ]
    # Spans go to Jaeger when the observability profile is on (.env sets both); with an empty endpoint
    # (the profile off) no exporter is configured.
    dotenv = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines() if "=" in line)
    assert dotenv["SLUICE_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert "observability" in dotenv["COMPOSE_PROFILES"].split(",")
    for stage in (*STAGES, "gateway"):
        raw = services[stage]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert raw == "${SLUICE_OTLP_ENDPOINT:-}", stage
    for name in ("jaeger", "prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"], name
    assert "4317:4317" in services["jaeger"]["ports"] and "16686:16686" in services["jaeger"]["ports"]


def _dashboard() -> dict[str, Any]:
    return json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "sluice.json").read_text())


def _dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for panel in _dashboard()["panels"] for t in panel["targets"]]
    assert exprs
    return exprs


def test_dashboard_queries_only_defined_metrics() -> None:
    used = {name for expr in _dashboard_exprs() for name in re.findall(r"\bsluice_[a-z0-9_]+", expr)}
    assert used - exposed_names() == set()
    for needed in (
        "sluice_generation_tokens_total",
        "sluice_time_to_first_token_seconds_bucket",
        "sluice_inter_token_latency_seconds_bucket",
        "sluice_requests_running",
        "sluice_requests_waiting",
        "sluice_batch_size_bucket",
        "sluice_kv_cache_usage_ratio",
        "sluice_tokenize_duration_seconds_bucket",
        "sluice_request_queue_time_seconds_bucket",
        "sluice_detokenize_duration_seconds_bucket",
    ):
        assert needed in used, needed


def test_dashboard_has_a_replica_variable_every_query_follows() -> None:
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    instance = variables["instance"]
    assert instance["multi"] and instance["includeAll"]
    assert "instance)" in instance["query"]["query"]
    for expr in _dashboard_exprs():
        for selector in re.findall(r"\bsluice_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert selector == '{instance=~"$instance"}', expr
    assert any("by (instance)" in expr for expr in _dashboard_exprs())


def test_grafana_is_provisioned_with_the_dashboard_and_datasource() -> None:
    grafana = ROOT / "deploy" / "grafana"
    sources = yaml.safe_load((grafana / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    prometheus = next(d for d in sources["datasources"] if d["type"] == "prometheus")
    assert prometheus["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((grafana / "provisioning" / "dashboards" / "sluice.yaml").read_text())
    dashboards_path = providers["providers"][0]["options"]["path"]
    volumes = compose()["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{dashboards_path}:ro" in volumes
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    dashboard = _dashboard()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == prometheus["uid"], panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"]["uid"] == prometheus["uid"]


# ---- sluice up ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("batching", "engine_threads"), [(None, 0), ("dynamic", 3)])
def test_launcher_flags_parse_for_every_child(
    batching: str | None, engine_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    flags = ["--port", "8100", "--grpc-base-port", "51000", "--engine-threads", str(engine_threads)]
    flags += ["--engines", "1"]  # auto: tests/test_plan.py
    args = parse_up_args(flags + (["--batching", batching] if batching else []))
    children = plan_children(args, "/models/m")
    assert [c.name for c in children] == [*STAGES, "gateway"]
    parsed = {c.name: settings_for(c.name, list(c.flags)) for c in children}
    for child in children:
        assert parsed[child.name].host == "127.0.0.1"
    assert parsed["gateway"].port == 8100
    assert parsed["gateway"].grpc_port == 51000
    assert parsed["gateway"].served_model_name == "tiny"  # the embedded model, as README's examples name it
    assert parsed["engine"].threads == (engine_threads or default_engine_threads())
    for stage in STAGES:
        assert parsed[stage].model == "/models/m"
        assert getattr(parsed["gateway"], stage) == (f"127.0.0.1:{parsed[stage].port}",)
    assert len({c.grpc_port for c in children}) == 4
    if batching:
        assert parsed["engine"].batching == batching


def test_the_engine_gets_every_usable_core_and_the_light_stages_a_lower_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default the engine has a torch thread per core this process may run on (its affinity, not
    the host's count) at the launcher's priority, and the tokenizer, detokenizer and gateway run
    LIGHT_NICE lower beside one engine (the engine's priority beside several); --engine-threads and
    --light-nice override, and the start-up line says which."""
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(plan.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(plan.os, "getloadavg", lambda: (0.2, 0.5, 0.5))
    assert default_engine_threads() == default_engine_threads(0.0) == 3
    assert default_engine_threads(plan.BUSY_LOAD) == default_engine_threads(9.0) == 2  # a busy host
    busy = parse_up_args(["--engines", "1"])
    assert settings_for("engine", list(plan_children(busy, "/m", load=5.0)[1].flags)).threads == 2
    assert "one less than the 3 usable cores: load average 5.00" in policy_line(busy, load=5.0)
    # Engines share the cores: none oversubscribes them (two threads each would wait on each other).
    assert default_engine_threads(0.0, engines=2) == 1 and default_engine_threads(0.0, engines=5) == 1
    two = parse_up_args(["--engines", "2"])
    engines = [c for c in plan_children(two, "/m", load=0.0) if c.kind == "engine"]
    assert [settings_for("engine", list(c.flags)).threads for c in engines] == [1, 1]
    assert "1 torch thread(s) each (one per usable core, 3, shared by 2 engines" in policy_line(two, load=0.0)
    # Beside several engines the light stages keep the engines' priority unless --light-nice says.
    assert {c.nice for c in plan_children(two, "/m", load=0.0)} == {0}
    assert "at the engine's priority (beside several engines" in policy_line(two, load=0.0)
    niced = parse_up_args(["--engines", "2", "--light-nice", "5"])
    assert {c.kind: c.nice for c in plan_children(niced, "/m", load=0.0)}["gateway"] == 5
    assert "at nice +5 (--light-nice)" in policy_line(niced, load=0.0)
    args = parse_up_args(["--tokenizers", "2", "--engines", "1"])
    children = plan_children(args, "/models/m")
    parsed = {c.name: settings_for(c.kind, list(c.flags)) for c in children}
    assert parsed["engine"].threads == 3
    assert {c.name: c.nice for c in children} == {
        "tokenizer-1": LIGHT_NICE,
        "tokenizer-2": LIGHT_NICE,
        "engine": 0,
        "detokenizer": LIGHT_NICE,
        "gateway": LIGHT_NICE,
    }
    assert LIGHT_NICE > 0
    assert "3 torch thread(s) (one per usable core, 3; load average 0.20" in policy_line(args)
    assert f"nice +{LIGHT_NICE}" in policy_line(args)
    old = parse_up_args(["--engine-threads", "1", "--light-nice", "0", "--engines", "1"])
    children = plan_children(old, "/models/m")
    assert settings_for("engine", list(children[1].flags)).threads == 1
    assert {c.nice for c in children} == {0}
    assert "1 torch thread(s) (--engine-threads)" in policy_line(old, load=5.0)
    assert settings_for("engine", list(plan_children(old, "/m", load=0.0)[1].flags)).threads == 1
    assert "at the engine's priority" in policy_line(old)


def test_light_nice_is_refused_outside_0_to_19(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_up_args(["--light-nice", "19"]).light_nice == 19
    for bad in ("-1", "20"):
        with pytest.raises(SystemExit):
            parse_up_args(["--light-nice", bad])
    assert "--light-nice" in capsys.readouterr().err


def test_launcher_passes_tracing_and_metrics_settings() -> None:
    args = parse_up_args(
        [
            "--port",
            "8100",
            "--grpc-base-port",
            "51000",
            "--metrics-base-port",
            "9200",
            "--otlp-endpoint",
            "http://127.0.0.1:4317",
            "--trace-console",
            "--engines",
            "1",
        ]
    )
    parsed = {c.name: settings_for(c.name, list(c.flags)) for c in plan_children(args, "/models/m")}
    assert [parsed[stage].metrics_port for stage in STAGES] == [9200, 9201, 9202]
    env = child_env(args, {"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_TRACES_EXPORTER": "console,otlp",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    quiet = argparse.Namespace(otlp_endpoint="", trace_console=False)
    assert child_env(quiet, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert child_env(quiet, {"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    console_only = argparse.Namespace(otlp_endpoint="", trace_console=True)
    assert child_env(console_only, {})["OTEL_TRACES_EXPORTER"] == "console"


# ---- Kubernetes ---------------------------------------------------------------------------------


_RENDERED: dict[str, list[dict[str, Any]]] = {}


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's documents, rendered once per test session."""
    if overlay not in _RENDERED:
        directory = K8S / "overlays" / overlay
        _RENDERED[overlay] = (
            kustomize.render_with_kubectl(directory) if kustomize.kubectl() else kustomize.render(directory)
        )
    return _RENDERED[overlay]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def container_environ(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment: its envFrom ConfigMaps, then its literal env."""
    config_maps = by_kind(docs, "ConfigMap")
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environ.update(config_maps[source["configMapRef"]["name"]]["data"])
    environ.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return environ


def deployment_settings(docs: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], Any, dict[str, str]]:
    container = pod_spec(by_kind(docs, "Deployment")[f"sluice-{name}"])["containers"][0]
    kind, flags = serve_command(container["args"])
    assert kind == name
    environ = container_environ(docs, container)
    return container, settings_for(name, flags, environ), environ


def named_port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def test_every_manifest_is_listed_in_its_kustomization() -> None:
    for kustomization in K8S.rglob("kustomization.yaml"):
        directory = kustomization.parent
        listed = kustomize.read_kustomization(directory)
        files = {entry for entry in listed.get("resources", []) if not entry.startswith("..")}
        files |= {patch["path"] for patch in listed.get("patches", []) if "path" in patch}
        on_disk = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
        assert files == on_disk, directory
        for entry in [*listed.get("resources", []), *listed.get("components", [])]:
            assert (directory / entry).exists(), (directory, entry)


@pytest.mark.skipif(kustomize.kubectl() is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fallback_renderer_agrees_with_kubectl(overlay: str) -> None:
    """The renderer the tests use without kubectl gives the same pods as `kubectl kustomize`."""
    ours = kustomize.render(K8S / "overlays" / overlay)
    theirs = rendered(overlay)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in ours if d["kind"] != "ConfigMap") == sorted(
        (d["kind"], d["metadata"]["name"]) for d in theirs if d["kind"] != "ConfigMap"
    )
    for name, deployment in by_kind(theirs, "Deployment").items():
        for ours_c, theirs_c in zip(
            pod_spec(by_kind(ours, "Deployment")[name])["containers"],
            pod_spec(deployment)["containers"],
            strict=True,
        ):
            assert container_environ(ours, ours_c) == container_environ(theirs, theirs_c), name
            for key in ("args", "command", "resources", "ports", "volumeMounts"):
                assert ours_c.get(key) == theirs_c.get(key), (name, key)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_deployments_parse_and_wire_up(overlay: str) -> None:
    docs = rendered(overlay)
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    ports = {}
    for name in (*STAGES, "gateway"):
        deployment = deployments[f"sluice-{name}"]
        assert deployment["metadata"]["namespace"] == "sluice"
        container, settings, _ = deployment_settings(docs, name)
        assert settings.host == "0.0.0.0"
        assert settings.port == default_port(name)
        ports[name] = settings.port
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels
        assert services[f"sluice-{name}"]["spec"]["selector"] == labels
        if name == "gateway":
            assert named_port(container, "http") == settings.port
            assert named_port(container, "grpc") == settings.grpc_port
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
            assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
            continue
        assert named_port(container, "grpc") == settings.port
        assert named_port(container, "metrics") == settings.metrics_port > 0
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": settings.port}, (name, probe)
        service_port = services[f"sluice-{name}"]["spec"]["ports"][0]
        assert (service_port["port"], service_port["targetPort"]) == (settings.port, "grpc")
        assert services[f"sluice-{name}"]["spec"]["clusterIP"] == "None"  # one DNS record per pod
        init = pod_spec(deployment)["initContainers"][0]
        assert container_environ(docs, init)["SLUICE_MODEL"] == settings.model
    _, gateway, environ = deployment_settings(docs, "gateway")
    for stage in STAGES:
        assert getattr(gateway, stage) == (f"dns:///sluice-{stage}:{ports[stage]}",)
    assert environ["SLUICE_ROUTING"] in ROUTING_POLICIES
    if hasattr(gateway, "routing"):
        assert gateway.routing == environ["SLUICE_ROUTING"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_engine_starts_slowly_drains_and_has_shared_memory(overlay: str) -> None:
    docs = rendered(overlay)
    for name in (*STAGES, "gateway"):
        deployment = by_kind(docs, "Deployment")[f"sluice-{name}"]
        container, settings, _ = deployment_settings(docs, name)
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        # SIGKILL only after the endpoint has left the rotation and the service's drain has run out.
        assert (
            pod_spec(deployment)["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + settings.grace_s + 5
        )
        assert "replicas" not in deployment["spec"], name  # the autoscalers own the counts
    engine = by_kind(docs, "Deployment")["sluice-engine"]
    container, settings, _ = deployment_settings(docs, "engine")
    startup = container["startupProbe"]
    assert startup["grpc"] == {"port": settings.port}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a real model loads for minutes
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    dshm = next(v for v in pod_spec(engine)["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"
    if overlay == "gpu":
        assert settings.device == "cuda" and settings.kv_cache_gb == 0  # KV pool sized from free memory
        assert 0 < settings.gpu_memory_utilization < 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        spec = pod_spec(engine)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    else:
        assert settings.device == "cpu" and settings.kv_cache_gb > 0
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        assert "tolerations" not in pod_spec(engine)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_restarts_a_stage_that_stops_serving(overlay: str) -> None:
    """Each stage's liveness probe is a gRPC probe of its overall health (the name "" that
    `ServiceHealth.set_failed` turns NOT_SERVING, as an engine whose loop failed does), so a pod NOT_SERVING
    or silent is restarted within half a minute; each check may take a few seconds on a busy CPU, and
    loading is the startupProbe's business, not liveness's."""
    assert "" in ServiceHealth([]).names
    docs = rendered(overlay)
    for name in STAGES:
        container, settings, _ = deployment_settings(docs, name)
        liveness, startup = container["livenessProbe"], container["startupProbe"]
        assert liveness["grpc"] == {"port": settings.port} == startup["grpc"], name  # no `service`: ""
        window = liveness["periodSeconds"] * liveness.get("failureThreshold", 3)
        assert 10 <= window <= 30, (name, liveness)
        assert liveness.get("timeoutSeconds", 1) >= 2, (name, liveness)
        assert "initialDelaySeconds" not in liveness, (name, liveness)
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, (name, startup)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_network_policy_admits_only_the_gateway_to_the_stages(overlay: str) -> None:
    docs = rendered(overlay)
    policies = list(by_kind(docs, "NetworkPolicy").values())
    assert len(policies) == 1
    spec = policies[0]["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    selected = {e["key"]: set(e["values"]) for e in spec["podSelector"]["matchExpressions"]}
    assert selected == {"app.kubernetes.io/name": {"sluice"}, "app.kubernetes.io/component": set(STAGES)}
    gateway_labels = by_kind(docs, "Deployment")["sluice-gateway"]["spec"]["template"]["metadata"]["labels"]
    for stage in STAGES:
        container, settings, _ = deployment_settings(docs, stage)
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        admitted = [
            rule
            for rule in spec["ingress"]
            if any(named.get(p["port"], p["port"]) == settings.port for p in rule["ports"])
        ]
        assert admitted and all(
            rule["from"] == [{"podSelector": {"matchLabels": gateway_labels}}] for rule in admitted
        ), stage
        for rule in spec["ingress"]:  # any other rule opens only the metrics port
            if rule not in admitted:
                assert [named[p["port"]] for p in rule["ports"]] == [settings.metrics_port]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_disruption_budgets_and_autoscalers(overlay: str) -> None:
    docs = rendered(overlay)
    deployments = by_kind(docs, "Deployment")
    budgets = by_kind(docs, "PodDisruptionBudget")
    for name in (*STAGES, "gateway"):
        labels = deployments[f"sluice-{name}"]["spec"]["selector"]["matchLabels"]
        assert budgets[f"sluice-{name}"]["spec"]["selector"]["matchLabels"] == labels
        assert budgets[f"sluice-{name}"]["spec"]["maxUnavailable"] == 1
    autoscalers = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(autoscalers) == {"sluice-tokenizer", "sluice-detokenizer", "sluice-gateway"}
    for name, hpa in autoscalers.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
        assert 1 < hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    scaled = by_kind(docs, "ScaledObject")
    if overlay == "cpu":
        assert scaled == {}
        return
    engine = scaled["sluice-engine"]["spec"]
    assert engine["scaleTargetRef"] == {"name": "sluice-engine"}
    [trigger] = engine["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert WAITING_GAUGE in exposed_names() and re.match(rf"sum\({WAITING_GAUGE}\{{[^}}]*\}}\)$", query)
    assert "gpu" not in query.lower() and "DCGM" not in query
    assert float(trigger["metadata"]["threshold"]) > 0
    assert trigger.get("metricType", "AverageValue") == "AverageValue"  # per replica


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_api_keys_come_from_a_secret(overlay: str) -> None:
    docs = rendered(overlay)
    secret = by_kind(docs, "Secret")["sluice-api-keys"]
    container, gateway, _ = deployment_settings(docs, "gateway")
    volume = next(
        v
        for v in pod_spec(by_kind(docs, "Deployment")["sluice-gateway"])["volumes"]
        if v.get("secret", {}).get("secretName") == "sluice-api-keys"
    )
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    [key] = secret["stringData"]
    assert gateway.api_keys_file == f"{mount['mountPath']}/{key}"


def test_k8s_model_jobs_fill_the_volume_the_pods_read() -> None:
    cpu, gpu = rendered("cpu"), rendered("gpu")
    _, cpu_engine, _ = deployment_settings(cpu, "engine")
    [cpu_job] = by_kind(cpu, "Job").values()
    commands = sluice_commands_in_shell(cpu_job["spec"]["template"]["spec"]["containers"][0]["command"][2])
    assert [check_sluice_command(c).command for c in commands] == ["model"]
    assert commands[0][3] == cpu_engine.model

    _, gpu_engine, environ = deployment_settings(gpu, "engine")
    [gpu_job] = by_kind(gpu, "Job").values()
    container = gpu_job["spec"]["template"]["spec"]["containers"][0]
    script = container["command"][2]
    assert 'hf download "$HF_MODEL_ID" --local-dir "$SLUICE_MODEL.partial"' in script
    assert 'mv "$SLUICE_MODEL.partial" "$SLUICE_MODEL"' in script
    job_env = container_environ(gpu, container)
    assert job_env["SLUICE_MODEL"] == gpu_engine.model == environ["SLUICE_MODEL"]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", job_env["HF_MODEL_ID"])
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]
    assert token["optional"] is True
    for job in (cpu_job, gpu_job):
        claim = job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
        assert claim == "sluice-models"
        assert job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == "/models"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_pods_export_metrics_and_tracing_is_off_by_default(overlay: str) -> None:
    docs = rendered(overlay)
    assert "otel-collector" not in by_kind(docs, "Deployment")
    for name in (*STAGES, "gateway"):
        template = by_kind(docs, "Deployment")[f"sluice-{name}"]["spec"]["template"]
        _, settings, environ = deployment_settings(docs, name)
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in environ
        metrics_port = settings.port if name == "gateway" else settings.metrics_port
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)


def test_k8s_otel_collector_component_turns_tracing_on(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # relative: kustomize refuses absolute paths
                "resources": [os.path.relpath(K8S / "overlays" / "cpu", tmp_path)],
                "components": [os.path.relpath(K8S / "components" / "otel-collector", tmp_path)],
            }
        )
    )
    docs = kustomize.render_with_kubectl(tmp_path) if kustomize.kubectl() else kustomize.render(tmp_path)
    collector = by_kind(docs, "Service")["otel-collector"]
    grpc_port = next(p["port"] for p in collector["spec"]["ports"] if p["name"] == "otlp-grpc")
    for name in (*STAGES, "gateway"):
        _, _, environ = deployment_settings(docs, name)
        assert environ["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{grpc_port}"
