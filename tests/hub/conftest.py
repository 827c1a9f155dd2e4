"""Fixtures of the hub tests; the helpers they share live in hub_support (a unique module name,
so `from hub_support import …` works whichever test folders one pytest run collects)."""

from hub_support import (  # noqa: F401  (fixtures are found by name)
    backend_hub,
    fresh_hub,
    hub,
    postgres_server,
    postgres_url,
    quick_recheck,
    user,
)
from s3_hub_support import s3_hub  # noqa: F401
