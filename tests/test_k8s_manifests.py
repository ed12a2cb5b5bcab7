"""The Kubernetes manifests in deploy/k8s/: that Kubernetes would read them as written, and that they fit together.

No cluster here, so the checks are static. A core kind (Deployment, Service, MutatingWebhookConfiguration,
...) goes through the official ``kubernetes`` client's model and back: the client drops a key it does not
know without a word, so a misspelled field shows up as a difference between the document and its round
trip (a value of the wrong type is refused outright). The KubeSchedulerConfiguration has no model there; its
keys are held to the json names of kube-scheduler's Go types instead. Then the pieces must agree: the
extender's URLs and the webhook's path are the service's routes, both reach the Service, the Service
reaches the container's port, the probes are the service's health routes, and the example pod's
annotation is a valid estimate request.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes.client
import pytest
import yaml
from kubernetes.client import ApiClient

from app.k8s.claims import CLAIM_GROUP, EXACT_VERSIONS, FLAT_VERSIONS, GPU_CLASSES, REFERENCE_CARD, gpu_places
from app.settings import Settings
from estimator import parse_request
from estimator.gpus import CATALOG

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
FILES = {"batchfit.yaml", "scheduler-config.yaml", "webhook.yaml", "example-pod.yaml", "example-claim.yaml"}

# a Go struct's json names, each with the JSON value types it decodes from
Fields = dict[str, type | tuple[type, ...]]

# The json field names of kube-scheduler's configuration types, from k8s.io/kube-scheduler config/v1/types.go
# (github.com/kubernetes/kube-scheduler at commit e87dbddd27a5bd4c2028727c7ccc082cfb2cdc09, 2026-07-23).
# KubeSchedulerConfiguration embeds metav1.TypeMeta (apiVersion, kind) and component-base's
# DebuggingConfiguration (config/v1alpha1/types.go at 349fbe06359c, the commit its go.mod names:
# enableProfiling, enableContentionProfiling).
SCHEDULER_CONFIGURATION_KEYS = {
    "apiVersion", "kind", "parallelism", "leaderElection", "clientConnection", "enableProfiling",
    "enableContentionProfiling", "percentageOfNodesToScore", "podInitialBackoffSeconds", "podMaxBackoffSeconds",
    "profiles", "extenders", "delayCacheUntilActive",
}
# component-base's ClientConnectionConfiguration (its config/v1alpha1/types.go at 349fbe06359c)
CLIENT_CONNECTION_KEYS: Fields = {"kubeconfig": str, "acceptContentTypes": str, "contentType": str,
                                  "qps": (int, float), "burst": int}
PROFILE_KEYS = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}
# type Extender struct: the Go type of each field, as the JSON value it decodes from
EXTENDER_KEYS: Fields = {
    "urlPrefix": str, "filterVerb": str, "preemptVerb": str, "prioritizeVerb": str, "weight": int, "bindVerb": str,
    "enableHTTPS": bool, "tlsConfig": dict, "httpTimeout": str, "nodeCacheCapable": bool,
    "managedResources": list, "ignorable": bool,
}
# type ExtenderTLSConfig struct ([]byte fields are base64 strings in JSON)
TLS_CONFIG_KEYS: Fields = {
    "insecure": bool, "serverName": str, "certFile": str, "keyFile": str, "caFile": str, "certData": str,
    "keyData": str, "caData": str,
}
# type ExtenderManagedResource struct
MANAGED_RESOURCE_KEYS: Fields = {"name": str, "ignoredByScheduler": bool}

# the routes batchfit serves for Kubernetes (app/k8s/; test_the_paths_are_the_apps_routes checks them)
FILTER_PATH, PRIORITIZE_PATH, MUTATE_PATH = "/k8s/filter", "/k8s/prioritize", "/k8s/mutate"


# --- reading the files ----------------------------------------------------------------------------------------

def _documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every YAML document in deploy/k8s/, in file order."""
    found = []
    for path in sorted(K8S.glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found.append((path.name, doc))
    return found


def _one(kind: str) -> dict[str, Any]:
    docs = [doc for _, doc in _documents() if isinstance(doc, dict) and doc.get("kind") == kind]
    assert len(docs) == 1, f"{len(docs)} documents of kind {kind}"
    return docs[0]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_every_document_parses() -> None:
    assert {p.name for p in K8S.iterdir()} == FILES
    docs = _documents()
    for name, doc in docs:
        assert isinstance(doc, dict), f"{name}: an empty or non-mapping document ({doc!r})"
        assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str), name
    for name in FILES:
        assert (K8S / name).read_text().startswith("#"), f"{name}: opens with a comment saying how it is used"
    assert sorted((name, doc["kind"]) for name, doc in docs) == [
        ("batchfit.yaml", "Deployment"), ("batchfit.yaml", "Namespace"), ("batchfit.yaml", "Service"),
        ("batchfit.yaml", "ServiceAccount"), ("example-claim.yaml", "Job"),
        ("example-claim.yaml", "ResourceClaimTemplate"), ("example-pod.yaml", "Pod"),
        ("scheduler-config.yaml", "KubeSchedulerConfiguration"), ("webhook.yaml", "MutatingWebhookConfiguration"),
    ]


# --- the official client's models -----------------------------------------------------------------------------

def _model_name(api_version: str, kind: str) -> str | None:
    """The client's model for this apiVersion and kind (``apps/v1`` Deployment: ``V1Deployment``), or None.

    A model's name carries the version and kind but not the group, so the group is checked too: the
    group's API class (``AppsV1Api``, ``CoreV1Api`` for the core group, ``AdmissionregistrationV1Api``) must
    take that model as the body of one of its calls.
    """
    group, _, version = api_version.rpartition("/")
    name = version.capitalize() + kind
    model = getattr(kubernetes.client.models, name, None)
    if model is None:
        return None
    words = group.removesuffix(".k8s.io").split(".") if group else ["core"]
    api = getattr(kubernetes.client, "".join(w.capitalize() for w in words) + version.capitalize() + "Api", None)
    if api is None:
        return None
    # the body's type: an annotation (client v37), or the docstring (":type body: V1Deployment" in v37,
    # ":param V1Deployment body:" in earlier clients)
    documented = re.compile(rf":type body: {name}\b|:param {name} body:")
    takes = [attr for attr in vars(api).values() if callable(attr)
             and (getattr(attr, "__annotations__", {}).get("body") in (model, name)
                  or documented.search(attr.__doc__ or ""))]
    return name if takes else None


def _differences(given: Any, back: Any, path: str = "") -> list[str]:
    """Where ``back`` differs from ``given``: dotted paths (list items as [i]), each with what differs."""
    if isinstance(given, dict) and isinstance(back, dict):
        out = []
        for key in sorted(set(given) | set(back), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in back:
                out.append(f"{where}: dropped by the client (not a field of this kind)")
            elif key not in given:
                out.append(f"{where}: added by the client")
            else:
                out += _differences(given[key], back[key], where)
        return out
    if isinstance(given, list) and isinstance(back, list) and len(given) == len(back):
        return [d for i, (g, b) in enumerate(zip(given, back, strict=True)) for d in _differences(g, b, f"{path}[{i}]")]
    if type(given) is not type(back) or given != back:
        return [f"{path}: {given!r} came back as {back!r}"]
    return []


def _client_problems(doc: dict[str, Any]) -> list[str]:
    """What the official client does not take as written: a refusal, or each difference after a round trip."""
    name = _model_name(doc["apiVersion"], doc["kind"])
    assert name is not None, f"the kubernetes client has no model for {doc['apiVersion']} {doc['kind']}"
    with ApiClient() as api:
        try:
            model = api._ApiClient__deserialize(copy.deepcopy(doc), name)
        except ValueError as exc:  # a missing field, a value of the wrong type (v37: pydantic's ValidationError)
            return [f"refused: {exc}"]
        back = api.sanitize_for_serialization(model)
    return _differences(doc, back)


def test_core_kinds_round_trip_through_the_official_client() -> None:
    checked, other = set(), set()
    for name, doc in _documents():
        if _model_name(doc["apiVersion"], doc["kind"]) is None:
            other.add(doc["kind"])
            continue
        checked.add(doc["kind"])
        problems = _client_problems(doc)
        assert not problems, f"{name} {doc['kind']}: " + "; ".join(problems)
    assert checked == {"Namespace", "ServiceAccount", "Deployment", "Service", "Pod", "MutatingWebhookConfiguration",
                       "ResourceClaimTemplate", "Job"}
    assert other == {"KubeSchedulerConfiguration"}  # checked against kube-scheduler's types below


def test_the_round_trip_catches_a_misspelled_or_mistyped_field() -> None:
    deployment = _one("Deployment")
    assert _client_problems(deployment) == []

    misspelled = copy.deepcopy(deployment)
    misspelled["spec"]["replcas"] = misspelled["spec"].pop("replicas")
    assert "spec.replcas: dropped by the client (not a field of this kind)" in _client_problems(misspelled)

    nested = copy.deepcopy(deployment)
    _container(nested)["imagePullPolicey"] = _container(nested).pop("imagePullPolicy")
    assert any(p.startswith("spec.template.spec.containers[0].imagePullPolicey: dropped")
               for p in _client_problems(nested))

    mistyped = copy.deepcopy(deployment)
    _container(mistyped)["resources"]["limits"]["cpu"] = 2  # a quantity is a string
    (problem,) = _client_problems(mistyped)
    # client v37 refuses it; earlier clients turn it into "2", a difference
    assert problem.startswith(("refused:", "spec.template.spec.containers[0].resources.limits.cpu: 2 came back"))
    assert "limits.cpu" in problem

    # a kind in the wrong group, or no such kind or version, has no model: it cannot pass as one
    assert _model_name("apps/v1", "Deployment") == "V1Deployment"
    assert _model_name("v1", "Pod") == "V1Pod"
    assert _model_name("batch/v1", "Deployment") is None
    assert _model_name("apps/v1", "Deploymnet") is None
    assert _model_name("apps/v2", "Deployment") is None
    assert _model_name("resource.k8s.io/v1", "ResourceClaimTemplate") == "V1ResourceClaimTemplate"
    assert _model_name("resource.k8s.io/v1beta1", "ResourceClaimTemplate") == "V1beta1ResourceClaimTemplate"

    # a v1beta1-shaped request (no ``exactly``) in a v1 template: the client drops its device class
    template = copy.deepcopy(_one("ResourceClaimTemplate"))
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    request.update(request.pop("exactly"))
    assert "spec.spec.devices.requests[0].deviceClassName: dropped by the client (not a field of this kind)" in (
        _client_problems(template))


# --- kube-scheduler's configuration ---------------------------------------------------------------------------

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_TERM = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def _go_duration_s(text: str) -> float:
    """Seconds in a Go duration string as ``time.ParseDuration`` reads it ("5s", "1m30s", "1.5h", "0")."""
    sign, body = (-1.0, text[1:]) if text[:1] == "-" else (1.0, text.removeprefix("+"))
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(body):
        term = _GO_TERM.match(body, pos)
        if term is None:
            raise ValueError(f"time: invalid duration {text!r}")
        total += float(term.group(1)) * _GO_UNITS[term.group(2)]
        pos = term.end()
    if not body:
        raise ValueError(f"time: invalid duration {text!r}")
    return sign * total


def test_go_duration_reading() -> None:
    assert _go_duration_s("5s") == 5.0 and _go_duration_s("500ms") == 0.5 and _go_duration_s("0") == 0.0
    assert _go_duration_s("1m30s") == 90.0 and _go_duration_s("1.5h") == 5400.0 and _go_duration_s("-2s") == -2.0
    for bad in ("5", "", "s", "5 s", "5sec", "1.2.3s", "5S"):
        with pytest.raises(ValueError):
            _go_duration_s(bad)


def _typed_keys(obj: dict[str, Any], fields: Fields, where: str) -> None:
    """Every key is one of the Go struct's json names, and its value decodes into that field's type."""
    unknown = set(obj) - set(fields)
    assert not unknown, f"{where}: not fields of kube-scheduler's type: {sorted(unknown)}"
    for key, value in obj.items():
        want = fields[key]
        ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
        assert ok, f"{where}.{key}: {value!r} is not a {want}"


def test_scheduler_config_keys_are_kube_schedulers() -> None:
    config = _one("KubeSchedulerConfiguration")
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert set(config) <= SCHEDULER_CONFIGURATION_KEYS, set(config) - SCHEDULER_CONFIGURATION_KEYS
    _typed_keys(config.get("clientConnection", {}), CLIENT_CONNECTION_KEYS, "clientConnection")
    (profile,) = config["profiles"]
    assert set(profile) <= PROFILE_KEYS, set(profile) - PROFILE_KEYS
    assert profile["schedulerName"] == "default-scheduler"
    (extender,) = config["extenders"]
    _typed_keys(extender, EXTENDER_KEYS, "extenders[0]")
    _typed_keys(extender["tlsConfig"], TLS_CONFIG_KEYS, "extenders[0].tlsConfig")
    for i, resource in enumerate(extender["managedResources"]):
        _typed_keys(resource, MANAGED_RESOURCE_KEYS, f"extenders[0].managedResources[{i}]")
    # and the check itself refuses a misspelled key
    with pytest.raises(AssertionError, match="nodeCachCapable"):
        _typed_keys({**extender, "nodeCachCapable": False}, EXTENDER_KEYS, "extenders[0]")


def test_extender_is_ignorable_and_quick() -> None:
    (extender,) = _one("KubeSchedulerConfiguration")["extenders"]
    assert extender["nodeCacheCapable"] is False  # batchfit reads each node's GPU from the Node objects sent
    assert extender["ignorable"] is True  # batchfit down: scheduling goes on without it
    assert 0 < _go_duration_s(extender["httpTimeout"]) <= 5.0
    assert extender["filterVerb"] and extender["prioritizeVerb"]
    assert "bindVerb" not in extender and "preemptVerb" not in extender
    assert isinstance(extender["weight"], int) and extender["weight"] > 0
    assert extender["enableHTTPS"] is True and extender["tlsConfig"].get("insecure", False) is False
    assert extender["tlsConfig"]["caFile"].startswith("/")
    # every GPU resource the device plugin advertises for a card in the catalog: whole cards and MIG slices
    mig = {name.partition("-MIG-")[2] for name in CATALOG if "-MIG-" in name}
    assert mig >= {"1g.5gb", "2g.10gb", "3g.20gb", "1g.10gb", "2g.20gb", "3g.40gb"}
    managed = {r["name"]: r.get("ignoredByScheduler", False) for r in extender["managedResources"]}
    assert managed == dict.fromkeys({"nvidia.com/gpu"} | {f"nvidia.com/mig-{p}" for p in mig}, False)


def _service_port(service: dict[str, Any], port: int) -> dict[str, Any]:
    (found,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    return found


def test_extender_urls_are_the_service_routes() -> None:
    (extender,) = _one("KubeSchedulerConfiguration")["extenders"]
    service = _one("Service")
    url = urlsplit(extender["urlPrefix"])
    assert url.scheme == "https" and not url.query and not url.fragment
    assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    _service_port(service, url.port or 443)
    # kube-scheduler's HTTPExtender.send: strings.TrimRight(urlPrefix, "/") + "/" + verb
    prefix = url.path.rstrip("/")
    assert prefix + "/" + extender["filterVerb"] == FILTER_PATH
    assert prefix + "/" + extender["prioritizeVerb"] == PRIORITIZE_PATH


# --- the webhook ----------------------------------------------------------------------------------------------

def test_webhook_reaches_the_service_and_never_blocks() -> None:
    config = _one("MutatingWebhookConfiguration")
    service = _one("Service")
    assert config["apiVersion"] == "admissionregistration.k8s.io/v1"
    (hook,) = config["webhooks"]
    assert hook["name"] == "pods.batchfit.io"
    client = hook["clientConfig"]
    assert "caBundle" not in client and "url" not in client  # cert-manager's cainjector fills caBundle
    target = client["service"]
    assert (target["name"], target["namespace"]) == (service["metadata"]["name"], service["metadata"]["namespace"])
    assert target["path"] == MUTATE_PATH
    _service_port(service, target.get("port", 443))
    secret = next(v["secret"]["secretName"] for v in _one("Deployment")["spec"]["template"]["spec"]["volumes"]
                  if "secret" in v)
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{target['namespace']}/{secret}"
    assert hook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                              "resources": ["pods"], "scope": "Namespaced"},
                             {"operations": ["CREATE"], "apiGroups": ["resource.k8s.io"],
                              "apiVersions": ["v1", "v1beta2", "v1beta1"],  # the shapes app/k8s/claims.py reads
                              "resources": ["resourceclaims", "resourceclaimtemplates"], "scope": "Namespaced"}]
    assert set(hook["rules"][1]["apiVersions"]) == set(EXACT_VERSIONS + FLAT_VERSIONS)
    assert hook["objectSelector"] == {"matchLabels": {"batchfit.io/enabled": "true"}}
    assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] == 5
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    assert hook["reinvocationPolicy"] == "Never" and hook["matchPolicy"] == "Equivalent"


# --- the Deployment and its Service ---------------------------------------------------------------------------

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def _bytes(quantity: str) -> int:
    """A memory quantity ("10Gi", "512M", "1073741824") in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT]i|[kMGT]?)", quantity)
    assert match, f"not a memory quantity: {quantity!r}"
    number, suffix = match.groups()
    return int(number) * (_BINARY.get(suffix) or _DECIMAL[suffix])


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_deployment_serves_https_on_its_named_port() -> None:
    deployment, service = _one("Deployment"), _one("Service")
    pod = deployment["spec"]["template"]
    container = _container(deployment)
    assert deployment["spec"]["replicas"] == 1
    assert container["image"] == "batchfit:0.6.0" and container["imagePullPolicy"] == "IfNotPresent"
    (port,) = container["ports"]
    assert port == {"name": "https", "containerPort": 8443, "protocol": "TCP"}
    command = container["command"]
    assert command[:2] == ["batchfit", "serve"] and _flag(command, "--host") == "0.0.0.0"
    assert int(_flag(command, "--port")) == port["containerPort"]
    # the certificate and key are the mounted kubernetes.io/tls Secret's files
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    tls = next(name for name, v in volumes.items() if "secret" in v)
    assert volumes[tls]["secret"]["secretName"] == "batchfit-tls" and mounts[tls]["readOnly"] is True
    assert _flag(command, "--ssl-certfile") == mounts[tls]["mountPath"] + "/tls.crt"
    assert _flag(command, "--ssl-keyfile") == mounts[tls]["mountPath"] + "/tls.key"
    # the Service picks this pod and sends port 443 to the container's https port
    assert service["metadata"]["namespace"] == deployment["metadata"]["namespace"] == "batchfit-system"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert _service_port(service, 443)["targetPort"] == port["name"]
    assert pod["spec"]["serviceAccountName"] == _one("ServiceAccount")["metadata"]["name"]


def test_deployment_probes_are_the_health_routes() -> None:
    container = _container(_one("Deployment"))
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["scheme"], get["port"]) == (path, "HTTPS", "https"), probe
    # the server listens only after its workers imported torch (about a minute): liveness waits for that
    startup = container["startupProbe"]
    assert startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_deployment_settings_and_resources() -> None:
    deployment = _one("Deployment")
    container = _container(deployment)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["BATCHFIT_WORKERS"] == "2" and env["BATCHFIT_WEBHOOK_DENY_UNFIT"] == "0"
    # every variable is a setting of the service (a misspelled one would be ignored), and a valid value
    fields = {}
    for name, value in env.items():
        field = name.removeprefix("BATCHFIT_").lower()
        assert name.startswith("BATCHFIT_") and field in Settings.model_fields, name
        fields[field] = value
    settings = Settings(**fields)
    # the SQLite cache lives on the emptyDir volume
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    cache_dir = str(Path(settings.cache_path).parent)
    assert "emptyDir" in volumes[mounts[cache_dir]]
    # each worker is killed past worker_memory_bytes: all of them, plus 1 GiB for the server process, fit the limit,
    # and the limit holds no more than that and 2 GiB (memory a node could give other pods)
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS: never evicted first
    assert resources["limits"]["cpu"] == str(settings.workers)
    limit = _bytes(resources["limits"]["memory"])
    workers = settings.workers * settings.worker_memory_bytes
    assert workers + 2**30 <= limit <= workers + 2 * 2**30
    # the image's user (Dockerfile: useradd --uid N), never root
    useradd = re.search(r"useradd\b[^\n]*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert useradd, "the Dockerfile creates its user with useradd --uid"
    uid = int(useradd.group(1))
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == uid == 10001
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


# --- the example pod ------------------------------------------------------------------------------------------

def test_example_pod_is_a_valid_request_for_its_gpu() -> None:
    pod = _one("Pod")
    hook = _one("MutatingWebhookConfiguration")["webhooks"][0]
    annotations = pod["metadata"]["annotations"]
    spec = yaml.safe_load(annotations["batchfit.io/spec"])  # JSON is YAML; json.loads agrees on this one
    assert isinstance(spec, dict) and "gpus" not in spec  # the GPU comes from the node
    request = parse_request({**spec, "gpus": ["A100-80GB"]})
    assert request.model.source == "transformers" and request.planner.target_global_batch == 256
    # parse_request leaves the preset to the model builder: it must be one batchfit ships
    from estimator.models.sources.transformers import presets  # imports torch: here only

    assert request.model.preset in presets()
    batch = annotations["batchfit.io/batch-size"]
    assert isinstance(batch, str) and batch.isdigit() and int(batch) > 0
    # GPU Feature Discovery's product label for the catalog's A100-80GB (NVML name, spaces as dashes)
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    # the webhook sees it (its label) and so does the extender (a managed resource)
    assert hook["objectSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["restartPolicy"] == "Never"  # a failed run is not restarted from scratch by the kubelet
    (container,) = pod["spec"]["containers"]
    (extender,) = _one("KubeSchedulerConfiguration")["extenders"]
    managed = {r["name"] for r in extender["managedResources"]}
    limits = container["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "1"} and set(limits) <= managed
    # the training script takes the batch and accumulation the webhook puts in its environment
    script = container["command"][-1]
    assert container["command"][:2] == ["sh", "-c"]
    assert "${BATCHFIT_BATCH_SIZE:-" + batch + "}" in script and "${BATCHFIT_GRAD_ACCUM:-1}" in script


def test_example_claim_template_is_a_valid_request_for_a_gpu() -> None:
    template, job = _one("ResourceClaimTemplate"), _one("Job")
    hook = _one("MutatingWebhookConfiguration")["webhooks"][0]
    annotations = template["metadata"]["annotations"]
    spec = yaml.safe_load(annotations["batchfit.io/spec"])
    assert isinstance(spec, dict) and "gpus" not in spec
    request = parse_request({**spec, "gpus": [REFERENCE_CARD]})
    from estimator.models.sources.transformers import presets  # imports torch: here only

    assert request.model.preset in presets()
    batch = annotations["batchfit.io/batch-size"]
    assert isinstance(batch, str) and batch.isdigit() and int(batch) > 0
    # the webhook sees its creation, and sizes its one request, of NVIDIA's GPU class
    assert hook["objectSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert template["apiVersion"] == f"{CLAIM_GROUP}/v1"
    (gpu,) = gpu_places(template, "ResourceClaimTemplate", "v1")
    assert gpu.request["deviceClassName"] in GPU_CLASSES and "selectors" not in gpu.request
    # the Job's pod claims a device from the template, for its container, and runs the batch the claim is sized for
    pod = job["spec"]["template"]["spec"]
    (claim,) = pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["resources"]["claims"] == [{"name": claim["name"]}] and "limits" not in container["resources"]
    assert container["command"][container["command"].index("--batch-size") + 1] == batch
    assert pod["restartPolicy"] == "Never"


def test_the_paths_are_the_apps_routes() -> None:
    from app.main import K8S, create_app

    paths = create_app(start_workers=False).openapi()["paths"]
    for path in (FILTER_PATH, PRIORITIZE_PATH, MUTATE_PATH):
        assert path in K8S and "post" in paths[path], path
