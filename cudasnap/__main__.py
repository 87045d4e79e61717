"""``python -m cudasnap ...`` is the ``cudasnap`` command."""
import sys

from .cli import main

sys.exit(main())
