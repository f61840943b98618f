"""Crafted checkpoint files whose pickle would run code: importing this module creates
``<marker>.imported`` and :func:`fire` creates ``<marker>`` (``$MEGATRON_TEST_PICKLE_MARKER``), so
a test proves that reading a checkpoint neither imported nor called what the file names.

:class:`Bomb` pickles as a call of :func:`fire`; :func:`torch_file` writes a ``torch.save`` file
holding one, :func:`dcp_metadata` a DCP ``.metadata`` (a plain pickle) holding one.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

MARKER_ENV = "MEGATRON_TEST_PICKLE_MARKER"


def _touch(path: str) -> None:
    Path(path).write_text("ran\n")


if os.environ.get(MARKER_ENV):
    _touch(os.environ[MARKER_ENV] + ".imported")


def fire(marker: str) -> None:
    """What a crafted file asks the unpickler to call: creates ``marker``."""
    _touch(marker)


class Bomb:
    """Unpickles as ``fire(marker)``."""

    def __init__(self, marker: str | os.PathLike) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (fire, (self.marker,))


def torch_file(path: str | os.PathLike, marker: str | os.PathLike) -> Path:
    """Write a ``torch.save`` file at ``path`` whose pickle calls :func:`fire` (``marker``)."""
    import torch

    torch.save({"args": None, "payload": Bomb(marker), "iteration": 12}, str(path))
    return Path(path)


def dcp_metadata(path: str | os.PathLike, marker: str | os.PathLike) -> Path:
    """Write a plain pickle at ``path`` (a DCP ``.metadata``) whose loading calls :func:`fire`."""
    Path(path).write_bytes(pickle.dumps(Bomb(marker), protocol=2))
    return Path(path)


def ran(marker: str | os.PathLike) -> list[str]:
    """Which of ``marker`` (called) and ``marker.imported`` (imported) exist."""
    return [p for p in (str(marker), f"{marker}.imported") if os.path.exists(p)]


def dcp_byte_object(checkpoint_dir: str | os.PathLike, key: str, marker: str | os.PathLike) -> Path:
    """Make the byte object ``key`` of a DCP checkpoint a crafted ``torch.save`` blob: appended to
    the data file that holds it, and ``.metadata`` (rewritten with plain pickle: the test's own
    trusted copy) pointed at it. Returns the data file."""
    import dataclasses
    import io

    import torch

    md_path = Path(checkpoint_dir) / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    blob = io.BytesIO()
    torch.save([Bomb(marker)], blob)
    data = Path(checkpoint_dir) / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    md_path.write_bytes(pickle.dumps(md))
    return data
