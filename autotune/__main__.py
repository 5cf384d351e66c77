"""`python -m autotune ...`: the command line without the installed `autotune` script."""
from autotune.cli import main

main(prog_name="autotune")
