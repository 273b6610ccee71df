"""python -m tfelastic.daemon"""

import sys

from tfelastic.daemon.cli import main

sys.exit(main())
