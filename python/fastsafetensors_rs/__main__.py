"""`python -m fastsafetensors_rs`: see `fastsafetensors_rs.cli`."""

from .cli import main

raise SystemExit(main())
