"""The management API: LMDeploy's ``/nodes/*``, the SGLang gateway's ``/workers`` and the peer
routers' routes, their bodies and answers (pydantic models), the route table that dispatches them
and the ``/openapi.json`` generated from it."""
