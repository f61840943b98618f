"""The upstream releases this overlay was written against and every upstream it is proven on:
the one place that names versions (``pyproject.toml`` installs :data:`RELEASES`; a unit test keeps
the two equal).

A fix outside its proven versions still decides by its behavioural probe (``docs/overlay.md``):
the versions only decide what happens when a probe cannot tell. To add an upstream, run the unit
lane and ``python -m megatron.fixes`` on it (``scripts/setup_upstream_main.sh`` shows how for
megatron-core main), then add it to :data:`PROVEN` with what it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["NARROWED", "PROVEN", "RELEASES", "Proven", "is_proven", "narrowed", "proven_specifier"]

#: distribution -> the release the fixes were written against (``pyproject.toml`` pins these).
RELEASES: dict[str, str] = {
    "megatron-core": "0.19.2",
    "nvidia-resiliency-ext": "0.7.0",
    "nvidia-modelopt": "0.47.0",
    "megatron-fsdp": "0.6.1",
}


@dataclass(frozen=True)
class Proven:
    """One upstream version the unit lane and the fixes' probes were run on.

    Attributes:
        version: the distribution's metadata version.
        what: where it came from (a release, or a development snapshot and its commit).
    """

    version: str
    what: str


#: distribution -> the upstream versions the fork is proven on (the release first).
PROVEN: dict[str, tuple[Proven, ...]] = {
    "megatron-core": (
        Proven("0.19.2", "release (PyPI)"),
        Proven(
            "0.20.0",
            "NVIDIA/Megatron-LM main at d98e8a6 (2026-08-22), a development snapshot whose "
            "metadata says 0.20.0; the compatibility lane of scripts/test.sh",
        ),
    ),
    "nvidia-resiliency-ext": (Proven("0.7.0", "release (PyPI)"),),
    "nvidia-modelopt": (Proven("0.47.0", "release (PyPI)"),),
    "megatron-fsdp": (Proven("0.6.1", "release (PyPI)"),),
}


#: fix name -> (the proven versions of its package narrowed for it, why). A part of a group
#: (``fsdp_dtensor.layout``) takes its group's entry.
NARROWED: dict[str, tuple[str, str]] = {
    "fsdp_dtensor": (
        "==0.19.2",
        "its functional tests (fused MLA + MTP under Megatron-FSDP) cannot run on upstream main, "
        "where MTP without Transformer Engine fails to build (Megatron-LM PR 5748); its probes "
        "and unit tests do run there, and an MLA-only fp32 round trip is bitwise",
    ),
}


def narrowed(fix_name: str) -> str | None:
    """The specifier :data:`NARROWED` gives ``fix_name`` (or its group), else ``None``."""
    for name in (fix_name, fix_name.split(".", 1)[0]):
        if name in NARROWED:
            return NARROWED[name][0]
    return None


def proven_specifier(package: str) -> str:
    """The proven versions of ``package`` as a specifier string (``==0.19.2 || ==0.20.0`` is not a
    PEP 440 specifier, so: the versions joined by ``, `` as ``==a`` alternatives, for messages).

    Raises:
        KeyError: ``package`` is not one of the overlay's upstreams.
    """
    return " or ".join(f"=={p.version}" for p in PROVEN[package])


def is_proven(package: str, version: str, only: str | None = None) -> bool:
    """True if ``version`` of ``package`` is one the fork is proven on (``only``: a specifier a fix
    narrows its proven versions to, e.g. ``"==0.19.2"``).

    Raises:
        KeyError: ``package`` is not one of the overlay's upstreams.
    """
    v = Version(version)
    versions = [Version(p.version) for p in PROVEN[package]]
    if only is not None:
        versions = [x for x in versions if x in SpecifierSet(only)]
    return v in versions
