"""`python -m fastsafetensors`: see `fastsafetensors.cli`."""

from .cli import main

raise SystemExit(main())
