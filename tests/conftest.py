"""Hardware lanes: ``gpu`` tests need one CUDA device and are skipped without; ``cluster`` tests
need Transformer Engine and/or several GPUs and run only with ``MEGATRON_CLUSTER_TESTS=1``.

The launch budget: the session fails when it started more real launcher processes (``torchrun``,
``ft_launcher``, launch scripts; counted by ``tests/helpers/launch.py``) than
:data:`REAL_LAUNCH_BUDGET`. A new functional test launches through the forked launcher
(``run_pretrain``'s default on CPU), or raises the budget with its reason in ``tests/README.md``.
"""

import collections
import json
import os
import sys

import pytest

#: Real launcher processes the default lane may start (tests/README.md lists who uses them and why).
REAL_LAUNCH_BUDGET = 40


def pytest_collection_modifyitems(config, items):
    import importlib.metadata

    import torch
    from packaging.requirements import Requirement

    has_cuda = torch.cuda.is_available()
    cluster = os.environ.get("MEGATRON_CLUSTER_TESTS") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        for mark in [*item.iter_markers("upstream_defect"), *item.iter_markers("fixed_upstream")]:
            req = Requirement(mark.args[0].replace(" ", ""))
            try:
                installed = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                continue
            if req.specifier.contains(installed, prereleases=True):
                item.add_marker(
                    pytest.mark.xfail(strict=True, reason=f"{mark.args[0]}: {mark.args[1]}")
                )
        if "cluster" in item.keywords and not cluster:
            item.add_marker(
                pytest.mark.skip(
                    reason="cluster-only (Transformer Engine / >= 2 GPUs): "
                    "set MEGATRON_CLUSTER_TESTS=1 there"
                )
            )


#: Launches counted by pytest-xdist workers (``-n``), gathered by the controller.
_FROM_WORKERS: tuple[list, list] = ([], [])


def _launch_counts():
    launch = sys.modules.get("tests.helpers.launch")
    if launch is None and not any(_FROM_WORKERS):
        return None
    real = [*_FROM_WORKERS[0], *(launch.REAL_LAUNCHES if launch else [])]
    forked = [*_FROM_WORKERS[1], *(launch.FORKED_LAUNCHES if launch else [])]
    return real, forked


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist, controller: a worker's launch counts join the session's."""
    data = getattr(node, "workeroutput", {}).get("launches")
    if data:
        real, forked = json.loads(data)
        _FROM_WORKERS[0].extend(tuple(r) for r in real)
        _FROM_WORKERS[1].extend(forked)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = _launch_counts()
    if counts is None:
        return
    real, forked = counts
    per_file = collections.defaultdict(lambda: [0, 0])
    for test, _ in real:
        per_file[test.split("::")[0]][0] += 1
    for test in forked:
        per_file[test.split("::")[0]][1] += 1
    tr = terminalreporter
    tr.section("launches (real launcher / forked)")
    for path in sorted(per_file):
        tr.write_line(f"{path}: {per_file[path][0]} / {per_file[path][1]}")
    tr.write_line(f"total: {len(real)} real (budget {REAL_LAUNCH_BUDGET}) / {len(forked)} forked")
    if len(real) > REAL_LAUNCH_BUDGET:
        tr.write_line(
            f"FAILED: {len(real)} real launches exceed the budget of {REAL_LAUNCH_BUDGET} "
            "(tests/conftest.py): launch through the forked launcher, or raise the budget with "
            "its reason in tests/README.md",
            red=True,
        )


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller counts and reports
        launch = sys.modules.get("tests.helpers.launch")
        if launch is not None:
            workeroutput["launches"] = json.dumps([launch.REAL_LAUNCHES, launch.FORKED_LAUNCHES])
        return
    counts = _launch_counts()
    if counts is not None and len(counts[0]) > REAL_LAUNCH_BUDGET and exitstatus == 0:
        session.exitstatus = 1
