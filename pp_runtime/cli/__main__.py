"""`python -m pp_runtime.cli`: the `pp-runtime` command."""
import sys

from pp_runtime.cli.main import main

sys.exit(main())
