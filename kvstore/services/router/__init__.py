"""``kvstore route``: the HTTP front of the routing library (docs/routing.md).

``config`` (RouteConfig), ``replica`` (one replica: info, events, health, load), ``proxy``
(forwarding, streaming pass-through, retries), ``metrics``, ``app`` (FastAPI routes),
``server`` (the process), ``cli`` (the subcommand), ``static/router.html`` (the page).
"""
