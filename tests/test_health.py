"""GPU health probes: every signal, both throttle API names, NotSupported, GpuIsLost,
fail-closed errors, no GPU, and the background monitor (fake NVML where no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from tests._fake_nvml import FakeGpu, FakeNvml
from trainer_client.errors import GpuCriticalError, TrainerClientError
from trainer_client.health import (
    EXIT_GPU_CRITICAL,
    GpuReport,
    HealthMonitor,
    HealthProbe,
    HealthReport,
    HealthThresholds,
    Status,
)

REPO = Path(__file__).resolve().parent.parent
ALL_SIGNALS = ["memory", "temperature", "clocks_event_reasons", "ecc_uncorrected",
               "remapped_rows", "pcie_replay", "pcie_throughput", "xid"]


def by_signal(gpu: GpuReport) -> dict[str, tuple[Status, str]]:
    return {c.signal: (c.status, c.reason) for c in gpu.checks}


def test_healthy_gpu_reports_every_signal_ok() -> None:
    """A healthy GPU yields one OK check per signal, none skipped, with raw values in
    their units (bytes, deg C, bytes/s)."""
    nvml = FakeNvml([FakeGpu(memory_used=2**30, temperature_c=55)])
    report = HealthProbe(nvml=nvml).probe()
    assert report.status is Status.OK and not report.no_gpu
    (gpu,) = report.gpus
    assert [c.signal for c in gpu.checks] == ALL_SIGNALS and gpu.skipped == ()
    assert all(c.status is Status.OK for c in gpu.checks)
    values = {k: v for c in gpu.checks for k, v in c.values.items()}
    assert values["memory_used_bytes"] == 2**30
    assert values["memory_total_bytes"] == 80 * 2**30
    assert values["temperature_celsius"] == 55
    assert values["pcie_tx_bytes_per_second"] == 1000 * 1024
    assert values["pcie_rx_bytes_per_second"] == 2000 * 1024
    assert nvml.registered == {0}
    json.dumps(report.to_dict())


CASES: list[tuple[str, Callable[[FakeGpu], None], str, Status, str]] = [
    ("memory full", lambda g: setattr(g, "memory_used", int(g.memory_total * 0.995)),
     "memory", Status.WARN, "(99.5%)"),
    ("warm", lambda g: setattr(g, "temperature_c", 86),
     "temperature", Status.WARN, "temperature 86 C >= WARN threshold 85 C"),
    ("hot", lambda g: setattr(g, "temperature_c", 95),
     "temperature", Status.CRITICAL, "temperature 95 C >= CRITICAL threshold 95 C"),
    ("hw slowdown", lambda g: setattr(g, "clocks_reasons", 0x08 | 0x04),
     "clocks_event_reasons", Status.WARN, "0xc: sw_power_cap, hw_slowdown"),
    ("idle and power cap are normal", lambda g: setattr(g, "clocks_reasons", 0x01 | 0x04),
     "clocks_event_reasons", Status.OK, "0x5: gpu_idle, sw_power_cap"),
    ("ecc", lambda g: setattr(g, "ecc_uncorrected", 1),
     "ecc_uncorrected", Status.CRITICAL, "1 volatile uncorrected ECC errors"),
    ("remap pending", lambda g: setattr(g, "remapped", (2, 1, 1, 0)),
     "remapped_rows", Status.WARN, "remapping pending (reset the GPU)"),
    ("remap failed", lambda g: setattr(g, "remapped", (2, 1, 0, 1)),
     "remapped_rows", Status.CRITICAL, "remapping failed (replace the GPU)"),
]


@pytest.mark.parametrize(("mutate", "signal", "status", "reason"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_signal_is_judged(
    mutate: Callable[[FakeGpu], None], signal: str, status: Status, reason: str
) -> None:
    """Each signal alone moves its own check (and the GPU's status) to the expected
    level, with a reason that says what was read; every other check stays OK."""
    gpu = FakeGpu()
    mutate(gpu)
    report = HealthProbe(nvml=FakeNvml([gpu])).probe()
    checks = by_signal(report.gpus[0])
    assert checks[signal][0] is status
    assert reason in checks[signal][1]
    assert all(s is Status.OK for name, (s, _) in checks.items() if name != signal)
    assert report.status is status


def test_pcie_replay_judges_the_increase_per_probe() -> None:
    """The replay counter is cumulative: a high but steady count is OK; +150 between
    two probes is WARN (threshold 100), +99 is OK."""
    gpu = FakeGpu(pcie_replay=5000)
    probe = HealthProbe(nvml=FakeNvml([gpu]))
    assert by_signal(probe.probe().gpus[0])["pcie_replay"][0] is Status.OK
    gpu.pcie_replay += 150
    status, reason = by_signal(probe.probe().gpus[0])["pcie_replay"]
    assert status is Status.WARN and reason == "PCIe replay counter 5150 (+150 since the last probe)"
    gpu.pcie_replay += 99
    assert by_signal(probe.probe().gpus[0])["pcie_replay"][0] is Status.OK


def test_xid_events_are_judged_and_sticky() -> None:
    """An application XID (13) is WARN; a hardware XID (79, fallen off the bus) is
    CRITICAL and stays CRITICAL on later probes without new events; events land on
    the GPU that raised them."""
    nvml = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")])
    probe = HealthProbe(nvml=nvml)
    probe.probe()
    nvml.emit_xid(1, 13)
    report = probe.probe()
    assert by_signal(report.gpus[0])["xid"] == (Status.OK, "no XID events")
    assert by_signal(report.gpus[1])["xid"] == (Status.WARN, "XID events [13]")
    nvml.emit_xid(1, 79)
    assert by_signal(probe.probe().gpus[1])["xid"][0] is Status.CRITICAL
    again = probe.probe()
    assert by_signal(again.gpus[1])["xid"] == (Status.CRITICAL,
                                               "XID events [13, 79], hardware XIDs [79]")
    assert again.status is Status.CRITICAL and again.gpus[0].status is Status.OK


@pytest.mark.parametrize("api", ["new", "old", "new-missing-in-driver"])
def test_both_throttle_api_names(api: str) -> None:
    """Clocks-event reasons are read through the new name when the bindings have it,
    through the old name otherwise or when the driver lacks the new function; the
    verdict is the same."""
    gpu = FakeGpu(clocks_reasons=0x40)
    if api == "new":
        nvml = FakeNvml([gpu])
    elif api == "old":
        nvml = FakeNvml([gpu], new_clock_api=False)
    else:
        nvml = FakeNvml([gpu])
        gpu.errors["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.NVMLError_FunctionNotFound()
    status, reason = by_signal(HealthProbe(nvml=nvml).probe().gpus[0])["clocks_event_reasons"]
    assert (status, reason) == (Status.WARN, "clocks event reasons 0x40: hw_thermal")
    used = [c for c in nvml.calls if "Clocks" in c]
    expected = {
        "new": ["nvmlDeviceGetCurrentClocksEventReasons"],
        "old": ["nvmlDeviceGetCurrentClocksThrottleReasons"],
        "new-missing-in-driver": ["nvmlDeviceGetCurrentClocksEventReasons",
                                  "nvmlDeviceGetCurrentClocksThrottleReasons"],
    }[api]
    assert used == expected


def test_not_supported_signals_are_skipped_not_errors() -> None:
    """NotSupported (consumer GPUs without ECC, remapping, replay counters, XID
    events) and bindings without any throttle API skip those signals; the GPU is OK."""
    ns = pynvml.NVMLError_NotSupported
    gpu = FakeGpu(errors={
        "nvmlDeviceGetTotalEccErrors": ns(), "nvmlDeviceGetRemappedRows": ns(),
        "nvmlDeviceGetPcieReplayCounter": ns(), "nvmlDeviceRegisterEvents": ns(),
    })
    nvml = FakeNvml([gpu], new_clock_api=False, old_clock_api=False)
    report = HealthProbe(nvml=nvml).probe()
    (g,) = report.gpus
    assert set(g.skipped) == {"ecc_uncorrected", "remapped_rows", "pcie_replay", "xid",
                              "clocks_event_reasons"}
    assert [c.signal for c in g.checks] == ["memory", "temperature", "pcie_throughput"]
    assert report.status is Status.OK


def test_gpu_is_lost_is_critical() -> None:
    """GpuIsLost while reading a signal makes the GPU CRITICAL with a reason that
    says so, and the probe stops reading that GPU; the other GPU is still judged."""
    lost = FakeGpu(uuid="GPU-lost", errors={"nvmlDeviceGetTemperature": pynvml.NVMLError_GpuIsLost()})
    nvml = FakeNvml([lost, FakeGpu(uuid="GPU-ok")])
    report = HealthProbe(nvml=nvml).probe()
    assert report.status is Status.CRITICAL
    assert by_signal(report.gpus[0])["temperature"] == (
        Status.CRITICAL, "GPU is lost (fell off the bus or hung): the node needs a reset")
    assert [c.signal for c in report.gpus[0].checks] == ["memory", "temperature"]
    assert report.gpus[1].status is Status.OK
    assert "gpu 0: GPU is lost" in report.problems()[0]


def test_other_nvml_errors_fail_closed() -> None:
    """Any other NVML error on a present GPU (here Unknown on the ECC counter, and on
    the device handle of a second GPU) is CRITICAL, never silently OK."""
    bad = FakeGpu(uuid="GPU-x", errors={"nvmlDeviceGetTotalEccErrors": pynvml.NVMLError_Unknown()})
    gone = FakeGpu(uuid="GPU-y", errors={"nvmlDeviceGetHandleByIndex": pynvml.NVMLError_Unknown()})
    report = HealthProbe(nvml=FakeNvml([bad, gone])).probe()
    status, reason = by_signal(report.gpus[0])["ecc_uncorrected"]
    assert status is Status.CRITICAL
    assert reason == "NVML error reading ecc_uncorrected: NVMLError_Unknown: Unknown Error"
    assert by_signal(report.gpus[1])["device"][0] is Status.CRITICAL
    assert report.status is Status.CRITICAL


@pytest.mark.parametrize("error", [pynvml.NVMLError_LibraryNotFound,
                                   pynvml.NVMLError_DriverNotLoaded, None])
def test_no_gpu_is_reported_not_an_error(error: type[Exception] | None) -> None:
    """No NVML library, no driver, or zero devices: no_gpu=True with status OK; with
    expected_gpus=1 the same node is CRITICAL."""
    def nvml() -> FakeNvml:
        return FakeNvml([] if error is None else [FakeGpu()],
                        init_error=error() if error else None)

    report = HealthProbe(nvml=nvml()).probe()
    assert report.no_gpu and report.gpus == () and report.status is Status.OK
    strict = HealthProbe(HealthThresholds(expected_gpus=1), nvml=nvml()).probe()
    assert strict.no_gpu and strict.status is Status.CRITICAL
    assert strict.checks[0].reason.startswith("expected 1 GPUs, found none")


def test_fewer_gpus_than_expected_is_critical() -> None:
    """expected_gpus=8 with 2 visible GPUs: a CRITICAL node check."""
    nvml = FakeNvml([FakeGpu(uuid="a"), FakeGpu(uuid="b")])
    report = HealthProbe(HealthThresholds(expected_gpus=8), nvml=nvml).probe()
    assert report.checks[0].reason == "2 GPUs visible, expected 8"
    assert report.status is Status.CRITICAL


def test_real_nvml_on_this_machine() -> None:
    """The real pynvml: without a GPU this is the no-GPU report (status OK); with
    GPUs every GPU yields checks and the report serializes."""
    with HealthProbe() as probe:
        report = probe.probe()
    if report.no_gpu:
        assert report.status is Status.OK and report.gpus == ()
    else:
        assert report.gpus and all(g.checks for g in report.gpus)
    json.dumps(report.to_dict())


def test_close_frees_the_event_set_and_shuts_nvml_down() -> None:
    """close() frees the XID event set and shuts NVML down exactly once."""
    nvml = FakeNvml()
    probe = HealthProbe(nvml=nvml)
    probe.probe()
    probe.close()
    probe.close()
    assert nvml.shutdowns == 1 and nvml.calls.count("nvmlEventSetFree") == 1


def test_monitor_calls_back_once_and_check_raises() -> None:
    """The background monitor calls on_critical exactly once when the GPU turns
    CRITICAL (an uncorrected ECC error); check() then raises GpuCriticalError with
    exit code 75."""
    gpu = FakeGpu()
    seen: list[HealthReport] = []
    fired = threading.Event()
    reports = threading.Semaphore(0)

    def on_critical(report: HealthReport) -> None:
        seen.append(report)
        fired.set()

    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])), interval_s=0.01,
                            on_critical=on_critical, on_report=lambda r: reports.release())
    with monitor:
        assert reports.acquire(timeout=30)
        monitor.check()  # healthy so far: no error
        gpu.ecc_uncorrected = 2
        assert fired.wait(30)
        for _ in range(3):  # later CRITICAL probes do not call back again
            assert reports.acquire(timeout=30)
    assert len(seen) == 1 and seen[0].status is Status.CRITICAL
    assert EXIT_GPU_CRITICAL == 75
    with pytest.raises(GpuCriticalError, match="2 volatile uncorrected ECC errors") as info:
        monitor.check()
    assert info.value.exit_code == 75 and info.value.report is seen[0]
    assert isinstance(info.value, TrainerClientError)


def test_monitor_fails_closed_when_the_probe_crashes() -> None:
    """A probe that raises something unexpected is a CRITICAL report, not a dead
    monitor thread."""
    gpu = FakeGpu(errors={"nvmlDeviceGetMemoryInfo": RuntimeError("driver bug")})
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])))
    report = monitor.probe_now()
    assert report.status is Status.CRITICAL
    assert report.checks[0].reason == "health probe crashed: RuntimeError: driver bug"
    assert monitor.critical is report


def run_worker(mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "tests" / "_health_worker.py"), mode],
                          env=env, capture_output=True, text=True, timeout=120)


def test_training_loop_checkpoints_and_exits_75() -> None:
    """A loop that calls monitor.check() between steps gets GpuCriticalError after the
    GPU turns CRITICAL, checkpoints on its own thread, and exits with code 75."""
    proc = run_worker("loop")
    assert proc.returncode == EXIT_GPU_CRITICAL, proc.stderr
    assert proc.stdout.startswith("checkpoint at step ")


def test_hung_process_is_ended_with_75() -> None:
    """A process whose main thread never checks (hung collective) is still ended with
    exit code 75 by exit_if_not_handled after its grace period."""
    proc = run_worker("hung")
    assert proc.returncode == EXIT_GPU_CRITICAL, proc.stderr
    assert proc.stdout == ""


def test_broken_callback_does_not_stop_the_monitor() -> None:
    """An on_report callback that raises is logged; the report is still recorded and
    returned, and on_critical still fires."""
    fired: list[HealthReport] = []

    def broken(report: HealthReport) -> None:
        raise ValueError("dashboard down")

    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([FakeGpu(ecc_uncorrected=1)])),
                            on_report=broken, on_critical=fired.append)
    report = monitor.probe_now()
    assert monitor.latest is report and fired == [report]
