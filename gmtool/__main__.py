"""python -m gmtool: the same entry point as the gmtool command."""

from gmtool.cli.main import main

main()
