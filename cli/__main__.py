import sys

from ddiloco.cli import main

sys.exit(main())
