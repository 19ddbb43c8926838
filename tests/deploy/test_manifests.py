"""compose.yaml and deploy/k8s run the same commands as `sluice up`: every service command in them
parses with that service's settings, and the addresses the gateway is given match the stages' ports.
Prometheus scrapes every service's metrics port, and the Grafana dashboard queries only metrics the
code defines."""

from __future__ import annotations

import argparse
import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.metrics import exposed_names
from services.common.settings import load_settings
from sluice.launcher import child_env, default_engine_threads, plan_children
from sluice.launcher import parse_args as parse_up_args

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "tokenizer": ("services.tokenizer.settings", "TokenizerSettings"),
    "engine": ("services.engine.settings", "EngineSettings"),
    "detokenizer": ("services.detokenizer.settings", "DetokenizerSettings"),
    "gateway": ("gateway.settings", "GatewaySettings"),
}
STAGES = ("tokenizer", "engine", "detokenizer")


def settings_for(name: str, flags: list[str], environ: dict[str, str] | None = None) -> Any:
    module_name, class_name = SETTINGS[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return load_settings(cls, flags, environ=environ or {})


def serve_command(argv: list[str]) -> tuple[str, list[str]]:
    assert argv[:2] == ["sluice", "serve"], argv
    return argv[2], argv[3:]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def test_compose_services_parse_and_wire_up() -> None:
    services = compose()["services"]
    assert set(STAGES) | {"gateway", "model"} <= set(services)
    ports = {}
    for name in (*STAGES, "gateway"):
        service = services[name]
        kind, flags = serve_command(service["command"])
        assert kind == name
        settings = settings_for(name, flags, {k: str(v) for k, v in service["environment"].items()})
        assert settings.host == "0.0.0.0"
        ports[name] = settings.port
        health_port = settings.grpc_port if name == "gateway" else settings.port
        assert f"127.0.0.1:{health_port}" in " ".join(service["healthcheck"]["test"])
    gateway = settings_for("gateway", serve_command(services["gateway"]["command"])[1])
    for stage in STAGES:
        assert getattr(gateway, stage) == (f"{stage}:{ports[stage]}",)
        assert services["gateway"]["depends_on"][stage]["condition"] == "service_healthy"
    assert "8000:8000" in services["gateway"]["ports"]


def test_k8s_deployments_parse_and_wire_up() -> None:
    docs = k8s_documents()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    ports = {}
    for name in (*STAGES, "gateway"):
        deployment = deployments[f"sluice-{name}"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        kind, flags = serve_command(container["args"])
        assert kind == name
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        settings = settings_for(name, flags, env)
        ports[name] = settings.port
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels
        assert services[f"sluice-{name}"]["spec"]["selector"] == labels
    gateway_args = deployments["sluice-gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    gateway = settings_for("gateway", serve_command(gateway_args)[1])
    for stage in STAGES:
        assert getattr(gateway, stage) == (f"sluice-{stage}:{ports[stage]}",)
        assert services[f"sluice-{stage}"]["spec"]["clusterIP"] == "None"
    kustomization = next(d for d in docs if d["kind"] == "Kustomization")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in (ROOT / "deploy" / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize(("batching", "engine_threads"), [(None, 0), ("dynamic", 3)])
def test_launcher_flags_parse_for_every_child(batching: str | None, engine_threads: int) -> None:
    flags = ["--port", "8100", "--grpc-base-port", "51000", "--engine-threads", str(engine_threads)]
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


def _compose_settings(name: str) -> Any:
    service = compose()["services"][name]
    environ = {k: str(v) for k, v in service["environment"].items()}
    return settings_for(name, serve_command(service["command"])[1], environ), environ


def test_prometheus_scrapes_every_service() -> None:
    services = compose()["services"]
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: {t for static in job["static_configs"] for t in static["targets"]}
        for job in config["scrape_configs"]
    }
    for stage in STAGES:
        settings, environ = _compose_settings(stage)
        assert settings.metrics_port > 0, stage
        assert targets[f"sluice-{stage}"] == {f"{stage}:{settings.metrics_port}"}
        assert environ["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    gateway, environ = _compose_settings("gateway")
    assert targets["sluice-gateway"] == {f"gateway:{gateway.port}"}
    assert environ["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert "4317:4317" in services["jaeger"]["ports"] and "16686:16686" in services["jaeger"]["ports"]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "sluice.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    return exprs


def test_dashboard_queries_only_defined_metrics() -> None:
    used = {name for expr in _dashboard_exprs() for name in re.findall(r"\bsluice_[a-z0-9_]+", expr)}
    assert used - exposed_names() == set()
    for needed in ("sluice_generation_tokens_total", "sluice_time_to_first_token_seconds_bucket",
                   "sluice_inter_token_latency_seconds_bucket", "sluice_requests_running",
                   "sluice_requests_waiting", "sluice_batch_size_bucket", "sluice_kv_cache_usage_ratio",
                   "sluice_tokenize_duration_seconds_bucket", "sluice_request_queue_time_seconds_bucket",
                   "sluice_detokenize_duration_seconds_bucket"):
        assert needed in used, needed


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
    dashboard = json.loads((grafana / "dashboards" / "sluice.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == prometheus["uid"], panel["title"]


def test_launcher_passes_tracing_and_metrics_settings() -> None:
    args = parse_up_args(["--port", "8100", "--grpc-base-port", "51000", "--metrics-base-port", "9200",
                          "--otlp-endpoint", "http://127.0.0.1:4317", "--trace-console"])
    parsed = {c.name: settings_for(c.name, list(c.flags)) for c in plan_children(args, "/models/m")}
    assert [parsed[stage].metrics_port for stage in STAGES] == [9200, 9201, 9202]
    env = child_env(args, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                   "OTEL_TRACES_EXPORTER": "console,otlp", "OMP_WAIT_POLICY": "PASSIVE"}
    quiet = argparse.Namespace(otlp_endpoint="", trace_console=False)
    assert child_env(quiet, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert child_env(quiet, {"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    console_only = argparse.Namespace(otlp_endpoint="", trace_console=True)
    assert child_env(console_only, {})["OTEL_TRACES_EXPORTER"] == "console"


def test_k8s_pods_export_metrics_and_traces() -> None:
    deployments = [d for d in k8s_documents() if d["kind"] == "Deployment"]
    assert len(deployments) == 4
    for deployment in deployments:
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        name, flags = serve_command(container["args"])
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://")
        settings = settings_for(name, flags, env)
        metrics_port = settings.port if name == "gateway" else settings.metrics_port
        assert metrics_port > 0
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)
