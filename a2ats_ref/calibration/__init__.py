"""Offline calibration (EQ-10, EQ-15..18 on a real model): corpus, collection of queries and keys, and the
``a2ats-calibrate`` command."""
