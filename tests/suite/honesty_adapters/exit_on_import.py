"""An adapter module that ends the process with sys.exit(0) when imported."""
import sys

sys.exit(0)
