"""deploy/'s Kubernetes manifests, checked without a cluster: each custom resource against the upstream schema of
its kind (deploy/crds/, as strict about unknown fields as the API server), and what the manifests tell pagedllm
against pagedllm itself: the Ray Serve application's import path and options, and the LeaderWorkerSet pods'
command lines, read by the CLI's own parser and checked together as an engine checks its options at start."""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import hashlib
import operator
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from pagedllm.cli import make_parser
from pagedllm.config import EngineConfig, ServeOptions, check_option, option_values

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
RAY_SERVICE = DEPLOY / "rayservice.yaml"
LEADER_WORKER_SET = DEPLOY / "leaderworkerset.yaml"

# Each kind's CRD file and the git blob id of the upstream file (deploy/README.md says which release): stored byte
# for byte, so a schema edited to let a manifest through is caught.
CRDS = {
    "RayService": ("ray.io_rayservices.yaml", "7ee63d6ddd11237a5649e04b3a8db3c52074c867"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io_leaderworkersets.yaml", "2b376d69063e46bec99d0d815d36948cdc87d128"),
}
# libyaml reads the two 1 MB CRDs in a fraction of a second; PyYAML's pure-Python loader takes seconds.
CRD_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

OPTION_LISTS = {spec.name: options for options in (EngineConfig, ServeOptions) for spec in fields(options)}

# Where deploy/Dockerfile links the default model: a path in the image, replaced here by a local file.
MODEL_IN_IMAGE = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
# The labels LWS gives its pods (its api/leaderworkerset/v1/leaderworkerset_types.go).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# Resolvable here, as the leader's DNS name is in the pods: --master-addr must resolve when the flags are read.
SAMPLE_LEADER_ADDRESS = "localhost"
REMOVED = object()


def documents(manifest: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(manifest.read_text()) if document is not None]


def of_kind(manifest: Path, kind: str) -> dict[str, Any]:
    (document,) = (document for document in documents(manifest) if document["kind"] == kind)
    return document


def mutated(document: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """A copy of `document` with the field at the dotted `path` (list items by index) set to `value`, or removed
    where `value` is REMOVED."""
    changed = copy.deepcopy(document)
    *parents, last = [int(key) if key.isdigit() else key for key in path.split(".")]
    holder = functools.reduce(operator.getitem, parents, changed)
    if value is REMOVED:
        del holder[last]
    else:
        holder[last] = value
    return changed


# ---- the CRD schemas ----------------------------------------------------------------------------------------------


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@functools.cache
def crd(kind: str) -> dict[str, Any]:
    filename, blob_id = CRDS[kind]
    data = (DEPLOY / "crds" / filename).read_bytes()
    assert git_blob_id(data) == blob_id, f"deploy/crds/{filename} is not the upstream file"
    definition = yaml.load(data, Loader=CRD_LOADER)
    assert definition["spec"]["names"]["kind"] == kind
    return definition


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` refusing unknown fields, as the API server does (kubectl's default, --validate=strict): each object
    that lists its properties, unless it keeps unknown fields, gets additionalProperties false. Only the structural
    parts (properties, items, additionalProperties) name fields; anyOf and the like only restrict values."""
    result = dict(schema)
    if "properties" in schema:
        result["properties"] = {name: strict(field) for name, field in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            result["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        result["additionalProperties"] = strict(schema["additionalProperties"])
    if "items" in schema:
        result["items"] = strict(schema["items"])
    return result


@functools.cache
def validator(kind: str, api_version: str) -> jsonschema.Draft7Validator | None:
    """The validator of `kind` at `api_version`, None when its CRD serves no such version. x-kubernetes-* keys
    are ignored; int-or-string fields come with an anyOf of both types that says the same."""
    spec = crd(kind)["spec"]
    for version in spec["versions"]:
        if version["served"] and api_version == f"{spec['group']}/{version['name']}":
            return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))
    return None


def schema_errors(resource: dict[str, Any]) -> list[str]:
    """What the API server would refuse in `resource`, a custom resource of a kind in CRDS."""
    check = validator(resource["kind"], resource["apiVersion"])
    if check is None:
        return [f"{resource['kind']} has no served version {resource['apiVersion']!r}"]
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in check.iter_errors(resource)]


@pytest.mark.parametrize(
    ("manifest", "path", "value", "refusal"),
    [
        (RAY_SERVICE, "apiVersion", "ray.io/v2", "no served version"),
        (RAY_SERVICE, "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus", 0, "is not of type 'string'"),
        (RAY_SERVICE, "spec.rayClusterConfig.workerGroupSpecs.0.groupName", REMOVED, "'groupName' is a required"),
        (RAY_SERVICE, "spec.rayClusterConfig.workerGroupSpecs.0.minReplica", 1, "'minReplica' was unexpected"),
        (LEADER_WORKER_SET, "spec.leaderWorkerTemplate.size", "3", "'3' is not of type 'integer'"),
        (LEADER_WORKER_SET, "spec.leaderWorkerTemplate.restartPolicy", "Always", "'Always' is not one of"),
        (LEADER_WORKER_SET, "spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.args.2", 3, "not of type"),
    ],
    ids=lambda case: case.name if isinstance(case, Path) else None,
)
def test_custom_resources_match_their_crds(manifest: Path, path: str, value: object, refusal: str) -> None:
    """Every custom resource of the manifest is one its CRD accepts; the mutated one shows a refusal gets through."""
    resources = [document for document in documents(manifest) if document["kind"] in CRDS]
    assert resources
    # The leaders' Service: test_service_reaches_the_leaders_only checks it.
    others = [document["kind"] for document in documents(manifest) if document["kind"] not in CRDS]
    assert others == (["Service"] if manifest == LEADER_WORKER_SET else [])
    for resource in resources:
        assert schema_errors(resource) == []
    (wrong,) = schema_errors(mutated(resources[0], path, value))
    assert refusal in wrong


# ---- the RayService's application ---------------------------------------------------------------------------------


def top_level_names(module: Path) -> set[str]:
    """What `module` defines or imports at its top level: what an import path may name in it."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def import_path_problems(import_path: str) -> list[str]:
    """`module:attr` with the module in the pagedllm package; once the module's file is there, attr defined in it."""
    match = re.fullmatch(r"(pagedllm(?:\.\w+)+):(\w+)", import_path)
    if match is None:
        return [f"import_path {import_path!r} is not pagedllm.<module>:<name>"]
    module, name = match.groups()
    folder = REPO.joinpath(*module.split("."))
    sources = [source for source in (folder.with_suffix(".py"), folder / "__init__.py") if source.exists()]
    # pagedllm.entrypoints.ray_serve is being written beside these manifests: until it is there, the form only.
    if sources and name not in top_level_names(sources[0]):
        return [f"{module} defines no {name}"]
    return []


def ray_service_problems(ray_service: dict[str, Any], model: Path) -> list[str]:
    """What Ray Serve or pagedllm would refuse in the RayService's application (`model`: the local stand-in for
    the image's model), and a Ray version other than the image's."""
    cluster = ray_service["spec"]["rayClusterConfig"]
    image_ray = re.search(r'"ray\[serve\]==([\w.]+)"', (DEPLOY / "Dockerfile").read_text())
    problems = [] if image_ray and cluster["rayVersion"] == image_ray[1] else ["rayVersion is not the image's Ray"]
    serve_config = yaml.safe_load(ray_service["spec"]["serveConfigV2"])
    try:
        ServeDeploySchema.model_validate(serve_config)
    except ValueError as error:  # pydantic's ValidationError
        problems.append(str(error))
    (application,) = serve_config["applications"]
    if application.get("route_prefix") != "/":
        problems.append(f"route_prefix is {application.get('route_prefix')!r}, not '/'")
    problems += import_path_problems(application["import_path"])
    for name, value in application["args"].items():
        if name in OPTION_LISTS:
            try:
                check_option(OPTION_LISTS[name], name, str(model) if value == MODEL_IN_IMAGE else value)
            except ValueError as error:
                problems.append(str(error))
        else:
            problems.append(f"args has {name!r}, no pagedllm option")
    return problems


def with_serve_config(ray_service: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """`ray_service` with the field at `path` of its Serve config (which the CRD holds as text) set to `value`."""
    serve_config = mutated(yaml.safe_load(ray_service["spec"]["serveConfigV2"]), path, value)
    return mutated(ray_service, "spec.serveConfigV2", yaml.safe_dump(serve_config))


@pytest.fixture
def local_model(tmp_path: Path) -> Path:
    model = tmp_path / Path(MODEL_IN_IMAGE).name
    model.touch()
    return model


@pytest.mark.parametrize(
    ("path", "value", "refusal"),
    [
        ("applications.0.args.tensor_parallel_sise", 1, "'tensor_parallel_sise', no pagedllm option"),
        ("applications.0.args.max_num_seqs", 0, "max_num_seqs must be"),
        ("applications.0.args.model", "/no/such/model.gguf", "model must be an existing file"),
        ("applications.0.import_path", "pagedllm.entrypoints.ray_serve.build_application", "is not pagedllm"),
        ("applications.0.import_path", "ray.serve.llm:build_openai_app", "is not pagedllm"),
        ("applications.0.import_path", "pagedllm.cli:build_application", "pagedllm.cli defines no build_application"),
        ("applications.0.route_prefix", "/v1", "not '/'"),
        ("applications.0.deployments", "pagedllm", "deployments"),
    ],
)
def test_ray_service_runs_pagedllm(path: str, value: object, refusal: str, local_model: Path) -> None:
    """The application is pagedllm's, at /, with options pagedllm has and values they admit; a mutated one is not."""
    ray_service = of_kind(RAY_SERVICE, "RayService")
    assert ray_service_problems(ray_service, local_model) == []
    (problem,) = ray_service_problems(with_serve_config(ray_service, path, value), local_model)
    assert refusal in problem


def test_ray_service_runs_the_images_ray(local_model: Path) -> None:
    ray_service = of_kind(RAY_SERVICE, "RayService")
    assert ray_service_problems(ray_service, local_model) == []
    older = mutated(ray_service, "spec.rayClusterConfig.rayVersion", "2.9.0")
    assert ray_service_problems(older, local_model) == ["rayVersion is not the image's Ray"]


# ---- the LeaderWorkerSet's command lines --------------------------------------------------------------------------


def substituted(text: str, env: dict[str, str]) -> str:
    """`text` with Kubernetes' $(NAME) references replaced from `env`: KeyError for one that would stay unreplaced."""
    return re.sub(r"\$\((\w+)\)", lambda reference: env[reference[1]], text)


def parsed_pod(template: dict[str, Any], env: dict[str, str], model: Path) -> argparse.Namespace:
    """The flags of the pagedllm container of the pod `template`, as that pod would run them here."""
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["pagedllm"]
    argv = [substituted(arg, env).replace(MODEL_IN_IMAGE, str(model)) for arg in container["args"]]
    return make_parser().parse_args(argv)


def group_engines(lws: dict[str, Any], model: Path) -> list[argparse.Namespace]:
    """The parsed flags of one group's pods, the leader's first, each after the engine's own checks of its options
    (EngineConfig: tensor_parallel_size a multiple of nnodes, node_rank below it, ...). The engine flags must be the
    same on every pod, node_rank apart."""
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    pods = [
        parsed_pod(
            template["leaderTemplate"] if index == 0 else template["workerTemplate"],
            {"LWS_LEADER_ADDRESS": SAMPLE_LEADER_ADDRESS, "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)},
            model,
        )
        for index in range(size)
    ]
    engines = [option_values(EngineConfig, args) for args in pods]
    for engine in engines:
        EngineConfig(**engine)
    assert [engine.pop("node_rank") for engine in engines] == list(range(size))
    assert all(engine == engines[0] for engine in engines)
    return pods


def test_leader_worker_set_runs_one_tensor_parallel_engine(local_model: Path) -> None:
    lws = of_kind(LEADER_WORKER_SET, "LeaderWorkerSet")
    leader, *workers = group_engines(lws, local_model)
    assert (leader.command, {worker.command for worker in workers}) == ("serve", {"worker"})
    assert leader.nnodes == lws["spec"]["leaderWorkerTemplate"]["size"] > 1
    (container,) = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    serve = ServeOptions(**option_values(ServeOptions, leader))
    assert serve.host == "0.0.0.0"  # not the loopback default: the Service reaches the pod from outside
    assert {"name": "http", "containerPort": serve.port} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}

    with pytest.raises(ValueError, match="must be a multiple of nnodes"):
        group_engines(mutated(lws, "spec.leaderWorkerTemplate.size", 2), local_model)
    worker_args = "spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.args"
    with pytest.raises(SystemExit):  # argparse's refusal of a flag pagedllm does not have
        group_engines(mutated(lws, f"{worker_args}.1", "--node-rnak=$(LWS_WORKER_INDEX)"), local_model)
    with pytest.raises(KeyError, match="LWS_WORKER_IDX"):
        group_engines(mutated(lws, f"{worker_args}.1", "--node-rank=$(LWS_WORKER_IDX)"), local_model)
    with pytest.raises(AssertionError):  # a worker whose engine flags differ from the leader's
        group_engines(mutated(lws, f"{worker_args}.8", "--kv-cache-memory=1073741824"), local_model)


def selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    return service["spec"]["selector"].items() <= labels.items()


def test_service_reaches_the_leaders_only() -> None:
    lws = of_kind(LEADER_WORKER_SET, "LeaderWorkerSet")
    service = of_kind(LEADER_WORKER_SET, "Service")
    assert service["apiVersion"] == "v1"
    name = lws["metadata"]["name"]
    assert service["metadata"]["name"] != name  # LWS's own headless Service, behind the pods' DNS names
    template = lws["spec"]["leaderWorkerTemplate"]
    leader_labels = {LWS_NAME_LABEL: name, LWS_WORKER_INDEX_LABEL: "0"}
    leader_labels |= template["leaderTemplate"].get("metadata", {}).get("labels", {})
    worker_labels = {LWS_NAME_LABEL: name, LWS_WORKER_INDEX_LABEL: "1"}
    worker_labels |= template["workerTemplate"].get("metadata", {}).get("labels", {})
    assert selects(service, leader_labels)
    assert not selects(service, worker_labels)
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {leader_port["name"] for leader_port in leader["ports"]}
