"""python -m gmtool: the same entry point as the gmtool command."""

from gmtool.cli.entry import main

main()
