"""OCI Distribution registries (the forkd hub or any other): references, auth, push, pull."""
