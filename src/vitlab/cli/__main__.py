"""`python -m vitlab.cli COMMAND ...` (as torchrun runs it): the same as the ``vitlab`` command."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
