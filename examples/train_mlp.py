"""The demo's trainer, a next-token MLP with a ledger of every record it trained on.

Its code is :mod:`trainguard.ops.demo_trainer` (in the package, so that a wheel has
what ``trainguard demo`` runs); this script runs it from a checkout, as compose does::

    python examples/train_mlp.py --redis-url redis://127.0.0.1:6379/0 \\
        --dataset demo --run-name mlp --store file:///tmp/ckpt/mlp --records 4000
"""

from trainguard.ops.demo_trainer import main

if __name__ == "__main__":
    raise SystemExit(main())
