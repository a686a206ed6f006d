"""RET-DECODE's fast paths: ``dispatch`` picks one; ``portable`` (host, in-graph, sort-free) runs on every
device; ``cuda`` holds the CUDA kernels and ``selfcheck`` gates them against the portable parts."""
