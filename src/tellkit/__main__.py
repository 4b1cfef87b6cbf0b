import sys

from tellkit.cli import main

sys.exit(main())
