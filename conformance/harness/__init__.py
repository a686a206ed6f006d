"""What every property stands on: the adapter protocol and capabilities, the one tolerance table, the
Hypothesis strategies, the pytest helpers and messages, and the settings a suite process pins."""
