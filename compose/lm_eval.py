"""`python -m compose.lm_eval`: the command of :mod:`compose.frontends.lm_eval`."""

from compose.frontends.lm_eval import *  # noqa: F403  (the front end's public names)
from compose.frontends.lm_eval import main

if __name__ == "__main__":
    raise SystemExit(main())
