"""The ``corral`` command line (``corral.cli.main:main``); see :mod:`corral.cli.main`."""
