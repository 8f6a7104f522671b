"""redis.source (bundled | external) x redis.mode (standalone | sentinel | cluster): each of the
six renders and lints, renders exactly its own Redis objects, hands the services the URL of its
topology (the password from the Secret), wires the sentinels and the Cluster as documented,
and its NetworkPolicies allow the Redis paths of its mode and no others. (Every rendering also
runs through the general checks of test_helm_manifests and test_helm_render: the `manifests`
fixture covers them all.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
import test_helm_manifests as checks
import yaml
from rendered import (
    CHART,
    EXTERNAL_MASTER,
    EXTERNAL_NODES,
    EXTERNAL_SECRET,
    EXTERNAL_SENTINELS,
    EXTERNAL_URL,
    KUBE_VERSION,
    NAMESPACE,
    REDIS_MODES,
    containers,
    env_of,
    find,
    pod_specs,
    run_helm,
    set_args,
)
from test_helm_values import rejected

from specserve.state.connection import parse_cluster_url, parse_sentinel_url

SUFFIX = f"{NAMESPACE}.svc.cluster.local"
REDIS, HEADLESS = "spec-specserve-redis", "spec-specserve-redis-headless"
SENTINEL = "spec-specserve-redis-sentinel"
CREATE_JOB = "spec-specserve-redis-cluster-create"
URL_VARS = {"router": "SPECSERVE_ROUTER_REDIS_URL", "target-launcher": "SPECSERVE_TARGET_REDIS_URL"}
URL = re.compile(r"^(?P<scheme>[a-z+]+)://(?::(?P<password>[^@]*)@)?(?P<hosts>[^/]+)(?:/(?P<path>.*))?$")

# Every object with "redis" in its name, per mode: what must exist, and nothing else.
EXPECTED_OBJECTS: dict[str, set[tuple[str, str]]] = {
    "bundled-standalone": {
        ("Secret", REDIS), ("Service", REDIS), ("StatefulSet", REDIS),
        ("NetworkPolicy", REDIS), ("NetworkPolicy", f"{REDIS}-egress")},
    "bundled-sentinel": {
        ("Secret", REDIS), ("ConfigMap", f"{REDIS}-scripts"), ("Service", HEADLESS),
        ("StatefulSet", REDIS), ("PodDisruptionBudget", REDIS),
        ("Service", SENTINEL), ("StatefulSet", SENTINEL), ("PodDisruptionBudget", SENTINEL),
        ("NetworkPolicy", REDIS), ("NetworkPolicy", f"{REDIS}-egress"),
        ("NetworkPolicy", SENTINEL), ("NetworkPolicy", f"{SENTINEL}-egress")},
    "bundled-cluster": {
        ("Secret", REDIS), ("ConfigMap", f"{REDIS}-scripts"), ("Service", HEADLESS),
        ("StatefulSet", REDIS), ("PodDisruptionBudget", REDIS), ("Job", CREATE_JOB),
        ("NetworkPolicy", REDIS), ("NetworkPolicy", f"{REDIS}-egress"),
        ("NetworkPolicy", CREATE_JOB), ("NetworkPolicy", f"{CREATE_JOB}-egress")},
    "external-standalone": set(),
    "external-sentinel": set(),
    "external-cluster": set(),
}


def pod_names(manifests, statefulset: str) -> list[str]:
    """The DNS names of a StatefulSet's pods, through its (headless) governing Service."""
    (sts,) = find(manifests, "StatefulSet", statefulset)
    service = sts["spec"]["serviceName"]
    (svc,) = find(manifests, "Service", service)
    assert svc["spec"]["clusterIP"] == "None", f"{service} must be headless for pod DNS names"
    assert svc["spec"]["publishNotReadyAddresses"] is True  # peers find a pod before it is ready
    assert checks._selects({"matchLabels": svc["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])
    return [f"{statefulset}-{i}.{service}.{SUFFIX}" for i in range(sts["spec"]["replicas"])]


def redis_urls(manifests) -> list[tuple[str, dict[str, Any]]]:
    """(container name, env) of each Redis client: the router and the target launchers."""
    out = []
    for _, _, c in containers(manifests):
        if c["name"] in URL_VARS:
            out.append((c["name"], env_of(c)))
    assert {name for name, _ in out} == set(URL_VARS)
    return out


def args_of(container) -> dict[str, str]:
    args = container["args"]
    assert len(args) % 2 == 0, args
    return dict(zip(args[::2], args[1::2], strict=True))


def scripts(manifests) -> dict[str, str]:
    (cm,) = find(manifests, "ConfigMap", f"{REDIS}-scripts")
    return cm["data"]


def test_each_mode_lints_strict(helm, redis_mode):
    name, _ = redis_mode
    proc = run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION,
                    *set_args(REDIS_MODES[name]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_each_mode_renders_its_own_redis_objects(redis_mode):
    name, manifests = redis_mode
    rendered = {(m["kind"], m["metadata"]["name"]) for m in manifests if "redis" in m["metadata"]["name"]}
    assert rendered == EXPECTED_OBJECTS[name]


def test_each_mode_passes_the_general_checks(redis_mode):
    """The validators of test_helm_render / test_helm_manifests, on each of the six (the
    `manifests` fixture runs them all too; this keeps the six in one place)."""
    import test_helm_render as render_checks

    _, manifests = redis_mode
    render_checks.test_core_objects_are_valid_kubernetes(manifests)
    render_checks.test_every_kind_is_validated_somewhere(manifests)
    checks.test_no_container_runs_as_root(manifests)
    checks.test_expanded_variables_are_defined_first(manifests)
    checks.test_env_names_are_settings_fields(manifests)


def test_the_services_redis_url_per_mode(redis_mode):
    name, manifests = redis_mode
    source, mode = name.split("-")
    secret = REDIS if source == "bundled" else EXTERNAL_SECRET
    for container, env in redis_urls(manifests):
        names = list(env)
        url = env[URL_VARS[container]]["value"]
        # the password: from the Secret, defined before the URL that expands it
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret, "key": "password"}, container
        assert names.index("REDIS_PASSWORD") < names.index(URL_VARS[container])
        parts = URL.match(url)
        assert parts, url
        assert parts["password"] == "$(REDIS_PASSWORD)", url
        hosts = parts["hosts"].split(",")
        if mode == "standalone":
            assert parts["scheme"] == "redis"
            if source == "bundled":
                assert hosts == [f"{REDIS}.{SUFFIX}:6379"] and parts["path"] == "0"
            else:
                assert url == EXTERNAL_URL.replace("redis://", "redis://:$(REDIS_PASSWORD)@")
        elif mode == "sentinel":
            assert parts["scheme"] == "redis+sentinel"
            # what the services' client makes of it (state/connection.py)
            sentinels, master, password, db = parse_sentinel_url(url.replace("$(REDIS_PASSWORD)", "s3cret"))
            assert password == "s3cret" and db == 0
            if source == "bundled":
                assert master == "specserve"
                expected = [f"{host}:26379" for host in pod_names(manifests, SENTINEL)]
                assert len(expected) == 3
            else:
                assert master == EXTERNAL_MASTER
                expected = list(EXTERNAL_SENTINELS)
            assert [f"{h}:{p}" for h, p in sentinels] == expected == hosts
        else:
            assert parts["scheme"] == "redis+cluster"
            assert parts["path"] is None, "a Cluster has only db 0: no db in its URL"
            # what the services' client makes of it (state/connection.py)
            nodes, password = parse_cluster_url(url.replace("$(REDIS_PASSWORD)", "s3cret"))
            assert password == "s3cret" and [f"{h}:{p}" for h, p in nodes] == hosts
            if source == "bundled":
                assert hosts == [f"{host}:6379" for host in pod_names(manifests, REDIS)[:3]]
            else:
                assert hosts == list(EXTERNAL_NODES)
        for host in hosts:
            assert re.fullmatch(r"[a-z0-9.-]+:[0-9]+", host), host


def test_external_tls_stays_with_standalone(production_manifests):
    for container, env in redis_urls(production_manifests):
        assert env[URL_VARS[container]]["value"].startswith("rediss://:$(REDIS_PASSWORD)@"), container
        assert env["SSL_CERT_FILE"]["value"] == "/etc/specserve/redis-ca/ca.crt"


@pytest.fixture(scope="module")
def bundled_sentinel(render):
    return render(sets=REDIS_MODES["bundled-sentinel"])


@pytest.fixture(scope="module")
def bundled_cluster(render):
    return render(sets=REDIS_MODES["bundled-cluster"])


def test_bundled_sentinel_wiring(bundled_sentinel):
    manifests = bundled_sentinel
    nodes, sentinels = pod_names(manifests, REDIS), pod_names(manifests, SENTINEL)
    assert len(nodes) == 2 and len(sentinels) == 3
    (sts,) = find(manifests, "StatefulSet", REDIS)
    assert sts["spec"]["podManagementPolicy"] == "OrderedReady"  # pod 0, the first primary, first
    (redis,) = sts["spec"]["template"]["spec"]["containers"]
    args = args_of(redis)
    assert args["--requirepass"] == args["--masterauth"] == "$(REDIS_PASSWORD)"
    assert args["--replica-announce-ip"] == f"$(POD_NAME).{HEADLESS}.{SUFFIX}"
    assert args["--appendonly"] == "yes" and args["--maxmemory-policy"] == "noeviction"
    assert redis["command"] == ["sh", "/scripts/redis.sh"]
    data = scripts(manifests)
    # pod 0 starts as the primary, the others as its replicas, unless the sentinels say otherwise
    assert f"FIRST_PRIMARY={nodes[0]}" in data["lib.sh"].splitlines()
    assert 'exec redis-server "$@" --replicaof "$primary" "$PORT"' in data["redis.sh"]
    # the sentinels' config
    conf = data["sentinel.conf"].splitlines()
    assert "port 26379" in conf
    monitor = conf.index(f"sentinel monitor specserve {nodes[0]} 6379 2")
    assert conf.index("sentinel resolve-hostnames yes") < monitor
    assert conf.index("sentinel announce-hostnames yes") < monitor
    assert "sentinel down-after-milliseconds specserve 5000" in conf
    assert "sentinel failover-timeout specserve 60000" in conf
    assert 'echo "sentinel auth-pass $MASTER_NAME $REDIS_PASSWORD"' in data["sentinel.sh"]
    assert 'echo "sentinel announce-ip $POD_NAME$SENTINEL_SUFFIX"' in data["sentinel.sh"]
    lib = dict(line.split("=", 1) for line in data["lib.sh"].splitlines() if re.match(r"^[A-Z_]+=", line))
    assert lib["SENTINELS"].strip('"').split() == sentinels
    assert f"$POD_NAME{lib['SENTINEL_SUFFIX']}" == f"$POD_NAME.{SENTINEL}.{SUFFIX}"
    # written at start into a writable emptyDir, which the sentinel rewrites
    (sentinel_sts,) = find(manifests, "StatefulSet", SENTINEL)
    spec = sentinel_sts["spec"]["template"]["spec"]
    (sentinel,) = spec["containers"]
    assert sentinel["command"] == ["sh", "/scripts/sentinel.sh"]
    assert ('exec redis-server "$conf" --sentinel' in data["sentinel.sh"]
            and "conf=/data/sentinel.conf" in data["sentinel.sh"])
    mounts = {m["mountPath"]: m for m in sentinel["volumeMounts"]}
    assert not mounts["/data"].get("readOnly")
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == mounts["/data"]["name"])
    assert {"name": "sentinel", "containerPort": 26379, "protocol": "TCP"} in sentinel["ports"]
    assert "REDISCLI_AUTH" not in env_of(sentinel)  # the sentinels take no password
    # a change of the scripts rolls the pods
    for s in (sts, sentinel_sts):
        assert s["spec"]["template"]["metadata"]["annotations"]["checksum/scripts"]


def test_sentinel_values_reach_the_config(render):
    manifests = render(sets=("redis.mode=sentinel", "redis.bundled.replicas=3", "redis.bundled.sentinel.replicas=5",
                             "redis.bundled.sentinel.quorum=3", "redis.bundled.sentinel.masterName=tokens",
                             "redis.bundled.sentinel.downAfterMilliseconds=2000", "redis.db=2"))
    nodes, sentinels = pod_names(manifests, REDIS), pod_names(manifests, SENTINEL)
    assert len(nodes) == 3 and len(sentinels) == 5
    conf = scripts(manifests)["sentinel.conf"].splitlines()
    assert f"sentinel monitor tokens {nodes[0]} 6379 3" in conf
    assert "sentinel down-after-milliseconds tokens 2000" in conf
    for container, env in redis_urls(manifests):
        url = env[URL_VARS[container]]["value"]
        found, master, _, db = parse_sentinel_url(url)
        assert [h for h, _ in found] == sentinels and master == "tokens" and db == 2, container


def test_bundled_cluster_wiring(bundled_cluster):
    manifests = bundled_cluster
    nodes = pod_names(manifests, REDIS)
    assert len(nodes) == 6
    (sts,) = find(manifests, "StatefulSet", REDIS)
    (redis,) = sts["spec"]["template"]["spec"]["containers"]
    args = args_of(redis)
    assert args["--cluster-enabled"] == "yes"
    assert args["--cluster-config-file"] == "/data/nodes.conf"
    assert "/data" in [m["mountPath"] for m in redis["volumeMounts"] if m["name"] == "data"]
    assert args["--cluster-announce-hostname"] == f"$(POD_NAME).{HEADLESS}.{SUFFIX}"
    assert args["--cluster-preferred-endpoint-type"] == "hostname"
    assert args["--requirepass"] == args["--masterauth"] == "$(REDIS_PASSWORD)"
    ports = {p["name"]: p["containerPort"] for p in redis["ports"]}
    assert ports == {"redis": 6379, "cluster-bus": 16379}
    (svc,) = find(manifests, "Service", HEADLESS)
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    # the Job that forms the Cluster
    (job,) = find(manifests, "Job", CREATE_JOB)
    assert "post-install" in job["metadata"]["annotations"]["helm.sh/hook"].split(",")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    script = c["command"][-1]
    assert c["command"][:2] == ["sh", "-c"]
    node_list = re.search(r'nodes="([^"]+)"', script)[1].split()
    assert node_list == [f"{n}:6379" for n in nodes]
    assert ('redis-cli -a "$REDIS_PASSWORD" --no-auth-warning --cluster create $nodes '
            '--cluster-replicas 1 --cluster-yes') in script
    # waits for every node, and creates nothing when the Cluster is formed already
    assert script.index("ping") < script.index("cluster_state:ok") < script.index("--cluster create")
    assert env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": REDIS, "key": "password"}


def test_cluster_values_reach_the_job(render):
    manifests = render(sets=("redis.mode=cluster", "redis.bundled.cluster.nodes=9",
                             "redis.bundled.cluster.replicasPerMaster=2"))
    nodes = pod_names(manifests, REDIS)
    assert len(nodes) == 9
    (job,) = find(manifests, "Job", CREATE_JOB)
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "--cluster-replicas 2 --cluster-yes" in script
    assert re.search(r'nodes="([^"]+)"', script)[1].split() == [f"{n}:6379" for n in nodes]


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX shell")
@pytest.mark.parametrize("mode", ["sentinel", "cluster"])
def test_start_scripts_parse(render, mode):
    """`sh -n` on every script the Redis pods run (the image's /bin/sh is dash, as here)."""
    manifests = render(sets=(f"redis.mode={mode}",))
    shell = [(name, text) for name, text in scripts(manifests).items() if name.endswith(".sh")]
    if mode == "cluster":
        (job,) = find(manifests, "Job", CREATE_JOB)
        shell.append(("create job", job["spec"]["template"]["spec"]["containers"][0]["command"][-1]))
    assert len(shell) >= 2
    for name, text in shell:
        proc = subprocess.run(["sh", "-n"], input=text, capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"


def egress_allowed(manifests, src: str, dst: str, port: int) -> bool:
    """May pod template `src` open a connection to pod template `dst` on `port`, under the
    rendered egress policies? (No egress policy selecting `src`: anything goes.)"""
    src_labels, dst_labels = checks._pod_labels(manifests, src), checks._pod_labels(manifests, dst)
    policies = [p for p in find(manifests, "NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]
                and checks._selects(p["spec"]["podSelector"], src_labels)]
    if not policies:
        return True
    for p in policies:
        for rule in p["spec"].get("egress", []):
            ports = [x["port"] for x in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("to")
            if peers is None or any("podSelector" in peer and "namespaceSelector" not in peer
                                    and checks._selects(peer["podSelector"], dst_labels) for peer in peers):
                return True
    return False


def reaches(manifests, src: str, dst: str, port: int) -> bool:
    """Both ends agree: `src`'s egress and `dst`'s ingress allow the connection."""
    return (checks.allowed(manifests, checks._pod_labels(manifests, src), dst, port)
            and egress_allowed(manifests, src, dst, port))


ROUTER, DRAFT = "Deployment/spec-specserve-router", "Deployment/spec-specserve-draft-small"
WORKER, HEAD = "RayCluster/spec-specserve-target/large-gpu", "RayCluster/spec-specserve-target/head"
NODES, SENTINELS, JOB = f"StatefulSet/{REDIS}", f"StatefulSet/{SENTINEL}", f"Job/{CREATE_JOB}"


def test_network_policies_per_mode(redis_mode):
    name, m = redis_mode
    source, mode = name.split("-")
    for where, _ in pod_specs(m):  # every pod is selected by some ingress policy
        checks.allowed(m, None, where, 1)
    if source == "external":
        assert not [p for p in find(m, "NetworkPolicy") if "redis" in p["metadata"]["name"]]
        return
    for client in (ROUTER, WORKER):
        assert reaches(m, client, NODES, 6379)
    for outsider in (DRAFT, HEAD):
        assert not reaches(m, outsider, NODES, 6379)
    assert not checks.allowed(m, None, NODES, 6379)
    if mode == "standalone":
        assert not egress_allowed(m, NODES, NODES, 6379)  # Redis reaches nothing
    elif mode == "sentinel":
        for client in (ROUTER, WORKER):
            assert reaches(m, client, SENTINELS, 26379)
        assert reaches(m, SENTINELS, NODES, 6379)       # sentinels watch and reconfigure nodes
        assert reaches(m, NODES, SENTINELS, 26379)      # a starting node asks who the primary is
        assert reaches(m, SENTINELS, SENTINELS, 26379)  # votes
        assert reaches(m, NODES, NODES, 6379)           # replication
        for outsider in (DRAFT, HEAD):
            assert not reaches(m, outsider, SENTINELS, 26379)
        assert not checks.allowed(m, None, SENTINELS, 26379)
        assert not reaches(m, ROUTER, SENTINELS, 6379) and not reaches(m, ROUTER, NODES, 26379)
        assert not egress_allowed(m, SENTINELS, ROUTER, 50051)
    else:
        assert reaches(m, NODES, NODES, 6379) and reaches(m, NODES, NODES, 16379)  # the bus
        assert reaches(m, JOB, NODES, 6379)
        assert not reaches(m, JOB, NODES, 16379)
        for client in (ROUTER, WORKER):
            assert not reaches(m, client, NODES, 16379)
        for src in (ROUTER, NODES, JOB):
            assert not checks.allowed(m, checks._pod_labels(m, src), JOB, 6379)  # nothing reaches the Job
        assert not egress_allowed(m, NODES, ROUTER, 50051)
    # the Redis pods of the HA modes resolve each other's names: DNS, and nothing else outside
    if mode != "standalone":
        for policy in find(m, "NetworkPolicy"):
            if policy["metadata"]["name"] in (f"{REDIS}-egress", f"{SENTINEL}-egress", f"{CREATE_JOB}-egress"):
                rules = policy["spec"]["egress"]
                assert {"port": 53, "protocol": "UDP"} in rules[-1]["ports"]
                assert all("podSelector" in peer for rule in rules[:-1] for peer in rule["to"])


@pytest.mark.parametrize("sets, message", [
    (("redis.source=external", "redis.mode=sentinel", "redis.external.masterName=cache"),
     "redis.external.sentinels is required with redis.source=external and redis.mode=sentinel"),
    (("redis.source=external", "redis.mode=sentinel", "redis.external.sentinels={s-0:26379}"),
     "redis.external.masterName is required with redis.source=external and redis.mode=sentinel"),
    (("redis.source=external", "redis.mode=cluster"),
     "redis.external.nodes is required with redis.source=external and redis.mode=cluster"),
    (("redis.source=external",), "redis.external.url"),
    (("redis.source=external", "redis.mode=cluster", "redis.external.nodes={n-0:6379}",
      "redis.external.caSecret=ca"), "redis.external.caSecret: TLS to Redis is supported with redis.mode=standalone"),
    (("redis.mode=sentinel", "redis.bundled.replicas=1"), "redis.bundled.replicas is 1"),
    (("redis.mode=sentinel", "redis.bundled.sentinel.quorum=4"),
     "redis.bundled.sentinel.quorum (4) cannot exceed redis.bundled.sentinel.replicas (3)"),
    (("redis.mode=cluster", "redis.bundled.cluster.nodes=5"), "redis.bundled.cluster.nodes is 5"),
    (("redis.mode=cluster", "redis.bundled.cluster.replicasPerMaster=2"), "needs at least 9"),
    (("redis.source=external", "redis.mode=cluster", "redis.external.nodes={n-0:6379}", "redis.db=3"), "redis.db"),
])
def test_missing_or_inconsistent_redis_values_fail(helm, tmp_path, sets, message):
    assert message in rejected(helm, tmp_path, sets=sets)


def test_template_checks_hold_without_the_schema(helm):
    """The template's own checks name the field too (helm --skip-schema-validation)."""
    proc = run_helm(helm, "template", "spec", str(CHART), "--skip-schema-validation",
                    *set_args(("redis.mode=cluster", "redis.db=1")))
    assert proc.returncode != 0 and "redis.db is 1 but a Redis Cluster has only db 0" in proc.stderr


def test_readme_and_values_document_every_mode():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["redis"]
    assert (values["mode"], values["source"]) == ("standalone", "bundled")
    readme = (CHART / "README.md").read_text()
    for word in ("redis.source", "redis.mode", "sentinel", "cluster", "redis+sentinel://", "redis+cluster://"):
        assert word in readme, word
