"""The command line: ``reconciler`` and its commands (docs/cli.md).

- :mod:`.entry`: the console script, deciding what may be left unimported before the
  command line loads; :mod:`.main`: the command group; :mod:`.commands`: one module per
  command.
- :mod:`.options`: every option more than one command takes (each also an ``RC_…``
  environment variable), with defaults read from the programs' configurations.
- :mod:`.progress`: a progress line for long one-shot work, on a terminal only.
- :mod:`.oneshot`: what the commands that talk to NATS once share (a bounded connection,
  clear errors, inputs checked before they are sent); :mod:`.logs`: logging;
  :mod:`.signals`: running a daemon until SIGTERM or SIGINT.
- :mod:`.config_file`: config files as ``apply`` and ``diff`` read them (and ``get``
  prints them), checked and sized as one change; :mod:`.host_command`: what
  ``cordon``, ``uncordon`` and ``drain`` share.

Layer rules: the top of the package; it may import everything below it, and nothing
imports it.
"""
