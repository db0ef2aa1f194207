"""``reconciler garm-provider``: GARM's external provider, backed by admission.

GARM runs the provider once per call, with no arguments, a bare environment (no PATH,
no HOME) and the ``GARM_*`` variables; stdin carries the bootstrap of a new runner.

Rules of this program:

- **stdout carries only the answer** (JSON, or the plain version string); every log line
  goes to stderr. Exit codes are GARM's: 0, 30 (not found), 31 (duplicate), 1.
- **Admission is the judge.** No instance is created before a decision admitted its
  lease, and every mutation is recorded on the bus (``mark-created``,
  ``mark-warm-injected``, ``mark-deleting``, ``release``).
- **Idempotent per runner name.** Every command's ``request_id`` and ``Nats-Msg-Id`` are
  derived from the runner name and its attempt number (:mod:`.attempts`), so a call
  killed midway and retried resumes the same attempt instead of admitting twice.
- **Secrets stay off the bus and out of logs**: the instance token, the CA bundle and the
  rendered bootstrap travel only to Incus (user data, pushed files).
- It imports the adapters below it (bus connection, Incus client) and the core; never
  another program (replica, bridge, executor) nor the command line.

Modules: :mod:`.program` (the executable: environment and stdin in, one command, the
answer out) over :mod:`.protocol` (GARM's external-provider protocol) and
:mod:`.errors` (its failures and exit codes); :mod:`.provider` (each GARM command) with
:mod:`.admission` (commands and queries on the bus) and :mod:`.attempts` (a runner's
deterministic identities); :mod:`.config` (the provider's TOML file), :mod:`.specs` (a
pool's extra specs) and :mod:`.schemas` (their JSON Schemas); :mod:`.bootstrap`
(cloud-init or a warm instance's files), :mod:`.install` (the runner's install script)
and :mod:`.gotemplate` (the Go templates those use).
"""
