"""recipes/langgraph-react parses, pins every Python package, and installs its agent (no VM);
pip in a build chroot trusts the host's CA bundle."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forkd.engine import image, recipe

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "recipes" / "langgraph-react"


def test_the_recipe_pins_langgraph_and_the_openai_client() -> None:
    r = recipe.load(FOLDER / "recipe.toml")
    assert r.name == "langgraph-react" and r.network
    assert "ca-certificates" in r.apt  # the trust store the egress CA is added to
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][0-9a-z.]*", p) for p in r.pip), r.pip
    pins = dict(p.split("==") for p in r.pip)
    assert pins["langgraph"] == "1.2.24" and pins["openai"] == "3.57.0"
    files = {f.path: f for f in r.files}
    assert files["/opt/agent/travel_agent.py"].content == (FOLDER / "travel_agent.py").read_bytes()
    pth = files["/usr/local/lib/python3.11/dist-packages/forkd-agent.pth"]
    assert pth.content == b"/opt/agent\n"
    assert "import travel_agent" in r.warmup
    assert (FOLDER / "DEMO.md").read_text().count("stand-in") >= 2


def test_the_host_runs_the_same_pins() -> None:
    """The host tests (test_standin.py) run the guest's versions of the client and graph."""
    import langgraph.version
    import openai

    pins = dict(p.split("==") for p in recipe.load(FOLDER / "recipe.toml").pip)
    assert openai.__version__ == pins["openai"]
    assert langgraph.version.__version__ == pins["langgraph"]


def test_pip_in_the_chroot_trusts_the_hosts_bundle(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pip_cert, ssl_file = tmp_path / "pip.pem", tmp_path / "ssl.pem"
    ssl_file.write_text("x")
    monkeypatch.setenv("PIP_CERT", str(pip_cert))  # missing: skipped
    monkeypatch.setenv("SSL_CERT_FILE", str(ssl_file))
    assert image._host_ca_bundle() == ssl_file
    pip_cert.write_text("x")
    assert image._host_ca_bundle() == pip_cert
    # requests (inside pip) prefers REQUESTS_CA_BUNDLE over --cert: all of them are set
    assert {"PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"} <= set(
        image.CA_BUNDLE_VARIABLES)


def test_a_recipe_folder_loads_its_recipe_toml(tmp_path: Path) -> None:
    assert recipe.load(FOLDER) == recipe.load(FOLDER / "recipe.toml")
    from forkd.errors import InvalidInput

    with pytest.raises(InvalidInput, match=r"folder holding a recipe\.toml"):
        recipe.load(tmp_path)
