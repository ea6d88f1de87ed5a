"""The `multiengine` command for the recipes shipped in this package (engines/recipe_cli.py is the command
itself; it runs any package of recipes given with --recipes-package)."""

import sys

from multiengine.engines.recipe_cli import main

if __name__ == "__main__":
    sys.exit(main())
