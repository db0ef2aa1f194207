"""``python -m reconciler.cli``: the ``reconciler`` console script."""

from reconciler.cli.entry import main

main()
