"""`python -m compose.generate`: the command of :mod:`compose.frontends.generate`."""

from compose.frontends.generate import *  # noqa: F403  (the front end's public names)
from compose.frontends.generate import main

if __name__ == "__main__":
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
