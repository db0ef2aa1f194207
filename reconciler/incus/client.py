"""The pylxd adapter: the one place that talks to Incus.

Rules:

- **pylxd only here.** pylxd (requests, ws4py) is blocking; every call runs in a worker
  thread (``anyio.to_thread``) under a per-host limiter, bounded twice: each HTTP request
  by ``request_timeout_s`` (requests' own timeout, so a thread never hangs) and each
  adapter call by an overall ``anyio.fail_after``. A call whose bound passes raises
  :class:`~reconciler.incus.errors.IncusUnavailable` (the abandoned thread still ends
  within its request timeout).
- **Operations are waited on** with ``/wait?timeout=N`` in slices until they finish or
  ``operation_timeout_s`` passes (:class:`~reconciler.incus.errors.OperationTimedOut`);
  a failed operation raises an error named after its condition
  (:mod:`reconciler.incus.errors`).
- **Idempotent mutations, after DRA's Deallocate rule**: creating an instance that
  already exists with the same ``user.rc.lease-id`` returns it; starting a running one,
  stopping a stopped one, and stopping or deleting a missing one succeed.
- **A destroy waits out the instance's running operations** (a create still unpacking
  its image holds the instance's lock, and Incus refuses a stop or delete meanwhile), so
  a delete right after a killed create succeeds and leaves nothing behind.
- **Views out.** Answers are turned into the frozen dataclasses of
  :mod:`reconciler.incus.views`; nothing pylxd leaves this module.
- The pylxd client is made on first use and dropped after a connection failure, so the
  next call reconnects.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import anyio
import requests
from pylxd import Client
from pylxd import exceptions as pylxd_errors
from pylxd.client import LXDSSLAdapter

from reconciler.incus.endpoints import IncusEndpoint, endpoints_from_fleet_file
from reconciler.incus.errors import (
    ApiRejected,
    ImageNotFound,
    ImageTypeMismatch,
    IncusError,
    IncusUnavailable,
    InstanceAlreadyRunning,
    InstanceAlreadyStopped,
    InstanceBusy,
    InstanceExists,
    InstanceNameTaken,
    InstanceNotFound,
    InstanceRunning,
    InstanceTypeUnsupported,
    NotFound,
    OperationFailed,
    OperationLost,
    OperationTimedOut,
)
from reconciler.incus.events import LifecycleStream, open_lifecycle_stream
from reconciler.incus.units import GIB
from reconciler.incus.unix_http import UNIX_SCHEME, unix_session
from reconciler.incus.views import (
    KNOWN_GPU_MEMORY_MIB,
    HostResources,
    InstanceSpec,
    InstanceView,
    ServerInfo,
    host_resources,
    instance_view,
    server_info,
)

__all__ = [
    "DEFAULT_OPERATION_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "IncusEndpoint",
    "IncusHost",
    "endpoints_from_fleet_file",
]

T = TypeVar("T")

#: operation errors that name a condition, by Incus's text
_OPERATION_ERRORS: tuple[tuple[str, type[OperationFailed]], ...] = (
    ("Instance is busy running a", InstanceBusy),
    ("The instance is already stopped", InstanceAlreadyStopped),
    ("The instance is already running", InstanceAlreadyRunning),
    ("doesn't match instance type", ImageTypeMismatch),
    ("is not supported on this server", InstanceTypeUnsupported),
    ("Image not provided for instance creation", ImageNotFound),
    ("Image not found", ImageNotFound),
    ("UNIQUE constraint failed: instances.project_id, instances.name", InstanceNameTaken),
    ("already exists", InstanceNameTaken),
)


#: operation status codes (Incus's ``api.StatusCode``)
_RUNNING, _PENDING = 103, 105


def _names_instance(url: str, name: str, project: str) -> bool:
    """Whether a resource URL (``/1.0/instances/NAME``, ``?project=P`` outside the
    default project) is instance ``name`` of ``project``."""
    parts = urlsplit(str(url))
    in_project = parse_qs(parts.query).get("project", ["default"])[0]
    return parts.path.rstrip("/") == f"/1.0/instances/{name}" and in_project == project


def _is_instance_not_found(message: str) -> bool:
    """7.x says "Instance not found"; 6.0 prefixes it with what it was fetching:
    ``Failed to fetch instance "NAME" in project "PROJECT": Instance not found``."""
    return message == "Instance not found" or message.endswith(": Instance not found")


def _failed_wait(response: Any) -> str | None:
    """The error of a failed operation as Incus 6.0's ``wait`` reports it, else ``None``.

    6.0 answers the wait of a failed operation with HTTP 200 and an *error* envelope
    whose ``error`` is the operation's ``err``; 7.x with a sync envelope of the operation
    (``status_code`` 400, ``err``), which the caller reads. Any other HTTP status is a
    real rejection (a 404: the operation is gone).
    """
    if int(getattr(response, "status_code", 0)) != 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("type") == "error":
        return str(body.get("error") or "operation failed")
    return None


class _PinnedSession(requests.Session):
    """A session whose pinned server certificate (``verify``, a file) is used as given:
    requests would put ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE`` in its place on every
    request (and then refuse the pinned host). The environment's proxy variables still
    apply, as they do to every other endpoint."""

    def merge_environment_settings(
        self, url: str, proxies: Any, stream: Any, verify: Any, cert: Any
    ) -> dict[str, Any]:
        settings: dict[str, Any] = super().merge_environment_settings(
            url, proxies, stream, verify, cert
        )
        settings["verify"] = self.verify
        return settings


def _session(endpoint: IncusEndpoint) -> requests.Session | None:
    """pylxd's session for an HTTPS endpoint whose server certificate is pinned (as
    pylxd's own, which compares the certificate's fingerprint), or None (pylxd's)."""
    if not isinstance(endpoint.verify, str):
        return None
    session = _PinnedSession()
    session.cert = endpoint.cert
    session.verify = endpoint.verify
    session.mount(endpoint.url, LXDSSLAdapter())
    return session


#: seconds one HTTP request to Incus may take, unless configured otherwise
DEFAULT_REQUEST_TIMEOUT_S = 10.0
#: seconds an Incus operation (create, start, stop, delete) may take
DEFAULT_OPERATION_TIMEOUT_S = 120.0


class IncusHost:
    """One Incus host, through pylxd, with async methods."""

    def __init__(
        self,
        endpoint: IncusEndpoint,
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S,
        max_concurrent_calls: int = 4,
        gpu_memory_mib: Mapping[str, int] = KNOWN_GPU_MEMORY_MIB,
    ) -> None:
        self.endpoint = endpoint
        self.request_timeout_s = request_timeout_s
        self.operation_timeout_s = operation_timeout_s
        self.gpu_memory_mib = gpu_memory_mib
        self._limiter = anyio.CapacityLimiter(max_concurrent_calls)
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self._memory_mib = 0  # the host's memory, for limits.memory percentages

    @property
    def name(self) -> str:
        return self.endpoint.host

    # ------------------------------------------------------------------ reads

    async def server_info(self) -> ServerInfo:
        """``GET /1.0``: the host's identity (uid = certificate fingerprint)."""
        return server_info(await self._get(("",)))

    async def resources(self) -> HostResources:
        """``GET /1.0/resources``: CPU threads, memory MiB and GPUs (indexed by PCI order)."""
        found = host_resources(await self._get(("resources",)), gpu_memory_mib=self.gpu_memory_mib)
        self._memory_mib = found.memory_mib
        return found

    async def storage_total_gib(self, pool: str = "default") -> int:
        """Total space of storage pool ``pool`` in GiB (rounded down)."""
        metadata = await self._get(("storage-pools", pool, "resources"))
        return int(metadata["space"]["total"]) // GIB

    async def list_instances(self, *, full: bool = False) -> list[InstanceView]:
        """Every instance of every project, with status (``recursion=1``), by project, name;
        ``full`` reads their state too (``recursion=2``: addresses; costlier for Incus)."""
        params = {"all-projects": "true", "recursion": 2 if full else 1}
        found = await self._get(("instances",), params=params)
        views = [instance_view(m, host_memory_mib=self._memory_mib) for m in found]
        return sorted(views, key=lambda v: (v.project, v.name))

    async def get_instance(
        self,
        name: str,
        *,
        project: str = "default",
        timeout_s: float | None = None,
        full: bool = False,
    ) -> InstanceView | None:
        """One instance, or ``None`` if it does not exist; other failures raise. ``full``
        reads its state too (addresses)."""
        params: dict[str, Any] = {"project": project}
        if full:
            params["recursion"] = 1
        try:
            found = await self._get(("instances", name), params=params, timeout_s=timeout_s)
        except InstanceNotFound:
            return None
        return instance_view(found, host_memory_mib=self._memory_mib)

    async def running_operations(
        self, name: str, *, project: str = "default"
    ) -> list[dict[str, Any]]:
        """The running (or pending) operations whose resources name instance ``name`` of
        ``project``, as Incus lists them."""
        listed = await self._get(("operations",), params={"project": project, "recursion": 1})
        return [
            op
            for ops in (listed or {}).values()
            for op in ops or ()
            if isinstance(op, dict)
            and int(op.get("status_code", 0)) in (_RUNNING, _PENDING)
            and any(
                _names_instance(url, name, project)
                for url in (op.get("resources") or {}).get("instances") or ()
            )
        ]

    async def wait_for_operations(self, name: str, *, project: str = "default") -> list[str]:
        """Wait until no operation of instance ``name`` runs (bounded by
        ``operation_timeout_s`` each); their descriptions. How they end does not matter."""
        waited: list[str] = []
        while ops := await self.running_operations(name, project=project):
            for op in ops:
                waited.append(str(op.get("description", "")))
                with contextlib.suppress(OperationFailed, OperationLost):
                    await self._in_thread(
                        functools.partial(self._wait, str(op["id"])),
                        budget_s=self.operation_timeout_s + 2 * self.request_timeout_s,
                    )
        return waited

    # ------------------------------------------------------------------ mutations

    async def create_instance(self, spec: InstanceSpec) -> InstanceView:
        """Create ``spec`` (not started); idempotent for the same ``user.rc.lease-id``."""
        try:
            await self._mutate(
                "post", ("instances",), params={"project": spec.project}, body=spec.request_body()
            )
        except (InstanceExists, InstanceNameTaken):
            return await self._existing(spec)
        view = await self.get_instance(spec.name, project=spec.project)
        if view is None:  # deleted between creation and the read: report it as such
            raise InstanceNotFound(
                self.name, f"instance {spec.name} vanished after creation", status=404
            )
        return view

    async def start_instance(self, name: str, *, project: str = "default") -> None:
        """Start ``name``; already running is success."""
        with contextlib.suppress(InstanceAlreadyRunning):
            await self._change_state(name, project=project, action="start", force=False)

    async def stop_instance(
        self, name: str, *, project: str = "default", force: bool = True
    ) -> None:
        """Stop ``name`` (forced by default); already stopped or missing is success."""
        with contextlib.suppress(InstanceAlreadyStopped, InstanceNotFound):
            await self._change_state(name, project=project, action="stop", force=force)

    async def delete_instance(self, name: str, *, project: str = "default") -> None:
        """Delete stopped ``name``; missing is success, running raises InstanceRunning."""
        with contextlib.suppress(InstanceNotFound):
            await self._mutate("delete", ("instances", name), params={"project": project})

    async def destroy_instance(self, name: str, *, project: str = "default") -> tuple[str, ...]:
        """GARM's delete: forced stop (tolerating missing and stopped), then delete; the
        descriptions of the operations it waited for.

        Running operations of the instance are waited for first: Incus refuses a stop or
        a delete while one holds the instance's lock (``Instance is busy running a
        "create" operation``), and a create whose record is not written yet would bring
        the instance back after a delete that found nothing. Bounded by
        ``operation_timeout_s``."""
        deadline = time.monotonic() + self.operation_timeout_s
        waited: list[str] = []
        while True:
            waited += await self.wait_for_operations(name, project=project)
            try:
                await self.stop_instance(name, project=project, force=True)
                await self.delete_instance(name, project=project)
            except InstanceBusy:
                if time.monotonic() >= deadline:
                    raise
                await anyio.sleep(0.1)
                continue
            return tuple(waited)

    async def update_config(
        self, name: str, config: Mapping[str, str], *, project: str = "default"
    ) -> None:
        """``PATCH`` config keys of ``name`` (the others stay as they are)."""
        await self._mutate(
            "patch", ("instances", name), params={"project": project}, body={"config": dict(config)}
        )

    async def push_file(
        self,
        name: str,
        path: str,
        content: bytes,
        *,
        mode: int = 0o644,
        project: str = "default",
    ) -> None:
        """Write ``content`` to ``path`` inside running ``name`` (root-owned, ``mode``)."""
        headers = {
            "X-Incus-uid": "0",
            "X-Incus-gid": "0",
            "X-Incus-mode": f"{mode:04o}",
            "X-Incus-type": "file",
            "X-Incus-write": "overwrite",
            "Content-Type": "application/octet-stream",
        }

        def call() -> None:
            self._node(("instances", name, "files")).post(
                params={"path": path, "project": project},
                data=content,
                headers=headers,
                timeout=self.request_timeout_s,
            )

        await self._in_thread(call, budget_s=self.request_timeout_s + 1.0)

    async def execute(
        self,
        name: str,
        command: list[str],
        *,
        environment: Mapping[str, str] | None = None,
        project: str = "default",
    ) -> int:
        """Run ``command`` in ``name`` without a terminal and wait for it; its exit code.

        The output is recorded by Incus (``record-output``), never read back here: it may
        carry what the command was given."""
        body = {
            "command": command,
            "environment": dict(environment or {}),
            "wait-for-websocket": False,
            "interactive": False,
            "record-output": True,
        }
        op = await self._mutate(
            "post", ("instances", name, "exec"), params={"project": project}, body=body
        )
        metadata = op.get("metadata") or {}
        return int(metadata.get("return", -1))

    # ------------------------------------------------------------------ events

    def lifecycle_events(
        self, *, idle_timeout_s: float = 35.0, buffer: int = 1024
    ) -> contextlib.AbstractAsyncContextManager[LifecycleStream]:
        """``async with host.lifecycle_events() as events: async for event in events``.

        Lifecycle events of every project, as Incus sent them. Iteration raises
        :class:`~reconciler.incus.errors.EventStreamLost` when the stream ends or stays
        silent (not even a ping) for ``idle_timeout_s``; reconnect with backoff.
        """
        return self._lifecycle_events(idle_timeout_s=idle_timeout_s, buffer=buffer)

    @contextlib.asynccontextmanager
    async def _lifecycle_events(
        self, *, idle_timeout_s: float, buffer: int
    ) -> AsyncIterator[LifecycleStream]:
        client = await self._in_thread(self._connected)
        async with open_lifecycle_stream(
            client,
            host=self.name,
            verify=self.endpoint.verify,
            connect_timeout_s=self.request_timeout_s,
            idle_timeout_s=idle_timeout_s,
            buffer=buffer,
        ) as stream:
            yield stream

    # ------------------------------------------------------------------ internals

    async def _existing(self, spec: InstanceSpec) -> InstanceView:
        view = await self.get_instance(spec.name, project=spec.project)
        if view is not None and spec.lease_id is not None and view.lease_id == spec.lease_id:
            return view
        owner = None if view is None else view.lease_id
        raise InstanceExists(
            self.name,
            f"instance {spec.project}/{spec.name} exists with lease {owner!r}, "
            f"not {spec.lease_id!r}",
            status=409,
        )

    async def _change_state(self, name: str, *, project: str, action: str, force: bool) -> None:
        body = {"action": action, "timeout": -1, "force": force, "stateful": False}
        await self._mutate(
            "put", ("instances", name, "state"), params={"project": project}, body=body
        )

    async def _get(
        self,
        path: tuple[str, ...],
        *,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        timeout = timeout_s or self.request_timeout_s

        def call() -> Any:
            response = self._node(path).get(params=params or {}, timeout=timeout)
            return response.json()["metadata"]

        return await self._in_thread(call, budget_s=timeout + 1.0)

    async def _mutate(
        self,
        method: str,
        path: tuple[str, ...],
        *,
        params: dict[str, Any],
        body: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Send a request that answers with an operation, and wait for the operation."""

        def call() -> dict[str, Any]:
            send = getattr(self._node(path), method)
            kwargs: dict[str, Any] = {"params": params, "timeout": self.request_timeout_s}
            if body is not None:
                kwargs["json"] = body
            answer = send(**kwargs).json()
            if answer.get("type") != "async":
                return dict(answer.get("metadata") or {})
            return self._wait(str(answer["operation"]))

        budget = self.operation_timeout_s + 2 * self.request_timeout_s
        return await self._in_thread(call, budget_s=budget)

    def _wait(self, operation_url: str) -> dict[str, Any]:
        """In a worker thread: wait for the operation in slices; raise on failure."""
        op_id = operation_url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        deadline = time.monotonic() + self.operation_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise OperationTimedOut(
                    self.name, f"operation {op_id} still running after {self.operation_timeout_s} s"
                )
            slice_s = max(1, min(int(remaining), 30))
            try:
                response = self._node(("operations", op_id, "wait")).get(
                    params={"timeout": slice_s}, timeout=slice_s + self.request_timeout_s
                )
            except pylxd_errors.LXDAPIException as exc:
                if int(getattr(exc.response, "status_code", 0)) == 404:
                    raise OperationLost(
                        self.name, f"operation {op_id} is gone; its outcome is unknown"
                    ) from exc
                failed = _failed_wait(exc.response)
                if failed is None:
                    raise
                raise self._operation_error(failed) from exc
            answer = response.json()
            failed = _failed_wait(response)
            if failed is not None:
                raise self._operation_error(failed)
            op: dict[str, Any] = answer["metadata"]
            code = int(op.get("status_code", 0))
            if code >= 200:
                if code == 200:
                    return op
                raise self._operation_error(str(op.get("err") or op.get("status", "")))

    def _operation_error(self, err: str) -> OperationFailed | InstanceNotFound:
        if _is_instance_not_found(err):
            return InstanceNotFound(self.name, err, status=404)
        for text, kind in _OPERATION_ERRORS:
            if text in err:
                return kind(self.name, err)
        return OperationFailed(self.name, err)

    def _node(self, path: tuple[str, ...]) -> Any:
        node = self._connected().api
        for part in path:
            if part:
                node = node[part]
        return node

    def _connected(self) -> Client:
        with self._client_lock:
            if self._client is None:
                url = self.endpoint.url
                # pylxd's own unix connection leaks a socket per failed connect
                session = unix_session() if url.startswith(UNIX_SCHEME) else _session(self.endpoint)
                try:
                    self._client = Client(
                        endpoint=url,
                        cert=self.endpoint.cert,
                        verify=self.endpoint.verify,
                        timeout=self.request_timeout_s,
                        session=session,
                    )
                except BaseException:
                    if session is not None:  # a refused first request leaves it open
                        session.close()
                    raise
            return self._client

    async def _in_thread(self, call: Callable[[], T], *, budget_s: float | None = None) -> T:
        budget = budget_s if budget_s is not None else self.request_timeout_s + 1.0
        try:
            with anyio.fail_after(budget):
                return await anyio.to_thread.run_sync(
                    functools.partial(self._translated, call),
                    limiter=self._limiter,
                    abandon_on_cancel=True,
                )
        except TimeoutError:
            raise IncusUnavailable(self.name, f"no answer within {budget:.1f} s") from None

    def _translated(self, call: Callable[[], T]) -> T:
        """In a worker thread: run ``call``, turning pylxd/requests errors into ours."""
        try:
            return call()
        except IncusError:
            raise
        except (
            requests.exceptions.RequestException,
            pylxd_errors.ClientConnectionFailed,
            ConnectionError,
        ) as exc:
            self._drop_client()
            raise IncusUnavailable(self.name, str(exc) or type(exc).__name__) from exc
        except pylxd_errors.LXDAPIException as exc:
            raise self._rejection(exc) from exc

    def _rejection(self, exc: pylxd_errors.LXDAPIException) -> ApiRejected:
        status = int(exc.response.status_code)
        message = str(exc)
        if status == 404:
            kind: type[ApiRejected] = (
                InstanceNotFound if _is_instance_not_found(message) else NotFound
            )
            return kind(self.name, message, status=status)
        if status == 400 and message == "Instance is running":
            return InstanceRunning(self.name, message, status=status)
        if status == 409 or "already exists" in message:
            return InstanceExists(self.name, message, status=status)
        return ApiRejected(self.name, message, status=status)

    def _drop_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.api.session.close()

    async def aclose(self) -> None:
        """Close the HTTP session (idempotent)."""
        self._drop_client()
