"""Hardware lanes: ``gpu`` tests need one CUDA device and are skipped without; ``cluster`` tests
need Transformer Engine and/or several GPUs and run only with ``MEGATRON_CLUSTER_TESTS=1``."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    cluster = os.environ.get("MEGATRON_CLUSTER_TESTS") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "cluster" in item.keywords and not cluster:
            item.add_marker(
                pytest.mark.skip(
                    reason="cluster-only (Transformer Engine / >= 2 GPUs): "
                    "set MEGATRON_CLUSTER_TESTS=1 there"
                )
            )
