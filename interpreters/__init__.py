"""Interpreters carry the core's effects out; the service facade drives one.

``simulator``: in memory, virtual clock, faults. ``service``: the scheduler
port. ``replay``: real traces through the facade. ``cli``: the ``kvstate`` command.
"""
