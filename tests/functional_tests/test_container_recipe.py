"""The container recipe's install step (``docker/install.sh`` with ``docker/requirements.txt``, what
``docker/Dockerfile`` runs) works in an environment that stands in for the NGC image, and leaves its
torch alone.

The stand-in: a fresh virtual environment whose only preinstalled packages are torch and its own
dependencies, visible through a ``.pth`` file that points at a directory of links to exactly those
distributions in this checkout's ``.venv`` (the same torch build; nothing else of ``.venv`` is
visible). That is less than an NGC image holds (it has numpy, packaging, PyYAML, ... too), so a
package the recipe forgot to list shows up here as an import error. The step then runs as in the
Dockerfile (``pip install --no-deps``: the stand-in's torch must stay where it was), and the
installed environment must start ``ft_launcher --help`` and ``pretrain_gpt.py --help`` and train a
few iterations with torch_dist and replicated local checkpoints (2 CPU ranks), from a directory
outside the repository (imports come from the installation, not from the checkout).

Needs the package index (pip downloads the listed wheels, cached after the first run): about
3 min 24 s on the 2-core machine with a warm pip cache (marked slow, runs in the full lane).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.dist import free_port
from tests.helpers.launch import REPO, TINY_GPT

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def torch_closure() -> list[md.Distribution]:
    """torch and every distribution it requires (transitively, extras not included)."""
    seen: dict[str, md.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        dist = md.distribution(name)
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def image_standin(root: Path) -> Path:
    """A venv at ``root/venv`` with torch (and its dependencies only) preinstalled, read-only
    beneath it as in an image. Returns its python."""
    base = root / "image-site-packages"
    base.mkdir(parents=True)
    site = Path(md.distribution("torch").locate_file(""))
    for dist in torch_closure():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            src = site / top
            if top.endswith(".py") or src.is_dir() or src.is_file():
                if not (base / top).exists() and src.exists() and not top.startswith(".."):
                    (base / top).symlink_to(src)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "image-torch.pth").write_text(str(base) + "\n")
    return py


def test_recipe_reads_one_package_list():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    install = (REPO / "docker" / "install.sh").read_text()
    assert "docker/install.sh" in dockerfile and "requirements.txt" in install
    reqs = [
        ln.split("#")[0].strip()
        for ln in (REPO / "docker" / "requirements.txt").read_text().splitlines()
    ]
    names = {canonicalize_name(re.split(r"[=<>!~ ;\[]", r)[0]) for r in reqs if r}
    assert {"megatron-core", "nvidia-resiliency-ext", "nvidia-modelopt", "megatron-fsdp"} <= names
    assert not names & {"torch", "transformer-engine", "apex"}, names
    pins = {
        canonicalize_name(Requirement(r).name): str(Requirement(r).specifier) for r in reqs if r
    }
    project = (REPO / "pyproject.toml").read_text()
    for name in ("megatron-core", "nvidia-resiliency-ext", "nvidia-modelopt", "megatron-fsdp"):
        assert f'"{name}{pins[name]}"' in project, (name, pins[name])  # the versions pyproject pins


def test_install_step_in_an_image_standin(tmp_path):
    py = image_standin(tmp_path)
    torch_before = subprocess.run(
        [str(py), "-c", "import torch; print(torch.__version__, torch.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{py.parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["bash", str(REPO / "docker" / "install.sh"), str(REPO)],
        env={**env, "PYTHON": str(py)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "install: ready (torch" in proc.stdout, proc.stdout[-3000:]
    torch_after = subprocess.run(
        [str(py), "-c", "import torch; print(torch.__version__, torch.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert torch_after == torch_before and str(tmp_path / "image-site-packages") in torch_after
    listed = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "list",
            "--path",
            subprocess.run(
                [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
            ).stdout.strip(),
        ],
        capture_output=True,
        text=True,
    ).stdout.lower()
    assert "\ntorch " not in listed  # nothing of torch installed on top of the image's

    outside = tmp_path / "run"
    outside.mkdir()
    shutil.copy(REPO / "pretrain_gpt.py", outside / "pretrain_gpt.py")
    ft = subprocess.run(
        [str(py.parent / "ft_launcher"), "--help"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ft.returncode == 0 and "--ft-cfg-path" in ft.stdout, (
        ft.stdout[-2000:] + ft.stderr[-4000:]
    )
    pre = subprocess.run(
        [str(py), "pretrain_gpt.py", "--help"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pre.returncode == 0, pre.stdout[-2000:] + pre.stderr[-4000:]
    for flag in (
        "--cpu",
        "--loss-log",
        "--non-persistent-ckpt-type",
        "--tensor-model-parallel-size",
    ):
        assert flag in pre.stdout, flag
    # a short 2-rank CPU run: torch_dist save, replicated local checkpoints (imports at save time)
    train = subprocess.run(
        [
            str(py),
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            "pretrain_gpt.py",
            "--cpu",
            *TINY_GPT,
            "--mock-data",
            "--train-iters",
            "4",
            "--save",
            "ckpt",
            "--save-interval",
            "4",
            "--ckpt-format",
            "torch_dist",
            "--non-persistent-ckpt-type",
            "local",
            "--non-persistent-local-ckpt-dir",
            "local",
            "--non-persistent-save-interval",
            "2",
            "--replication",
            "--replication-jump",
            "1",
            "--replication-factor",
            "2",
        ],
        cwd=outside,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stdout[-6000:]
    assert (outside / "ckpt" / "iter_0000004").is_dir()
    assert sorted(p.name for p in (outside / "local" / "1").iterdir()) == [
        "iter_0000002_0_local.pt",
        "iter_0000002_1_local.pt",
    ]
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import megatron.fixes, megatron.core; print(megatron.fixes.__file__, "
            "megatron.core.__file__)",
        ],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
    )
    assert str(REPO) not in where.stdout and str(py.parent.parent) in where.stdout, (
        where.stdout + where.stderr
    )
