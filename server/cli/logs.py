"""The commands' logging, set up in one place: jaxserve's and the servers' records at
INFO, the libraries' beneath them (JAX, and absl, which orbax logs through) from
WARNING: their INFO is their own bookkeeping (a one-second `convert` printed 56 lines
of orbax's)."""

from __future__ import annotations

import logging

LIBRARIES = ("jax", "absl", "orbax")


def configure(level: int = logging.INFO, fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """Root at `level`, in `fmt`, replacing the handler absl's `app.run` installed (it
    printed every library's INFO in absl's format); the libraries at WARNING or above."""
    logging.basicConfig(level=level, format=fmt, force=True)
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
