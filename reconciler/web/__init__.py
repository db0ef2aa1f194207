"""``reconciler web``: a read-only page of the fleet, served over HTTP(S).

- :mod:`.page`: the HTML, rendered on the server from the queries' answers (Jinja2,
  every value escaped): hosts with their capacity bars, pools with their warm VMs, the
  most recent decisions, and a lease's trail (``/lease/<lease_id>``).
- :mod:`.server`: the aiohttp server: what it may listen on, TLS, HTTP basic auth,
  the security headers, and where the page's data comes from (:class:`~.server.Queries`:
  the ``fleet``, ``decisions`` and ``lease`` queries of any synced replica).

Rules:

- It reads through the queries of any synced replica (core NATS request-reply, as
  ``reconciler query`` does) and writes nothing: no input, no store, no stream.
- It listens on a loopback address unless TLS (a certificate and its key) and a password
  are given; a password, when given, is asked for on every request (HTTP basic auth,
  compared in constant time), and it never travels on the command line.
- Every name and text on the page comes from the bus and is escaped; the page loads no
  script and nothing from elsewhere (its Content-Security-Policy says so).
- No front-end build: the templates and the style sheet are package data.

Layer: a program, beside ``replica`` and ``bridge``: it uses ``reconciler.client`` and
``reconciler.core``; only ``reconciler.cli`` imports it.
"""
