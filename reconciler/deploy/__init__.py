"""What a secured deployment is made of, generated: its credentials, the NATS accounts
that give each component exactly the permissions it uses, and the Incus fleet file.

``reconciler credentials`` (:mod:`reconciler.cli.commands.credentials`) drives it. Rules:

- **Named fleet.** A deployment is a prefix, NATS nodes, replicas and Incus hosts, each
  by name (:class:`~reconciler.deploy.fleet.Fleet`), recorded in the output directory
  (``deployment.json``); names given on a later run are *added* to it, never dropped.
- **Idempotent.** A key, seed or certificate that exists is kept: a run makes only what
  is missing and rewrites the generated configuration (``accounts.conf``,
  ``fleet.json``) from the fleet. Only an explicit rotation replaces a component's
  secrets, keeping the previous NKey accepted until it is retired.
- **Least privilege from names.** Every subject, stream and consumer name in the
  accounts comes from the module that uses it (:class:`~reconciler.bus.streams.StreamNames`,
  the executor's consumer name, the snapshot bucket's name), so the permissions follow
  the code.
- **Private by default.** The directory is ``0700``; private keys and seeds are written
  ``0600`` from the start (never widened, then narrowed); nothing secret is ever printed.
- Offline: ``cryptography`` for the certificates, ``nkeys`` for the seeds.

Modules: :mod:`.fleet` (the deployment's named parts), :mod:`.pki` (its certificate
authority and certificates), :mod:`.accounts` (the NATS accounts file) and
:mod:`.credentials` (the directory made or completed in place).
"""
