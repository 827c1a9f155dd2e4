"""OCI Distribution Spec v1.1 under /v2/: one module per resource, dispatched by router."""
