"""``python -m reconciler.garm``: the provider, as ``reconciler-garm-provider``."""

from reconciler.garm.program import main

main()
