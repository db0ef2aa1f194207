"""The NATS JetStream adapter: connecting, the streams, reading inputs in order, decoding
them against the contract, and publishing outputs exactly once.

- :mod:`.connection`: connecting (credentials, TLS that never falls back to plaintext,
  reconnection, connection logs); :mod:`.tls_probe`: why a server hung up on a TLS
  connection (a refused client certificate whose alert was lost to a reset);
  :mod:`.violations`: the server's permission violations as typed errors.
- :mod:`.streams`: the IN and OUT streams and the leader bucket, created or reconciled.
- :mod:`.reader`: the one pull reader every stream reader of the project is built on;
  :mod:`.consumers`: every consumer it reads, configured in one place;
  :mod:`.input_consumer`: the replica's input consumer (in stream order, gap-free).
- :mod:`.schemas`: the contract's JSON Schemas, compiled; :mod:`.decoder`: subject and
  bytes to a typed input, or a dead letter with its reason.
- :mod:`.publisher`: outputs to the OUT stream, pipelined and confirmed;
  :mod:`.sending`: one input to the IN stream, sized and retried; :mod:`.wire`: many
  publishes as one write; :mod:`.direct`: deliveries handed to a plain function.
- :mod:`.nats_internals`: every nats-py internal the project relies on, and what happens
  on a nats-py without it; no other module names one.
- :mod:`.asyncapi`: the AsyncAPI document of the bus, generated from the schemas;
  :mod:`.embedded`: a local nats-server for the demo and the benchmarks.

Layer rules: of the project it imports :mod:`reconciler.core` only (never the store,
Incus, a program or the command line); what it publishes carries the fold's bytes and
ids unchanged.
"""
