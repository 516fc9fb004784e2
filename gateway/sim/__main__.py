"""``python -m gateway.sim [flags]``: the same as ``kv-gateway sim``."""

from gateway.sim.cli import main

raise SystemExit(main())
