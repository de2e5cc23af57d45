"""Plug-ins that let other frameworks run their environments on corral (each imports
its framework lazily; install the framework to use it):

- :mod:`corral.integrations.harbor`: Harbor's ``BaseEnvironment`` (Terminal-Bench,
  SkyRL and others): ``harbor run --env corral.integrations.harbor:CorralEnvironment``.
"""
