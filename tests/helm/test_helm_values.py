"""values.schema.json refuses bad values at `helm install` time, the chart's own checks refuse
inconsistent pools, and every `settings:` map in the schema is the services' settings class:
same fields (minus those the chart wires itself), same types and bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from rendered import CHART, run_helm, template_args

from specserve.config import DraftSettings, RouterSettings, TargetSettings

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# Fields the chart sets from structured values (ports, hosts, Redis URL, pools, models...).
CHART_WIRED = {
    "router": {"host", "port", "port_file", "metrics_port", "metrics_port_file", "redis_url",
               "key_prefix", "tokenizer", "draft_pools", "default_pool", "http_port", "http_port_file",
               "admin_token", "admin_tokens",  # secrets: from a Secret (router.adminToken), never values
               "api_keys",  # from a Secret (router.apiKeys)
               "tls_dir", "tls_server_name"},  # from values.tls
    "draft": {"pool", "model", "host", "port", "port_file", "metrics_port", "metrics_port_file", "tls_dir"},
    "target": {"model", "redis_url", "key_prefix", "name", "host", "port", "metrics_port",
               "num_gpus", "tls_dir",
               "draft_pools", "tls_server_name",  # the engine's links to the draft pools (ADR 0014)
               "eagle_pools",  # from the pools with model "eagle" (ADR 0020)
               "local_draft_model",  # from the inTarget pool with a model directory (ADR 0025)
               "tensor_parallel"},  # from target.tensorParallel (ADR 0030: it sizes the pod's GPUs too)
}
CLASSES = {"router": RouterSettings, "draft": DraftSettings, "target": TargetSettings}
CONSTRAINTS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
               "additionalProperties", "items")


def rejected(helm, tmp_path: Path, values: dict | None = None, sets: tuple[str, ...] = ()) -> str:
    files = []
    if values is not None:
        files.append(tmp_path / "values.yaml")
        files[0].write_text(yaml.safe_dump(values))
    proc = run_helm(helm, *template_args(*files, sets=sets))
    assert proc.returncode != 0, "helm template accepted bad values"
    return proc.stderr


def default_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.mark.parametrize("sets, message", [
    (("router.replicas=-1",), "router.replicas: Must be greater than or equal to 1"),
    (("router.port=70000",), "router.port"),
    (("router.settings.default_k=33",), "router.settings.default_k"),
    (("router.settings.port=1",), "Additional property port is not allowed"),
    (("router.settings.bogus=1",), "Additional property bogus is not allowed"),
    # redis.mode is the topology now; where Redis comes from is redis.source
    (("redis.mode=bundled",), "redis.mode"),
    (("redis.mode=external",), "redis.mode"),
    (("redis.source=sentinel",), "redis.source"),
    (("redis.source=external",), "url"),
    (("redis.source=external", "redis.external.url=http://redis:6379"), "redis.external.url"),
    (("redis.mode=cluster", "redis.db=1"), "redis.db"),
    (("redis.source=external", "redis.mode=cluster", "redis.external.nodes={redis-0}"), "redis.external.nodes.0"),
    (("redis.mode=sentinel", "redis.bundled.sentinel.masterName=my master"), "redis.bundled.sentinel.masterName"),
    (("target.settings.max_restarts=-2",), "target.settings.max_restarts"),
    (("tracing.samplerArg=1.5",), "tracing.samplerArg"),
    (("podSecurityContext.runAsNonRoot=false",), "podSecurityContext.runAsNonRoot"),
    (("draft.pools=null",), "draft: pools is required"),
    # a worker's GPU request and its device agree (ADR 0016)
    (("target.gpu=0", "target.settings.device=cuda:0"), 'target: settings.device "cuda:0" needs gpu >= 1'),
    (("target.settings.device=cpu",), 'target: gpu is 1 but settings.device is "cpu"'),
])
def test_schema_rejects(helm, tmp_path, sets, message):
    assert message in rejected(helm, tmp_path, sets=sets)


@pytest.mark.parametrize(("pool", "device", "message"), [
    (1, "cuda", 'draft.pools "ngram": settings.device "cuda" needs gpu >= 1'),
    (0, "cpu", 'draft.pools "small": gpu is 1 but settings.device is "cpu"'),
])
def test_a_pools_gpu_request_and_its_device_agree(helm, tmp_path, pool, device, message):
    values = default_values()
    values["draft"]["pools"][pool].setdefault("settings", {})["device"] = device
    assert message in rejected(helm, tmp_path, values)


def test_pool_without_a_name_is_rejected(helm, tmp_path):
    values = default_values()
    del values["draft"]["pools"][1]["name"]
    assert "draft.pools.1: name is required" in rejected(helm, tmp_path, values)


def test_pool_name_must_be_a_dns_label(helm, tmp_path):
    values = default_values()
    values["draft"]["pools"][0]["name"] = "Small_Pool"
    assert "draft.pools.0.name" in rejected(helm, tmp_path, values)


def test_duplicate_pools_are_rejected(helm, tmp_path):
    values = default_values()
    values["draft"]["pools"][1]["name"] = "small"
    assert 'pool name "small" is used twice' in rejected(helm, tmp_path, values)


def test_default_pool_must_exist(helm, tmp_path):
    err = rejected(helm, tmp_path, sets=("router.defaultPool=medium",))
    assert 'router.defaultPool "medium" is not one of draft.pools (ngram, small)' in err


def test_good_overrides_render(render):
    manifests = render(sets=("router.autoscaling.enabled=false", "router.replicas=3",
                             "networkPolicy.enabled=false", "redis.bundled.persistence.enabled=true"))
    router = next(m for m in manifests if m["metadata"]["name"] == "spec-specserve-router"
                  and m["kind"] == "Deployment")
    assert router["spec"]["replicas"] == 3
    assert not [m for m in manifests if m["kind"] in ("HorizontalPodAutoscaler", "NetworkPolicy")]
    (sts,) = [m for m in manifests if m["kind"] == "StatefulSet"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


@pytest.mark.parametrize("service", ["router", "draft", "target"])
def test_settings_schema_mirrors_the_settings_class(service):
    cls = CLASSES[service]
    section = SCHEMA["properties"][service]["properties"]["settings"]
    assert section["additionalProperties"] is False
    fields = set(cls.model_fields)
    assert CHART_WIRED[service] <= fields, "the chart wires a field the service no longer has"
    assert set(section["properties"]) == fields - CHART_WIRED[service], \
        f"{cls.__name__} and values.schema.json {service}.settings disagree"
    pydantic = cls.model_json_schema()["properties"]
    for name, prop in section["properties"].items():
        expected = {k: v for k, v in pydantic[name].items() if k in CONSTRAINTS}
        actual = {k: v for k, v in prop.items() if k in CONSTRAINTS}
        assert actual == expected, f"{service}.settings.{name}"


def test_default_values_use_known_settings_only():
    values = default_values()
    for service in CLASSES:
        assert set(values[service]["settings"]) <= set(CLASSES[service].model_fields)
    for pool in values["draft"]["pools"]:
        assert set(pool.get("settings", {})) <= set(DraftSettings.model_fields)


def test_admin_token_comes_from_a_secret_and_policies_are_seeded(render):
    def router_env(manifests) -> dict:
        (dep,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-router")]
        return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    env = router_env(render())
    assert "SPECSERVE_ROUTER_ADMIN_TOKEN" not in env  # no Secret named: administration refused
    seeded = json.loads(env["SPECSERVE_ROUTER_POLICIES"]["value"])
    assert set(seeded) == {"code", "chat", "extraction"}
    from specserve.control.policy import Policy

    for cls, fields in seeded.items():  # what the router will validate at start
        Policy.from_dict({**fields, "workload_class": cls}).validate({"small"})
    env = router_env(render(sets=("router.adminToken.secretName=ops-admin",)))
    ref = env["SPECSERVE_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "ops-admin", "key": "admin-token"} and "value" not in env["SPECSERVE_ROUTER_ADMIN_TOKEN"]


def test_tls_mounts_the_secret_everywhere_and_probes_by_tcp(render):
    """tls.enabled: every specserve container gets the Secret and its *_TLS_DIR; the router
    checks workers against workerServerName; probes become TCP connects (no TLS in kubelet)."""
    manifests = render(sets=("tls.enabled=true", "tls.secretName=my-certs"))
    wired = {}
    for m in manifests:
        spec = (m.get("spec", {}).get("template") or {}).get("spec")
        specs = [spec] if spec else []
        if m["kind"] == "RayCluster":
            specs = [g["template"]["spec"] for g in m["spec"]["workerGroupSpecs"]]
        for s in specs:
            for c in s["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                dirs = [v for k, v in env.items() if k.endswith("_TLS_DIR")]
                if dirs:
                    wired[c["name"]] = env
                    assert dirs == ["/etc/specserve/tls"]
                    assert {"name": "tls", "secret": {"secretName": "my-certs"}} in s["volumes"]
                    assert any(v["name"] == "tls" and v["readOnly"] for v in c["volumeMounts"])
                    assert "tcpSocket" in c["livenessProbe"]  # readiness may be the HTTP API's /health
                    assert not any("grpc" in c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert {"router", "target-launcher"} <= set(wired) and any(n.startswith("draft") for n in wired), wired
    assert wired["router"]["SPECSERVE_ROUTER_TLS_SERVER_NAME"] == "specserve-workers"
    # the engine dials the draft replicas too (ADR 0014): their certificates, the same name
    assert wired["target-launcher"]["SPECSERVE_TARGET_TLS_SERVER_NAME"] == "specserve-workers"


def test_an_in_target_ngram_pool_has_no_deployment_and_both_sides_name_it_local(helm, render, tmp_path):
    from rendered import containers, env_of

    from specserve.config import LOCAL_NGRAM

    values = default_values()
    values["draft"]["pools"][1]["inTarget"] = True  # the ngram pool
    path = tmp_path / "in-target.yaml"
    path.write_text(yaml.safe_dump(values))
    manifests = render(path)
    pools = {m["metadata"]["labels"].get("specserve.io/pool") for m in manifests
             if m["kind"] in ("Deployment", "Service", "PodDisruptionBudget")}
    assert "ngram" not in pools and "small" in pools
    seen = {}
    for _, _, c in containers(manifests):
        for var in ("SPECSERVE_ROUTER_DRAFT_POOLS", "SPECSERVE_TARGET_DRAFT_POOLS"):
            if var in env_of(c):
                seen[var] = json.loads(env_of(c)[var]["value"])
    assert set(seen) == {"SPECSERVE_ROUTER_DRAFT_POOLS", "SPECSERVE_TARGET_DRAFT_POOLS"}
    for var, pools_json in seen.items():
        assert pools_json["ngram"] == [LOCAL_NGRAM] and pools_json["small"] != [LOCAL_NGRAM], var
    values["draft"]["pools"][0].update(inTarget=True, model="org/some-hub-id")  # a hub id cannot (offline)
    assert 'draft.pools "small": inTarget needs model "ngram", "eagle", "suffix" or a draft model\'s directory' in \
        rejected(helm, tmp_path, values)


def _in_target_pool(render, tmp_path: Path, pool: dict) -> tuple[dict, list[dict]]:
    """The default values with `pool` added inTarget, rendered: no Deployment, Service or PDB
    of its own; (the values, every container's env)."""
    from rendered import containers, env_of

    values = default_values()
    values["draft"]["pools"].append({**pool, "inTarget": True, "replicas": 1})
    path = tmp_path / f"{pool['name']}.yaml"
    path.write_text(yaml.safe_dump(values))
    manifests = render(path)
    assert pool["name"] not in {m["metadata"]["labels"].get("specserve.io/pool") for m in manifests
                                if m["kind"] in ("Deployment", "Service", "PodDisruptionBudget")}
    return values, [env_of(c) for _, _, c in containers(manifests)]


def test_an_in_target_draft_model_pool_is_local_draft_with_the_targets_draft_model(helm, render, tmp_path):
    """ADR 0025: a pool with a model directory and inTarget is local:draft on both sides (no
    Deployment), and the target is told the directory (SPECSERVE_TARGET_LOCAL_DRAFT_MODEL);
    without such a pool the target gets no directory; two directories are refused."""
    from rendered import containers, env_of

    from specserve.config import LOCAL_DRAFT

    values, envs = _in_target_pool(render, tmp_path, {"name": "draft-local", "model": "/models/draft"})
    for var in ("SPECSERVE_ROUTER_DRAFT_POOLS", "SPECSERVE_TARGET_DRAFT_POOLS"):
        pools = json.loads(next(e for e in envs if var in e)[var]["value"])
        assert pools["draft-local"] == [LOCAL_DRAFT] and pools["small"] != [LOCAL_DRAFT], var
    target = next(e for e in envs if "SPECSERVE_TARGET_DRAFT_POOLS" in e)
    assert target["SPECSERVE_TARGET_LOCAL_DRAFT_MODEL"]["value"] == "/models/draft"
    assert TargetSettings(model="/models/target", local_draft_model=target["SPECSERVE_TARGET_LOCAL_DRAFT_MODEL"][
        "value"], draft_pools=json.loads(target["SPECSERVE_TARGET_DRAFT_POOLS"]["value"])).local_draft_model
    plain = [env_of(c) for _, _, c in containers(render())]
    assert not any("SPECSERVE_TARGET_LOCAL_DRAFT_MODEL" in e for e in plain)
    values["draft"]["pools"].append({"name": "other-local", "model": "/models/other", "inTarget": True,
                                     "replicas": 1})
    assert "the target drafts inside itself with one draft model" in rejected(helm, tmp_path, values)


def test_a_suffix_pool_is_drafted_inside_the_target_only(helm, render, tmp_path):
    """ADR 0026: `model: suffix` with inTarget is local:suffix on both sides (no Deployment);
    without inTarget the chart refuses it (there is no suffix replica to deploy)."""

    from specserve.config import LOCAL_SUFFIX

    values, envs = _in_target_pool(render, tmp_path, {"name": "suffix", "model": "suffix"})
    for var in ("SPECSERVE_ROUTER_DRAFT_POOLS", "SPECSERVE_TARGET_DRAFT_POOLS"):
        assert json.loads(next(e for e in envs if var in e)[var]["value"])["suffix"] == [LOCAL_SUFFIX], var
    values["draft"]["pools"][-1]["inTarget"] = False
    assert 'draft.pools "suffix": a suffix pool is drafted inside the target only' in rejected(helm, tmp_path, values)


def test_eagle_pools_in_the_target_and_remote(helm, render, tmp_path):
    """ADR 0020: an inTarget eagle pool is local:eagle on both sides (no Deployment); a remote
    one is a Deployment of `model: eagle` replicas with the head's and the target's
    directories, and the target is told to send it its features (SPECSERVE_TARGET_EAGLE_POOLS)."""
    from rendered import containers, env_of

    from specserve.config import LOCAL_EAGLE

    values = default_values()
    values["draft"]["pools"].append({"name": "eagle-local", "model": "eagle", "inTarget": True, "replicas": 1})
    values["draft"]["pools"].append({"name": "eagle", "model": "eagle", "replicas": 2, "settings": {
        "eagle_head": "/models/specserve-demo-v1/eagle", "eagle_target": "/models/specserve-demo-v1/target"}})
    path = tmp_path / "eagle.yaml"
    path.write_text(yaml.safe_dump(values))
    manifests = render(path)
    deployments = {m["metadata"]["labels"].get("specserve.io/pool") for m in manifests if m["kind"] == "Deployment"}
    assert "eagle" in deployments and "eagle-local" not in deployments
    envs = [env_of(c) for _, _, c in containers(manifests)]
    target = next(e for e in envs if "SPECSERVE_TARGET_DRAFT_POOLS" in e)
    assert json.loads(target["SPECSERVE_TARGET_DRAFT_POOLS"]["value"])["eagle-local"] == [LOCAL_EAGLE]
    assert json.loads(target["SPECSERVE_TARGET_EAGLE_POOLS"]["value"]) == ["eagle"]
    replica = next(e for e in envs if e.get("SPECSERVE_DRAFT_POOL", {}).get("value") == "eagle")
    assert replica["SPECSERVE_DRAFT_MODEL"]["value"] == "eagle"
    assert replica["SPECSERVE_DRAFT_EAGLE_HEAD"]["value"] == "/models/specserve-demo-v1/eagle"
    assert replica["SPECSERVE_DRAFT_EAGLE_TARGET"]["value"] == "/models/specserve-demo-v1/target"
    del values["draft"]["pools"][-1]["settings"]
    assert 'a remote eagle pool needs settings.eagle_head and settings.eagle_target' in rejected(helm, tmp_path, values)
