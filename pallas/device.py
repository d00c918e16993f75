"""The target device and its tuning data: ``pallas/tuning/<device kind>/<stage>.json``.

A device kind's folder is its ``jax.Device.device_kind`` in lower case with spaces as dashes
(``NVIDIA H200`` -> ``nvidia-h200``). A schedule table maps a shape key to a kernel's schedule; the
``auto.json`` table says, per stage and key, whether the kernel measured faster than XLA there
(``benchmarks/auto_table.py`` makes it). Every lookup is made when a call is traced.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import jax


def device_kind() -> str:
    """Kind of the device being compiled for: the abstract mesh's (ahead-of-time lowering), or the
    default device's."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.device_kind
    return jax.devices()[0].device_kind


READ_CEILING_TBS = 4.65
"""HBM read rate, TB/s, that the floors and the engine's tiling model assume: the H200's measured
ceiling (docs/findings.md, ceilings behind the cost notes)."""

TABLES_OF = {"NVIDIA H100 80GB HBM3": "NVIDIA H200"}
"""Device kinds that take another kind's schedule tables where they have no entry of their own: the
H100 SXM has the H200's 132 SMs, 227 KiB of shared memory per block and 50 MB of L2 (only the HBM
differs), and on it the H200's tables beat or tie the heuristic's schedules at every shape measured
but one (docs/findings.md, borrowed tables). The H100's own tables come first. Where
``backend="auto"`` runs a kernel is each kind's own measurement (``measured_faster``)."""


def table_kinds() -> tuple[str, ...]:
    """The device kinds whose schedule tables the target device consults, in order: its own, then
    the kind it borrows from (``TABLES_OF``) for the keys its own tables lack."""
    kind = device_kind()
    return (kind, TABLES_OF[kind]) if kind in TABLES_OF else (kind,)


def core_count(default: int = 132) -> int:
    """Streaming multiprocessors of the target device (the abstract mesh's when lowering ahead of
    time), ``default`` where unknown."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    cores = getattr(abstract, "num_cores", None) if abstract is not None else None
    if not cores:
        cores = getattr(jax.devices()[0], "core_count", None)
    return cores or default


def kind_folder(kind: str) -> str:
    """The tuning folder of device kind ``kind``: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return "-".join(kind.lower().split())


@functools.cache
def tuning_entries(kind: str, table: str) -> dict[str, dict]:
    """The ``entries`` of ``pallas/tuning/<kind_folder(kind)>/<table>.json`` (installed as package
    data), or ``{}`` where that device kind has no such table."""
    folder = resources.files("moe_front_jax.pallas").joinpath("tuning", kind_folder(kind))
    path = folder.joinpath(f"{table}.json")
    if not path.is_file():
        return {}
    return json.loads(path.read_text())["entries"]


def measured_faster(stage: str, key: str) -> bool:
    """Whether the target device's own auto table (``auto.json``) has ``stage``'s kernel faster than
    the XLA reference at tuning-table key ``key``; False for a device, stage or key it does not
    list."""
    return tuning_entries(device_kind(), "auto").get(stage, {}).get(key, {}).get("kernel", False)
