"""Subprocess helper for test_health: a "training process" whose GPU turns CRITICAL.

Usage: python tests/_health_worker.py hung|loop
- hung: the main thread never checks (stuck in a collective): exit_if_not_handled
  must end the process with code 75 after its grace period.
- loop: the main thread calls monitor.check() between steps, catches
  GpuCriticalError, "checkpoints" (prints) and exits with the error's exit_code.
"""

from __future__ import annotations

import sys
import time

from tests._fake_nvml import FakeGpu, FakeNvml
from trainer_client.errors import GpuCriticalError
from trainer_client.health import HealthMonitor, HealthProbe, exit_if_not_handled


def main(mode: str) -> int:
    gpu = FakeGpu()
    grace_s = 0.2 if mode == "hung" else 60.0
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])), interval_s=0.01,
                            on_critical=exit_if_not_handled(grace_s)).start()
    for step in range(100_000):
        if step == 3:
            gpu.ecc_uncorrected = 1
        if mode == "hung":
            time.sleep(0.01)
            continue
        try:
            monitor.check()
        except GpuCriticalError as exc:
            print(f"checkpoint at step {step}", flush=True)
            return exc.exit_code
        time.sleep(0.01)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
