"""The fleet: how nodes come and go. What a node is (its record), every way one comes in (the
command line, ``/nodes/*``, the state file, Kubernetes and DNS sources, the replicas' shared
membership), and what the control plane learns of each (health, models, its engine's figures)."""
