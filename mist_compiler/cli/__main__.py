"""``python -m mist_compiler.cli COMMAND ...``: the same as ``mistc COMMAND ...`` (for torchrun's ``-m``)."""
import sys

from . import main

sys.exit(main())
