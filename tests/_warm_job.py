"""Test helper: the ledger job (tests/_client_train.py) started through
``trainguard.elastic.warm``, saying first how it was started.

Prints ``<rank>: WARM <torch imported before this line: 0|1> PID <pid> PPID <parent>``
before anything else is imported, then runs the ledger job on its arguments.
"""

from __future__ import annotations

import os
import sys

print(f"{os.environ.get('RANK', '0')}: WARM {int('torch' in sys.modules)} PID {os.getpid()} "
      f"PPID {os.getppid()}", flush=True)

from tests._client_train import main  # noqa: E402  (after the line: what was imported)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
