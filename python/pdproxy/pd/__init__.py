"""Prefill/decode disaggregation: the prefill runs on one node, the decode on another, the KV
cache migrated between them. ``lmdeploy`` speaks LMDeploy's DistServe; ``links`` keeps the
prefill-decode connections; ``ledger`` makes sure no preserved prefill session is ever lost."""
