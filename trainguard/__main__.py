from trainguard.ops.cli import main

raise SystemExit(main())
