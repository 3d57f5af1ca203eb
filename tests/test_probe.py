"""`trainguard probe`: /metrics and /healthz over a fake-NVML monitor, the real daemon
as a subprocess, and --once exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.utils import floatToGoString

from tests._fake_nvml import FakeGpu, FakeNvml
from trainer_client.health import EXIT_GPU_CRITICAL, HealthMonitor, HealthProbe
from trainguard.ops.cli import main
from trainguard.ops.probe import ProbeServer, exit_code_for, format_table

REPO = Path(__file__).resolve().parent.parent


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode()


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu(uuid="GPU-a", temperature_c=60)


@pytest.fixture
def served(gpu: FakeGpu) -> Iterator[tuple[HealthMonitor, ProbeServer]]:
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])))
    server = ProbeServer(monitor, "127.0.0.1", 0).start()
    yield monitor, server
    server.stop()


def test_healthz_follows_the_latest_report(
    served: tuple[HealthMonitor, ProbeServer], gpu: FakeGpu
) -> None:
    """/healthz is 503 before any probe, 200 while OK or WARN, 503 with the reason
    while CRITICAL, and 200 again once a transient signal (temperature) recovers."""
    monitor, server = served
    assert fetch(server.url + "/healthz")[0] == 503
    monitor.probe_now()
    code, body = fetch(server.url + "/healthz")
    assert code == 200 and json.loads(body) == {"status": "OK", "no_gpu": False, "problems": []}
    gpu.temperature_c = 90
    monitor.probe_now()
    code, body = fetch(server.url + "/healthz")
    assert code == 200 and json.loads(body)["status"] == "WARN"
    gpu.temperature_c = 97
    monitor.probe_now()
    code, body = fetch(server.url + "/healthz")
    assert code == 503
    assert json.loads(body)["problems"] == [
        "CRITICAL: gpu 0: temperature 97 C >= CRITICAL threshold 95 C"]
    gpu.temperature_c = 60
    monitor.probe_now()
    assert fetch(server.url + "/healthz")[0] == 200
    assert fetch(server.url + "/nope")[0] == 404


def test_metrics_expose_every_reading_and_status(
    served: tuple[HealthMonitor, ProbeServer], gpu: FakeGpu
) -> None:
    """/metrics carries each GPU reading as a gauge with gpu/uuid labels, a status per
    signal, and the node status; an ECC error shows up as status 2 on both."""
    monitor, server = served
    gpu.ecc_uncorrected = 3
    monitor.probe_now()
    code, text = fetch(server.url + "/metrics")
    assert code == 200
    lines = set(text.splitlines())
    for line in [
        'trainguard_gpu_temperature_celsius{gpu="0",uuid="GPU-a"} 60.0',
        'trainguard_gpu_memory_total_bytes{gpu="0",uuid="GPU-a"} '
        + floatToGoString(80 * 2**30),
        'trainguard_gpu_ecc_uncorrected_volatile_errors{gpu="0",uuid="GPU-a"} 3.0',
        'trainguard_gpu_check_status{gpu="0",signal="ecc_uncorrected",uuid="GPU-a"} 2.0',
        'trainguard_gpu_check_status{gpu="0",signal="temperature",uuid="GPU-a"} 0.0',
        "trainguard_node_health_status 2.0",
        "trainguard_node_no_gpu 0.0",
        "trainguard_node_gpus 1.0",
    ]:
        assert line in lines, line


def test_once_table_and_exit_codes(gpu: FakeGpu) -> None:
    """The --once table lists every check; exit code is 0 for OK and WARN, 75 for
    CRITICAL, and 75 for WARN with --fail-on-warn."""
    probe = HealthProbe(nvml=FakeNvml([gpu]))
    ok = probe.probe()
    assert exit_code_for(ok) == 0
    table = format_table(ok)
    assert "temperature 60 C" in table and table.endswith("overall: OK")
    gpu.temperature_c = 90
    warn = probe.probe()
    assert exit_code_for(warn) == 0
    assert exit_code_for(warn, fail_on_warn=True) == EXIT_GPU_CRITICAL
    gpu.temperature_c = 99
    assert exit_code_for(probe.probe()) == EXIT_GPU_CRITICAL == 75


def test_cli_once_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """`trainguard probe --once --json` prints the real report as JSON (no GPU here:
    status OK, exit 0); requiring more GPUs than exist exits 75."""
    real = HealthProbe()
    try:
        expected = real.probe()
    finally:
        real.close()
    rc = main(["probe", "--once", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["no_gpu"] == expected.no_gpu
    if expected.no_gpu:
        assert rc == 0 and out["status"] == "OK"
    assert main(["probe", "--once", "--expected-gpus", "4096"]) == 75
    assert "CRITICAL" in capsys.readouterr().out


def test_daemon_serves_and_stops_on_sigterm() -> None:
    """The real daemon (subprocess, real NVML) serves /healthz and /metrics on the
    port it reports, and exits 0 on SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "probe", "--port", "0", "--interval-s", "0.2"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("trainguard probe: serving http://127.0.0.1:"), line
        base = line.split()[3].removesuffix("/metrics")
        code, body = fetch(base + "/healthz")
        status = json.loads(body)
        assert (code == 503) == (status["status"] == "CRITICAL")
        code, text = fetch(base + "/metrics")
        assert code == 200 and "trainguard_node_health_status" in text
        if status["no_gpu"]:
            assert code == 200 and "trainguard_node_no_gpu 1.0" in text.splitlines()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_service_reads_what_the_daemon_writes(
    served: tuple[HealthMonitor, ProbeServer], gpu: FakeGpu
) -> None:
    """The probe metrics are one contract (``trainguard.core.probe_metrics``): the
    service's reader turns the daemon's own /metrics into the monitor's report, node
    status, per-GPU status, the failing signal and every reading."""
    from ingest_service.service.gpu_health import summarize_metrics

    monitor, server = served
    gpu.ecc_uncorrected = 3
    report = monitor.probe_now()
    code, text = fetch(server.url + "/metrics")
    assert code == 200
    node = summarize_metrics(text)
    assert node["status"] == "CRITICAL" and node["no_gpu"] is False
    assert node["taken_at"] == report.taken_at
    [seen] = node["gpus"]
    assert seen["gpu"] == 0 and seen["status"] == "CRITICAL"
    assert seen["problems"] == ["ecc_uncorrected: CRITICAL"]
    readings = {k: v for check in report.gpus[0].checks for k, v in check.values.items()}
    assert seen["readings"] == readings
