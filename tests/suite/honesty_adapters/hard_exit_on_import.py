"""An adapter module that ends the process with os._exit(0) when imported (no cleanup, no exception)."""
import os

os._exit(0)
