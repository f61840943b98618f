"""The restricted unpickler (``megatron/integrity/unpickle.py``): a file naming a global outside
the allowlist is refused naming the file and the global, before anything it names is imported
or called; what the writers store loads; the escape hatch; DCP metadata; the failure DCP gathers
from another rank is found behind its ``CheckpointException``; the local-directory ownership
check at start."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
from argparse import Namespace
from collections import OrderedDict

import pytest
import torch

from megatron.integrity import unpickle
from tests.helpers import pickle_bomb as pb

FIRE = "tests.helpers.pickle_bomb.fire"


@contextlib.contextmanager
def unimported_bomb():
    """``tests.helpers.pickle_bomb`` removed from ``sys.modules`` (re-imported only if a load
    imports it); restored after."""
    saved = sys.modules.pop(pb.__name__)
    try:
        yield
        assert pb.__name__ not in sys.modules, "a refused load imported the module its file names"
    finally:
        sys.modules[pb.__name__] = saved


def test_crafted_torch_file_is_refused_naming_file_and_global(tmp_path):
    marker = tmp_path / "MARKER"
    path = pb.torch_file(tmp_path / "evil.pt", marker)
    for load in (unpickle.torch_load, unpickle.load_without_tensors):
        with unimported_bomb(), pytest.raises(unpickle.UnsafeCheckpointError) as e:
            load(path)
        assert e.value.path == str(path) and e.value.global_name == FIRE
        assert str(e.value).startswith(f"{path} names {FIRE}, outside the unpickling allowlist")
        assert unpickle.UNRESTRICTED_FLAG in str(e.value)
        assert isinstance(e.value, pickle.UnpicklingError)
    assert pb.ran(marker) == []


def test_os_system_is_refused(tmp_path):
    class Shell:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'MARKER'}",))

    blob = io.BytesIO()
    torch.save([Shell()], blob)
    blob.seek(0)
    with pytest.raises(unpickle.UnsafeCheckpointError, match=r"<x> names posix\.system"):
        unpickle.torch_load(blob, what="<x>")
    assert not (tmp_path / "MARKER").exists()


def test_crafted_plain_pickle_is_refused(tmp_path):
    from megatron.integrity.dcp_metadata import DcpMetadataError, read_dcp_metadata

    marker = tmp_path / "MARKER"
    path = pb.dcp_metadata(tmp_path / ".metadata", marker)
    with unimported_bomb(), open(path, "rb") as f:
        with pytest.raises(unpickle.UnsafeCheckpointError, match="names tests"):
            unpickle.pickle_load(f, what=str(path))
    with unimported_bomb(), pytest.raises(DcpMetadataError) as e:
        read_dcp_metadata(tmp_path)
    assert isinstance(e.value.__cause__, unpickle.UnsafeCheckpointError) and not e.value.missing
    assert f"names {FIRE}" in str(e.value)
    assert pb.ran(marker) == []


def test_what_writers_store_loads_bitwise(tmp_path):
    """Tensors, parameters, OrderedDicts, dtypes, numpy RNG state, argparse args with enums and
    paths: what megatron-core's checkpoints hold."""
    import pathlib

    import numpy as np
    from megatron.core.transformer.enums import AttnBackend

    state = {
        "model": OrderedDict(w=torch.randn(3, 4), b=torch.arange(5, dtype=torch.bfloat16)),
        "p": torch.nn.Parameter(torch.ones(2)),
        "args": Namespace(
            params_dtype=torch.float32,
            attention_backend=AttnBackend.auto,
            save=pathlib.PosixPath("/x"),
            ranks={1, 2},
        ),  # fmt: skip
        "np_rng": np.random.RandomState(3).get_state(),
        "torch_rng": torch.get_rng_state(),
    }
    torch.save(state, tmp_path / "ok.pt")
    got = unpickle.torch_load(tmp_path / "ok.pt", map_location="cpu")
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert got["model"]["b"].dtype == torch.bfloat16 and isinstance(got["p"], torch.nn.Parameter)
    assert got["args"] == state["args"]
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(got["np_rng"], state["np_rng"]))  # fmt: skip
    assert torch.equal(got["torch_rng"], state["torch_rng"])
    head = unpickle.load_without_tensors(tmp_path / "ok.pt")
    assert head["model"]["w"] is None and head["args"] == state["args"]


def test_unrestricted_policy_loads_anything(tmp_path):
    """The escape hatch (``--unrestricted-unpickling``) restores plain unpickling."""
    blob = io.BytesIO()
    torch.save({"f": fractions_half()}, blob)
    blob.seek(0)
    with pytest.raises(unpickle.UnsafeCheckpointError, match="fractions.Fraction"):
        unpickle.torch_load(blob)
    blob.seek(0)
    unpickle.POLICY.unrestricted = True
    try:
        assert unpickle.torch_load(blob)["f"] == fractions_half()
    finally:
        unpickle.POLICY.unrestricted = False


def fractions_half():
    import fractions

    return fractions.Fraction(1, 2)


def test_the_allowlist_is_explicit_and_every_entry_names_its_writer():
    assert len(unpickle.ALLOWLIST) >= 40
    assert all(isinstance(w, str) and w for w in unpickle.ALLOWLIST.values())
    assert not any(unpickle.allowed(g) for g in ("builtins.eval", "builtins.getattr",
                                                 "posix.system", "os.system", "subprocess.Popen",
                                                 "torch.load", "builtins.exec"))  # fmt: skip
    assert unpickle.allowed("torch.float8_e4m3fn") and unpickle.allowed("torch.bfloat16")


def test_unsafe_error_travels_between_ranks_and_is_found_behind_dcp():
    """DCP gathers every rank's failure (pickled) into a ``CheckpointException``: the persistent
    tier finds the unsafe pickle behind it and falls back."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _wrap_exception

    from megatron.training_ext.persistent_tier.restricted import find_unsafe

    e = pickle.loads(pickle.dumps(unpickle.UnsafeCheckpointError("/c/.metadata", FIRE)))
    assert (e.path, e.global_name) == ("/c/.metadata", FIRE)
    try:
        raise e
    except unpickle.UnsafeCheckpointError as x:
        wrapped = pickle.loads(pickle.dumps(_wrap_exception(x)))
    gathered = CheckpointException("read", {1: wrapped})
    found = find_unsafe(gathered)
    assert found is not None and found.global_name == FIRE
    assert find_unsafe(CheckpointException("read", {0: _wrap_exception(ValueError("x"))})) is None


@pytest.mark.parametrize(
    "mode, refused", [(0o755, None), (0o777, "writable by others (mode 777)"),
                      (0o775, "writable by its group (mode 775)"), (0o1777, None)],
)  # fmt: skip
def test_local_directory_ownership(tmp_path, mode, refused):
    from megatron.training_ext.start_checks import check_local_ownership

    root = tmp_path / "local"
    (root / "0").mkdir(parents=True)
    (root / "0" / "iter_0000002_0_local.pt").write_bytes(b"x")
    os.chmod(root / "0", mode)
    args = Namespace(non_persistent_local_ckpt_dir=str(root), non_persistent_ckpt_type="local")
    if refused is None:
        check_local_ownership(args)
        return
    with pytest.raises(SystemExit) as e:
        check_local_ownership(args)
    msg = str(e.value.code)
    assert f"local checkpoint path {root / '0'} is {refused}" in msg, msg
    assert "chmod go-w" in msg and "--non-persistent-local-ckpt-dir" in msg
    assert "--accept-shared-local-ckpt-dir" in msg
    check_local_ownership(Namespace(**vars(args), accept_shared_local_ckpt_dir=True))


def test_a_file_writable_by_others_is_refused(tmp_path):
    from megatron.training_ext.start_checks import check_local_ownership

    (tmp_path / "0").mkdir()
    f = tmp_path / "0" / "iter_0000002_0_local.pt"
    f.write_bytes(b"x")
    os.chmod(f, 0o666)
    args = Namespace(non_persistent_local_ckpt_dir=str(tmp_path), non_persistent_ckpt_type="local")
    with pytest.raises(SystemExit, match="iter_0000002_0_local.pt is writable by others"):
        check_local_ownership(args)
