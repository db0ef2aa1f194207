"""The NATS accounts file of a deployment: one account with JetStream, one NKey user per
component, each allowed exactly the subjects it uses (docs/operations.md, "Permissions").

Rules:

- JetStream reads go through ``$JS.API`` subjects, so that is where a user is
  restricted: a replica may use only its own input consumer, the executor only its
  hosts' pre-made consumers (it may create none: a consumer's ``deliver_subject`` could
  name any subject), the bridge and the producer read single messages only.
- Every component connects with ``--inbox-prefix _INBOX.<user>`` and may subscribe to
  its own replies only; request-reply responders (the replicas' queries) get
  ``allow_responses``.
- A user listed with several public keys (a rotation in progress) is one entry per key,
  with the same permissions.
- The output is deterministic for a fleet and its keys.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reconciler.core.messages import PRODUCER_VERBS, Subjects
from reconciler.deploy.fleet import Fleet
from reconciler.executor.executor import consumer_name as executor_consumer
from reconciler.replica.snapshot_bucket import bucket_name as snapshot_bucket

__all__ = ["Permissions", "permissions", "render_accounts"]


@dataclass(frozen=True, kw_only=True)
class Permissions:
    """What one user may publish and subscribe to, and why (a comment in the file)."""

    why: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def _replica(fleet: Fleet, replica: str) -> Permissions:
    n = fleet.names
    p = fleet.prefix
    s = Subjects(p)
    consumer = n.replica_consumer(replica)
    snapshots = f"OBJ_{snapshot_bucket(p)}"
    return Permissions(
        why=(
            f"reconciler run --replica {replica}: folds {n.in_stream} through its own "
            f"consumer {consumer}, publishes {n.out_stream} while it leads, answers "
            "queries; its warm-pool top-ups, expiries, queue timeouts and live checks go back "
            "in as inputs"
        ),
        publish=(
            s.outputs,
            s.command("admit"),
            s.command("release"),
            s.command("queue-timeout"),
            s.host_input("*", "observation"),
            f"$JS.API.STREAM.INFO.{n.in_stream}",
            f"$JS.API.STREAM.INFO.{n.out_stream}",
            f"$JS.API.STREAM.INFO.{n.leader_stream}",
            f"$JS.API.CONSUMER.INFO.{n.in_stream}.{consumer}",
            f"$JS.API.CONSUMER.CREATE.{n.in_stream}.{consumer}",
            f"$JS.API.CONSUMER.DELETE.{n.in_stream}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{n.in_stream}.{consumer}",
            f"$JS.ACK.{n.in_stream}.{consumer}.>",
            f"$KV.{n.leader_bucket}.>",
            f"$JS.API.DIRECT.GET.{n.leader_stream}.>",
            f"$JS.API.STREAM.MSG.GET.{n.leader_stream}",
            # snapshots (an object store made by `reconciler provision`): the leader puts
            # and prunes them, an empty replica reads the newest; reading one subscribes by
            # subject, for which nats-py looks its stream up by name
            f"$JS.API.STREAM.INFO.{snapshots}",
            f"$O.{snapshot_bucket(p)}.>",
            f"$JS.API.STREAM.PURGE.{snapshots}",
            f"$JS.API.STREAM.MSG.GET.{snapshots}",
            f"$JS.API.DIRECT.GET.{snapshots}.>",
            "$JS.API.STREAM.NAMES",
            f"$JS.API.CONSUMER.CREATE.{snapshots}",
            f"$JS.API.CONSUMER.CREATE.{snapshots}.>",
            f"$JS.API.CONSUMER.DELETE.{snapshots}.>",
        ),
        subscribe=(f"_INBOX.{replica}.>", f"{s.queries} {s.query_group}"),
        allow_responses=True,
    )


def permissions(fleet: Fleet) -> dict[str, Permissions]:
    """Every user's permissions, in the order of :attr:`Fleet.users`."""
    n = fleet.names
    s = Subjects(fleet.prefix)
    hosts = sorted(fleet.incus_hosts)
    out = {
        "admin": Permissions(
            why="provisioning and operators' tools (reconciler provision, replay, audit)",
            publish=(">",),
            subscribe=(">",),
        )
    }
    for replica in fleet.replicas:
        out[replica] = _replica(fleet, replica)
    out["bridge"] = Permissions(
        why=(
            "reconciler bridge: Incus events, inventories and resources in; it looks the "
            "streams up at start and reads its last inventory back to continue its revisions"
        ),
        publish=(
            s.host_inputs,
            f"$JS.API.STREAM.MSG.GET.{n.in_stream}",
            f"$JS.API.STREAM.INFO.{n.in_stream}",
            f"$JS.API.STREAM.INFO.{n.out_stream}",
            f"$JS.API.STREAM.INFO.{n.leader_stream}",
        ),
        subscribe=("_INBOX.bridge.>",),
    )
    pulls: list[str] = []
    for host in hosts:
        consumer = executor_consumer(host)
        pulls += [
            f"$JS.API.CONSUMER.INFO.{n.out_stream}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{n.out_stream}.{consumer}",
            f"$JS.ACK.{n.out_stream}.{consumer}.>",
        ]
    out["executor"] = Permissions(
        why=(
            f"reconciler executor: pulls the commands of hosts {', '.join(hosts)} from the "
            "consumers `reconciler provision --executor-host` made, acknowledges them, and "
            "reports what fails for good as their hosts' failure inputs"
        ),
        publish=(*pulls, *(s.host_input(host, "failure") for host in hosts)),
        subscribe=("_INBOX.executor.>",),
    )
    out["producer"] = Permissions(
        why=(
            "a producer (the GARM provider): commands in (not the operators' config and "
            "host commands), decisions and query answers out, and the failure of a create "
            "it made itself"
        ),
        publish=(
            *(s.command(verb) for verb in PRODUCER_VERBS),
            s.host_input("*", "failure"),
            s.any_query,
            f"$JS.API.STREAM.MSG.GET.{n.out_stream}",
        ),
        subscribe=("_INBOX.producer.>", s.decisions),
    )
    return out


def _allow(field: str, values: Sequence[str], indent: str) -> list[str]:
    # JSON strings are NATS configuration strings (quoted, a leading $ is no variable);
    # array items are separated by line ends
    if len(values) <= 2:
        return [f"{indent}{field}: {{ allow: [{', '.join(json.dumps(v) for v in values)}] }}"]
    items = [f"{indent}    {json.dumps(v)}" for v in values]
    return [f"{indent}{field}: {{", f"{indent}  allow: [", *items, f"{indent}  ]", f"{indent}}}"]


def _wrap(text: str, indent: str, width: int = 92) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent + "# ", subsequent_indent=indent + "# ")


def render_accounts(fleet: Fleet, keys: Mapping[str, Sequence[str]]) -> str:
    """The accounts file: ``keys`` maps each user to its public NKeys (newest first)."""
    lines = [
        "# Who may do what on the bus. Generated by `reconciler credentials` from",
        "# deployment.json beside this file: do not edit, run the command again.",
        f"# Prefix {fleet.prefix!r}; replicas {', '.join(fleet.replicas)}; "
        f"Incus hosts {', '.join(sorted(fleet.incus_hosts))}.",
        "# Each component authenticates with its NKey over TLS with a client certificate of",
        "# the deployment's CA, and connects with --inbox-prefix _INBOX.<user>.",
        "",
        "accounts {",
        "  RC {",
        "    jetstream: enabled",
        "    users: [",
    ]
    for user, perms in permissions(fleet).items():
        lines += _wrap(f"{user}: {perms.why}", "      ")
        for key in keys[user]:
            lines += [
                "      {",
                f"        nkey: {json.dumps(key)}",
                "        permissions: {",
                *_allow("publish", perms.publish, "          "),
                *_allow("subscribe", perms.subscribe, "          "),
            ]
            if perms.allow_responses:
                lines.append("          allow_responses: true")
            lines += ["        }", "      }"]
    lines += ["    ]", "  }", "  SYS {}", "}", "system_account: SYS", ""]
    return "\n".join(lines)
