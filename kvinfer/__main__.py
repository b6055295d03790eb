"""`python -m kvinfer ...`: the same as the `kvinfer` command."""
from kvinfer.cli import run

run()
