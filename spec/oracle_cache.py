"""CACHE-*: the float64 model of the adapter cache protocol, ``OracleCache``, one import away.

It is defined in ``a2ats_spec.oracle`` with the clause functions it is built from; this module keeps the
name importable here too.
"""

from a2ats_spec.oracle import OracleCache

__all__ = ["OracleCache"]
