"""How ``pdproxy serve`` runs and answers: the process (under granian, or behind the Rust edge),
the worker group of ``--workers``, the supervisor of the control plane's parts, the ASGI app and
what it answers with, and who may ask (keys, tenants)."""
