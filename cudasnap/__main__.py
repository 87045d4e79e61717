"""``python -m cudasnap ...`` is the ``cudasnap`` command."""
import sys

from .tools.cli import main

sys.exit(main())
