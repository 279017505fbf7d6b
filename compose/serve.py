"""`python -m compose.serve`: the command of :mod:`compose.frontends.serve`."""

from compose.frontends.serve import *  # noqa: F403  (the front end's public names)
from compose.frontends.serve import main

if __name__ == "__main__":
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
