"""`python -m compose.code_eval`: the command of :mod:`compose.frontends.code_eval`."""

from compose.frontends.code_eval import *  # noqa: F403  (the front end's public names)
from compose.frontends.code_eval import main

if __name__ == "__main__":
    raise SystemExit(main())
