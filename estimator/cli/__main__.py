"""``python -m estimator.cli``: the ``batchfit`` command."""

import sys

from estimator.cli.main import main

sys.exit(main())
