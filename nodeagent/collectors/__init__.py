"""Collectors: one hardware signal each, behind :class:`base.Collector`. They are
registered in one place, :mod:`nodeagent.registry`."""
