"""A simulated fleet of Incus hosts: the REST API pylxd and GARM meet, without Incus.

Layers, each a module with its own rules:

- :mod:`.shapes` — what a host has (CPU, memory, storage, GPUs) and its stable identity;
- :mod:`.wire` — status codes, the sync/async/error envelopes, timestamps;
- :mod:`.operations` — background operations, ``/wait`` and their expiry;
- :mod:`.events` — the ``/1.0/events`` fan-out and Incus's lifecycle event shape;
- :mod:`.host` — one host's instances, their state machine, faults and controls;
- :mod:`.render` — the host as Incus API objects;
- :mod:`.api` — the Incus routes; :mod:`.control` — the ``/_sim/`` routes (not Incus);
- :mod:`.versions` — the Incus release played (6.0 LTS by default, or 7.x) and every
  behaviour in which the two differ;
- :mod:`.fleet` — every host served on its own unix socket or TCP port, the fleet file,
  and a background-thread runner.

What the simulator is faithful to: for 7.x, ``FACTS.md`` and ``rest-api.yaml`` (the
comparison tests hold it there); for 6.0 LTS, a real Incus 6.0 daemon, which
``tests/incus/simulator/test_differential.py`` sends the same requests as the simulator
(``docs/incus-simulator.md``). Where it simplifies, the module that does so says how.
It imports nothing from the reconciler but :mod:`reconciler.incus.units`.
"""

from reconciler.incus.simulator.fleet import Fleet, FleetOptions, Listen, SimulatorThread
from reconciler.incus.simulator.host import Profile, SimHost, SimInstance, Timing
from reconciler.incus.simulator.shapes import (
    GpuShape,
    HostShape,
    default_fleet,
    fleet_from_json,
    read_fleet_file,
)
from reconciler.incus.simulator.versions import (
    DEFAULT_VERSION,
    LATEST,
    LTS,
    IncusVersion,
    parse_version,
)

__all__ = [
    "DEFAULT_VERSION",
    "LATEST",
    "LTS",
    "Fleet",
    "FleetOptions",
    "GpuShape",
    "HostShape",
    "IncusVersion",
    "Listen",
    "Profile",
    "SimHost",
    "SimInstance",
    "SimulatorThread",
    "Timing",
    "default_fleet",
    "fleet_from_json",
    "parse_version",
    "read_fleet_file",
]
