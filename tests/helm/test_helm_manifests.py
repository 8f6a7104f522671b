"""What the rendered manifests promise: GPUs only where intended, gRPC health probes, env names
that are the services' settings (and values they accept), non-root containers, drain-aware
termination, network policies that allow only the documented paths, the target wiring."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings
from rendered import NAMESPACE, ROOT, containers, env_of, find, pod_specs

from specserve.config import DraftSettings, RouterSettings, TargetSettings
from specserve.v1 import draft_pb2, generation_pb2, target_pb2

GPU = "nvidia.com/gpu"
SETTINGS: dict[str, type[BaseSettings]] = {
    "SPECSERVE_ROUTER_": RouterSettings, "SPECSERVE_DRAFT_": DraftSettings,
    "SPECSERVE_TARGET_": TargetSettings}
# Which settings class each specserve container is configured by, and its gRPC service.
SERVICE_CONTAINERS = {
    "router": ("SPECSERVE_ROUTER_", generation_pb2.DESCRIPTOR.services_by_name["Generation"]),
    "draft": ("SPECSERVE_DRAFT_", draft_pb2.DESCRIPTOR.services_by_name["Draft"]),
    "target-launcher": ("SPECSERVE_TARGET_", target_pb2.DESCRIPTOR.services_by_name["Target"]),
}
RAY_CONTAINERS = {"ray-head", "ray-worker"}
# Variables the chart sets that are not settings fields: the downward API, the Redis password
# (expanded into the URL), Ray's address, Hugging Face's cache, the standard OTel variables.
OTHER_ENV = {"POD_IP", "POD_NAME", "POD_NAMESPACE", "REDIS_PASSWORD", "REDISCLI_AUTH", "HOME",
             "RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "HF_HOME", "HF_HUB_OFFLINE",
             "HF_TOKEN",
             "SSL_CERT_FILE", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_RESOURCE_ATTRIBUTES"}
# Read by specserve outside the settings classes (telemetry); must still exist in the source.
SHARED_SPECSERVE_ENV = {"SPECSERVE_TRACING"}
EXPAND = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
DUMMY = {"POD_IP": "10.1.2.3", "POD_NAME": "spec-worker-abc", "POD_NAMESPACE": NAMESPACE,
         "REDIS_PASSWORD": "s3cret"}


def gpus(container: dict[str, Any]) -> int:
    res = container.get("resources", {})
    return int(res.get("limits", {}).get(GPU, res.get("requests", {}).get(GPU, 0)))


def specserve_containers(manifests):
    for where, spec, c in containers(manifests):
        if c["name"] in SERVICE_CONTAINERS:
            yield where, spec, c


def test_gpus_are_requested_exactly_where_intended(manifests, request):
    with_gpu = {where: gpus(c) for where, _, c in containers(manifests) if gpus(c)}
    small = "qwen3-0-6b" if "production" in request.node.callspec.id else "small"
    assert with_gpu == {
        f"Deployment/spec-specserve-draft-{small}/draft": 1,
        "RayCluster/spec-specserve-target/large-gpu/ray-worker": 1,
    }
    # and the pods that hold them are placed on GPU nodes, tolerating the GPU taint
    for where, spec in pod_specs(manifests):
        if any(gpus(c) for c in spec["containers"]):
            assert spec.get("nodeSelector"), f"{where} requests GPUs without a nodeSelector"
            assert any(t.get("key") == GPU for t in spec.get("tolerations", [])), where
        else:
            assert not any(t.get("key") == GPU for t in spec.get("tolerations", [])), \
                f"{where} tolerates GPU nodes but uses no GPU"


def test_grpc_health_probes(manifests):
    seen = set()
    for where, _, c in specserve_containers(manifests):
        prefix, service = SERVICE_CONTAINERS[c["name"]]
        port = int(env_of(c)[f"{prefix}PORT"]["value"])
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, f"{where} {probe} is not on the gRPC port"
        assert c["startupProbe"]["grpc"]["service"] == service.full_name
        if c["name"] == "router":  # ready = both APIs serve: the HTTP API's /health (ADR 0012)
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        else:
            assert c["readinessProbe"]["grpc"] == {"port": port, "service": service.full_name}
        assert c["livenessProbe"]["grpc"]["service"] == ""  # the server as a whole
        seen.add(c["name"])
    assert seen == set(SERVICE_CONTAINERS)


def test_env_names_are_settings_fields(manifests):
    telemetry = "\n".join(p.read_text() for p in (ROOT / "src" / "specserve").rglob("*.py"))
    for where, _, c in containers(manifests):
        for name in env_of(c):
            if name in SHARED_SPECSERVE_ENV:
                assert f'"{name}"' in telemetry, f"{name} is no longer read by specserve"
            elif name.startswith("SPECSERVE_"):
                assert c["name"] in SERVICE_CONTAINERS, f"{where} sets {name}"
                prefix = SERVICE_CONTAINERS[c["name"]][0]
                assert name.startswith(prefix), f"{where}: {name} is not a {prefix}* setting"
                field = name.removeprefix(prefix).lower()
                assert field in SETTINGS[prefix].model_fields, \
                    f"{where}: {name} is not a field of {SETTINGS[prefix].__name__}"
            else:
                assert name in OTHER_ENV, f"{where}: unexpected variable {name}"


def test_expanded_variables_are_defined_first(manifests):
    for where, _, c in containers(manifests):
        defined: set[str] = set()
        for e in c.get("env", []):
            for ref in EXPAND.findall(e.get("value", "")):
                assert ref in defined, f"{where}: {e['name']} uses $({ref}) before it is defined"
            defined.add(e["name"])
        for arg in c.get("command", []) + c.get("args", []):
            for ref in EXPAND.findall(arg):
                assert ref in defined, f"{where}: command uses $({ref}), not in its env"


def settings_for(container, monkeypatch) -> BaseSettings:
    """The settings object the service would build from this container's environment."""
    prefix = SERVICE_CONTAINERS[container["name"]][0]
    for key in [k for k in os.environ if k.startswith("SPECSERVE_")]:
        monkeypatch.delenv(key)
    for name, e in env_of(container).items():
        if name.startswith(prefix) and "value" in e:
            monkeypatch.setenv(name, EXPAND.sub(lambda m: DUMMY[m.group(1)], e["value"]))
    return SETTINGS[prefix]()


def test_services_accept_their_environment(manifests, monkeypatch):
    pools_seen = []
    for where, _, c in specserve_containers(manifests):
        s: Any = settings_for(c, monkeypatch)
        assert s.port > 0, f"{where}: a fixed port, never 0 (= pick a free one)"
        if c["name"] == "router":
            assert s.host == "0.0.0.0" and s.default_pool in s.draft_pools
            assert s.redis_url.startswith(("redis://", "rediss://", "redis+sentinel://", "redis+cluster://"))
            pools_seen = sorted(s.draft_pools)
            for pool, addresses in s.draft_pools.items():
                (address,) = addresses  # the pool's Service, listed once
                host, port = address.rsplit(":", 1)
                svc_name, ns, svc, *_ = host.split(".")
                assert (ns, svc) == (NAMESPACE, "svc")
                svc_obj = find(manifests, "Service", svc_name)
                assert svc_obj, f"{address}: no such Service"
                assert svc_obj[0]["spec"]["clusterIP"] == "None"  # headless: every replica
                assert svc_obj[0]["spec"]["selector"]["specserve.io/pool"] == pool
                assert int(port) in [p["port"] for p in svc_obj[0]["spec"]["ports"]]
        elif c["name"] == "draft":
            assert s.host == "0.0.0.0" and s.model
        else:  # the target launcher: the actor advertises this pod's IP
            assert s.host == DUMMY["POD_IP"] and s.name == DUMMY["POD_NAME"]
            assert s.resources[f"node:{DUMMY['POD_IP']}"] > 0  # pinned to its own pod
            assert s.num_gpus >= 1
    deployments = {d["metadata"]["labels"].get("specserve.io/pool") for d in
                   find(manifests, "Deployment")} - {None}
    assert pools_seen == sorted(deployments)


def test_target_launcher_wiring(manifests):
    (ray,) = find(manifests, "RayCluster")
    (group,) = ray["spec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] >= 1
    spec = group["template"]["spec"]
    assert spec["containers"][0]["name"] == "ray-worker"  # KubeRay's Ray container is the first
    launcher = next(c for c in spec["containers"] if c["name"] == "target-launcher")
    env = env_of(launcher)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["SPECSERVE_TARGET_HOST"]["value"] == "$(POD_IP)"
    head_svc = f"{ray['metadata']['name']}-head-svc.{NAMESPACE}.svc.cluster.local:6379"
    assert env["RAY_ADDRESS"]["value"] == head_svc
    assert "SPECSERVE_TARGET_MAX_RESTARTS" in env
    assert launcher["command"][-1].endswith("exec python -m specserve.services.target")
    # the launcher reaches the raylet's socket through the shared /tmp
    mounts = {m["name"]: m["mountPath"] for m in launcher["volumeMounts"]}
    worker_mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["tmp"] == worker_mounts["tmp"] == "/tmp"
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def _quantity(q: str | int) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_worker_pods_offer_what_the_actor_asks_for(manifests):
    """Ray would leave the actor pending forever if its pod cannot hold it."""
    (ray,) = find(manifests, "RayCluster")
    (group,) = ray["spec"]["workerGroupSpecs"]
    worker, launcher = group["template"]["spec"]["containers"]
    env = env_of(launcher)
    assert float(env["SPECSERVE_TARGET_NUM_GPUS"]["value"]) <= gpus(worker)
    num_cpus = float(env.get("SPECSERVE_TARGET_NUM_CPUS", {}).get("value", 1))
    assert num_cpus <= _quantity(worker["resources"]["requests"]["cpu"])
    # KubeRay passes rayStartParams.resources to `ray start --resources=` through a shell
    offered_raw = group["rayStartParams"].get("resources", '"{}"')
    offered = json.loads(offered_raw.strip('"').replace('\\"', '"'))
    asked = json.loads(env["SPECSERVE_TARGET_RESOURCES"]["value"])
    assert [k for k in asked if k.startswith("node:")] == ["node:$(POD_IP)"]
    for name, amount in asked.items():
        if not name.startswith("node:"):
            assert offered.get(name, 0) >= amount, f"no worker offers Ray resource {name}"


def _effective(spec, c, key):
    return c.get("securityContext", {}).get(key, spec.get("securityContext", {}).get(key))


def test_no_container_runs_as_root(manifests):
    for where, spec, c in containers(manifests):
        assert _effective(spec, c, "runAsNonRoot") is True, f"{where} may run as root"
        assert _effective(spec, c, "runAsUser") not in (0, None), f"{where} has no non-root uid"
        sc = c.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert not sc.get("privileged"), where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        if c["name"] not in RAY_CONTAINERS:
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert "/tmp" in [m["mountPath"] for m in c.get("volumeMounts", [])], where


def test_termination_outlasts_the_drain(manifests):
    checked = 0
    for where, spec, c in specserve_containers(manifests):
        prefix = SERVICE_CONTAINERS[c["name"]][0]
        env = env_of(c)
        grace = float(env[f"{prefix}GRACE_S"]["value"]) if f"{prefix}GRACE_S" in env else \
            SETTINGS[prefix].model_fields["grace_s"].default
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert spec["terminationGracePeriodSeconds"] > math.ceil(grace + sleep), where
        checked += 1
    assert checked >= 4


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _port_numbers(spec) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])
            if "name" in p}


def allowed(manifests, src: dict[str, str] | None, dst: str, port: int) -> bool:
    """May a pod with labels `src` (None: a client outside the release) reach pod template
    `dst` on `port`, under the rendered NetworkPolicies (same namespace)?"""
    (dst_spec,) = [s for w, s in pod_specs(manifests) if w == dst]
    dst_labels = _pod_labels(manifests, dst)
    names = _port_numbers(dst_spec)
    policies = [p for p in find(manifests, "NetworkPolicy")
                if _selects(p["spec"]["podSelector"], dst_labels)]
    assert policies, f"{dst} is selected by no NetworkPolicy"
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            ports = [names.get(x["port"], x["port"]) for x in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            if src is not None and any("podSelector" in peer and "namespaceSelector" not in peer
                                       and _selects(peer["podSelector"], src) for peer in peers):
                return True
    return False


def _pod_labels(manifests, where: str) -> dict[str, str]:
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet", "Job") and where == f"{m['kind']}/{m['metadata']['name']}":
            return m["spec"]["template"]["metadata"]["labels"]
        if m["kind"] == "RayCluster" and where.startswith(f"RayCluster/{m['metadata']['name']}/"):
            group = where.rsplit("/", 1)[1]
            if group == "head":
                return m["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
            return next(g for g in m["spec"]["workerGroupSpecs"]
                        if g["groupName"] == group)["template"]["metadata"]["labels"]
    raise KeyError(where)


def test_network_policies_allow_only_the_documented_paths(default_manifests):
    m = default_manifests
    router_w, draft_w = "Deployment/spec-specserve-router", "Deployment/spec-specserve-draft-small"
    redis_w = "StatefulSet/spec-specserve-redis"
    head_w, worker_w = "RayCluster/spec-specserve-target/head", "RayCluster/spec-specserve-target/large-gpu"
    router, draft = _pod_labels(m, router_w), _pod_labels(m, draft_w)
    worker, head = _pod_labels(m, worker_w), _pod_labels(m, head_w)
    # every pod template is covered by some policy (allowed() asserts it)
    for where, _ in pod_specs(m):
        allowed(m, router, where, 1)
    assert allowed(m, None, router_w, 50051)           # clients -> router
    assert allowed(m, router, draft_w, 50061)          # router -> draft
    assert allowed(m, router, worker_w, 50071)         # router -> target actor
    assert allowed(m, router, redis_w, 6379)           # router -> Redis
    assert allowed(m, worker, draft_w, 50061)          # target engine -> draft (ADR 0014)
    assert allowed(m, worker, redis_w, 6379)           # target heartbeat -> Redis
    assert allowed(m, worker, head_w, 6379)            # Ray inside the RayCluster
    assert allowed(m, head, worker_w, 12345)
    assert not allowed(m, None, draft_w, 50061)        # and nothing else
    assert not allowed(m, draft, draft_w, 50061)
    assert not allowed(m, draft, redis_w, 6379)
    assert not allowed(m, None, redis_w, 6379)
    assert not allowed(m, head, redis_w, 6379)
    assert not allowed(m, None, head_w, 6379)
    assert not allowed(m, draft, worker_w, 50071)
    assert not allowed(m, router, head_w, 6379)


def test_production_network_policy_restricts_clients(production_manifests):
    (policy,) = find(production_manifests, "NetworkPolicy", "spec-specserve-router")
    values = yaml.safe_load((ROOT / "helm/specserve/ci/production-values.yaml").read_text())
    grpc_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    assert grpc_rule["from"] == values["networkPolicy"]["clients"]
    assert {"port": "http", "protocol": "TCP"} in grpc_rule["ports"]  # the HTTP API: same clients
    assert not allowed(production_manifests, None, "Deployment/spec-specserve-router", 50051)
    assert not allowed(production_manifests, None, "Deployment/spec-specserve-router", 8000)


def test_router_http_api_port_and_keys(default_manifests, production_manifests):
    for manifests in (default_manifests, production_manifests):
        (svc,) = find(manifests, "Service", "spec-specserve-router")
        assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"} \
            in svc["spec"]["ports"]
    (dep,) = find(default_manifests, "Deployment", "spec-specserve-router")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    assert env_of(c)["SPECSERVE_ROUTER_HTTP_PORT"]["value"] == "8000"
    assert "SPECSERVE_ROUTER_API_KEYS" not in env_of(c)  # no Secret named: no key asked for
    (dep,) = find(production_manifests, "Deployment", "spec-specserve-router")
    keys = env_of(dep["spec"]["template"]["spec"]["containers"][0])["SPECSERVE_ROUTER_API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "specserve-api-keys", "key": "api-keys"}


def test_target_links_to_the_router_s_draft_pools(default_manifests):
    """The engine drives the rounds (ADR 0014): every target worker gets the same pool ->
    replica addresses as the router, so a policy's pool name means the same replicas to both."""
    (dep,) = find(default_manifests, "Deployment", "spec-specserve-router")
    router_pools = json.loads(env_of(dep["spec"]["template"]["spec"]["containers"][0])
                              ["SPECSERVE_ROUTER_DRAFT_POOLS"]["value"])
    assert set(router_pools) == {"small", "ngram"}
    targets = [c for where, _, c in specserve_containers(default_manifests) if "target" in where
               and "SPECSERVE_TARGET_MODEL" in env_of(c)]
    assert targets
    for c in targets:
        assert json.loads(env_of(c)["SPECSERVE_TARGET_DRAFT_POOLS"]["value"]) == router_pools


def test_tracing_env_only_when_enabled(default_manifests, production_manifests):
    for where, _, c in specserve_containers(default_manifests):
        assert not [n for n in env_of(c) if n.startswith("OTEL_")], where
    for where, _, c in specserve_containers(production_manifests):
        env = env_of(c)
        assert env["SPECSERVE_TRACING"]["value"] == "otlp", where
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].startswith("http://otel-collector")
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
        assert float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == 0.05


def test_redis_auth_and_tls(default_manifests, production_manifests):
    (secret,) = find(default_manifests, "Secret", "spec-specserve-redis")
    (sts,) = find(default_manifests, "StatefulSet", "spec-specserve-redis")
    redis = sts["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == \
        secret["metadata"]["name"]
    for manifests, scheme, secret_name in [(default_manifests, "redis", "spec-specserve-redis"),
                                           (production_manifests, "rediss", "specserve-redis")]:
        for where, _, c in specserve_containers(manifests):
            env = env_of(c)
            url = next((e["value"] for n, e in env.items() if n.endswith("_REDIS_URL")), None)
            if c["name"] == "draft":
                assert url is None, "draft workers do not talk to Redis"
                continue
            assert url.startswith(f"{scheme}://:$(REDIS_PASSWORD)@"), where
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret_name


def test_observability_config_maps_ship_the_deploy_files(default_manifests):
    files = {"spec-specserve-otel-collector": ("collector.yaml", "deploy/otel-collector.yaml"),
             "spec-specserve-grafana-dashboard": ("specserve.json", "deploy/grafana/specserve.json"),
             "spec-specserve-prometheus-rules": ("specserve-rules.yaml", "deploy/prometheus/specserve-rules.yaml")}
    for name, (key, path) in files.items():
        (cm,) = find(default_manifests, "ConfigMap", name)
        shipped = cm["data"][key]
        assert shipped.strip() == (ROOT / path).read_text().strip(), f"{name} differs from {path}"
    (dash,) = find(default_manifests, "ConfigMap", "spec-specserve-grafana-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["specserve.json"])["panels"]
    assert "otlp" in yaml.safe_load(find(default_manifests, "ConfigMap",
                                         "spec-specserve-otel-collector")[0]["data"]["collector.yaml"])[
        "receivers"]
    (rules,) = find(default_manifests, "ConfigMap", "spec-specserve-prometheus-rules")
    groups = yaml.safe_load(rules["data"]["specserve-rules.yaml"])["groups"]
    assert any(r.get("alert") == "SpecserveAcceptanceDrop" for g in groups for r in g["rules"])


def test_prometheus_rules_are_optional_and_labelled(render):
    labelled = render(sets=("observability.prometheusRules.labels.prometheus_rule=specserve",))
    (rules,) = find(labelled, "ConfigMap", "spec-specserve-prometheus-rules")
    assert rules["metadata"]["labels"]["prometheus_rule"] == "specserve"
    assert not find(render(sets=("observability.prometheusRules.enabled=false",)), "ConfigMap",
                    "spec-specserve-prometheus-rules")


def test_monitors_select_metrics_ports(production_manifests):
    (sm,) = find(production_manifests, "ServiceMonitor")
    scraped = [s for s in find(production_manifests, "Service")
               if s["metadata"]["labels"]["app.kubernetes.io/component"]
               in sm["spec"]["selector"]["matchExpressions"][1]["values"]]
    assert len(scraped) == 3  # the router and both pools
    for svc in scraped:
        assert "metrics" in [p["name"] for p in svc["spec"]["ports"]]
    (pm,) = find(production_manifests, "PodMonitor")
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    (ray,) = find(production_manifests, "RayCluster")
    spec = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert port in _port_numbers(spec)


@pytest.mark.parametrize("component", ["router", "draft-small", "draft-ngram"])
def test_rollouts_keep_capacity(default_manifests, component):
    (pdb,) = find(default_manifests, "PodDisruptionBudget", f"spec-specserve-{component}")
    (dep,) = find(default_manifests, "Deployment", f"spec-specserve-{component}")
    assert _selects(pdb["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["minAvailable"] >= 1


def test_bundled_redis_is_durable_and_needs_a_password(default_manifests):
    """ADR 0011: the append-only file fsynced every second, and AUTH, by default."""
    redis = next(d for d in default_manifests if d["kind"] == "StatefulSet"
                 and d["metadata"]["labels"].get("app.kubernetes.io/component") == "redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--appendonly"] == "yes" and pairs["--appendfsync"] == "everysec"
    assert pairs["--requirepass"] == "$(REDIS_PASSWORD)"


def test_every_ray_process_needs_the_token(default_manifests):
    """Ray token auth: the head, the workers and the launchers all run with the token."""
    cluster = next(d for d in default_manifests if d["kind"] == "RayCluster")
    specs = [cluster["spec"]["headGroupSpec"]["template"]["spec"]] + \
        [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    for spec in specs:
        for c in spec["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token", c["name"]
    assert any(d["kind"] == "Secret" and d["metadata"]["name"].endswith("-ray-token") for d in default_manifests)


def test_egress_is_allow_listed(default_manifests):
    """Router -> draft/target/Redis only (plus DNS); drafts reach no specserve pod; Redis
    reaches nothing."""
    egress = {m["metadata"]["name"].split("specserve-", 1)[1]: m["spec"] for m in default_manifests
              if m["kind"] == "NetworkPolicy" and m["spec"]["policyTypes"] == ["Egress"]}
    assert set(egress) == {"router-egress", "draft-egress", "target-egress", "redis-egress"}

    def components(spec) -> set[str]:
        return {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                for rule in spec["egress"] for p in rule.get("to", []) if "podSelector" in p}

    def dns(spec) -> bool:
        return any({"port": 53, "protocol": "UDP"} in rule.get("ports", []) for rule in spec["egress"])

    assert components(egress["router-egress"]) == {"draft", "target", "redis"}
    assert components(egress["target-egress"]) == {"target", "draft", "redis"}
    assert components(egress["draft-egress"]) == set()
    assert all(dns(egress[n]) for n in ("router-egress", "draft-egress", "target-egress"))
    assert egress["redis-egress"]["egress"] == []
