"""What a health probe reports: a status per signal per GPU, and the thresholds that
judge each reading (see :mod:`trainer_client.health` for the signal table)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CLOCKS_HW_POWER_BRAKE",
    "CLOCKS_HW_SLOWDOWN",
    "CLOCKS_HW_THERMAL",
    "CLOCKS_SW_THERMAL",
    "CLOCK_BIT_NAMES",
    "DEFAULT_CRITICAL_XIDS",
    "Check",
    "GpuReport",
    "HealthReport",
    "HealthThresholds",
    "Status",
]

# Clocks-event (throttle) reason bits, identical under the old and new NVML names.
CLOCKS_HW_SLOWDOWN = 0x08
CLOCKS_SW_THERMAL = 0x20
CLOCKS_HW_THERMAL = 0x40
CLOCKS_HW_POWER_BRAKE = 0x80
CLOCK_BIT_NAMES = {
    0x01: "gpu_idle", 0x02: "applications_clocks_setting", 0x04: "sw_power_cap",
    CLOCKS_HW_SLOWDOWN: "hw_slowdown", 0x10: "sync_boost", CLOCKS_SW_THERMAL: "sw_thermal",
    CLOCKS_HW_THERMAL: "hw_thermal", CLOCKS_HW_POWER_BRAKE: "hw_power_brake",
    0x100: "display_clock_setting",
}

DEFAULT_CRITICAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
"""XIDs that mean broken hardware (double-bit ECC, row remap failure, NVLink error,
fallen off the bus, GSP errors, ...). Other XIDs, often caused by the application
(13, 31, 43, 45), are WARN."""


class Status(enum.IntEnum):
    OK = 0
    WARN = 1
    CRITICAL = 2


@dataclass(frozen=True)
class HealthThresholds:
    memory_warn_fraction: float | None = 0.99
    memory_critical_fraction: float | None = None
    temperature_warn_c: float | None = 85.0
    temperature_critical_c: float | None = 95.0
    clocks_warn_mask: int = (
        CLOCKS_HW_SLOWDOWN | CLOCKS_SW_THERMAL | CLOCKS_HW_THERMAL | CLOCKS_HW_POWER_BRAKE
    )
    clocks_critical_mask: int = 0
    ecc_uncorrected_warn: int | None = None
    ecc_uncorrected_critical: int | None = 1
    remapped_rows_pending: Status = Status.WARN
    remapped_rows_failed: Status = Status.CRITICAL
    pcie_replay_warn_per_probe: int | None = 100
    pcie_replay_critical_per_probe: int | None = None
    critical_xids: frozenset[int] = DEFAULT_CRITICAL_XIDS
    expected_gpus: int | None = None
    """If set, fewer visible GPUs (or none) is CRITICAL instead of "no GPU"."""


@dataclass(frozen=True)
class Check:
    signal: str
    status: Status
    reason: str
    values: Mapping[str, float] = field(default_factory=dict)
    """Raw readings with units in the key, e.g. ``{"temperature_celsius": 71.0}``."""


@dataclass(frozen=True)
class GpuReport:
    index: int
    name: str
    uuid: str
    checks: tuple[Check, ...]
    skipped: tuple[str, ...] = ()

    @property
    def status(self) -> Status:
        return max((c.status for c in self.checks), default=Status.OK)


@dataclass(frozen=True)
class HealthReport:
    gpus: tuple[GpuReport, ...]
    no_gpu: bool = False
    checks: tuple[Check, ...] = ()
    """Node-level checks (NVML init, GPU count)."""
    taken_at: float = 0.0
    """time.time() of the probe."""

    @property
    def status(self) -> Status:
        return max(
            [c.status for c in self.checks] + [g.status for g in self.gpus], default=Status.OK
        )

    def problems(self) -> list[str]:
        """Every WARN/CRITICAL reason, prefixed with its GPU."""
        out = [f"{c.status.name}: {c.reason}" for c in self.checks if c.status]
        for g in self.gpus:
            out += [f"{c.status.name}: gpu {g.index}: {c.reason}" for c in g.checks if c.status]
        return out

    def to_dict(self) -> dict[str, Any]:
        def check(c: Check) -> dict[str, Any]:
            return {"signal": c.signal, "status": c.status.name, "reason": c.reason,
                    "values": dict(c.values)}

        return {
            "status": self.status.name,
            "no_gpu": self.no_gpu,
            "taken_at": self.taken_at,
            "checks": [check(c) for c in self.checks],
            "gpus": [
                {"index": g.index, "name": g.name, "uuid": g.uuid, "status": g.status.name,
                 "checks": [check(c) for c in g.checks], "skipped": list(g.skipped)}
                for g in self.gpus
            ],
        }

