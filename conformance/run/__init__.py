"""Running the suite: the ``a2ats-conformance`` command, the supervisor of its child run, the per-example
watchdog, the pytest plugin and the port's xfails file."""
