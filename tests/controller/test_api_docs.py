"""docs/openapi-controller.json is the schema the daemon serves (no VM needed)."""

from __future__ import annotations

import json
from pathlib import Path

from forkd.controller.app import openapi_document

DOC = Path(__file__).resolve().parents[2] / "docs" / "openapi-controller.json"


def test_openapi_document_matches_the_code():
    current = openapi_document()
    assert json.loads(DOC.read_text()) == json.loads(json.dumps(current)), (
        "docs/openapi-controller.json is stale; regenerate it with: python3 -P -c "
        "'import json; from forkd.controller.app import openapi_document as d; "
        "print(json.dumps(d(), indent=1, sort_keys=True))' > docs/openapi-controller.json"
    )
    documented = (DOC.parent / "api.md").read_text()
    for path in current["paths"]:
        assert path.split("{")[0].rstrip("/") in documented, path
