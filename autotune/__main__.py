"""`python -m autotune ...`: the command line without the installed `autotune` script."""
from autotune.console import main

main()
