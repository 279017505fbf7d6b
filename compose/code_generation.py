"""`python -m compose.code_generation`: the command of :mod:`compose.frontends.code_generation`."""

from compose.frontends.code_generation import *  # noqa: F403  (the front end's public names)
from compose.frontends.code_generation import main

if __name__ == "__main__":
    raise SystemExit(main())
