"""The files in deploy/: they parse, the Kubernetes objects are wired to each other and
to the gateway's config, the configs pass `check-config`, the alert rules pass
promtool (checked and unit-tested), and every metric the alerts and the dashboard use
is one a real gateway exports.

promtool comes from scripts/setup (Debian's prometheus package, or Homebrew's). When it
is missing these tests fail and say so: a deploy that was never checked is not skipped
into looking green.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.assembly import COUNTS_TTL
from gateway.config import Config, load_config
from gateway.metrics import OUTCOMES
from gateway.records import OPEN_STATES
from tests.conftest import unique
from tests.support.servers import ROOT, Process, free_port, gateway_process, wait_for_port

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
COMPOSE = DEPLOY / "docker-compose.yml"
RUNBOOK = ROOT / "docs" / "operations.md"
TOKEN = "test-admin-token"


# -- helpers ---------------------------------------------------------------------------


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not on PATH: run scripts/setup, which installs it (Debian's "
            "prometheus package, or `brew install prometheus` on a Mac)",
            pytrace=False,
        )
    return subprocess.run(
        [path, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def deploy_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


def load_yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_objects() -> dict[str, dict[str, Any]]:
    """Every object in deploy/kubernetes, by kind (one of each kind here)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load_yaml_docs(path):
            if "apiVersion" in doc and doc.get("kind") != "Kustomization":
                assert doc["kind"] not in objects, f"two {doc['kind']} objects"
                objects[doc["kind"]] = doc
    return objects


def listen_port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def load_gateway_config(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(str(path))


def configmap_config_text() -> str:
    return str(k8s_objects()["ConfigMap"]["data"]["config.yaml"])


def container() -> dict[str, Any]:
    containers = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def container_port(port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert port in named, f"no container port named {port!r}: {named}"
    return int(named[port])


def rule_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(ALERTS.read_text())["groups"])


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel.get("targets", [])]
    for variable in doc["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def rule_exprs() -> list[str]:
    return [str(rule["expr"]) for group in rule_groups() for rule in group["rules"]]


METRIC_NAME = re.compile(r"\bidempotency_gateway_[a-z0-9_]+")
RECORDED_NAME = re.compile(r"\bidempotency_gateway:[a-z0-9_:]+")
LABEL_MATCHER = re.compile(r'\b(state|outcome|result|action)\s*(=~|=)\s*"([^"]*)"')


# -- every file parses ---------------------------------------------------------------


@pytest.mark.parametrize(
    "path", deploy_files(".yml", ".yaml"), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_yaml_parses(path: Path) -> None:
    assert load_yaml_docs(path), f"{path} holds no YAML document"


@pytest.mark.parametrize("path", deploy_files(".json"), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_parses(path: Path) -> None:
    assert json.loads(path.read_text())


def test_there_is_something_to_parse() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in deploy_files(".yml", ".yaml", ".json")}
    assert {
        "docker-compose.yml",
        "config.yaml",
        "prometheus.yml",
        "prometheus/alerts.yml",
        "prometheus/alerts_test.yml",
        "grafana/dashboard.json",
        "kubernetes/deployment.yaml",
        "kubernetes/prometheusrule.yaml",
    } <= names


# -- Kubernetes ------------------------------------------------------------------------


def test_kubernetes_has_every_object() -> None:
    kinds = set(k8s_objects())
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "PrometheusRule",
    } <= kinds
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_deployment_runs_two_replicas_with_resources() -> None:
    deployment = k8s_objects()["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    template = deployment["spec"]["template"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    resources = container()["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True


def test_probes_hit_health_and_readiness_on_the_admin_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_gateway_config(configmap_config_text(), tmp_path, monkeypatch)
    admin_port = listen_port(config.admin.listen)
    spec = container()
    liveness, readiness = spec["livenessProbe"]["httpGet"], spec["readinessProbe"]["httpGet"]
    assert liveness["path"] == "/healthz"
    assert readiness["path"] == "/readyz"
    assert container_port(liveness["port"]) == admin_port
    assert container_port(readiness["port"]) == admin_port
    assert container_port("http") == listen_port(config.server.listen)


def test_listeners_bind_every_interface_in_containers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for text in (configmap_config_text(), (DEPLOY / "config.yaml").read_text()):
        config = load_gateway_config(text, tmp_path, monkeypatch)
        assert config.server.listen.startswith("0.0.0.0:")
        assert config.admin.listen.startswith("0.0.0.0:")
        assert config.store.url.startswith("redis://"), "replicas must share a Redis store"


def prestop_sleep() -> float:
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


def test_termination_grace_outlasts_prestop_and_shutdown_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_gateway_config(configmap_config_text(), tmp_path, monkeypatch)
    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    sleep = prestop_sleep()
    assert sleep > 0, "the preStop sleep lets the Service stop routing before SIGTERM"
    # The kubelet's clock runs from the preStop hook; SIGTERM comes after it.
    assert pod["terminationGracePeriodSeconds"] > sleep + config.server.shutdown_grace


def test_config_map_is_mounted_where_the_gateway_reads_it() -> None:
    objects = k8s_objects()
    spec = container()
    env = {e["name"]: e for e in spec["env"]}
    config_path = Path(env["GATEWAY_CONFIG"]["value"])
    mount = next(m for m in spec["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volumes = objects["Deployment"]["spec"]["template"]["spec"]["volumes"]
    volume = next(v for v in volumes if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    assert config_path.name in objects["ConfigMap"]["data"]


def test_admin_token_comes_from_the_secret() -> None:
    secret = k8s_objects()["Secret"]
    env = {e["name"]: e for e in container()["env"]}
    ref = env["GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}
    assert "${GATEWAY_ADMIN_TOKEN" in configmap_config_text()


def test_service_and_pdb_select_the_pods() -> None:
    objects = k8s_objects()
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    service = objects["Service"]
    assert service["spec"]["selector"].items() <= pod_labels
    for port in service["spec"]["ports"]:
        container_port(port["targetPort"])  # names a real container port
    pdb = objects["PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels
    assert 0 < pdb["spec"]["minAvailable"] < objects["Deployment"]["spec"]["replicas"]


def test_service_monitor_scrapes_metrics_on_the_admin_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_gateway_config(configmap_config_text(), tmp_path, monkeypatch)
    objects = k8s_objects()
    monitor, service = objects["ServiceMonitor"], objects["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert container_port(ports[endpoint["port"]]["targetPort"]) == listen_port(config.admin.listen)


def test_prometheus_rule_embeds_the_alerts_file() -> None:
    rule = k8s_objects()["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == rule_groups(), (
        "deploy/kubernetes/prometheusrule.yaml's spec.groups differs from "
        "deploy/prometheus/alerts.yml; regenerate it (see the comment at its top)"
    )


# -- gateway configs ---------------------------------------------------------------------


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "GATEWAY_ADMIN_TOKEN": TOKEN},
        timeout=30,
    )


def test_compose_config_passes_check_config() -> None:
    result = check_config(DEPLOY / "config.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_map_config_passes_check_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(configmap_config_text())
    result = check_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


# -- Docker ------------------------------------------------------------------------------


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def test_dockerfile() -> None:
    text = dockerfile()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r"^RUN pip install \.", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^ENV GATEWAY_CONFIG=/etc/idempotency-gateway/config\.yaml$", text, re.M)
    assert re.search(r"^EXPOSE 8080 9090$", text, re.M)
    assert re.search(r'^CMD \["idempotency-gateway", "run"\]$', text, re.M)
    assert "curl" not in healthcheck_command()


def healthcheck_command() -> list[str]:
    """The HEALTHCHECK's exec form, and the URL it reads from GATEWAY_HEALTH_URL."""
    match = re.search(r"^HEALTHCHECK .*?CMD (\[.*?\])$", dockerfile(), re.M | re.S)
    assert match, "no HEALTHCHECK ... CMD [...] in deploy/Dockerfile"
    command = json.loads(match.group(1).replace("\\\n", ""))
    assert isinstance(command, list)
    return [str(part) for part in command]


def test_healthcheck_url_is_the_admin_healthz() -> None:
    url = re.search(r"^ENV GATEWAY_HEALTH_URL=(\S+)$", dockerfile(), re.M)
    assert url and url.group(1) == "http://127.0.0.1:9090/healthz"


def compose_services() -> dict[str, dict[str, Any]]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"])


def compose_gateways() -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in compose_services().items()
        if service.get("build", {}).get("dockerfile") == "deploy/Dockerfile"
        and "command" not in service
    }


def test_compose_runs_redis_two_gateways_a_job_endpoint_and_prometheus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose_services()
    config = load_gateway_config((DEPLOY / "config.yaml").read_text(), tmp_path, monkeypatch)
    assert services["redis"]["image"].startswith("redis:")
    assert config.store.url.startswith("redis://redis:")
    gateways = compose_gateways()
    assert len(gateways) == 2
    for service in gateways.values():
        env = service["environment"]
        assert f"./config.yaml:{env['GATEWAY_CONFIG']}:ro" in service["volumes"]
        assert "GATEWAY_ADMIN_TOKEN" in env
        grace = service["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) > config.server.shutdown_grace
    # Every route's upstream is the job service, which runs the demo job endpoint.
    job = services["job"]
    assert "gateway.demo import job_app" in " ".join(job["command"])
    port = re.search(r"port=(\d+)", " ".join(job["command"]))
    assert port
    for route in config.routes:
        assert route.upstream == f"http://job:{port.group(1)}"
    assert (
        "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro"
        in (services["prometheus"]["volumes"])
    )


def test_the_sqlite_compose_keeps_the_database_on_a_volume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SQLite compose file's gateway names a file on a named volume, in the
    directory the image declares a VOLUME and gives its user: the records outlive the
    container, and the gateway can write them."""
    spec = yaml.safe_load((DEPLOY / "docker-compose.sqlite.yml").read_text())
    gateway = spec["services"]["gateway"]
    monkeypatch.setenv("GATEWAY_STORE_URL", gateway["environment"]["GATEWAY_STORE_URL"])
    config = load_gateway_config((DEPLOY / "config.yaml").read_text(), tmp_path, monkeypatch)
    assert config.store.kind == "sqlite"
    folder = str(Path(config.store.url.removeprefix("sqlite://")).parent)
    mounts = dict(reversed(volume.split(":")[:2]) for volume in gateway["volumes"])
    assert mounts[folder] in spec["volumes"], "a named volume, not the container's layer"
    assert f"./config.yaml:{gateway['environment']['GATEWAY_CONFIG']}:ro" in gateway["volumes"]
    text = dockerfile()
    assert re.search(rf"^VOLUME {re.escape(folder)}$", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)[-1]
    assert re.search(rf"chown {re.escape(user)} {re.escape(folder)}\b", text)


def test_compose_prometheus_scrapes_both_gateways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_gateway_config((DEPLOY / "config.yaml").read_text(), tmp_path, monkeypatch)
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    [job] = prometheus["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    admin_port = listen_port(config.admin.listen)
    assert targets == {f"{name}:{admin_port}" for name in compose_gateways()}
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]


def test_promtool_checks_the_compose_prometheus_config(tmp_path: Path) -> None:
    # The rules file is where the compose file mounts it; point at the real one.
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    prometheus["rule_files"] = [str(ALERTS)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(prometheus))
    result = promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- alert rules -------------------------------------------------------------------------


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules() -> None:
    result = promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    cases: dict[str, list[bool]] = {}
    for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(bool(case.get("exp_alerts")))
    for rule in alert_rules():
        fired = cases.get(rule["alert"], [])
        assert True in fired, f"no unit test where {rule['alert']} fires"
        assert False in fired, f"no unit test where {rule['alert']} stays quiet"
    assert set(cases) <= {rule["alert"] for rule in alert_rules()}


def test_every_alert_has_a_runbook_section() -> None:
    runbook = RUNBOOK.read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    for rule in alert_rules():
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(annotations)
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        page, _, anchor = annotations["runbook"].partition("#")
        assert page == "docs/operations.md"
        assert anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]


def test_recorded_series_used_are_recorded() -> None:
    recorded = {rule.get("record") for group in rule_groups() for rule in group["rules"]}
    used = {
        name for expr in rule_exprs() + dashboard_exprs() for name in RECORDED_NAME.findall(expr)
    }
    assert used, "the route-freshness alert reads the per-route expected intervals"
    assert used <= recorded


# -- a real gateway's /metrics -----------------------------------------------------------


def live_config(tmp_path: Path, upstream: Process, port: int, admin_port: int) -> Path:
    job = {
        "match": {"methods": ["POST"]},
        "upstream": upstream.url,
        "key": {"body": "job_key"},
        # The query string tells the test upstream how to behave; not part of the key.
        "fingerprint": ["method", "path", "body"],
        "upstream_timeout": "200ms",
    }
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": "${GATEWAY_ADMIN_TOKEN}"},
        "store": {"url": "memory://"},
        "routes": [
            {  # unknown outcomes are parked
                **job,
                "name": "send-reminder",
                "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
            },
            {  # unknown outcomes are checked with the upstream
                **job,
                "name": "send-invoices",
                "match": {"methods": ["POST"], "path": "/jobs/send-invoices"},
                "on_unknown_outcome": "reconcile",
                "reconcile": {
                    "url": upstream.url + "/_status/{key}",
                    "timeout": "500ms",
                    "every": "300ms",
                },
            },
            {  # 202 at once, delivered by the gateway; two attempts, close together
                **job,
                "name": "send-receipts",
                "match": {"methods": ["POST"], "path": "/jobs/send-receipts"},
                "upstream_timeout": "5s",
                "delivery": "async",
                "retry": {"attempts": 2, "backoff": "10ms", "max_backoff": "20ms"},
            },
            {"name": "other-jobs", "match": {"path": "/jobs/{name}"}, "upstream": upstream.url},
        ],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Live:
    def __init__(self, scrape: str, admin_url: str) -> None:
        self.scrape = scrape
        self.admin_url = admin_url
        self.families = list(text_string_to_metric_families(scrape))
        self.samples = [sample for family in self.families for sample in family.samples]
        self.sample_names = {sample.name for sample in self.samples}


def drive_traffic(http: httpx.Client, admin: httpx.Client) -> None:
    reminder, invoices = "/jobs/send-reminder", "/jobs/send-invoices"
    key = unique()
    assert http.post(reminder, json={"job_key": key}).status_code == 200
    replay = http.post(reminder, json={"job_key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    # Timeouts after sending: unknown outcomes. send-reminder parks them.
    parked, claimed = unique("parked"), unique("claimed")
    for k in (parked, claimed):
        slow = http.post(reminder, json={"job_key": k}, params={"sleep": "0.4"})
        assert slow.status_code == 504
    claim = admin.post(f"/admin/keys/send-reminder/{claimed}/claim", json={"operator": "test"})
    assert claim.status_code == 200, claim.text
    # send-invoices checks with the upstream, which says done once the work finished.
    slow = http.post(invoices, json={"job_key": unique()}, params={"sleep": "0.4"})
    assert slow.status_code == 504
    assert http.get("/jobs/anything").status_code == 200  # passthrough
    # An async route: one delivered, one that fails both attempts and is parked.
    receipts = "/jobs/send-receipts"
    accepted = http.post(receipts, json={"job_key": unique("receipt")})
    assert accepted.status_code == 202, accepted.text
    failing = http.post(receipts, json={"job_key": unique("failing")}, params={"fail_first": "5"})
    assert failing.status_code == 202, failing.text
    assert http.get(accepted.headers["location"]).status_code == 200
    assert http.get("/_idempotency/status/send-receipts/x/y").status_code == 404


#: What the scrape shows once the traffic settled: a reconcile check, both deliveries.
LIVE_WAITS = (
    "idempotency_gateway_reconcile_total{",
    'idempotency_gateway_delivery_attempts_total{result="completed",route="send-receipts"} 1.0',
    'idempotency_gateway_delivery_attempts_total{result="exhausted",route="send-receipts"} 1.0',
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, upstream: Process) -> Iterator[Live]:
    port, admin_port = free_port(), free_port()
    path = live_config(tmp_path_factory.mktemp("live"), upstream, port, admin_port)
    gateway = gateway_process(path, port, env={"GATEWAY_ADMIN_TOKEN": TOKEN}).start()
    try:
        wait_for_port(admin_port)
        admin_url = f"http://127.0.0.1:{admin_port}"
        headers = {"authorization": f"Bearer {TOKEN}"}
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http,
            httpx.Client(base_url=admin_url, headers=headers, timeout=10) as admin,
        ):
            drive_traffic(http, admin)
            deadline = time.monotonic() + 15
            scrape = admin.get("/metrics").text
            while not all(want in scrape for want in LIVE_WAITS):
                assert time.monotonic() < deadline, f"not all of {LIVE_WAITS}:\n{scrape}"
                time.sleep(0.2)
                scrape = admin.get("/metrics").text
            # The key and queue gauges come from counts a scrape keeps for COUNTS_TTL:
            # once the counters say the traffic settled, one more scrape after that
            # long reads counts taken after it.
            time.sleep(COUNTS_TTL * 1.5)
            scrape = admin.get("/metrics").text
        yield Live(scrape, admin_url)
    finally:
        assert gateway.stop() == 0, gateway.output()


@pytest.mark.process
def test_scrape_passes_promtool_check_metrics(live: Live) -> None:
    result = promtool("check", "metrics", stdin=live.scrape.encode())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout


@pytest.mark.process
def test_every_metric_family_has_samples(live: Live) -> None:
    ours = [f for f in live.families if f.name.startswith("idempotency_gateway_")]
    assert len(ours) >= 10
    empty = [family.name for family in ours if not family.samples]
    assert not empty, f"families without samples in the scrape: {empty}"
    states = {s.labels["state"] for s in live.samples if s.name == "idempotency_gateway_keys"}
    assert states == {str(state) for state in OPEN_STATES}
    parked = [
        s.value
        for s in live.samples
        if s.name == "idempotency_gateway_keys"
        and s.labels == {"route": "send-reminder", "state": "parked"}
    ]
    assert parked == [1.0]


@pytest.mark.process
def test_metrics_in_alerts_and_dashboard_are_exported(live: Live) -> None:
    for source, exprs in (("alerts.yml", rule_exprs()), ("dashboard.json", dashboard_exprs())):
        used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
        assert used, f"{source} uses no gateway metric"
        missing = sorted(used - live.sample_names)
        assert not missing, f"{source} uses metrics the gateway does not export: {missing}"


@pytest.mark.process
def test_label_values_in_alerts_and_dashboard_exist(live: Live) -> None:
    known: dict[str, set[str]] = {"outcome": set(OUTCOMES)}
    for sample in live.samples:
        for label, value in sample.labels.items():
            if label != "outcome":
                known.setdefault(label, set()).add(value)
    for expr in rule_exprs() + dashboard_exprs():
        for label, op, value in LABEL_MATCHER.findall(expr):
            values = value.split("|") if op == "=~" else [value]
            for item in values:
                assert item in known.get(label, set()), f'{label}{op}"{value}" in {expr}'


@pytest.mark.process
def test_docker_healthcheck_command_works(live: Live) -> None:
    command = healthcheck_command()
    assert command[0] == "python"
    run = [sys.executable, *command[1:]]
    ok = subprocess.run(run, env={"GATEWAY_HEALTH_URL": live.admin_url + "/healthz"}, timeout=30)
    assert ok.returncode == 0
    bad = subprocess.run(
        run,
        env={"GATEWAY_HEALTH_URL": live.admin_url + "/no-such-page"},
        capture_output=True,
        timeout=30,
    )
    assert bad.returncode != 0


@pytest.mark.process
def test_delivery_metrics_count_each_attempt_once(live: Live) -> None:
    def value(name: str, **labels: str) -> float:
        found = [s.value for s in live.samples if s.name == name and s.labels == labels]
        assert len(found) == 1, (name, labels)
        return found[0]

    attempts = "idempotency_gateway_delivery_attempts_total"
    route = "send-receipts"
    assert value(attempts, route=route, result="completed") == 1
    assert value(attempts, route=route, result="retry_scheduled") == 1  # the failing one's first
    assert value(attempts, route=route, result="exhausted") == 1
    assert value(attempts, route=route, result="unknown_outcome") == 0
    # Nothing is left waiting: the parked one is a parked key, not queue depth.
    depth = "idempotency_gateway_queue_depth"
    assert value(depth, route=route, state="queued") == 0
    assert value(depth, route=route, state="retrying") == 0
    assert value("idempotency_gateway_queue_oldest_age_seconds", route=route) == 0
    assert value("idempotency_gateway_queue_max", route=route) == 10_000  # the default
    assert value("idempotency_gateway_keys", route=route, state="parked") == 1
    first = "idempotency_gateway_delivery_first_attempt_delay_seconds_count"
    assert value(first, route=route) == 2
    # Queue gauges are for async routes only.
    assert not [s for s in live.samples if s.name == depth and s.labels["route"] != route]
    requests = "idempotency_gateway_requests_total"
    assert value(requests, route=route, outcome="accepted") == 2
    assert value(requests, route=route, outcome="status") == 1
    assert value(requests, route="", outcome="status_not_found") == 1


def test_queue_gauges_keep_each_state_apart() -> None:
    from gateway.metrics import Metrics
    from gateway.records import QueueStat

    metrics = Metrics()
    stats = [QueueStat("send-receipts", 3, 1, 42.5), QueueStat("gone", 0, 2, 7.0)]
    metrics.set_queue_stats(stats, {"send-receipts": 10, "idle": 5})
    sample = metrics.registry.get_sample_value
    depth = "idempotency_gateway_queue_depth"
    assert sample(depth, {"route": "send-receipts", "state": "queued"}) == 3
    assert sample(depth, {"route": "send-receipts", "state": "retrying"}) == 1
    assert sample(depth, {"route": "idle", "state": "queued"}) == 0  # present, at 0
    assert sample(depth, {"route": "gone", "state": "retrying"}) == 2  # work left, unconfigured
    age = "idempotency_gateway_queue_oldest_age_seconds"
    assert sample(age, {"route": "send-receipts"}) == 42.5
    assert sample(age, {"route": "idle"}) == 0
    assert sample("idempotency_gateway_queue_max", {"route": "idle"}) == 5
    metrics.set_queue_stats([], {"send-receipts": 10})  # drained: back to 0, "gone" dropped
    assert sample(depth, {"route": "send-receipts", "state": "queued"}) == 0
    assert sample(depth, {"route": "gone", "state": "retrying"}) is None
