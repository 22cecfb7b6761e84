"""The GPU deployment as written: the Dockerfile's gpu stage, compose's device reservation, the
Kubernetes manifest asking for nvidia.com/gpu (against the Kubernetes schema), Ray Serve replicas
asking for GPUs; each serving with flags the server accepts."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dspark_serve.server.cli import build_parser
from dspark_serve.server.ray_serve import RayServeConfig
from tests.deploy.test_k8s import VERSIONS, manifests

ROOT = Path(__file__).resolve().parents[2]


def stages() -> dict[str, list[str]]:
    """The Dockerfile's stages: name -> its lines (the FROM line first)."""
    out: dict[str, list[str]] = {}
    name = None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        m = re.match(r"FROM (\S+)(?: AS (\w+))?$", line)
        if m:
            name = m.group(2) or m.group(1)
            out[name] = [line]
        elif name and line and not line.startswith("#"):
            out[name].append(line)
    return out


def entrypoint_flags(lines: list[str]) -> list[str]:
    (ep,) = [line for line in lines if line.startswith("ENTRYPOINT")]
    argv = yaml.safe_load(ep.removeprefix("ENTRYPOINT "))
    assert argv[0] == "dspark-serve"
    return argv[1:]


def test_the_dockerfile_builds_a_cpu_default_and_a_gpu_stage():
    st = stages()
    assert list(st) == ["base", "gpu", "cpu"]  # the last stage, the default build, is the CPU one
    assert st["gpu"][0] == "FROM base AS gpu" and st["cpu"][0] == "FROM base AS cpu"
    assert any(re.search(r'pip install .*"\.\[gpu\]"', line) for line in st["gpu"])
    gpu_flags = entrypoint_flags(st["gpu"])
    assert gpu_flags[gpu_flags.index("--device") + 1] == "auto"
    for stage in ("gpu", "cpu"):
        build_parser().parse_args(entrypoint_flags(st[stage]))
    assert "NVIDIA_VISIBLE_DEVICES=all" in " ".join(st["gpu"])


def test_compose_reserves_a_gpu_for_the_gpu_image():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gpu = services["dspark-gpu"]
    assert gpu["build"] == {"context": ".", "target": "gpu"} and gpu["profiles"] == ["gpu"]
    (dev,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["count"] >= 1 and "gpu" in dev["capabilities"]
    assert gpu["ports"][0].endswith(":8000") and gpu["ports"][0] != services["dspark"]["ports"][0]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert "dspark-gpu:8000" in scrape["scrape_configs"][0]["static_configs"][0]["targets"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_kubernetes_gpu_deployment_requests_a_gpu(version):
    (dep,) = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "gpu" / "deployment.yaml").read_text()))
    kubernetes_validate.validate(dep, version, strict=True)
    cpu = manifests()["Deployment"]
    # a drop-in for the CPU Deployment: the Service and autoscalers there select it unchanged
    assert dep["metadata"]["name"] == cpu["metadata"]["name"]
    assert dep["spec"]["selector"] == cpu["spec"]["selector"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert c["image"].endswith(":gpu")
    args = build_parser().parse_args(c["args"])
    assert args.device == "cuda" and 0 < args.gpu_memory_utilization <= 1
    tol = dep["spec"]["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tol)


def test_ray_serve_replicas_ask_for_gpus():
    assert "num_gpus" not in RayServeConfig().deployment_options(10)["ray_actor_options"]
    opts = RayServeConfig(num_gpus=1).deployment_options(10)["ray_actor_options"]
    assert opts == {"num_cpus": 1.0, "num_gpus": 1}
    with pytest.raises(ValueError, match="num_gpus must be >= 0"):
        RayServeConfig(num_gpus=-1)
