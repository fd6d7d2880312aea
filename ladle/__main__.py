"""`python -m ladle ...` runs the same commands as the `ladle` console script."""

import sys

from ladle.cli import main

if __name__ == "__main__":
    sys.exit(main())
