"""The one time limit the tests put on a child process or a wait: a guard against a hang, never a speed check.

It is long enough that no load makes a working test trip it (a test command must pass on a machine at a load
average of 20, where a child that takes 10 s on a quiet machine takes minutes). Set A2ATS_TEST_HANG_S to change it.
"""

import os

HANG_S = float(os.environ.get("A2ATS_TEST_HANG_S", "3600"))
