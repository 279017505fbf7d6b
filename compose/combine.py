"""`python -m compose.combine`: the command of :mod:`compose.frontends.combine`."""

from compose.frontends.combine import *  # noqa: F403  (the front end's public names)
from compose.frontends.combine import main

if __name__ == "__main__":
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
