"""``python -m corral.cli ...`` (what torchrun and the child services run)."""

from corral.cli import main

raise SystemExit(main())
