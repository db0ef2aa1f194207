"""The commands of ``reconciler``, one module each, named after the command
(:mod:`reconciler.cli.main` loads each when it is needed).

- The programs: :mod:`.run` (a replica), :mod:`.bridge`, :mod:`.executor`,
  :mod:`.garm_provider`, :mod:`.sim_incus` (a simulated Incus fleet).
- Setting up: :mod:`.provision` (streams, bucket and consumers, as an admin),
  :mod:`.credentials` (the deployment's certificates and NATS accounts).
- Talking to the replicas: :mod:`.cmd` (one command and its decisions), :mod:`.query`,
  :mod:`.apply` (configuration from a file, whole or not at all), :mod:`.get`,
  :mod:`.diff` and :mod:`.delete` (the config in force, compared, deleted);
  :mod:`.cordon`, :mod:`.uncordon` and :mod:`.drain` (hosts out of service and back).
- Looking back: :mod:`.replay`, :mod:`.audit` (a lease's timeline), :mod:`.status`
  (hosts and pools from a store), :mod:`.web` (a read-only page of the fleet, from the
  replicas' queries), and :mod:`.demo`.

Rules: a command module turns its options into a program's configuration and runs it;
the shared options are :mod:`reconciler.cli.options`'s, and every refusal is a
:class:`click.ClickException` (one sentence, exit status 1) or a usage error (2).
"""
