"""`python -m quire.router`: the router without going through `quire`'s own CLI."""

import sys

from quire.router.cli import main

if __name__ == "__main__":
    sys.exit(main())
