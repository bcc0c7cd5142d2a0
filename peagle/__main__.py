"""`python -m peagle ...` runs the CLI."""

from peagle.cli import main

main()
