import sys

from fastml.cli import main

sys.exit(main())
