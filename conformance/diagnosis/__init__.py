"""Why a port failed: the known deviations (``deviations.py``), each a variant of the float64 oracle; the
diagnosis that replays failing examples through them (``diagnose.py``); the search for revealing examples
(``reveal.py``); and the replay of a saved counterexample (``repro.py``)."""
